"""Eagle3 draft training at long context: the teacher in tiles beside the teacher from the
target's logits, per-rank step memory and the longest S under a cap, at cp = 1, 2, 4.

Legend: S global seq, L local seq (S / W), W cp size (ranks), V target vocab, Vd draft vocab.

The model is Llama-3-shaped where it matters for memory (``MODEL``: V = 128256 and a draft
vocabulary of Vd = 32000) and small elsewhere so that it trains on this machine (hidden 128,
3 decoder layers (the three Eagle3 reads), 4 heads, 2 kv heads; the one-layer draft; 7 TTT steps), fp32, B = 1, the
row right-padded by ``--pad`` tokens, layout zigzag. A step is ``eagle3_train.train_step``
at dp = 1: the target's forward under CP (``run_target``), the draft's TTT unroll
(``eagle3_step``), its backward, the all-reduce of the draft's gradients and AdamW; the
teacher is ``Eagle3Config.teacher``: "logits" (the target's [L, V] logits, the draft's
[L, Vd] teacher and every step's [L, Vd] logits kept for the backward: the path before the
tiles) or "tiled" (the library's default, ``teacher='auto'`` here: final hidden states and
the head, one tile of rows at a time, the default tile ``ringattn.loss.DEFAULT_TILE``).

Memory is the peak of live tensor bytes on a rank during one step (``common.TensorBytes``:
every tensor the step allocates; not the weights or AdamW's state, which a warm-up step at
S = 256 makes before it), the max over ranks. A step fits if that peak is at most
``--cap-mib``. Measured:

1. the peak at a fixed S (``--seqlen``) for each teacher and W, and at a fixed L
   (``--flat-l`` tokens per rank) for the tiled teacher (flat in W: O(S / W));
2. the longest S that fits, for each teacher and W: from W x (W = 1's longest) (or
   ``--start``), S doubles or halves until the cap is bracketed, then bisections until the
   bracket is within ``--tol`` of its low end (S a multiple of 16 W);
3. the step time of each teacher at W = 2 and ``--time-s``: the median over ``--rounds``
   paired rounds (each round runs both, in alternating order), each step the slowest rank's;
4. the seed's "max training length" table: for each W and length, whether the step fits,
   read off the searches' brackets (memory grows with S: a length at most the longest S
   that fit fits, one at least the first S that did not does not; between them: not
   measured).

Writes ``<out>/eagle3_longest.json`` and ``eagle3_longest.png``.

    python benchmarks/bench_eagle3_longest.py            # cap 256 MiB (about 25 min)
    python benchmarks/bench_eagle3_longest.py --quick    # V 8192, Vd 2048, cap 32 MiB
    python benchmarks/bench_eagle3_longest.py --table    # the tables of the last run
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, Cluster, TensorBytes, machine_info, paired_rounds,  # noqa: E402
                    write_json)

MODEL = dict(vocab=128256, draft_vocab=32000, hidden=128, heads=4, kv_heads=2,
             intermediate=256, target_layers=3, ttt_steps=7)
TEACHERS = ("logits", "tiled")
WORLDS = (1, 2, 4)
WARMUP_S = 256
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)


# ---------------------------------------------------------------------------- rank side


def _setup(model: dict, teacher: str, pad: int):
    """(target, draft, AdamW, a step(S) function) on this rank, warmed up at S = 256."""
    from ringattn.apps.eagle3_train import (Eagle3Config, build_draft, build_target,
                                            make_batches, train_step)
    from ringattn.integrations import transformers as ra_hf

    group = dist.group.WORLD  # W = 1: the same code on a one-rank group
    cfg = Eagle3Config(seqlen=WARMUP_S, pad=min(pad, WARMUP_S // 2), steps=1, batch=1,
                       teacher="logits" if teacher == "logits" else "auto", **model)
    target = build_target(replace(cfg, seqlen=1 << 17), ra_hf.NAME)
    draft = build_draft(cfg, target, torch.arange(cfg.draft_vocab))
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)

    def step(s: int) -> float:
        c = replace(cfg, seqlen=s, pad=min(pad, s // 2))
        sums = train_step(target, draft, opt, next(make_batches(c)), c, cp_group=group)
        return float(sums[0, 0])

    step(WARMUP_S)
    return step


def peak_task(model: dict, teacher: str, s: int, pad: int) -> dict:
    step = _setup(model, teacher, pad)
    gc.collect()
    t0 = time.perf_counter()
    with TensorBytes() as mode:
        loss = step(s)
    return {"peak_mib": mode.peak / 2**20, "loss": loss, "step_s": time.perf_counter() - t0}


def time_task(model: dict, s: int, pad: int, rounds: int) -> dict:
    steps = {t: _setup(model, t, pad) for t in TEACHERS}
    times = paired_rounds({t: functools.partial(steps[t], s) for t in TEACHERS}, rounds)
    return {t: statistics.median(v) for t, v in times.items()} | {"rounds": times}


# ---------------------------------------------------------------------------- parent side


def _measure(cluster, model, teacher, s, pad) -> dict:
    ranks = cluster.run(peak_task, model, teacher, s, pad, timeout=3600)
    return {"S": s, "L": s / cluster.world, "peak_mib": max(r["peak_mib"] for r in ranks),
            "loss": ranks[0]["loss"], "step_s": max(r["step_s"] for r in ranks)}


def longest(cluster, model, teacher, opts, bar, guess=None) -> dict:
    """The longest S that fits and the first that did not, with every point measured."""
    w, cap, unit = cluster.world, opts["cap_mib"], 16 * cluster.world
    points, lo, hi = [], None, None
    s = max(unit, (guess or opts["start"] * w) // unit * unit)
    while (lo is None or hi is None) and unit <= s <= opts["max_s"]:
        bar.set_postfix_str(f"{teacher} W={w} S={s}")
        rec = _measure(cluster, model, teacher, s, opts["pad"])
        bar.update(1)
        points.append(rec)
        if rec["peak_mib"] <= cap:
            lo = s
            s = 2 * s if guess is None else s + max(unit, s // 8 // unit * unit)
        else:
            hi = s
            s = s // 2 if guess is None else s - max(unit, s // 8 // unit * unit)
    while lo is not None and hi is not None and hi - lo > max(unit, opts["tol"] * lo):
        mid = (lo + hi) // 2 // unit * unit
        if mid <= lo:
            break
        bar.set_postfix_str(f"{teacher} W={w} S={mid}")
        rec = _measure(cluster, model, teacher, mid, opts["pad"])
        bar.update(1)
        points.append(rec)
        lo, hi = (mid, hi) if rec["peak_mib"] <= cap else (lo, mid)
    return {"teacher": teacher, "W": w, "max_s": lo, "first_over": hi,
            "points": sorted(points, key=lambda p: p["S"])}


def run(args, out: Path) -> dict:
    model = {**MODEL, "vocab": args.vocab, "draft_vocab": args.draft_vocab}
    from ringattn.loss import DEFAULT_TILE, tile_rows

    opts = {"cap_mib": args.cap_mib, "start": args.start, "tol": args.tol, "pad": args.pad,
            "max_s": args.max_s, "seqlen": args.seqlen, "flat_l": args.flat_l,
            "time_s": args.time_s, "rounds": args.rounds,
            "tile": DEFAULT_TILE,
            "tile_rows": {"target head": tile_rows(DEFAULT_TILE, model["vocab"], torch.float32),
                          "draft head": tile_rows(DEFAULT_TILE, model["draft_vocab"],
                                                  torch.float32)}}
    data = {"machine": machine_info(), "model": model, "dtype": "fp32", "B": 1,
            "options": opts, "warmup_S": WARMUP_S,
            "memory": "peak live tensor bytes of one step (common.TensorBytes), max over ranks",
            "fixed": [], "flat": [], "search": [], "time": None}
    t0 = time.monotonic()
    bar = tqdm(unit="step", dynamic_ncols=True)
    if args.time_only:  # keep the memory runs of the last run, measure the times again
        old = json.loads((out / "eagle3_longest.json").read_text())
        data.update({k: old[k] for k in ("fixed", "flat", "search", "options", "model")})
        args.worlds = [2]
    for w in ([] if args.time_only else args.worlds):
        cluster = Cluster(w, memory=True)
        try:
            for teacher in TEACHERS:
                bar.set_postfix_str(f"{teacher} W={w} S={args.seqlen}")
                data["fixed"].append({"teacher": teacher, "W": w,
                                      **_measure(cluster, model, teacher, args.seqlen,
                                                 args.pad)})
                bar.update(1)
            bar.set_postfix_str(f"tiled W={w} L={args.flat_l}")
            data["flat"].append({"teacher": "tiled", "W": w,
                                 **_measure(cluster, model, "tiled", args.flat_l * w, args.pad)})
            bar.update(1)
            for teacher in TEACHERS:
                one = next((r["max_s"] for r in data["search"]
                            if r["teacher"] == teacher and r["W"] == 1), None)
                data["search"].append(longest(cluster, model, teacher, opts, bar,
                                              guess=one and one * w))
                write_json(out / "eagle3_longest.json", data)
        finally:
            cluster.close(force=True)
    if 2 in args.worlds and not args.skip_time:
        cluster = Cluster(2)
        try:
            bar.set_postfix_str(f"time at S={args.time_s}")
            med = cluster.run(time_task, model, args.time_s, args.pad, args.rounds,
                              timeout=3600)[0]
        finally:
            cluster.close(force=True)
        data["time"] = {"W": 2, "S": args.time_s, "median_s": {t: med[t] for t in TEACHERS},
                        "rounds_s": med["rounds"],
                        "tiled_over_logits": med["tiled"] / med["logits"],
                        "load_average": list(__import__("os").getloadavg())}
    bar.close()
    data["summary"] = summarize(data)
    data["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(out / "eagle3_longest.json", data)
    return data


def summarize(data) -> dict:
    best = {(r["teacher"], r["W"]): r for r in data["search"]}
    longest_ = {}
    for (t, w), r in best.items():
        one = best.get((t, 1), {}).get("max_s")
        longest_.setdefault(t, {})[w] = {
            "max_s": r["max_s"], "first_over": r["first_over"],
            "over_w1": r["max_s"] / one if r["max_s"] and one else None}
    tiled_over = {w: (best[("tiled", w)]["max_s"] / best[("logits", w)]["max_s"]
                      if best.get(("logits", w), {}).get("max_s") and
                      best.get(("tiled", w), {}).get("max_s") else None)
                  for w in sorted({w for _, w in best})}
    flat = [r["peak_mib"] for r in data["flat"]]
    lengths = {}
    for (t, w), r in best.items():
        for n in LENGTHS:
            fits = ("yes" if r["max_s"] and n <= r["max_s"] else
                    "no" if r["first_over"] and n >= r["first_over"] else "not measured")
            lengths.setdefault(t, {}).setdefault(w, {})[n] = fits
    return {"longest": longest_, "tiled_over_logits": tiled_over,
            "flat_max_over_min": max(flat) / min(flat) if flat else None,
            "max_training_length": lengths}


def markdown(data) -> str:
    s = summarize(data)
    worlds = sorted({r["W"] for r in data["search"]})
    lines = ["| teacher | " + " | ".join(f"cp={w}: longest S (bracket)" for w in worlds) +
             " |", "|---|" + "---|" * len(worlds)]
    for t in TEACHERS:
        cells = []
        for w in worlds:
            r = s["longest"].get(t, {}).get(w)
            if not r or r["max_s"] is None:
                cells.append("none")
                continue
            ratio = f", {r['over_w1']:.2f}x cp=1" if w > 1 and r["over_w1"] else ""
            cells.append(f"{r['max_s']} ({r['max_s']}-{r['first_over']}{ratio})")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| cp | " + " | ".join(str(n) for n in LENGTHS) + " |")
    lines.append("|---|" + "---|" * len(LENGTHS))
    for w in worlds:
        for t in TEACHERS:
            row = s["max_training_length"].get(t, {}).get(w, {})
            lines.append(f"| {w} ({t}) | " + " | ".join(row.get(n, "-") for n in LENGTHS) + " |")
    lines.append("")
    fixed = {(r["teacher"], r["W"]): r["peak_mib"] for r in data["fixed"]}
    lines.append(f"| peak MiB per rank at S={data['options']['seqlen']} | " +
                 " | ".join(f"cp={w}" for w in worlds) + " |")
    lines.append("|---|" + "---|" * len(worlds))
    for t in TEACHERS:
        lines.append(f"| {t} | " + " | ".join(f"{fixed.get((t, w), float('nan')):.1f}"
                                              for w in worlds) + " |")
    return "\n".join(lines)


def plot(data, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summarize(data)
    worlds = sorted({r["W"] for r in data["search"]})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for t in TEACHERS:
        fixed = [next((r["peak_mib"] for r in data["fixed"] if r["teacher"] == t and r["W"] == w),
                      float("nan")) for w in worlds]
        ax.plot(worlds, fixed, marker="o", label=f"{t} teacher, S={data['options']['seqlen']}")
        best = [s["longest"].get(t, {}).get(w, {}).get("max_s") or float("nan") for w in worlds]
        bx.plot(worlds, best, marker="o", label=f"{t} teacher")
    flat = [next((r["peak_mib"] for r in data["flat"] if r["W"] == w), float("nan"))
            for w in worlds]
    ax.plot(worlds, flat, marker="s", ls="--", label=f"tiled, L={data['options']['flat_l']}")
    ax.axhline(data["options"]["cap_mib"], color="gray", ls=":", label="cap")
    ax.set_xlabel("cp (W)")
    ax.set_ylabel("peak live tensor MiB per rank")
    ax.set_yscale("log")
    ax.set_xticks(worlds)
    ax.legend(fontsize=7)
    bx.set_xlabel("cp (W)")
    bx.set_ylabel("longest S under the cap")
    bx.set_yscale("log", base=2)
    bx.set_xticks(worlds)
    bx.legend(fontsize=7)
    fig.suptitle(f"Eagle3 step, V={data['model']['vocab']}, Vd={data['model']['draft_vocab']}, "
                 f"cap {data['options']['cap_mib']:.0f} MiB per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap-mib", type=float, default=256.0)
    ap.add_argument("--vocab", type=int, default=MODEL["vocab"])
    ap.add_argument("--draft-vocab", type=int, default=MODEL["draft_vocab"])
    ap.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    ap.add_argument("--seqlen", type=int, default=1024, help="the fixed S of the peak table")
    ap.add_argument("--flat-l", type=int, default=1024, help="tokens per rank of the flat run")
    ap.add_argument("--start", type=int, default=512, help="first S per rank of a search")
    ap.add_argument("--tol", type=float, default=0.03,
                    help="a search stops when its bracket is within this fraction of S")
    ap.add_argument("--max-s", type=int, default=1 << 17)
    ap.add_argument("--pad", type=int, default=37, help="right padding of the row")
    ap.add_argument("--time-s", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--time-only", action="store_true",
                    help="keep the last run's memory results, measure the step times again")
    ap.add_argument("--quick", action="store_true",
                    help="V 8192, Vd 2048, cap 32 MiB, W 1 and 2 (a smoke run)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--table", action="store_true",
                    help="print the tables of the last run's JSON and redraw its plot")
    args = ap.parse_args(argv)
    out = args.out or (RESULTS / "smoke" if args.quick else RESULTS)
    if args.table:
        done = json.loads((out / "eagle3_longest.json").read_text())
        plot(done, out / "eagle3_longest.png")
        print(markdown(done))
        return
    if args.quick:
        args.vocab, args.draft_vocab, args.cap_mib, args.worlds = 8192, 2048, 32.0, [1, 2]
        args.seqlen, args.flat_l, args.time_s, args.rounds, args.tol = 256, 256, 256, 1, 0.1
    out.mkdir(parents=True, exist_ok=True)
    data = run(args, out)
    plot(data, out / "eagle3_longest.png")
    print(markdown(data))


if __name__ == "__main__":
    main()
