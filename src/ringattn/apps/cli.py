"""Command line: ``ringattn demo`` (run by ``make demo``: Eagle3 draft training; ``--target
lm`` for the plain LM) and ``ringattn train``.

Also ``python -m ringattn.apps.cli demo|train``; ``ringattn train`` takes the options of
``python -m ringattn.apps.train`` and, like it, runs under torchrun too.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from .. import __version__
from .._program import PROGRAMS
from ..layouts import LAYOUTS
from . import Number, Parser, World, number_error, require_extra, train
from .demo import LEARN_STEPS as LM_LEARN_STEPS
from .eagle3_demo import LEARN_STEPS as EAGLE3_LEARN_STEPS
from .eagle3_train import PROMPT_TOKENS, SYNTHETIC_MIN_SEQLEN, Eagle3Config

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ringattn", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Train under ring attention: ringattn demo (what make demo runs: an Eagle3 draft "
            "on CPU ranks beside one process; --target lm for a plain causal LM) and ringattn "
            "train (a transformers causal LM, on spawned ranks or under torchrun).", 78),
        epilog="the package's programs:\n" + "\n".join(
            f"  {command}\n" + textwrap.fill(what, 78, initial_indent=" " * 6,
                                              subsequent_indent=" " * 6)
            for command, what in PROGRAMS))
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train under ring attention on CPU ranks (an Eagle3 draft, or a plain LM); "
        "check it matches one process",
        description="Train twice from one seed: under context parallelism on W gloo CPU "
        "ranks, and in one process. --target eagle3 (default): an Eagle3 draft with 7 TTT "
        "steps against a tiny transformers Llama target (the one process uses the dense TTT "
        "mask). --target lm: a tiny LlamaForCausalLM on a copy task. Exit 1 if the curves "
        "differ beyond float32 rounding, or if the model did not learn in a run of at least "
        f"{EAGLE3_LEARN_STEPS} steps (eagle3) or {LM_LEARN_STEPS} (lm): a shorter run is too "
        "short to judge learning, checks the curves only and says so.",
    )
    demo.add_argument("--target", choices=("eagle3", "lm"), default="eagle3",
                      help="what to train (default eagle3)")
    demo.add_argument("--world", type=World(), default=2,
                      help="number of CPU ranks W (default 2; at most this machine's cores, "
                      "or 8 if it has fewer)")
    demo.add_argument("--steps", type=Number(int, 1), default=None,
                      help=f"optimizer steps (default: eagle3 {Eagle3Config.steps}, "
                      f"lm {train.TrainConfig.steps})")
    demo.add_argument("--seqlen", type=Number(int), default=None,  # range: by --target
                      help=f"sequence length S (default: eagle3 {Eagle3Config.seqlen}, "
                      f"lm {train.TrainConfig.seqlen}; at least eagle3 {SYNTHETIC_MIN_SEQLEN}, "
                      f"lm {train.MIN_SEQLEN})")
    demo.add_argument("--layout", choices=sorted(LAYOUTS), default="zigzag",
                      help="token placement on ranks (default zigzag)")
    demo.add_argument("--single-attn", choices=train.SINGLE_ATTN, default="sdpa",
                      help="lm: attention of the single-process run (default sdpa)")
    demo.add_argument("--out", default="demo_out", help="output directory (default demo_out/)")
    parser.demo = demo  # its checks that depend on --target report as "ringattn demo: ..."
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
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.seqlen is not None and args.target == "eagle3":
            # a prompt, then a target token for each TTT step: on shorter rows TTT steps
            # have nothing to train on (below 10 tokens every loss is 0)
            number_error(parser.demo, "--seqlen", Number(int, SYNTHETIC_MIN_SEQLEN),
                         args.seqlen, f"with --target eagle3 ({PROMPT_TOKENS} prompt tokens, "
                         f"then one for each of the {Eagle3Config.ttt_steps} TTT steps)")
        elif args.seqlen is not None:
            number_error(parser.demo, "--seqlen", Number(int, train.MIN_SEQLEN), args.seqlen,
                         "with --target lm")
        defaults = Eagle3Config if args.target == "eagle3" else train.TrainConfig
        args.steps = defaults.steps if args.steps is None else args.steps
        args.seqlen = defaults.seqlen if args.seqlen is None else args.seqlen
    require_extra("demo", f"ringattn {args.command}")
    if args.command == "train":
        train.run_and_report(args)
        return 0
    try:
        if args.target == "eagle3":
            from .eagle3_demo import run_eagle3_demo

            result = run_eagle3_demo(world=args.world, steps=args.steps, out_dir=args.out,
                                     layout=args.layout, seqlen=args.seqlen)
            what = "an Eagle3 draft"
        else:
            from .demo import run_demo

            result = run_demo(world=args.world, steps=args.steps, out_dir=args.out,
                              layout=args.layout, seqlen=args.seqlen,
                              single_attn=args.single_attn)
            what = "a causal LM"
    except ValueError as exc:
        print(f"ringattn demo: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if result["failures"]:
        for message in result["failures"]:
            print(f"DEMO FAILED: {message}", file=sys.stderr)
        raise SystemExit(1)
    print(
        f"DEMO PASSED: {what} trained under ring attention on {args.world} ranks matches one "
        f"process (max relative loss difference {result['max_rel_diff']:.2e} "
        f"<= {result['tolerance']:g})"
        + ("" if result["learning_judged"] else
           f"; learning not judged: {args.steps} steps are too few (it takes "
           f"{result['learn_steps']})")
    )
    return 0


if __name__ == "__main__":
    main()
