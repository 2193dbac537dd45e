"""Hybrid families' layers converted by ``convert_mixers`` (see ``hybrid``): more."""

from __future__ import annotations

LAYERS: dict = {}
"""transformers' layer class name -> the mixin of its converted class."""
FAMILIES: frozenset = frozenset()
"""model_type of the families these layers complete."""
KWARGS_STOP: frozenset = frozenset()
"""The families among FAMILIES whose model does not pass ring_context on to its layers."""

if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
