"""Hybrid families under context parallelism: their sequence mixers across ranks.

``base`` holds what every converted mixer shares and ``convert_mixers``; one file per
mechanism holds the layers and registers its rows in ``checks`` (transformers' layer class
-> the mixin of its converted class, the families it completes, those whose model drops
the ring context): ``delta`` (gated delta rules), ``conv`` (short convolutions), ``mamba``
(selective scans), ``recurrent`` (RG-LRU, lightning attention, RWKV, xLSTM). Adding a
family whose layers one of them serves is one row there.
"""

from __future__ import annotations

from . import conv, delta, inkling, mamba, recurrent  # noqa: F401 (each registers its rows)
from .base import convert_mixers

__all__ = ["convert_mixers"]


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
