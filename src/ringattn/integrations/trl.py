"""The documented import path of ``ringattn.integrations.trainers.trl`` (RingSFTTrainer, RingDPOTrainer, RingGRPOTrainer),
which holds the code."""

from .trainers.grpo import RingGRPOTrainer  # noqa: F401
from .trainers.trl import *  # noqa: F401,F403
from .trainers.trl import __all__ as _trl_all

__all__ = [*_trl_all, "RingGRPOTrainer"]


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
