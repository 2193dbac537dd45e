"""``python -m ringattn.apps.eagle3_target``: store a target's outputs for offline Eagle3
training (``ringattn.eagle3.target``'s format), from chat data."""

from __future__ import annotations

from ..eagle3.target import _DTYPES, load_target, precompute


def main(argv=None) -> int:
    """``python -m ringattn.apps.eagle3_target --target DIR --data chats.jsonl --out DIR``: render
    the conversations with the target's tokenizer and write the offline format."""
    import argparse

    from transformers import AutoTokenizer

    from ..eagle3.data import load_conversations, render

    parser = argparse.ArgumentParser(prog="python -m ringattn.apps.eagle3_target",
                                     description=main.__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="a local transformers model directory")
    parser.add_argument("--data", required=True, help="JSON lines of conversations")
    parser.add_argument("--out", required=True, help="the offline directory to write")
    parser.add_argument("--seqlen", type=int, default=None, help="cut conversations to this")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16",
                        help="of the stored hidden states and logits")
    args = parser.parse_args(argv)
    target = load_target(args.target, attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    samples = []
    for conv in load_conversations(args.data):
        ids, mask = render(tok, conv, max_len=args.seqlen)
        samples.append({"input_ids": ids, "loss_mask": mask})
    index = precompute(target, samples, args.out, dtype=args.dtype)
    print(f"wrote {len(index['samples'])} samples to {args.out} (aux layers "
          f"{index['aux_layers']}, {args.dtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
