"""Command line: ``ringattn demo`` (also ``python -m ringattn.cli demo``, run by ``make demo``)."""

from __future__ import annotations

import argparse
import sys

from .layouts import LAYOUTS

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a tiny LM with ring attention on CPU ranks and check it matches one process",
        description="Train a tiny causal LM on a copy task twice from one seed: with ring "
        "attention on W gloo CPU ranks, and in one process with SDPA. Exit 1 if the loss "
        "curves differ beyond float32 rounding or the model did not learn.",
    )
    demo.add_argument("--world", type=int, default=2, help="number of CPU ranks W (default 2)")
    demo.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    demo.add_argument("--layout", choices=sorted(LAYOUTS), default="zigzag",
                      help="token placement on ranks (default zigzag)")
    demo.add_argument("--out", default="demo_out", help="output directory (default demo_out/)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command in ``argv`` (default ``sys.argv[1:]``); exit non-zero on failure.

    Arguments:
        argv: command-line arguments without the program name.

    Returns:
        0 on success (a failure exits through ``SystemExit(1)``; bad usage through argparse's 2).
    """
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        try:
            result = run_demo(
                world=args.world, steps=args.steps, out_dir=args.out, layout=args.layout
            )
        except ValueError as exc:
            print(f"ringattn demo: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        if result["failures"]:
            for message in result["failures"]:
                print(f"DEMO FAILED: {message}", file=sys.stderr)
            raise SystemExit(1)
        print(
            f"DEMO PASSED: ring attention on {args.world} ranks matches one process "
            f"(max relative loss difference {result['max_rel_diff']:.2e} "
            f"<= {result['tolerance']:g})"
        )
    return 0


if __name__ == "__main__":
    main()
