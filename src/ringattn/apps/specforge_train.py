"""``python -m ringattn.apps.specforge_train train -c run.yaml --cp-size C``: SpecForge's own
Eagle3 trainer (offline features, colocated) with ringattn as its context-parallel attention
(``ringattn.integrations.specforge``; docs/specforge.md). Run one process per rank, as
``torchrun --nproc_per_node N -m ringattn.apps.specforge_train train -c run.yaml --cp-size C``."""

from __future__ import annotations

import os
import sys

from . import Number, Parser

PROG = "python -m ringattn.apps.specforge_train"


def parser() -> Parser:
    """The program's argument parser (needs no SpecForge)."""
    p = Parser(prog=PROG, description=(
        "Train a SpecForge Eagle3 draft whose config names RingLlamaForCausalLMEagle3 with "
        "SpecForge's own trainer, its sequence sharded over --cp-size ranks by ringattn "
        "(exact: the losses and gradients of one process). Start one process per rank with "
        "torchrun."))
    sub = p.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from a SpecForge run config")
    train.add_argument("-c", "--config", required=True, help="SpecForge's YAML or JSON run config")
    train.add_argument("--cp-size", type=Number(int, 1), default=None,
                       help="ranks per context-parallel group (default: the whole world)")
    train.add_argument("overrides", nargs="*",
                       help="SpecForge's dotted overrides, e.g. training.learning_rate=1e-4")
    return p


def main(argv=None) -> int:
    """Parse ``train -c CONFIG [--cp-size C] [dotted overrides...]`` and run SpecForge's
    trainer under CP.

    Returns:
        0 once training ends (bad arguments, a missing SpecForge or a refused config exit
        with status 2 and one line).
    """
    args = parser().parse_args(argv)
    if not os.path.isfile(args.config):  # before SpecForge: its paths are in this file
        print(f"{PROG}: -c {args.config!r} is not a file (SpecForge's run config)",
              file=sys.stderr)
        raise SystemExit(2)
    try:
        import specforge.config  # noqa: F401
    except ImportError:
        print(f"{PROG} needs SpecForge (make test-specforge installs it into .venv-specforge; "
              "see docs/specforge.md)", file=sys.stderr)
        raise SystemExit(2) from None
    from specforge.distributed import destroy_distributed

    from ..integrations.specforge import build

    cp = args.cp_size if args.cp_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        run = build(args.config, args.overrides, cp_size=cp)
    except ValueError as exc:  # a refused config: one line, the same on every rank
        print(f"{PROG}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        run.run()  # (returns the trainer's last step, not a status)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
