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
* ``ringattn-loss``: the same with ``loss_tile=--loss-tile`` (the default path:
  ``tiled_lm_loss``; ``--loss-tile`` defaults to the library's ``DEFAULT_TILE``, a byte
  budget of one tile's fp32 logits: 16 MiB, 32 rows at V = 128256);
* ``ringattn-tiled``: ``loss_tile`` and ``ra_hf.tile_mlp`` (opt-in: each MLP in tiles of
  ``--mlp-tile`` tokens, default ``tile_mlp``'s own, recomputed in the backward); no layer
  checkpointing (ALST's recipe adds it: it would lengthen S further, and each step here);
* ``torch-cp``: PyTorch 2.13's ``context_parallel`` (``longest_peers.torch_cp_step``:
  its ring, with torch's CPU flash op as the local kernel; the untiled loss);
* ``alst``: DeepSpeed's Ulysses SP with ALST's tiled loss (tiles of as many rows as
  ``--loss-tile`` gives ringattn at this V, so the loss is tiled alike; ALST's own default
  is about 1 GiB of logits per tile), tiled MLP and checkpointing (``longest_alst.py``, run by the python of
  ``.venv-alst``, which ``make bench-longest`` builds: DeepSpeed does not live in the
  project's venv); skipped, and said so in the JSON, where that venv is missing. Searched
  at ``--alst-worlds`` (W = 1) up to ``--alst-max-s`` only: with its layer checkpointing
  it reaches S where one step takes minutes on this machine's two cores.

For each method at W = 1, S doubles from ``--start`` until a step no longer fits (or
halves until one does); at W = 2 and 4 the search starts at W times W = 1's longest S and
moves by W times W = 1's bracket (its first S over minus its longest S; a quarter of S
where W = 1 has no bracket), doubling the move while it goes the same way; then up to
``--bisect`` bisections narrow the bracket (each S a multiple of 16 W: the bisection stops
at that unit). Each search's bracket (``max_s``, the longest S that fit, and
``first_over``, the shortest S measured over the cap) is in the JSON; a ratio to W = 1 is
given with the range its two brackets allow. ``--skip-w4`` methods are not searched at
W = 4 (four ranks share this machine's two cores: each step there is slow). Then:

* memory per rank at a fixed L (``--flat-l`` tokens per rank) for each W
  (``ringattn-tiled``): flat in W means the step is O(S / W) per rank;
* time per token at one S at W = 2 (``--time-s``), with ``--time-tile`` (default the
  library's ``DEFAULT_TILE`` too): each tiled method's median step time over the untiled
  one's, measured in the same run (``--resume --time-only`` measures only this again; the
  load average of the machine before and after is recorded beside it).

``--loss-tile`` and ``--time-tile`` take rows (an int) or a byte budget ("16MiB"), as
``context_parallel``'s ``loss_tile`` does; the JSON records the value given and the rows it
gives at the bench's V. ``options.non_defaults`` lists every setting of a library call
that differs from the library's default (and the bench's own settings, such as the cap).

Writes ``<out>/longest.json`` and ``longest.png``.

    python benchmarks/bench_longest.py                 # cap 288 MiB (make bench-longest)
    python benchmarks/bench_longest.py --quick         # V 4096, cap 24 MiB (results/smoke/)
    python benchmarks/bench_longest.py --table         # the markdown tables of the last run
"""

from __future__ import annotations

import argparse
import gc
import inspect
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
from common import (RESULTS, Cluster, RankFailure, TensorBytes, machine_info,  # noqa: E402
                    write_json)
import longest_peers as peers  # noqa: E402
from ringattn.loss import DEFAULT_TILE, check_loss_tile, tile_rows  # noqa: E402

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
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "alst.json"
        cmd = [str(ALST_PY), str(Path(__file__).resolve().parent / "longest_alst.py"),
               "--seqlens", str(s), "--world", str(w), "--cap-mib", str(opts["cap_mib"]),
               "--abort-mib", str(4 * opts["cap_mib"]),
               "--loss-tile", str(opts["alst_loss_tile_rows"]),
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


def longest(cluster, method: str, w: int, opts: dict, bar, prior: dict | None = None) -> dict:
    """The longest S that fits (None if none does), the shortest S measured over the cap
    (None if none was) and every point measured. At W = 1 (``prior`` None) S doubles from
    ``start`` x W while a step fits or halves while it does not. At W > 1 (``prior`` the
    W = 1 search) it starts at W x W = 1's longest S and moves by W x W = 1's bracket (a
    quarter of S without one), doubling the move while it goes the same way. Then up to
    ``bisect`` bisections (S a multiple of 16 W)."""
    cap, unit = opts["cap_mib"], 16 * w
    points, lo, hi = [], None, None
    guess = prior.get("max_s") and prior["max_s"] * w if prior else None
    s = max(unit, (guess or opts["start"] * w) // unit * unit)
    step = None
    if guess and prior.get("first_over"):
        step = max(unit, (prior["first_over"] - prior["max_s"]) * w // unit * unit)
    top = opts["alst_max_s"] if method == "alst" else opts["max_s"]
    moved = False
    while (lo is None or hi is None) and unit <= s <= top:
        bar.set_postfix_str(f"{method} W={w} S={s}")
        rec = _measure(cluster, method, s, opts)
        bar.update(1)
        points.append(rec)
        fits = rec["peak_mib"] <= cap
        if fits:
            lo = s
        else:
            hi = s
        if lo is not None and hi is not None:
            break
        if guess is None:
            s = 2 * s if fits else s // 2
            continue
        if step is None:
            step = max(unit, s // 4 // unit * unit)
        elif moved:
            step *= 2  # the same way again (the other way has ended the loop)
        s, moved = s + (step if fits else -step), True
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
            "bracket_rel": (hi - lo) / lo if lo and hi else None,
            "points": sorted(points, key=lambda p: p["S"])}


def _tile_value(text: str):
    """``--loss-tile`` / ``--time-tile``: rows (an int) or a byte budget ("16MiB"), checked
    by ``ringattn.loss.check_loss_tile`` and kept as given."""
    text = text.strip()
    value = int(text) if text.isdigit() else text
    try:
        check_loss_tile(value, "the loss tile")
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def _rows(tile, vocab: int) -> int:
    """The rows of a loss tile for this bench's head (V outputs, fp32 logits)."""
    return tile_rows(tile, vocab, torch.float32)


def non_defaults(opts: dict) -> list[dict]:
    """Every setting of a library call here that differs from the library's default, and
    the bench's own settings (no library default): what the numbers depend on."""
    from ringattn.integrations import transformers as ra_hf

    mlp_default = inspect.signature(ra_hf.tile_mlp).parameters["tile"].default
    cp_default = inspect.signature(ra_hf.context_parallel).parameters["loss_tile"].default
    out = []
    if opts["loss_tile"] != cp_default:
        out.append({"option": "context_parallel(loss_tile=)", "where": "ringattn-loss, "
                    "ringattn-tiled searches", "value": opts["loss_tile"],
                    "library_default": cp_default})
    if opts["time_tile"] != cp_default:
        out.append({"option": "context_parallel(loss_tile=)", "where": "step times",
                    "value": opts["time_tile"], "library_default": cp_default})
    out.append({"option": "context_parallel(loss_tile=)", "where": "ringattn",
                "value": None, "library_default": cp_default,
                "why": "the untiled method: the model's own loss, by design"})
    out.append({"option": "tile_mlp(tile=)", "where": "ringattn-tiled (tile_mlp is opt-in)",
                "value": opts["mlp_tile"], "library_default": mlp_default,
                **({} if opts["mlp_tile"] != mlp_default else {"same": True})})
    out.append({"option": "ALST's loss tile", "where": "alst",
                "value": f"{opts['alst_loss_tile_rows']} rows (ringattn's loss tile at "
                         f"V = {opts['vocab']})",
                "library_default": "ceil(L V 4 / 2^30) tiles (about 1 GiB of fp32 logits)",
                "why": "the loss tiled alike in both"})
    out.append({"option": "cap_mib", "where": "bench", "value": opts["cap_mib"],
                "library_default": None, "why": "the per-rank cap of the searches"})
    out.append({"option": "bisect", "where": "bench", "value": opts["bisect"],
                "library_default": None, "why": "bisections after the bracket is found"})
    return out


def run(args, out: Path) -> dict:
    opts = {"vocab": args.vocab, "cap_mib": args.cap_mib, "start": args.start,
            "bisect": args.bisect, "max_s": args.max_s, "alst_max_s": args.alst_max_s,
            "loss_tile": args.loss_tile, "loss_tile_rows": _rows(args.loss_tile, args.vocab),
            "time_tile": args.time_tile, "time_tile_rows": _rows(args.time_tile, args.vocab),
            "alst_loss_tile_rows": _rows(args.loss_tile, args.vocab),
            "library_default_loss_tile": DEFAULT_TILE, "mlp_tile": args.mlp_tile}
    opts["non_defaults"] = non_defaults(opts)
    data = {"machine": machine_info(), "model": {**peers.MODEL, "vocab_size": args.vocab},
            "dtype": "fp32", "B": 1, "options": opts, "warmup_S": peers.WARMUP_S,
            "memory": "peak live tensor bytes of one step (common.TensorBytes), max over ranks",
            "search": [], "flat": [], "time": None}
    if args.resume and (out / "longest.json").exists():  # keep what an earlier run measured
        old = json.loads((out / "longest.json").read_text())
        same = ("vocab", "cap_mib", "loss_tile", "mlp_tile", "start", "bisect")
        if all(old.get("options", {}).get(k) == opts[k] for k in same):
            for key in ("search", "flat", "time"):
                data[key] = old.get(key) or data[key]
            if args.time_only:
                data["time"] = None
                args.worlds = [2]
                data["machine"], data["elapsed_s"] = old["machine"], old.get("elapsed_s")
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
                    one = next((r for r in data["search"]
                                if r["method"] == method and r["W"] == 1), None)
                    data["search"].append(longest(cluster, method, w, opts, bar,
                                                  prior=one if w > 1 else None))
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
                load0 = os.getloadavg()
                med = cluster.run(time_task, ring, args.time_s, timing, args.iters,
                                  timeout=3600)[0]
                load1 = os.getloadavg()
                base = med.get("ringattn")
                data["time"] = {"W": w, "S": args.time_s, "loss_tile": args.time_tile,
                                "loss_tile_rows": opts["time_tile_rows"],
                                "mlp_tile": args.mlp_tile, "rounds": args.iters,
                                "median_s": med,
                                "over_untiled": {m: t / base for m, t in med.items()}
                                if base else None,
                                "loadavg_1_5_15_before": [round(x, 2) for x in load0],
                                "loadavg_1_5_15_after": [round(x, 2) for x in load1],
                                "cores": os.cpu_count()}
                bar.update(1)
        finally:
            cluster.close(force=True)
        write_json(out / "longest.json", data)
    bar.close()
    data["summary"] = summarize(data)
    if args.time_only:  # the searches' machine info and time stay; this run's beside them
        data["time"]["machine"] = machine_info()
        data["time"]["elapsed_s"] = round(time.monotonic() - t0, 1)
    else:
        data["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(out / "longest.json", data)
    return data


def summarize(data) -> dict:
    """The longest S per method and W, their ratios to W = 1, and the flatness of memory at
    a fixed L (max / min over W)."""
    recs = {(r["method"], r["W"]): r for r in data["search"]}
    table = {}
    for (m, w), r in recs.items():
        s, over = r.get("max_s"), r.get("first_over")
        one = recs.get((m, 1), {})
        s1, over1 = one.get("max_s"), one.get("first_over")
        table.setdefault(m, {})[w] = {
            "max_s": s, "first_over": over,
            "over_w1": s / s1 if s and s1 else None,
            # the ratio of the true longest S's lies in this range, given both brackets
            "over_w1_bracket": [s / over1 if s and over1 else None,
                                over / s1 if over and s1 else None] if w > 1 else None}
    flat = [r["peak_mib"] for r in data["flat"]]
    # the peak per rank at L = W = 1's longest S, at each W (the W > 1 searches start there)
    at_longest = {}
    for (m, w), r in recs.items():
        s1 = recs.get((m, 1), {}).get("max_s")
        p = next((p for p in r.get("points") or [] if s1 and p["S"] == s1 * w), None)
        if p is not None:
            at_longest.setdefault(m, {"L": s1, "peak_mib": {}})["peak_mib"][w] = p["peak_mib"]
    for v in at_longest.values():
        peaks = list(v["peak_mib"].values())
        v["max_over_min"] = max(peaks) / min(peaks)
    return {"longest": table,
            "flat_max_over_min": max(flat) / min(flat) if flat else None,
            "peak_at_w1_longest_l": at_longest}


def _ratio(v) -> str:
    lo, hi = v["over_w1_bracket"] or (None, None)
    rng = f"; bracket {lo:.2f}-{hi:.2f}x" if lo and hi else (
        f"; bracket >= {lo:.2f}x" if lo else "")
    return f" ({v['over_w1']:.2f}x{rng})"


def markdown(data) -> str:
    """The tables of docs/trainers.md and RESULTS.md, from a run's JSON."""
    summary = summarize(data)
    worlds = sorted({r["W"] for r in data["search"]})
    lines = ["| method | " + " | ".join(f"W={w}: longest S / first S over" + (
        " (x W=1; bracket)" if w > 1 else "") for w in worlds) + " |",
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
                s = f"{v['max_s']} / " + (f"{over}" if over else "none (stopped)")
                cells.append(s + (_ratio(v) if w > 1 and v["over_w1"] else ""))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    out = "\n".join(lines)
    o = data["options"]
    tiles = (f"loss tile {o['loss_tile']} ({o['loss_tile_rows']} rows at V = {o['vocab']}; "
             f"ALST {o.get('alst_loss_tile_rows')} rows), MLP tile {o['mlp_tile']}, cap "
             f"{o['cap_mib']:g} MiB, bisections up to {o['bisect']}")
    out += f"\n\nSearches: {tiles}."
    nd = [d for d in o.get("non_defaults", []) if not d.get("same")]
    if nd:
        out += " Not the library's default: " + "; ".join(
            f"{d['option']} = {d['value']} in {d['where']} (default {d['library_default']})"
            for d in nd if d["library_default"] is not None) + "."
    at = summary.get("peak_at_w1_longest_l") or {}
    if at:
        out += "\n\nPer-rank step memory at S / W = W=1's longest S, from the searches: " + \
            "; ".join(f"{m} (L = {v['L']}): " + ", ".join(
                f"W={w}: {p:.1f}" for w, p in sorted(v["peak_mib"].items(), key=lambda x:
                                                      int(x[0]))) + f" MiB, max / min "
                f"{v['max_over_min']:.3f}" for m, v in at.items()
                if len(v["peak_mib"]) > 1) + "."
    if data["flat"]:
        flat = ", ".join(f"W={r['W']}: {r['peak_mib']:.1f} MiB" for r in data["flat"])
        out += (f"\n\nPer-rank step memory at S / W = {int(data['flat'][0]['L'])} "
                f"({data['flat'][0]['method']}): {flat}; max / min "
                f"{summary['flat_max_over_min']:.3f}.")
    if data.get("time") and data["time"].get("over_untiled"):
        t = data["time"]
        ratios = ", ".join(f"{m} {r:.2f}" for m, r in t["over_untiled"].items() if m != "ringattn")
        rows = f" = {t['loss_tile_rows']} rows" if "loss_tile_rows" in t else ""
        load = t.get("loadavg_1_5_15_before")
        load = (f"; load average before / after {load[0]:.2f} / "
                f"{t['loadavg_1_5_15_after'][0]:.2f} on {t['cores']} cores" if load else "")
        out += (f"\n\nStep time over the untiled step (W={t['W']}, S={t['S']}, loss tile "
                f"{t.get('loss_tile')}{rows}, median of {t.get('rounds', 'the')} rounds, "
                f"same run{load}): {ratios}.")
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
    o = data["options"]
    ax.set_title(f"V={data['model']['vocab_size']}, fp32; cap {o['cap_mib']:g} MiB; loss tile "
                 f"{o['loss_tile']} ({o.get('loss_tile_rows', o['loss_tile'])} rows)",
                 fontsize=9)
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
    ap.add_argument("--bisect", type=int, default=6,
                    help="bisections after the bracket is found (each stops at 16 W)")
    ap.add_argument("--alst-worlds", type=int, nargs="*", default=[1],
                    help="W searched for ALST (its steps at the S it reaches take minutes here)")
    ap.add_argument("--alst-max-s", type=int, default=16384,
                    help="ALST's search stops above it (a step there takes minutes here)")
    ap.add_argument("--skip-w4", nargs="*", default=["ringattn-tiled"],
                    help="methods not searched at W = 4 (each step there is slow on 2 cores)")
    ap.add_argument("--max-s", type=int, default=1 << 17, help="the search stops above it")
    ap.add_argument("--loss-tile", type=_tile_value, default=DEFAULT_TILE,
                    help="loss tile of the searches: rows (an int) or a byte budget of one "
                         "tile's fp32 logits such as 16MiB (default: the library's, "
                         f"{DEFAULT_TILE})")
    ap.add_argument("--mlp-tile", type=int, default=None,
                    help="tile_mlp's tile in ringattn-tiled (default: tile_mlp's own)")
    ap.add_argument("--flat-l", type=int, default=2048)
    ap.add_argument("--time-s", type=int, default=512)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--time-tile", type=_tile_value, default=DEFAULT_TILE,
                    help=f"loss tile of the timing runs, as --loss-tile (default {DEFAULT_TILE})")
    ap.add_argument("--time-only", action="store_true",
                    help="with --resume: measure only the step times again")
    ap.add_argument("--quick", action="store_true",
                    help="V 4096, cap 24 MiB, W 1 and 2, one bisection, MLP tile 128 (a "
                         "smoke run)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--resume", action="store_true",
                    help="keep the searches of an earlier run with the same options")
    ap.add_argument("--table", action="store_true",
                    help="print the markdown tables of the last run's JSON and redraw its "
                         "plot, run nothing")
    args = ap.parse_args(argv)
    if args.mlp_tile is None:
        from ringattn.integrations import transformers as ra_hf
        args.mlp_tile = inspect.signature(ra_hf.tile_mlp).parameters["tile"].default
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
    for m, v in data["summary"]["longest"].items():
        for w, r in sorted(v.items()):
            if w > 1 and r["over_w1"]:
                print(f"{m} W={w}: {r['max_s']} / {r['first_over']}{_ratio(r)}")
    print("flat (max/min peak at fixed L over W):", data["summary"]["flat_max_over_min"])
    print("time over untiled:", data["time"] and data["time"]["over_untiled"])


if __name__ == "__main__":
    main()
