"""Command line: ``ringattn demo`` (run by ``make demo``) and ``ringattn train``.

Also ``python -m ringattn.cli demo|train``; ``ringattn train`` takes the options of
``python -m ringattn.train`` and, like it, runs under torchrun too.
"""

from __future__ import annotations

import argparse
import sys

from . import train
from .layouts import LAYOUTS

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringattn", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a transformers LM under ring attention on CPU ranks; check it matches "
        "one process",
        description="Train a tiny LlamaForCausalLM (transformers) on a copy task twice from "
        "one seed: with ring attention on W gloo CPU ranks, and in one process with "
        "transformers' own attention. Exit 1 if the loss curves differ beyond float32 "
        "rounding or the model did not learn.",
    )
    demo.add_argument("--world", type=int, default=2, help="number of CPU ranks W (default 2)")
    demo.add_argument("--steps", type=int, default=train.TrainConfig.steps,
                      help=f"optimizer steps (default {train.TrainConfig.steps})")
    demo.add_argument("--seqlen", type=int, default=train.TrainConfig.seqlen,
                      help=f"sequence length S (default {train.TrainConfig.seqlen})")
    demo.add_argument("--layout", choices=sorted(LAYOUTS), default="zigzag",
                      help="token placement on ranks (default zigzag)")
    demo.add_argument("--single-attn", choices=train.SINGLE_ATTN, default="sdpa",
                      help="attention of the single-process run (default sdpa)")
    demo.add_argument("--out", default="demo_out", help="output directory (default demo_out/)")
    train.add_arguments(sub.add_parser(
        "train",
        help="train a transformers LM under context parallelism (spawned ranks or torchrun)",
        description=train.__doc__.split("\n\n")[0],
    ))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command in ``argv`` (default ``sys.argv[1:]``); exit non-zero on failure.

    Arguments:
        argv: command-line arguments without the program name.

    Returns:
        0 on success (a failure exits through ``SystemExit(1)``; bad usage through 2).
    """
    args = _parser().parse_args(argv)
    if args.command == "train":
        train.run_and_report(args)
        return 0
    from .demo import run_demo

    try:
        result = run_demo(world=args.world, steps=args.steps, out_dir=args.out,
                          layout=args.layout, seqlen=args.seqlen, single_attn=args.single_attn)
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
