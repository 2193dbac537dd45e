"""The longest sequence one training step fits under a per-rank memory cap: ringattn with
and without tiling, at W = 1, 2, 4, beside PyTorch's own context parallelism.

Legend: S global seq, L local seq (S / W), V vocabulary, W world size (CP ranks).

The model is ``longest_peers.build_model``: a Llama with a large vocabulary and little else
(V = 128256, hidden 128, MLP 512, 2 layers, 4 heads, 2 KV heads, untied head), fp32,
random weights from a fixed seed; the batch one row of S random tokens with labels =
input_ids (every rank holds the same global batch). A step is forward, backward, the
gradients averaged over the group and AdamW. Memory is the peak of live tensor bytes on a
rank during one step (``common.TensorBytes``: every tensor the step allocates: activations,
logits, gradients; not the weights or AdamW's state, made by a warm-up step at S = 64
before it), the max over ranks. A step fits if that peak is at most ``--cap-mib``.

Methods:

* ``ringattn``: ``ra_hf.context_parallel(model, loss_tile=None)``: the model's own untiled
  loss ([L, V] logits and their gradient per rank);
* ``ringattn-loss``: the same with ``loss_tile`` (the default path: ``tiled_lm_loss``);
* ``ringattn-tiled``: ``loss_tile`` and ``ra_hf.tile_mlp`` (each MLP in tiles of
  ``--mlp-tile`` tokens, recomputed in the backward); no layer checkpointing (ALST's
  recipe adds it: it would lengthen S further, and each step here);
* ``torch-cp``: PyTorch 2.13's ``context_parallel`` (``longest_peers.torch_cp_step``:
  its ring, with torch's CPU flash op as the local kernel; the untiled loss);
* ``alst``: DeepSpeed's Ulysses SP with ALST's tiled loss (tiles of ``--loss-tile``
  tokens), tiled MLP and checkpointing (``longest_alst.py``, run by the python of
  ``.venv-alst``, which ``make bench-longest`` builds: DeepSpeed does not live in the
  project's venv); skipped, and said so in the JSON, where that venv is missing. Searched
  at ``--alst-worlds`` (W = 1) up to ``--alst-max-s`` only: with its layer checkpointing
  it reaches S where one step takes minutes on this machine's two cores.

For each method at W = 1, S doubles from ``--start`` until a step no longer fits (or
halves until one does); at W = 2 and 4 the search starts at W times W = 1's longest S and
moves by a quarter; then ``--bisect`` bisections narrow the bracket (each S a multiple of
16 W). ``--skip-w4`` methods are not searched at W = 4 (four ranks share this machine's two
cores: each step there is slow). Then:

* memory per rank at a fixed L (``--flat-l`` tokens per rank) for each W
  (``ringattn-tiled``): flat in W means the step is O(S / W) per rank;
* time per token at one S at W = 2 (``--time-s``), with the default loss tile
  (``--time-tile``; the searches use ``--loss-tile``, small enough for its [tile, V]
  buffers to fit under the cap): each tiled method's median step time over the untiled
  one's, measured in the same run (``--resume --time-only`` measures only this again).

Writes ``<out>/longest.json`` and ``longest.png``.

    python benchmarks/bench_longest.py                 # cap 288 MiB (make bench-longest)
    python benchmarks/bench_longest.py --quick         # V 4096, cap 24 MiB (results/smoke/)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, Cluster, RankFailure, TensorBytes, machine_info,  # noqa: E402
                    write_json)
import longest_peers as peers  # noqa: E402

METHODS = ("ringattn", "ringattn-loss", "ringattn-tiled", "torch-cp", "alst")
ALST_PY = Path(__file__).resolve().parent.parent / ".venv-alst" / "bin" / "python"
WORLDS = (1, 2, 4)


# ---------------------------------------------------------------------------- rank side


def _ringattn_step(model, opt, ids, labels, group, loss_tile) -> float:
    from ringattn.integrations import transformers as ra_hf

    opt.zero_grad(set_to_none=True)
    with ra_hf.context_parallel(model, group, loss_tile=loss_tile):
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
    ra_hf.average_gradients(model, group)
    opt.step()
    return float(out.loss.detach())


def _ringattn_setup(method: str, opts: dict):
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    model = peers.build_model(attn_implementation="ringattn", vocab_size=opts["vocab"])
    if method == "ringattn-tiled":
        ra_hf.tile_mlp(model, tile=opts["mlp_tile"])
    tile = None if method == "ringattn" else opts["loss_tile"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    group = dist.group.WORLD
    _ringattn_step(model, opt, *peers.global_batch(peers.WARMUP_S, opts["vocab"]), group, tile)
    return lambda ids, labels: _ringattn_step(model, opt, ids, labels, group, tile)


def peak_task(method: str, s: int, opts: dict) -> dict:
    """One measured step at S on this rank: {"peak_mib", "loss", "step_s"}."""
    if method == "torch-cp":
        rec = peers.peak_task(s, None, None, opts["vocab"])
        return {"peak_mib": rec["peak_mib"], "loss": rec["loss"], "step_s": rec["step_s"]}
    step = _ringattn_setup(method, opts)
    ids, labels = peers.global_batch(s, opts["vocab"])
    gc.collect()
    t0 = time.perf_counter()
    with TensorBytes() as mode:
        loss = step(ids, labels)
    return {"peak_mib": mode.peak / 2**20, "loss": loss, "step_s": time.perf_counter() - t0}


def time_task(methods, s: int, opts: dict, iters: int) -> dict:
    """Median step time of each method at S (rounds interleave the methods; each time the
    slowest rank's)."""
    steps = {m: _ringattn_setup(m, opts) for m in methods}
    ids, labels = peers.global_batch(s, opts["vocab"])
    times = {m: [] for m in methods}
    for r in range(iters + 1):  # round 0 warms every method at this S and is dropped
        for m in methods:
            dist.barrier()
            t0 = time.perf_counter()
            steps[m](ids, labels)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r:
                times[m].append(float(t))
    return {m: statistics.median(ts) for m, ts in times.items()}


# ---------------------------------------------------------------------------- parent side


def _measure_alst(w: int, s: int, opts: dict) -> dict:
    """ALST's step at S on W fresh ranks of its own venv (a subprocess)."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "alst.json"
        cmd = [str(ALST_PY), str(Path(__file__).resolve().parent / "longest_alst.py"),
               "--seqlens", str(s), "--world", str(w), "--cap-mib", str(opts["cap_mib"]),
               "--abort-mib", str(4 * opts["cap_mib"]), "--loss-tile", str(opts["loss_tile"]),
               "--json", str(out)]
        if opts["vocab"] != peers.MODEL["vocab_size"]:
            cmd += ["--vocab", str(opts["vocab"])]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                              env={**os.environ, "DS_ACCELERATOR": "cpu"})
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"longest_alst.py failed: {proc.stderr[-500:]}")
        rec = json.loads(out.read_text())["records"][0]
    peak = rec["peak_mib"] if rec["peak_mib"] is not None else float("inf")
    return {"S": s, "L": s / w, "peak_mib": peak, "loss": rec.get("loss"),
            "step_s": rec.get("step_s")}


def _measure(cluster, method: str, s: int, opts: dict) -> dict:
    if method == "alst":
        return _measure_alst(cluster.world, s, opts)
    ranks = cluster.run(peak_task, method, s, opts, timeout=3600)
    return {"S": s, "L": s / cluster.world, "peak_mib": max(r["peak_mib"] for r in ranks),
            "loss": ranks[0]["loss"], "step_s": max(r["step_s"] for r in ranks)}


def longest(cluster, method: str, w: int, opts: dict, bar, guess: int | None = None) -> dict:
    """The longest S that fits (None if none does) and every point measured: from ``guess``
    (W times the longest S at W = 1, when known) or ``start`` x W, S doubles while a step
    fits or halves while it does not, then ``bisect`` bisections (S a multiple of 16 W)."""
    cap, unit = opts["cap_mib"], 16 * w
    points, lo, hi = [], None, None
    s = max(unit, (guess or opts["start"] * w) // unit * unit)
    top = opts["alst_max_s"] if method == "alst" else opts["max_s"]
    while (lo is None or hi is None) and unit <= s <= top:
        bar.set_postfix_str(f"{method} W={w} S={s}")
        rec = _measure(cluster, method, s, opts)
        bar.update(1)
        points.append(rec)
        if rec["peak_mib"] <= cap:
            lo, s = s, (2 * s if guess is None else s + max(unit, s // 4 // unit * unit))
        else:
            hi, s = s, (s // 2 if guess is None else s - max(unit, s // 4 // unit * unit))
        if lo is not None and hi is not None:
            break
    for _ in range(opts["bisect"] if lo is not None and hi is not None else 0):
        mid = (lo + hi) // 2 // unit * unit
        if mid <= lo:
            break
        bar.set_postfix_str(f"{method} W={w} S={mid}")
        rec = _measure(cluster, method, mid, opts)
        bar.update(1)
        points.append(rec)
        lo, hi = (mid, hi) if rec["peak_mib"] <= cap else (lo, mid)
    return {"method": method, "W": w, "max_s": lo, "first_over": hi,
            "points": sorted(points, key=lambda p: p["S"])}


def run(args, out: Path) -> dict:
    opts = {"vocab": args.vocab, "cap_mib": args.cap_mib, "start": args.start,
            "bisect": args.bisect, "max_s": args.max_s, "alst_max_s": args.alst_max_s,
            "loss_tile": args.loss_tile, "mlp_tile": args.mlp_tile}
    data = {"machine": machine_info(), "model": {**peers.MODEL, "vocab_size": args.vocab},
            "dtype": "fp32", "B": 1, "options": opts, "warmup_S": peers.WARMUP_S,
            "memory": "peak live tensor bytes of one step (common.TensorBytes), max over ranks",
            "search": [], "flat": [], "time": None}
    if args.resume and (out / "longest.json").exists():  # keep what an earlier run measured
        old = json.loads((out / "longest.json").read_text())
        same = ("vocab", "cap_mib", "loss_tile", "mlp_tile")
        if all(old.get("options", {}).get(k) == opts[k] for k in same):
            for key in ("search", "flat", "time"):
                data[key] = old.get(key) or data[key]
            if args.time_only:
                data["time"] = None
                args.worlds = [2]
    done = {(r["method"], r["W"]) for r in data["search"]}
    t0 = time.monotonic()
    bar = tqdm(unit="step", dynamic_ncols=True)
    for w in args.worlds:
        cluster = Cluster(w, memory=True)
        try:
            for method in args.methods:
                if w == 4 and method in args.skip_w4 or (method, w) in done or args.time_only:
                    continue
                if method == "alst" and w not in args.alst_worlds:
                    continue
                if method == "alst" and not ALST_PY.exists():
                    data["search"].append({"method": method, "W": w, "max_s": None,
                                           "error": f"{ALST_PY} missing: make bench-longest "
                                                    f"builds it"})
                    continue
                try:
                    one = next((r.get("max_s") for r in data["search"]
                                if r["method"] == method and r["W"] == 1), None)
                    data["search"].append(longest(cluster, method, w, opts, bar,
                                                  guess=one and one * w))
                except (RankFailure, RuntimeError) as err:
                    data["search"].append({"method": method, "W": w, "max_s": None,
                                           "error": str(err).splitlines()[0][:300]})
                write_json(out / "longest.json", data)
            tiled = [m for m in args.methods if m.startswith("ringattn")][-1:]
            for m in tiled:
                if any(r["method"] == m and r["W"] == w for r in data["flat"]) or args.time_only:
                    continue
                bar.set_postfix_str(f"{m} W={w} L={args.flat_l}")
                data["flat"].append({"method": m, "W": w,
                                     **_measure(cluster, m, args.flat_l * w, opts)})
                bar.update(1)
            if w == 2 and data["time"] is None:
                ring = [m for m in args.methods if m.startswith("ringattn")]
                bar.set_postfix_str(f"time per token at S={args.time_s}")
                timing = {**opts, "loss_tile": args.time_tile}
                med = cluster.run(time_task, ring, args.time_s, timing, args.iters,
                                  timeout=3600)[0]
                base = med.get("ringattn")
                data["time"] = {"W": w, "S": args.time_s, "loss_tile": args.time_tile,
                                "median_s": med,
                                "over_untiled": {m: t / base for m, t in med.items()}
                                if base else None}
                bar.update(1)
        finally:
            cluster.close(force=True)
        write_json(out / "longest.json", data)
    bar.close()
    data["summary"] = summarize(data)
    data["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(out / "longest.json", data)
    return data


def summarize(data) -> dict:
    """The longest S per method and W, their ratios to W = 1, and the flatness of memory at
    a fixed L (max / min over W)."""
    best = {(r["method"], r["W"]): r.get("max_s") for r in data["search"]}
    table = {}
    for (m, w), s in best.items():
        one = best.get((m, 1))
        table.setdefault(m, {})[w] = {"max_s": s, "over_w1": s / one if s and one else None}
    flat = [r["peak_mib"] for r in data["flat"]]
    return {"longest": table,
            "flat_max_over_min": max(flat) / min(flat) if flat else None}


def markdown(data) -> str:
    """The tables of docs/trainers.md and RESULTS.md, from a run's JSON."""
    summary = summarize(data)
    worlds = sorted({r["W"] for r in data["search"]})
    lines = ["| method | " + " | ".join(f"W={w}: longest S (x W=1)" for w in worlds) + " |",
             "|---|" + "---|" * len(worlds)]
    for m in METHODS:
        per = summary["longest"].get(m)
        if not per:
            continue
        cells = []
        for w in worlds:
            rec = next((r for r in data["search"] if r["method"] == m and r["W"] == w), None)
            v = per.get(w)
            if rec is None:
                cells.append("not run")
            elif v is None or v["max_s"] is None:
                cells.append("none fits" if not rec.get("error") else "failed")
            else:
                over = rec.get("first_over")
                s = f"{v['max_s']}" + ("" if over else "+")
                cells.append(s + (f" ({v['over_w1']:.2f}x)" if w > 1 and v["over_w1"] else ""))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    out = "\n".join(lines)
    if data["flat"]:
        flat = ", ".join(f"W={r['W']}: {r['peak_mib']:.1f} MiB" for r in data["flat"])
        out += (f"\n\nPer-rank step memory at S / W = {int(data['flat'][0]['L'])} "
                f"({data['flat'][0]['method']}): {flat}; max / min "
                f"{summary['flat_max_over_min']:.3f}.")
    if data.get("time") and data["time"].get("over_untiled"):
        t = data["time"]
        ratios = ", ".join(f"{m} {r:.2f}" for m, r in t["over_untiled"].items() if m != "ringattn")
        out += (f"\n\nStep time over the untiled step (W={t['W']}, S={t['S']}, loss tile "
                f"{t.get('loss_tile')}, median of the rounds, same run): {ratios}.")
    return out


def plot(data, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {1: "-", 2: "--", 4: ":"}
    colors = dict(zip(METHODS, ("tab:red", "tab:orange", "tab:green", "tab:blue", "tab:purple")))
    for r in data["search"]:
        pts = r.get("points") or []
        if pts:
            ax.plot([p["L"] for p in pts], [p["peak_mib"] for p in pts], marker="o",
                    ls=styles.get(r["W"], "-"), color=colors.get(r["method"]),
                    label=f"{r['method']} W={r['W']}")
    ax.axhline(data["options"]["cap_mib"], color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("tokens per rank (S / W)")
    ax.set_ylabel("step memory per rank (MiB, live tensors)")
    ax.set_title(f"V={data['model']['vocab_size']}, fp32; cap {data['options']['cap_mib']:g} MiB")
    ax.legend(fontsize=6, ncol=2)
    methods = [m for m in METHODS if any(r["method"] == m for r in data["search"])]
    worlds = sorted({r["W"] for r in data["search"]})
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        ys = [next((r.get("max_s") or 0 for r in data["search"]
                    if r["method"] == m and r["W"] == w), 0) for w in worlds]
        bx.bar([j + i * width for j in range(len(worlds))], ys, width, label=m,
               color=colors.get(m))
    bx.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(worlds))],
                  [f"W={w}" for w in worlds])
    bx.set_yscale("log", base=2)
    bx.set_ylabel("longest S that fits")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap-mib", type=float, default=288.0)
    ap.add_argument("--vocab", type=int, default=peers.MODEL["vocab_size"])
    ap.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--start", type=int, default=512, help="first S per rank of the search")
    ap.add_argument("--bisect", type=int, default=2)
    ap.add_argument("--alst-worlds", type=int, nargs="*", default=[1],
                    help="W searched for ALST (its steps at the S it reaches take minutes here)")
    ap.add_argument("--alst-max-s", type=int, default=16384,
                    help="ALST's search stops above it (a step there takes minutes here)")
    ap.add_argument("--skip-w4", nargs="*", default=["ringattn-tiled"],
                    help="methods not searched at W = 4 (each step there is slow on 2 cores)")
    ap.add_argument("--max-s", type=int, default=1 << 17, help="the search stops above it")
    ap.add_argument("--loss-tile", type=int, default=16)
    ap.add_argument("--mlp-tile", type=int, default=256)
    ap.add_argument("--flat-l", type=int, default=2048)
    ap.add_argument("--time-s", type=int, default=512)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--time-tile", type=int, default=1024,
                    help="loss tile of the timing runs (the default; the searches use "
                         "--loss-tile, whose [tile, V] buffers must fit under the cap)")
    ap.add_argument("--time-only", action="store_true",
                    help="with --resume: measure only the step times again")
    ap.add_argument("--quick", action="store_true",
                    help="V 4096, cap 24 MiB, W 1 and 2, one bisection (a smoke run)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--resume", action="store_true",
                    help="keep the searches of an earlier run with the same options")
    ap.add_argument("--table", action="store_true",
                    help="print the markdown tables of the last run's JSON and redraw its "
                         "plot, run nothing")
    args = ap.parse_args(argv)
    if args.table:
        done = json.loads(((args.out or RESULTS) / "longest.json").read_text())
        plot(done, (args.out or RESULTS) / "longest.png")
        print(markdown(done))
        return
    if args.quick:
        args.vocab, args.cap_mib, args.worlds, args.bisect = 4096, 24.0, [1, 2], 1
        args.flat_l, args.time_s, args.iters, args.mlp_tile = 256, 256, 1, 128
    out = args.out or (RESULTS / "smoke" if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    data = run(args, out)
    plot(data, out / "longest.png")
    for m, per_w in data["summary"]["longest"].items():
        print(m, {w: v["max_s"] for w, v in sorted(per_w.items())})
    print("flat (max/min peak at fixed L over W):", data["summary"]["flat_max_over_min"])
    print("time over untiled:", data["time"] and data["time"]["over_untiled"])


if __name__ == "__main__":
    main()
