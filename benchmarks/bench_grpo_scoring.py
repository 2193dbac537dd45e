"""One GRPO scoring + loss step under CP at a 152k vocabulary: the loss in tiles
(``ringattn.tiled_token_loss``) beside the untiled one (the logits, then log-softmax),
per-rank memory and the longest sequence under a cap, at W = 1, 2, 4.

Legend: S global seq (prompt + completion), L = S / W, V vocabulary.

The model is a Llama with V = 151936 (Qwen's), narrow but deep enough that its
activations, not only the head, grow with S (hidden 128, 16 layers, 4 heads, 2 kv heads,
MLP 256, untied head; no checkpointing), fp32, B = 1, ring attention (``ra_hf.prepare_batch``, zigzag).
A step is what GRPO's trainer computes for one micro-batch: the reference model's
log-probabilities (no grad), the policy's (with grad) and its entropy, then GRPO's per-token
loss (``min(r A, clip(r, 1 - 0.2, 1 + 0.2) A)`` with ``r`` the ratio to the old policy's
log-probabilities (the policy's own, detached, as with one iteration) and ``A`` 1 at every
third position and -0.5 elsewhere, plus ``0.04`` times the k3 KL to the reference, whose
head is the policy's moved by N(0, 0.05)), a masked mean over the completion's tokens (the last 3/4 of
the row; the global count), the backward and the gradients' all-reduce. "untiled" computes
each log-probability from the [L, V] logits (``lm_head``, ``/ temperature``,
``log_softmax``: what a trainer without a fused head does); "tiled" from the hidden states,
the reference's log-probabilities with ``tiled_logprobs`` and the policy's loss with
``tiled_token_loss`` (the per-token loss above, its gradients computed in the forward; the
default tile, "16MiB": 27 rows at this V); "tiled_logprobs", timed only, the policy's
log-probabilities with ``tiled_logprobs`` and the loss on them by autograd (each tile's
logits computed again in the backward). The weights' gradients (the embedding's and the
head's [V, H] each, 74 MiB) count in every method.

Memory is the peak of live tensor bytes on a rank during one step (``common.TensorBytes``;
the weights made before), the max over ranks. Measured: the peak at a fixed S
(``--seqlen``) per method and W; at a fixed L (``--flat-l``) for the tiled method (flat in
W); the longest S under ``--cap-mib`` per method and W (S doubles from W times W = 1's
longest, or ``--start``, until the cap is bracketed, then ``--bisect`` bisections; S a
multiple of 8 W); the step time of each method at W = 2, S = ``--time-s`` (the median of
``--rounds`` paired rounds, each step the slowest rank's).

Writes ``<out>/grpo_scoring.json`` and ``grpo_scoring.png``.

    python benchmarks/bench_grpo_scoring.py            # cap 512 MiB
    python benchmarks/bench_grpo_scoring.py --quick    # V 8192, W 1 and 2
    python benchmarks/bench_grpo_scoring.py --table    # the tables of the last run
    python benchmarks/bench_grpo_scoring.py --time-only    # the timing again, into its JSON
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, Cluster, longest_under_cap, machine_info,  # noqa: E402
                    paired_rounds, run_once, step_peaks, write_json)

MODEL = dict(vocab=151936, hidden=128, layers=16, heads=4, kv_heads=2, intermediate=256)
METHODS = ("untiled", "tiled")
TIMED = METHODS + ("tiled_logprobs",)
WORLDS = (1, 2, 4)
TEMPERATURE, EPSILON, BETA = 0.9, 0.2, 0.04


# ---------------------------------------------------------------------------- rank side


def _setup(model: dict):
    """(step(S, method) -> loss) on this rank: policy and reference, the same weights."""
    import transformers as tf

    import ringattn as ra
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    cfg = tf.LlamaConfig(vocab_size=model["vocab"], hidden_size=model["hidden"],
                         intermediate_size=model["intermediate"],
                         num_hidden_layers=model["layers"],
                         num_attention_heads=model["heads"],
                         num_key_value_heads=model["kv_heads"], max_position_embeddings=1 << 17)
    torch.manual_seed(0)
    policy = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=ra_hf.NAME)
    reference = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=ra_hf.NAME)
    reference.load_state_dict(policy.state_dict())
    with torch.no_grad():  # a reference a little apart from the policy: a KL that is not 0
        g = torch.Generator().manual_seed(1)
        reference.lm_head.weight.add_(0.05 * torch.randn(reference.lm_head.weight.shape,
                                                         generator=g))
    reference.requires_grad_(False)
    params = [p for p in policy.parameters()]
    group = dist.group.WORLD

    def hidden_of(m, local):
        return m.model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                       ring_context=local["ring_context"]).last_hidden_state

    def logprobs(m, local, method, entropy):
        hidden, target = hidden_of(m, local), local["shift_labels"]
        if method != "untiled":
            return ra.tiled_logprobs(hidden, m.lm_head, shift_labels=target,
                                     temperature=TEMPERATURE, entropy=entropy)
        logp = torch.log_softmax(m.lm_head(hidden).float() / TEMPERATURE, dim=-1)
        lp = logp.gather(-1, target.clamp_min(0)[..., None])[..., 0] * (target >= 0)
        ent = -(logp.exp() * logp).sum(-1) if entropy else None
        return lp, ent

    def token_loss(lp, ent, advantage, ref_lp, weight):
        """GRPO's per-token loss (one iteration: the old policy is the policy, detached),
        the KL to the reference, times the token's weight (its mask over the count)."""
        ratio = torch.exp(lp - lp.detach())
        clipped = torch.clamp(ratio, 1 - EPSILON, 1 + EPSILON)
        kl = torch.exp(ref_lp - lp) - (ref_lp - lp) - 1
        return (-torch.minimum(ratio * advantage, clipped * advantage) + BETA * kl) * weight

    def step(s: int, method: str) -> float:
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(0, model["vocab"], (1, s), generator=g)
        labels = ids.clone()
        labels[:, : s // 4] = -100  # the prompt: no loss
        for p in params:
            p.grad = None
        local = ra_hf.prepare_batch(policy, {"input_ids": ids, "labels": labels}, group=group)
        with torch.no_grad():
            ref_lp, _ = logprobs(reference, local, method, False)
        mask = (local["shift_labels"] >= 0).float()
        advantage = torch.where(local["position_ids"] % 3 == 0, 1.0, -0.5)  # per token
        count = mask.sum().detach().clone()
        dist.all_reduce(count, group=group)
        if method == "tiled":  # the loss's gradients in its forward: nothing recomputed
            loss = ra.tiled_token_loss(
                hidden_of(policy, local), policy.lm_head, token_loss,
                shift_labels=local["shift_labels"], temperature=TEMPERATURE, entropy=True,
                inputs={"advantage": advantage, "ref_lp": ref_lp, "weight": mask / count}).loss
        else:
            lp, ent = logprobs(policy, local, method, True)
            loss = token_loss(lp, ent, advantage, ref_lp, mask / count).sum()
            del ent
        loss.backward()
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        return float(total)

    for method in TIMED:  # warm-up
        step(64 * dist.get_world_size(), method)
    return step


def peak_task(model: dict, cases: list) -> list:
    """[{method, S, peak_mib, loss}] of each (method, S) in ``cases`` on this rank."""
    return step_peaks(_setup(model), cases, "method")


def time_task(model: dict, s: int, rounds: int) -> dict:
    step = _setup(model)
    times = paired_rounds({m: functools.partial(step, s, m) for m in TIMED}, rounds)
    return {"median_s": {m: statistics.median(v) for m, v in times.items()}, "rounds_s": times}


# ---------------------------------------------------------------------------- parent side


def _peak(cluster, model, method, s) -> float:
    ranks = cluster.run(peak_task, model, [(method, s)], timeout=3600)
    return max(r[0]["peak_mib"] for r in ranks)


def longest(cluster, model, method, opts, bar, guess=None) -> dict:
    """The longest S within the cap and the first over it, every probe recorded."""
    w = cluster.world

    def peak_of(s):
        bar.set_postfix_str(f"{method} W={w} S={s}")
        peak = _peak(cluster, model, method, s)
        bar.update(1)
        return peak

    lo, hi, probes = longest_under_cap(peak_of, opts["cap_mib"], guess or opts["start"] * w,
                                       8 * w, opts["max_s"], opts["bisect"])
    return {"method": method, "W": w, "max_s": lo, "first_over": hi, "probes": probes}


def run(args, out: Path) -> dict:
    model = {**MODEL, "vocab": args.vocab}
    opts = {"cap_mib": args.cap_mib, "start": args.start, "bisect": args.bisect,
            "max_s": args.max_s, "seqlen": args.seqlen, "flat_l": args.flat_l,
            "time_s": args.time_s, "rounds": args.rounds}
    data = {"machine": machine_info(), "model": model, "dtype": "fp32", "B": 1,
            "temperature": TEMPERATURE, "epsilon": EPSILON, "beta": BETA, "options": opts,
            "memory": "peak live tensor bytes of one step (common.TensorBytes), max over ranks",
            "fixed": [], "flat": [], "search": [], "time": None}
    t0 = time.monotonic()
    bar = tqdm(unit="probe", dynamic_ncols=True)
    for w in args.worlds:
        cluster = Cluster(w, memory=True)
        try:
            cases = [(m, args.seqlen) for m in METHODS] + [("tiled", args.flat_l * w)]
            bar.set_postfix_str(f"W={w} fixed S and L")
            ranks = cluster.run(peak_task, model, cases, timeout=3600)
            for i, (m, s) in enumerate(cases):
                row = {"method": m, "W": w, "S": s, "L": s / w,
                       "peak_mib": max(r[i]["peak_mib"] for r in ranks),
                       "loss": ranks[0][i]["loss"]}
                data["fixed" if i < len(METHODS) else "flat"].append(row)
            bar.update(1)
            for m in METHODS:
                one = next((r["max_s"] for r in data["search"]
                            if r["method"] == m and r["W"] == 1), None)
                data["search"].append(longest(cluster, model, m, opts, bar,
                                              guess=one and one * w))
                write_json(out / "grpo_scoring.json", data)
        finally:
            cluster.close(force=True)
    if 2 in args.worlds and args.rounds:
        bar.set_postfix_str(f"time W=2 S={args.time_s}")
        data["time"] = timing(model, args)
    bar.close()
    data["summary"] = summarize(data)
    data["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(out / "grpo_scoring.json", data)
    return data


def timing(model: dict, args) -> dict:
    """The paired-rounds step times at W = 2, S = ``--time-s``."""
    got = run_once(2, time_task, model, args.time_s, args.rounds)[0]
    med = got["median_s"]
    return {"W": 2, "S": args.time_s, **got,
            "tiled_over_untiled": med["tiled"] / med["untiled"],
            "tiled_logprobs_over_untiled": med["tiled_logprobs"] / med["untiled"],
            "load_average": list(os.getloadavg())}


def summarize(data) -> dict:
    best = {(r["method"], r["W"]): r for r in data["search"]}
    longest_ = {m: {w: {"max_s": r["max_s"], "first_over": r["first_over"],
                        "over_w1": (r["max_s"] / best[(m, 1)]["max_s"]
                                    if r["max_s"] and best.get((m, 1), {}).get("max_s")
                                    else None)}
                    for (mm, w), r in best.items() if mm == m} for m in METHODS}
    flat = [r["peak_mib"] for r in data["flat"]]
    fixed = {(r["method"], r["W"]): r for r in data["fixed"]}
    return {
        "longest": longest_,
        "tiled_over_untiled_longest": {w: (best[("tiled", w)]["max_s"] /
                                           best[("untiled", w)]["max_s"])
                                       for (m, w) in best if m == "tiled"
                                       and best.get(("untiled", w), {}).get("max_s")},
        "flat_max_over_min": max(flat) / min(flat) if flat else None,
        "losses_agree": all(abs(fixed[("tiled", w)]["loss"] - fixed[("untiled", w)]["loss"])
                            <= 1e-5 * abs(fixed[("untiled", w)]["loss"])
                            for (m, w) in fixed if m == "tiled"),
    }


def markdown(data) -> str:
    s, o = data["summary"], data["options"]
    worlds = sorted({r["W"] for r in data["fixed"]})
    lines = [f"GRPO scoring + loss step, V = {data['model']['vocab']}, fp32, B = 1, cap "
             f"{o['cap_mib']:.0f} MiB per rank:", "",
             "| method | " + " | ".join(f"W = {w}: longest S (first over)" for w in worlds)
             + " |", "|---|" + "---|" * len(worlds)]
    for m in METHODS:
        cells = []
        for w in worlds:
            r = s["longest"][m].get(w, {})
            ratio = f", {r['over_w1']:.2f}x W = 1" if w > 1 and r.get("over_w1") else ""
            cells.append(f"{r.get('max_s')} ({r.get('first_over')}{ratio})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "| peak MiB per rank | " + " | ".join(f"W = {w}" for w in worlds) + " |",
              "|---|" + "---:|" * len(worlds)]
    for m in METHODS:
        lines.append(f"| {m}, S = {o['seqlen']} | " + " | ".join(
            f"{next(r['peak_mib'] for r in data['fixed'] if r['method'] == m and r['W'] == w):.1f}"
            for w in worlds) + " |")
    lines.append(f"| tiled, L = {o['flat_l']} | " + " | ".join(
        f"{next(r['peak_mib'] for r in data['flat'] if r['W'] == w):.1f}" for w in worlds) + " |")
    lines += ["", f"at a fixed L, max / min over W: {s['flat_max_over_min']:.4f}; the two "
              f"methods' losses agree (1e-5 relative): {s['losses_agree']}"]
    if data["time"]:
        t = data["time"]
        lines.append(f"step time at W = 2, S = {t['S']}: tiled / untiled "
                     f"{t['tiled_over_untiled']:.2f}x, tiled_logprobs / untiled "
                     f"{t['tiled_logprobs_over_untiled']:.2f}x (medians of "
                     f"{len(t['rounds_s']['tiled'])} paired rounds, load average "
                     f"{t['load_average'][0]:.1f})")
    return "\n".join(lines)


def plot(data, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = data["summary"]
    worlds = sorted({r["W"] for r in data["fixed"]})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for m in METHODS:
        ax.plot(worlds, [next(r["peak_mib"] for r in data["fixed"] if r["method"] == m
                              and r["W"] == w) for w in worlds], marker="o",
                label=f"{m}, S={data['options']['seqlen']}")
        bx.plot(worlds, [s["longest"][m].get(w, {}).get("max_s") or float("nan")
                         for w in worlds], marker="o", label=m)
    ax.plot(worlds, [next(r["peak_mib"] for r in data["flat"] if r["W"] == w) for w in worlds],
            marker="s", ls="--", label=f"tiled, L={data['options']['flat_l']}")
    ax.axhline(data["options"]["cap_mib"], color="gray", ls=":", label="cap")
    for a, label in ((ax, "peak live tensor MiB per rank"), (bx, "longest S under the cap")):
        a.set_xlabel("W")
        a.set_ylabel(label)
        a.set_yscale("log")
        a.set_xticks(worlds)
        a.legend(fontsize=7)
    fig.suptitle(f"GRPO scoring + loss step, V={data['model']['vocab']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap-mib", type=float, default=512.0)
    ap.add_argument("--vocab", type=int, default=MODEL["vocab"])
    ap.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    ap.add_argument("--seqlen", type=int, default=1024, help="the fixed S of the peak table")
    ap.add_argument("--flat-l", type=int, default=512, help="tokens per rank of the flat run")
    ap.add_argument("--start", type=int, default=512, help="first S per rank of a search")
    ap.add_argument("--bisect", type=int, default=2)
    ap.add_argument("--max-s", type=int, default=1 << 16)
    ap.add_argument("--time-s", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3, help="paired timing rounds (0: none)")
    ap.add_argument("--quick", action="store_true", help="V 8192, W 1 and 2, cap 16 MiB")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--time-only", action="store_true",
                    help="time the step again (on a quiet machine) into the last run's JSON")
    ap.add_argument("--table", action="store_true",
                    help="print the tables of the last run's JSON and redraw its plot")
    args = ap.parse_args(argv)
    out = args.out or (RESULTS / "smoke" if args.quick else RESULTS)
    if args.time_only:  # the timing again, into the last run's JSON
        done = json.loads((out / "grpo_scoring.json").read_text())
        done["time"] = timing(done["model"], args)
        write_json(out / "grpo_scoring.json", done)
        print(markdown(done))
        return
    if args.table:
        done = json.loads((out / "grpo_scoring.json").read_text())
        plot(done, out / "grpo_scoring.png")
        print(markdown(done))
        return
    if args.quick:
        args.vocab, args.worlds, args.cap_mib = 8192, [1, 2], 16.0
        args.seqlen, args.flat_l, args.time_s, args.rounds, args.bisect = 256, 128, 256, 1, 1
        args.start = 256
    out.mkdir(parents=True, exist_ok=True)
    data = run(args, out)
    plot(data, out / "grpo_scoring.png")
    print(markdown(data))


if __name__ == "__main__":
    main()
