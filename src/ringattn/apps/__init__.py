"""Programs built on the library (nothing in the library imports them):

* ``cli``: the ``ringattn`` command (``ringattn demo``, ``ringattn train``);
* ``train``: the LM trainer (``python -m ringattn.apps.train``, ``ringattn train``);
* ``demo``: the LM demo (``ringattn demo --target lm``);
* ``eagle3_train``: Eagle3 draft training, DP x CP (``python -m ringattn.apps.eagle3_train``);
* ``eagle3_demo``: the Eagle3 demo that ``make demo`` runs (``ringattn demo``);
* ``eagle3_target``: store a target's outputs for offline Eagle3 training
  (``python -m ringattn.apps.eagle3_target``);
* ``specforge_train``, ``modelopt_train``: SpecForge's and ModelOpt's Eagle3 trainers under
  ringattn's context parallelism.

What they share: ``require_extra`` (a missing package, one line), ``Number`` (every numeric
option), ``check_model_dir`` (a model path that is not a local model directory, one line),
``check_world`` (more ranks than the machine runs, one line), ``Parser`` (usage errors, one
line): each exits with status 2 before any rank starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

EXTRAS = {"demo": ("transformers", "accelerate", "tqdm", "matplotlib"),
          "hf": ("transformers", "accelerate"),
          "modelopt": ("modelopt", "requests", "transformers", "accelerate")}
"""The install extras the programs need (pyproject.toml's optional dependencies), by import
name (``modelopt`` installs as nvidia-modelopt): transformers' ``Trainer`` (``ringattn
train``, ``ringattn demo --target lm``) needs accelerate; ModelOpt imports requests without
declaring it."""


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


def hub_hint(path) -> str:
    """What to add to a refusal of a model ``path`` that does not exist here but reads as a
    hub name ("org/name"): the programs read models from disk only (``local_files_only``;
    a rank must not download), so say how to get one there; "" for any other path."""
    if (isinstance(path, str) and not os.path.exists(path) and path.count("/") == 1
            and not path.startswith((".", "~")) and all(path.split("/"))):
        return (f"; the programs read no hub names: download it first (hf download {path} "
                f"--local-dir DIR) and pass DIR")
    return ""


def check_model_dir(path, what: str) -> None:
    """Refuse, before any rank starts, a model path that is not a local transformers model
    directory (one holding a ``config.json``): a missing path or a hub name ("org/name")
    otherwise ends in a traceback from transformers on every rank.

    Arguments:
        path: the path as the user gave it.
        what: how the user gave it, for the message ("--target", "model.model_name_or_path").

    Raises:
        ValueError: ``{what} {path!r} is not a local transformers model directory (no
            config.json)``, and for a hub name how to download it.
    """
    if not (isinstance(path, str) and os.path.isfile(os.path.join(path, "config.json"))):
        raise ValueError(f"{what} {path!r} is not a local transformers model directory "
                         f"(no config.json){hub_hint(path)}")


class Number:
    """An argparse ``type=`` for a number in a range, the one check of every program's
    numeric options: ``--steps 0`` fails in argparse (status 2, before any rank starts) with
    ``argument --steps: must be an int >= 1, got 0``; text that is not a number keeps
    argparse's ``invalid int value: 'x'``.

    Arguments:
        kind: ``int`` or ``float`` (a float must also be finite: no nan or inf).
        low: the smallest value allowed (None: no lower bound).
        high: the largest value allowed (None: no upper bound).
        above: a value the number must exceed (for a float > 0), instead of ``low``.
    """

    def __init__(self, kind: type, low=None, high=None, *, above=None):
        if kind not in (int, float) or (low is not None and above is not None):
            raise ValueError("Number(kind in (int, float), low or above, high)")
        self.kind, self.low, self.high, self.above = kind, low, high, above
        self.__name__ = kind.__name__  # argparse's "invalid int value" names it

    @property
    def allowed(self) -> str:
        """The range in words: "an int >= 1", "a float > 0", "an int in [0, 4294967295]"."""
        what = "an int" if self.kind is int else "a finite float"
        if self.low is not None and self.high is not None:
            return f"{what} in [{self.low}, {self.high}]"
        if self.above is not None:
            bound = f" > {self.above}"
        elif self.low is not None:
            bound = f" >= {self.low}"
        else:
            bound = ""
        return what + bound + (f" <= {self.high}" if self.high is not None else "")

    def problem(self, value) -> str | None:
        """Why ``value`` is out of range (``must be ..., got ...``), or None."""
        bad = (isinstance(value, bool) or not isinstance(value, (int, float))
               or (self.kind is int and not isinstance(value, int))
               or (isinstance(value, float) and not math.isfinite(value))
               or (self.low is not None and value < self.low)
               or (self.above is not None and value <= self.above)
               or (self.high is not None and value > self.high))
        return f"must be {self.allowed}, got {value!r}" if bad else None

    def __call__(self, text: str):
        value = self.kind(text)  # ValueError: argparse's "invalid int value: 'x'"
        problem = self.problem(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return value


WORLD_FLOOR = 8
"""The most ranks a program spawns on any machine, whatever its core count, is at least
this: ranks beyond the cores share them (slower, still exact), and a small machine still
runs the world sizes the tests use (3, 5, 6 and 8 on 2 cores)."""


def cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def world_limit() -> int:
    """The most ranks a program spawns on this machine: its cores, at least ``WORLD_FLOOR``
    (``ringattn demo --world 1000`` once started spawning 1000 ranks on 2 cores). Under
    torchrun the launcher decides, not this."""
    return max(WORLD_FLOOR, cores())


def world_problem(world) -> str | None:
    """Why ``world`` ranks cannot be spawned here (``must be at most 8 on this machine
    (...), got 1000``), or None."""
    limit = world_limit()
    if isinstance(world, int) and world > limit:
        return (f"must be at most {limit} on this machine (spawned ranks share its {cores()} "
                f"cores: at most max(cores, {WORLD_FLOOR}) of them), got {world}")
    return None


class World(Number):
    """The ``--world`` of a program that spawns its ranks: ``Number(int, 1)`` that also
    refuses more ranks than ``world_limit()``, naming the value and the limit."""

    def __init__(self):
        super().__init__(int, 1)

    def problem(self, value) -> str | None:
        return super().problem(value) or world_problem(value)


def number_error(parser: argparse.ArgumentParser, option: str, number: Number, value,
                 why: str = "") -> None:
    """A range that depends on other options, checked after parsing: the same error as
    ``Number`` gives (``argument --seqlen: must be an int >= 16 <why>, got 9``, status 2)
    when ``value`` is outside ``number``'s range; nothing otherwise."""
    problem = number.problem(value)
    if problem is not None:
        if why:
            problem = problem.replace(", got ", f" {why}, got ", 1)
        parser.error(f"argument {option}: {problem}")


class Parser(argparse.ArgumentParser):
    """The programs' argument parser: a usage error is one line on stderr naming the
    program and the error (not argparse's usage block first), and exit status 2."""

    def error(self, message: str):
        print(f"{self.prog}: {message} (--help lists the options)", file=sys.stderr)
        raise SystemExit(2)
