"""Acceptance against context length: an Eagle3 draft trained on short rows beside one trained
on longer rows, evaluated by speculative decoding per bucket of the position where each
round's speculation starts (``ringattn.eagle3.evaluate.acceptance``'s ``by_position``).

Legend: S training row length, P prompt length, K proposals per round.

CPU-sized: the target is ``Eagle3Config``'s tiny random Llama (4 layers, hidden 64, vocab
96; its greedy next token is mostly determined by the current one), the same for both drafts
(a training config's ``seqlen`` only sets the RoPE length the config records; RoPE is
computed at any position). Each draft is one Llama decoder layer with 7 TTT steps and the
whole vocabulary as its own, trained in one process by ``apps.eagle3_train.train_eagle3``
(``--steps`` AdamW steps of ``--batch`` random-token rows, constant learning rate 1e-2, no
clipping: the unit tests' recipe), at ``--short`` and at ``--long`` tokens per row.

Evaluation: greedy chain speculative decoding (``speculation_rounds``, no KV cache: every
round reruns the target over the whole sequence), K = ``--draft-len``, ``--new`` tokens
after each of ``--per-bucket`` held-out random prompts per bucket, their lengths spread
evenly over the bucket (the last one up to ``--max-len``), every bucket's prompts ending in
the same ``--per-bucket`` random 4-token tails (``make_prompts``); a round counts in the
bucket of its own start position S (verified tokens before it).

Writes ``results/eagle3_context.json`` (the machine, every setting, the training curves'
ends, both drafts' ``acceptance`` dicts and every round as [position, proposed,
accepted]) and ``results/eagle3_context.png``, and prints the
table for RESULTS.md.

    python benchmarks/bench_eagle3_context.py            # 223 s on 2 idle cores
    python benchmarks/bench_eagle3_context.py --replot   # table and plot from the JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

from common import RESULTS, machine_info, write_json
from ringattn.apps.eagle3_train import Eagle3Config, build_target, train_eagle3
from ringattn.eagle3.evaluate import acceptance, by_position, speculation_rounds

OUT = RESULTS / "eagle3_context.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", type=int, default=32, help="row length of the short draft")
    p.add_argument("--long", type=int, default=256, help="row length of the long draft")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps of each draft")
    p.add_argument("--batch", type=int, default=8, help="rows per step")
    p.add_argument("--buckets", type=int, nargs="+", default=[0, 32, 256, 512],
                   help="lower edges of the position buckets (the first 0)")
    p.add_argument("--max-len", type=int, default=1024, help="longest prompt")
    p.add_argument("--per-bucket", type=int, default=12, help="prompts per bucket")
    p.add_argument("--new", type=int, default=16, help="tokens generated per prompt")
    p.add_argument("--draft-len", type=int, default=4, help="proposals per round (K)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (tiny matrices: more only contend on 2 cores)")
    p.add_argument("--replot", action="store_true", help="table and plot from the JSON")
    return p.parse_args(argv)


SUFFIX = 4
"""Every prompt ends with one of ``per_bucket`` fixed random 4-token tails."""


def prompt_lengths(buckets: list[int], max_len: int, per_bucket: int) -> list[int]:
    """``per_bucket`` prompt lengths spread evenly over each bucket [a, b) (the last up to
    ``max_len``), each >= ``SUFFIX``."""
    ends = [*buckets[1:], max_len]
    return [max(SUFFIX, a + (b - a) * i // per_bucket)
            for a, b in zip(buckets, ends) for i in range(per_bucket)]


def make_prompts(lengths: list[int], per_bucket: int) -> list[torch.Tensor]:
    """Held-out random prompts (training draws from seed 17): prompt k is random filler,
    then tail k mod ``per_bucket``. Each bucket's prompts thus end in the same tails, so
    the buckets differ in how much context precedes the tokens generated, not in which
    tokens start the generation (the target's greedy continuation follows mostly the last
    token, and a draft's acceptance differs between continuations more than between
    positions)."""
    vocab = Eagle3Config.vocab
    tails = [torch.randint(vocab, (SUFFIX,), generator=torch.Generator().manual_seed(9000 + i))
             for i in range(per_bucket)]
    return [torch.cat([torch.randint(vocab, (n - SUFFIX,),
                                     generator=torch.Generator().manual_seed(7000 + k)),
                       tails[k % per_bucket]])
            for k, n in enumerate(lengths)]


def train_config(seqlen: int, args) -> Eagle3Config:
    """The unit tests' recipe (tests/unit/test_eagle3_evaluate.py) at row length ``seqlen``."""
    return Eagle3Config(seqlen=seqlen, batch=args.batch, pad=min(4, seqlen // 8),
                        steps=args.steps, lr=1e-2, grad_clip=0.0, min_lr_ratio=1.0,
                        draft_vocab=Eagle3Config.vocab)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    target = build_target(Eagle3Config(), "sdpa")
    lengths = prompt_lengths(args.buckets, args.max_len, args.per_bucket)
    prompts = make_prompts(lengths, args.per_bucket)
    result = {"machine": machine_info(), "settings": vars(args), "prompt_lengths": lengths,
              "drafts": {}}
    for name, seqlen in (("short", args.short), ("long", args.long)):
        cfg = train_config(seqlen, args)
        t0, cpu0 = time.perf_counter(), time.process_time()
        trained = train_eagle3(cfg, progress=False, keep_draft=True)
        train_s, train_cpu = time.perf_counter() - t0, time.process_time() - cpu0
        t0, cpu0 = time.perf_counter(), time.process_time()
        draft = trained["draft"].eval()
        res = acceptance(target, draft, prompts, max_new_tokens=args.new,
                         draft_len=args.draft_len, buckets=args.buckets)
        records = speculation_rounds(target, draft, prompts, max_new_tokens=args.new,
                                     draft_len=args.draft_len)  # the same rounds, listed
        if by_position(records, args.buckets) != res["by_position"]:
            raise RuntimeError("speculation_rounds' records bucket differently: not deterministic")
        n = min(10, args.steps)
        result["drafts"][name] = {
            "config": dataclasses.asdict(cfg), "train_seconds": train_s,
            "train_cpu_seconds": train_cpu, "eval_seconds": time.perf_counter() - t0,
            "eval_cpu_seconds": time.process_time() - cpu0,
            "loss_first_last": [trained["loss"][0], trained["loss"][-1]],
            "step0_accuracy_last10": sum(trained["step_accuracy"][0][-n:]) / n,
            "acceptance": res,
            "rounds": [[r.position, r.proposed, r.accepted] for r in records]}
        d = result["drafts"][name]
        print(f"{name} draft (S={seqlen}): trained {train_s:.0f} s ({train_cpu:.0f} s CPU), "
              f"evaluated {d['eval_seconds']:.0f} s ({d['eval_cpu_seconds']:.0f} s CPU); "
              f"{res['mean_accepted_per_round']:.3f} tokens per round", flush=True)
    return result


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(result: dict) -> str:
    """RESULTS.md's table: per bucket, each draft's rounds, tokens per round and acceptance
    rate; then all rounds."""
    drafts = result["drafts"]
    head = ["start position"] + [f"S={d['config']['seqlen']} draft: {what}" for d in
                                 drafts.values() for what in ("rounds", "tokens/round", "rate")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = zip(*(d["acceptance"]["by_position"] for d in drafts.values()))
    for buckets in rows:
        cells = [buckets[0]["label"]]
        for b in buckets:
            cells += [str(b["rounds"]), _fmt(b["mean_accepted_per_round"]),
                      _fmt(b["acceptance_rate"], ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    cells = ["all"]
    for d in drafts.values():
        a = d["acceptance"]
        cells += [str(a["rounds"]), _fmt(a["mean_accepted_per_round"]),
                  _fmt(a["acceptance_rate"], ".3f")]
    lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafts = result["drafts"]
    k = result["settings"]["draft_len"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(drafts)
    for d, (name, draft) in enumerate(drafts.items()):
        buckets = draft["acceptance"]["by_position"]
        xs = [i - 0.4 + width * (d + 0.5) for i in range(len(buckets))]
        heights = [b["mean_accepted_per_round"] or 0.0 for b in buckets]
        ax.bar(xs, heights, width=width * 0.95,
               label=f"draft trained at S={draft['config']['seqlen']}")
        for x, b in zip(xs, buckets):
            ax.annotate(_fmt(b["mean_accepted_per_round"]), (x, b["mean_accepted_per_round"]
                                                             or 0.0),
                        ha="center", va="bottom", fontsize="x-small")
    labels = [b["label"] for b in next(iter(drafts.values()))["acceptance"]["by_position"]]
    ax.set_xticks(range(len(labels)), labels)
    ax.axhline(k + 1, color="tab:green", ls=":", lw=1, label=f"all {k} proposals accepted")
    ax.axhline(1, color="tab:red", ls=":", lw=1, label="none accepted")
    ax.set_ylim(0, k + 2.4)
    ax.set_xlabel("position where the speculation starts (verified tokens before the round)")
    ax.set_ylabel("tokens per round (accepted + 1)")
    ax.legend(fontsize="small", loc="upper right", ncol=2)
    ax.grid(alpha=0.3, axis="y")
    s = result["settings"]
    ax.set_title(f"Eagle3 draft acceptance by context position (tiny random Llama target, "
                 f"CPU)\n{s['steps']} steps x {s['batch']} rows each; {s['new']} new tokens "
                 f"after {s['per_bucket']} prompts per bucket, K={k}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.replot:
        import json

        result = json.loads(OUT.read_text())
    else:
        t0, cpu0 = time.perf_counter(), time.process_time()
        result = run(args)
        result["seconds"] = time.perf_counter() - t0
        result["cpu_seconds"] = time.process_time() - cpu0  # wall on an idle machine
        result["load_average_1min_at_end"] = os.getloadavg()[0]
        write_json(OUT, result)
    plot(result, OUT.with_suffix(".png"))
    print(table(result))
    print(f"wrote {OUT} and {OUT.with_suffix('.png').name} ({result['seconds']:.0f} s, "
          f"{result['cpu_seconds']:.0f} s CPU, load average "
          f"{result['load_average_1min_at_end']:.1f} at the end)")


if __name__ == "__main__":
    main()
