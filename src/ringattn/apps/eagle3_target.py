"""``python -m ringattn.apps.eagle3_target``: store a target's outputs for offline Eagle3
training (``ringattn.eagle3.target``'s format, version 3: auxiliary and final hidden states,
the head once), from chat data."""

from __future__ import annotations

import os
import sys

from ..eagle3.target import _DTYPES, load_target, precompute
from . import Number, Parser, check_model_dir, require_extra

PROG = "python -m ringattn.apps.eagle3_target"


def main(argv=None) -> int:
    """``python -m ringattn.apps.eagle3_target --target DIR --data chats.jsonl --out DIR``: render
    the conversations with the target's tokenizer and write the offline format.

    Returns:
        0 (bad arguments, or a missing transformers or tqdm, exit with status 2 and one line).
    """
    parser = Parser(prog=PROG, description=(
        "Store a target's outputs (auxiliary and final hidden states, and its head once) for "
        "offline Eagle3 training: render the conversations with the target's tokenizer and "
        "chat template, run the target once, and write the offline format that python -m "
        "ringattn.apps.eagle3_train --offline reads."))
    parser.add_argument("--target", required=True, help="a local transformers model directory")
    parser.add_argument("--data", required=True, help="JSON lines of conversations")
    parser.add_argument("--out", required=True, help="the offline directory to write")
    parser.add_argument("--seqlen", type=Number(int, 1), default=None,
                        help="cut conversations to this many tokens (default: whole)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16",
                        help="of the stored hidden states and head (default bfloat16)")
    parser.add_argument("--teacher", choices=("auto", "tiled", "logits"), default="auto",
                        help="tiled: store the final hidden states [S, H] and the head once "
                             "(format version 3); logits: the [S, V] logits (version 2, V "
                             "values per token); auto (default): tiled where ringattn's head "
                             "table reads the target's head, else logits")
    args = parser.parse_args(argv)
    require_extra("demo", PROG, packages=("transformers", "tqdm"))
    try:
        check_model_dir(args.target, "--target")
        if not os.path.isfile(args.data):
            raise ValueError(f"--data {args.data!r} is not a file")
        from transformers import AutoTokenizer

        from ..eagle3.data import load_conversations, render
        from ..integrations import transformers as ra_hf  # noqa: F401 (reads the head)

        conversations = load_conversations(args.data)
        target = load_target(args.target, attn_implementation="sdpa")
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    tok = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    samples = []
    for conv in conversations:
        ids, mask = render(tok, conv, max_len=args.seqlen)
        samples.append({"input_ids": ids, "loss_mask": mask})
    try:
        index = precompute(target, samples, args.out, dtype=args.dtype, teacher=args.teacher)
    except ValueError as exc:  # a head the table cannot read, with --teacher tiled
        print(f"{PROG}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {len(index['samples'])} samples to {args.out} (format version "
          f"{index['version']}, aux layers {index['aux_layers']}, {args.dtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
