"""The documented import path of ``ringattn.integrations.trainers.trl`` (RingSFTTrainer, RingDPOTrainer),
which holds the code."""

from .trainers.trl import *  # noqa: F401,F403
from .trainers.trl import __all__  # noqa: F401
