"""Programs built on the library (nothing in the library imports them):

* ``cli``: the ``ringattn`` command (``ringattn demo``, ``ringattn train``);
* ``train``: the LM trainer (``python -m ringattn.apps.train``, ``ringattn train``);
* ``demo``: the LM demo (``ringattn demo --target lm``);
* ``eagle3_train``: Eagle3 draft training, DP x CP (``python -m ringattn.apps.eagle3_train``);
* ``eagle3_demo``: the Eagle3 demo that ``make demo`` runs (``ringattn demo``);
* ``eagle3_target``: store a target's outputs for offline Eagle3 training
  (``python -m ringattn.apps.eagle3_target``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

EXTRAS = {"demo": ("transformers", "tqdm", "matplotlib"), "hf": ("transformers", "accelerate")}
"""The install extras the programs need (pyproject.toml's optional dependencies)."""


def require_extra(extra: str, program: str, packages: tuple[str, ...] | None = None) -> None:
    """Exit with one line naming the missing packages and the extra that installs them,
    before a program starts any work.

    Arguments:
        extra: the extra that installs what ``program`` needs.
        program: the program's name, as the user typed it.
        packages: the packages of ``extra`` the program needs (default: all of them).

    Raises:
        SystemExit: code 2 when one of them is not installed.
    """
    missing = [m for m in packages or EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        print(f"{program} needs {', '.join(missing)}: pip install 'ringattn[{extra}]'",
              file=sys.stderr)
        raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    """The programs' argument parser: a usage error is one line on stderr naming the
    program and the error (not argparse's usage block first), and exit status 2."""

    def error(self, message: str):
        print(f"{self.prog}: {message} (--help lists the options)", file=sys.stderr)
        raise SystemExit(2)
