"""The documented import path of ``ringattn.integrations.trainers.hf_trainer`` (RingTrainer, RingTrainerMixin),
which holds the code."""

from .trainers.hf_trainer import *  # noqa: F401,F403
from .trainers.hf_trainer import __all__  # noqa: F401
