"""The package's programs, and what a library module says when it is run as one.

Every library module ends with a guard that calls ``not_a_program`` when it is run with
``python -m``, so that a mistyped program name (the library's ``ringattn.eagle3.target``
for the program ``ringattn.apps.eagle3_target``) fails with a line naming the programs
instead of doing nothing and exiting 0.
"""

from __future__ import annotations

import sys

__all__ = ["PROGRAMS", "not_a_program"]

PROGRAMS = (
    ("ringattn demo", "train an Eagle3 draft (or, with --target lm, a causal LM) under CP "
     "on CPU ranks and check it against one process"),
    ("ringattn train", "train a transformers causal LM under context parallelism"),
    ("python -m ringattn.apps.train", "the same as ringattn train (for torchrun ... -m)"),
    ("python -m ringattn.apps.eagle3_train", "train an Eagle3 draft on a DP x CP mesh, "
     "online against a target or on stored outputs, and export it"),
    ("python -m ringattn.apps.eagle3_target", "store a target's outputs for "
     "python -m ringattn.apps.eagle3_train --offline"),
    ("python -m ringattn.apps.specforge_train", "SpecForge's own Eagle3 trainer with "
     "ringattn's context parallelism (needs SpecForge: docs/specforge.md)"),
    ("python -m ringattn.apps.modelopt_train", "ModelOpt's Eagle3 training recipe with "
     "ringattn's context parallelism (needs ringattn[modelopt]: docs/modelopt.md)"),
)
"""(command, what it does) of every program the package installs."""


def not_a_program(spec=None) -> None:
    """Exit with status 2 and one line on stderr: ``spec``'s module (the ``__spec__`` of
    the module run; None: ``sys.argv[0]``) is a library module, and the programs are these.

    Raises:
        SystemExit: always, code 2.
    """
    name = spec.name if spec is not None else sys.argv[0]
    print(f"{name} is a library module, not a program; the programs are: "
          + ", ".join(command for command, _ in PROGRAMS), file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    not_a_program(__spec__)
