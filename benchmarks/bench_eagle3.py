"""Eagle3 draft training under context parallelism on CPU gloo ranks: per-rank memory of a
training step, the longest S within a memory cap, tokens/s, and what re-sending the step-0
keys around the ring at every TTT step costs against gathering them once.

Legend: B batch, S global seq, L local seq (S / W), W = cp size (ranks), H heads, Hkv kv
heads, D head dim, T TTT steps.

One fixed model (``MODEL``: a 4-layer random-weight Llama target, hidden 256, 8 heads, 2 kv
heads, vocab 2048; the one-layer draft with a 512-token vocabulary, 7 TTT steps), fp32,
B=1, the row right-padded by 37 tokens (``--pad``; ``Eagle3Config``'s default), layout
zigzag. A training step is what ``ringattn.apps.eagle3_train.train_eagle3`` does at dp=1: the
target's forward under CP (``run_target``), the draft's TTT forward (``eagle3_step``), its
backward, one all-reduce of the draft's gradients, AdamW. W=1 is the same code on a
one-rank group. Every measurement
runs in fresh processes (peak RSS is a process's high-water mark) and starts with one
warm-up step at S=256 (plans, lazily imported code, AdamW's state).

1. *Memory at a fixed S* (``--seqlen``), W in {1, 2, 4}: the RSS right before the measured
   step (``rss_before``: torch, transformers, both models, AdamW's state; after
   ``malloc_trim``), then one step and ``ru_maxrss`` after it (``peak``, nothing
   subtracted); step memory = peak - rss_before; the tables give the max over ranks. These
   ranks start with ``MALLOC_MMAP_THRESHOLD_`` (``common.Cluster(memory=True)``: freed
   tensors leave the RSS, so the high water measures the step, not old heap) and one
   compute thread each (with 2 threads, the mmap-served allocations made a step at S=1024
   up to 10x slower on this machine under load).
2. *Longest S under a cap*: a step fits if its step memory is at most ``--cap-mib``. From
   the fixed-S run, S grows (or shrinks) until the cap is bracketed, then the bracket
   shrinks until its ends are within ``--tol`` (``longest_s``: each next S is where step
   memory, nearly linear in S, extrapolates to the cap, nudged to land on the side that
   closes the bracket); each probe is a memory run in fresh processes. S need not divide
   anything (ringattn pads the shards).
3. *Tokens/s at the fixed S*: separate runs with default malloc and cores // W threads per
   rank (``ringattn.apps.train.spawn``'s rule; at W=4, 4 one-thread ranks on 2 cores); after the
   measured step, ``--timed-steps`` steps, each the slowest rank's time (barrier before,
   all-reduce MAX after); tokens/s = B * S / median. Every W shares the same 2 cores, so
   tokens/s at W=2, 4 over W=1 measures what CP costs (sharding, the ring, Lookahead, more
   processes), not a speedup. The JSON also keeps these runs' peak RSS (default malloc).
4. *Step-0 keys: ring at every TTT step, or gather once?* At W=2 and the fixed S, with random
   tensors of the draft's shapes, per round: (a) ``ttt_attention`` forward+backward for
   j = 0..T-1 (the step-0 keys ride the ring again at every j), summed; (b) one
   all-gather of K0/V0 per batch, then for every j the local queries against the
   gathered keys and the cached diagonal keys through torch's SDPA (flash backend) with an
   explicit causal + diagonal boolean mask, and at the end one reduce-scatter of the
   gathered keys' gradients back to their owners. Rounds alternate the order (a, b / b, a);
   the ratio (b)/(a) is taken within each round. (b) holds the whole S of K0/V0 on every
   rank: 2 * S * Hkv * D * 4 bytes more (and as much again for their gradients during the
   backward), growing with the global S instead of S / W.

Writes ``<out>/eagle3.json`` (every raw number, per rank, and the machine) and
``eagle3.png`` (left: step memory per rank vs W; right: the longest S under the cap vs W).

    python benchmarks/bench_eagle3.py            # S=4096, cap 512 MiB: 6.5 min on 2 cores
    python benchmarks/bench_eagle3.py --quick    # S=1024, cap 128 MiB: 2 min (results/smoke/)
    python benchmarks/bench_eagle3.py --replot   # redraw eagle3.png from eagle3.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import statistics
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from common import RESULTS, Cluster, _proc_status_kib, machine_info, timed, write_json
from ringattn.apps.eagle3_train import Eagle3Config

MODEL = dict(hidden=256, heads=8, kv_heads=2, intermediate=512, vocab=2048, draft_vocab=512,
             target_layers=4, ttt_steps=7, batch=1, layout="zigzag")
"""The fixed model and batch shape (fields of ``Eagle3Config``)."""
CP_SIZES = (1, 2, 4)
WARMUP_S = 256
"""The warm-up step's S: it builds the ring's plans, imports lazily loaded code and creates
AdamW's state, while staying far below the measured step's high water."""
STRIDE = 4
"""The longest-S search moves S by at most this factor while the cap is not yet bracketed."""


def _threads(w: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // w)


# ---------------------------------------------------------------------------- rank tasks


def _train_step(target, draft, opt, batch, cfg: Eagle3Config, group) -> None:
    """One step of ``train_eagle3``'s loop at dp=1 (``ringattn.apps.eagle3_train.train_step``)."""
    from ringattn.apps.eagle3_train import train_step

    sums = train_step(target, draft, opt, batch, cfg, cp_group=group)
    if not math.isfinite(float(sums[0, 0])):
        raise FloatingPointError(f"step-0 loss is {float(sums[0, 0])} at S={cfg.seqlen}")


def step_task(model: dict, s: int, pad: int, timed_steps: int, threads: int) -> dict:
    """On every rank: warm up, then one measured step at S (RSS before, ru_maxrss after),
    then ``timed_steps`` timed steps. Returns this rank's numbers (times: max over ranks)."""
    from ringattn.apps.eagle3_train import build_draft, build_target, make_batches
    from ringattn.integrations import transformers as ra_hf
    from ringattn.apps.train import peak_rss_mib

    torch.set_num_threads(threads)
    group = dist.group.WORLD
    cfg = Eagle3Config(seqlen=s, pad=pad, steps=1 + timed_steps, **model)
    target = build_target(cfg, ra_hf.NAME)
    # Which target ids form the draft vocabulary changes no cost: take the first ones.
    draft = build_draft(cfg, target, torch.arange(cfg.draft_vocab))
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    warm = replace(cfg, seqlen=WARMUP_S, pad=min(pad, WARMUP_S // 2), steps=1)
    _train_step(target, draft, opt, next(make_batches(warm)), warm, group)

    batches = make_batches(cfg)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss_before = _proc_status_kib("VmRSS") / 1024
    hwm_before = peak_rss_mib()
    first = timed(lambda: _train_step(target, draft, opt, next(batches), cfg, group),
                  iters=1, warmup=0, group=group)
    peak = peak_rss_mib()
    times = timed(lambda: _train_step(target, draft, opt, next(batches), cfg, group),
                  iters=timed_steps, warmup=0, group=group) if timed_steps else []
    return {"rank": dist.get_rank(group), "threads": threads, "rss_before_mib": rss_before,
            "hwm_before_mib": hwm_before, "peak_mib": peak, "step_mib": peak - rss_before,
            "first_step_s": first[0], "times_s": times}


def ttt_task(s: int, h: int, hkv: int, d: int, steps: int, rounds: int) -> dict:
    """Paired rounds of (a) ``ttt_attention`` over the TTT steps, (b) the step-0 keys
    gathered once + SDPA with an explicit mask, and (b) without the diagonal key sets;
    times are max over ranks."""
    from ringattn import positions
    from ringattn.eagle3 import ttt_attention
    from ringattn.layouts import local_positions

    group = dist.group.WORLD
    w, rank = dist.get_world_size(group), dist.get_rank(group)
    layout = MODEL["layout"]
    pos_L = positions(s, group=group, layout=layout)
    n = pos_L.numel()
    if n * w != s:
        raise ValueError(f"the TTT comparison needs S={s} to split into {2 * w} equal chunks")
    pos_S = torch.cat([local_positions(layout, r, w, s) for r in range(w)])  # gathered keys
    gen = torch.Generator().manual_seed(1 + rank)
    qs = [torch.randn(1, n, h, d, generator=gen) for _ in range(steps)]
    ks = [torch.randn(1, n, hkv, d, generator=gen) for _ in range(steps)]
    vs = [torch.randn(1, n, hkv, d, generator=gen) for _ in range(steps)]
    douts = [torch.randn(1, n, h, d, generator=gen) for _ in range(steps)]
    def leaf(t):
        return t.detach().requires_grad_()

    def ring_every_step():
        keys, values = [leaf(k) for k in ks], [leaf(v) for v in vs]
        for j in range(steps):
            q = leaf(qs[j])
            out = ttt_attention(q, keys[:j + 1], values[:j + 1], group=group, layout=layout,
                                seqlen=s)
            torch.autograd.grad(out, [q, *keys[:j + 1], *values[:j + 1]], douts[j])

    def gather_once(diagonal: bool):
        kv0 = torch.cat([ks[0], vs[0]], dim=2)[0]  # [L, 2 Hkv, D]: one collective for both
        kv_S = torch.empty(w * n, 2 * hkv, d)
        dist.all_gather_single(kv_S, kv0, group=group)
        kv_S = leaf(kv_S[None])  # [1, S, 2 Hkv, D], rank-major
        k0_S = kv_S[:, :, :hkv].transpose(1, 2)
        v0_S = kv_S[:, :, hkv:].transpose(1, 2)
        causal = pos_S[None, :] <= pos_L[:, None]  # [L, S]
        eye = torch.eye(n, dtype=torch.bool)
        cached_k = [leaf(k).transpose(1, 2) for k in ks[1:]]
        cached_v = [leaf(v).transpose(1, 2) for v in vs[1:]]
        grad_kv = torch.zeros_like(kv_S)
        for j in range(steps):
            i = j if diagonal else 0  # without the diagonal: the step-0 keys alone, every step
            q = leaf(qs[j]).transpose(1, 2)
            k = torch.cat([k0_S, *cached_k[:i]], dim=2)
            v = torch.cat([v0_S, *cached_v[:i]], dim=2)
            mask = torch.cat([causal] + [eye] * i, dim=1)  # [L, S + i L]
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            grads = torch.autograd.grad(out, [q, kv_S, *cached_k[:i], *cached_v[:i]],
                                        douts[j].transpose(1, 2))
            grad_kv += grads[1]
        mine = torch.empty_like(kv0)  # the summed gradients of this rank's K0/V0 (rank-major)
        dist.reduce_scatter_single(mine, grad_kv[0], group=group)

    funcs = {"ring": ring_every_step, "gather": partial(gather_once, True),
             "gather-step0-only": partial(gather_once, False)}
    times: dict[str, list[float]] = {name: [] for name in funcs}
    names = list(funcs)
    for r in range(rounds + 1):  # round 0 warms every variant up and is dropped
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = timed(funcs[name], iters=1, warmup=0, group=group)[0]
            if r:
                times[name].append(t)
    return {"rank": rank, "times_s": times, "L": n}


# ---------------------------------------------------------------------------- the runs


def measure(w: int, s: int, *, pad: int, memory: bool, timed_steps: int = 0) -> dict:
    """One step at S (then ``timed_steps`` timed ones) on W fresh ranks; maxima over ranks.

    ``memory``: ranks started with MALLOC_MMAP_THRESHOLD_, one thread each (the memory runs);
    otherwise default malloc and cores // W threads per rank (the timing runs).
    """
    threads = 1 if memory else _threads(w)
    t0 = time.monotonic()
    cluster = Cluster(w, memory=memory)
    try:
        ranks = cluster.run(step_task, MODEL, s, pad, timed_steps, threads, timeout=3600)
    finally:
        cluster.close()
    rec = {"S": s, "W": w, "threads": threads, "mmap_threshold": memory, "ranks": ranks,
           "wall_s": round(time.monotonic() - t0, 1)}
    for key in ("rss_before_mib", "hwm_before_mib", "peak_mib", "step_mib"):
        rec[key] = max(r[key] for r in ranks)
    if timed_steps:
        rec["step_s"] = statistics.median(ranks[0]["times_s"])
        rec["tokens_per_s"] = MODEL["batch"] * s / rec["step_s"]
    return rec


def longest_s(w: int, start: dict, *, cap_mib: float, tol: float, pad: int, bar) -> dict:
    """The longest S whose step memory fits the cap, from the fixed-S memory run ``start``.

    With lo the longest S probed that fits and hi the shortest that does not: while one of
    them is missing, the next S is where step memory, taken as proportional to S through
    the other, meets the cap, moved tol / 2 further (above it while there is no hi, below
    while there is no lo; at most ``STRIDE`` times or 1 / ``STRIDE`` of the last end). Then
    the bracket shrinks until hi <= lo * (1 + tol): the split point is where the line through
    both ends' step memory meets the cap (false position), kept tol / 2 * lo inside the
    bracket, and the midpoint after two probes in a row that moved the same end. Step memory
    is close to linear in S, so this takes two or three probes where doubling and then
    halving the bracket down to 5% takes six or more, each a fresh set of processes.
    """
    probes = [start]
    def fits(rec):
        return rec["step_mib"] <= cap_mib

    def aim(rec, side):
        return rec["S"] * cap_mib / rec["step_mib"] * (1 + side * tol / 2)

    moved: list[bool] = []
    while True:
        lo = max((r for r in probes if fits(r)), key=lambda r: r["S"], default=None)
        hi = min((r for r in probes if not fits(r)), key=lambda r: r["S"], default=None)
        bracketed = lo is not None and hi is not None
        if bracketed and hi["S"] <= lo["S"] * (1 + tol):
            break
        if hi is None:
            s = min(round(aim(lo, +1)), STRIDE * lo["S"])
        elif lo is None:
            s = max(round(aim(hi, -1)), hi["S"] // STRIDE)
            if s < WARMUP_S:
                raise RuntimeError(f"W={w}: even S={s} exceeds the cap of {cap_mib:g} MiB")
        elif len(moved) >= 2 and moved[-1] == moved[-2]:
            s = (lo["S"] + hi["S"]) // 2
        else:
            slope = (hi["step_mib"] - lo["step_mib"]) / (hi["S"] - lo["S"])
            s = (lo["S"] + round((cap_mib - lo["step_mib"]) / slope) if slope > 0
                 else (lo["S"] + hi["S"]) // 2)
        if bracketed:
            margin = max(1, math.ceil(tol / 2 * lo["S"]))
            s = min(max(s, lo["S"] + margin), hi["S"] - margin)
        bar.set_postfix_str(f"W={w} S={s} under a {cap_mib:g} MiB cap")
        rec = measure(w, s, pad=pad, memory=True)
        bar.update(1)
        probes.append(rec)
        if bracketed:
            moved.append(fits(rec))
    return {"W": w, "max_s": lo["S"], "first_over": hi["S"], "probes": probes}


def ttt_compare(s: int, rounds: int) -> dict:
    """The step-0 keys' comparison at W=2 (``ttt_task``); ratios to the ring within rounds."""
    h, hkv = MODEL["heads"], MODEL["kv_heads"]
    d = MODEL["hidden"] // h
    w, t = 2, MODEL["ttt_steps"]
    cluster = Cluster(w)
    try:
        ranks = cluster.run(ttt_task, s, h, hkv, d, t, rounds, timeout=3600)
    finally:
        cluster.close()
    times = ranks[0]["times_s"]
    ratios = {f"{name} / ring": [b / a for a, b in zip(times["ring"], xs)]
              for name, xs in times.items() if name != "ring"}
    n = ranks[0]["L"]
    return {"S": s, "W": w, "H": h, "Hkv": hkv, "D": d, "T": t, "L": n, "rounds": rounds,
            "threads": 1, "times_s": times, "ratios": ratios,
            "ratio_median": {k: statistics.median(v) for k, v in ratios.items()},
            # what gathering holds on every rank: K0 and V0 of the whole S (fp32)
            "gathered_kv_bytes": 2 * s * hkv * d * 4,
            # what the ring holds instead: the local K0/V0 block and the one in flight
            "ring_kv_bytes": 2 * 2 * n * hkv * d * 4,
            # the benchmark's explicit boolean mask at the last TTT step (not a design cost)
            "mask_bytes_last_step": n * (s + (t - 1) * n)}


def run(args, out_dir: Path) -> dict:
    data = {"machine": machine_info(), "model": MODEL, "dtype": "fp32", "pad": args.pad,
            "S": args.seqlen, "cp_sizes": list(CP_SIZES), "warmup_S": WARMUP_S,
            "timed_steps": args.timed_steps, "cap_mib": args.cap_mib,
            "cap": "step memory (peak RSS - RSS before the step), max over ranks",
            "tol": args.tol, "fixed": [], "search": [], "loadavg": {}}
    t0 = time.monotonic()
    bar = tqdm(unit="run", dynamic_ncols=True)
    data["loadavg"]["start"] = os.getloadavg()
    for w in CP_SIZES:
        bar.set_postfix_str(f"W={w} S={args.seqlen}: memory")
        mem = measure(w, args.seqlen, pad=args.pad, memory=True)
        bar.update(1)
        bar.set_postfix_str(f"W={w} S={args.seqlen}: tokens/s")
        speed = measure(w, args.seqlen, pad=args.pad, memory=False, timed_steps=args.timed_steps)
        bar.update(1)
        data["fixed"].append({"W": w, "S": args.seqlen, "memory": mem, "speed": speed})
        write_json(out_dir / "eagle3.json", data)
    base = data["fixed"][0]["speed"]["tokens_per_s"]
    for rec in data["fixed"]:
        rec["speed"]["tokens_per_s_over_w1"] = rec["speed"]["tokens_per_s"] / base
    data["loadavg"]["after_fixed"] = os.getloadavg()
    if not args.skip_search:
        for rec in data["fixed"]:
            data["search"].append(longest_s(rec["W"], rec["memory"], cap_mib=args.cap_mib,
                                            tol=args.tol, pad=args.pad, bar=bar))
            write_json(out_dir / "eagle3.json", data)
        data["loadavg"]["after_search"] = os.getloadavg()
    bar.set_postfix_str(f"TTT step-0 keys: ring vs gather, S={args.seqlen}")
    data["ttt"] = ttt_compare(args.seqlen, args.rounds)
    bar.update(1)
    bar.close()
    data["loadavg"]["end"] = os.getloadavg()
    data["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(out_dir / "eagle3.json", data)
    return data


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_m, ax_s) = plt.subplots(1, 2, figsize=(11, 4.5))
    ws = [rec["W"] for rec in data["fixed"]]
    x = range(len(ws))
    base = [rec["memory"]["rss_before_mib"] for rec in data["fixed"]]
    step = [rec["memory"]["step_mib"] for rec in data["fixed"]]
    ax_m.bar(x, step, color="tab:orange", label="step memory (peak - RSS before the step)")
    ax_m.bar(x, base, bottom=step, color="0.8", label="RSS before the step (torch, models)")
    for i, (st, b) in enumerate(zip(step, base)):
        ax_m.text(i, st / 2, f"{st:.0f}", ha="center", va="center", fontsize=8)
        ax_m.text(i, st + b, f"peak {st + b:.0f}", ha="center", va="bottom", fontsize=8)
    ax_m.set_xticks(list(x), [f"cp={w}" for w in ws])
    ax_m.set_ylabel("MiB per rank (max over ranks)")
    ax_m.set_title(f"one training step at S={data['S']}", fontsize=9)
    ax_m.legend(fontsize=7, loc="upper right")
    if data["search"]:
        xs = [r["W"] for r in data["search"]]
        ax_s.bar(range(len(xs)), [r["max_s"] for r in data["search"]], color="tab:blue")
        for i, r in enumerate(data["search"]):
            ax_s.text(i, r["max_s"], f"{r['max_s']}", ha="center", va="bottom", fontsize=8)
        ax_s.set_xticks(range(len(xs)), [f"cp={w}" for w in xs])
    ax_s.set_ylabel("longest S that trains a step")
    ax_s.set_title(f"step memory cap {data['cap_mib']:g} MiB per process "
                   f"(bracket within {data['tol']:.0%})", fontsize=9)
    m = data["model"]
    mach = data["machine"]
    fig.suptitle(f"Eagle3 draft step under CP, gloo CPU ranks ({mach['nproc']} cores); fp32 "
                 f"B={m['batch']} pad {data['pad']} {m['layout']}; target {m['target_layers']} "
                 f"layers, hidden {m['hidden']}, H={m['heads']} Hkv={m['kv_heads']}, vocab "
                 f"{m['vocab']}; "
                 f"draft vocab {m['draft_vocab']}, T={m['ttt_steps']}; torch {mach['torch']}, "
                 f"{mach['date'][:10]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="S=1024, cap 128 MiB, tol 10%%, 3 rounds (2 min); writes to "
                    f"{RESULTS / 'smoke'} unless --out")
    ap.add_argument("--seqlen", type=int, default=4096, help="the fixed S (default 4096)")
    ap.add_argument("--cap-mib", type=float, default=512.0,
                    help="step-memory cap per process, MiB (default 512)")
    ap.add_argument("--tol", type=float, default=0.05,
                    help="stop bisecting when the bracket's ends are this close (default 0.05)")
    ap.add_argument("--pad", type=int, default=Eagle3Config.pad,
                    help=f"right padding of the row, tokens (default {Eagle3Config.pad})")
    ap.add_argument("--timed-steps", type=int, default=2,
                    help="timed steps after the measured one (default 2)")
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds of the TTT comparison")
    ap.add_argument("--skip-search", action="store_true", help="no longest-S search")
    ap.add_argument("--replot", action="store_true", help="redraw eagle3.png from eagle3.json")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"output folder (default {RESULTS}, {RESULTS / 'smoke'} for --quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seqlen, args.cap_mib, args.tol, args.rounds = 1024, 128.0, 0.10, 3
    if args.seqlen % (2 * 2):
        ap.error(f"--seqlen {args.seqlen} must split into 4 zigzag chunks (the TTT comparison)")
    out = args.out or (RESULTS / "smoke" if args.quick else RESULTS)
    if args.replot:
        plot(json.loads((out / "eagle3.json").read_text()), out / "eagle3.png")
        print(f"wrote {out / 'eagle3.png'}")
        return
    data = run(args, out)
    plot(data, out / "eagle3.png")
    for rec in data["fixed"]:
        mem, speed = rec["memory"], rec["speed"]
        print(f"W={rec['W']} S={rec['S']}: RSS before {mem['rss_before_mib']:.0f} MiB, peak "
              f"{mem['peak_mib']:.0f} MiB, step {mem['step_mib']:.0f} MiB; "
              f"{speed['tokens_per_s']:.0f} tokens/s ({speed['tokens_per_s_over_w1']:.2f}x W=1)")
    for rec in data["search"]:
        print(f"W={rec['W']}: longest S within {data['cap_mib']:g} MiB = {rec['max_s']} "
              f"(S={rec['first_over']} over; {len(rec['probes'])} probes)")
    t = data["ttt"]
    for name, r in t["ratio_median"].items():
        print(f"TTT step-0 keys, W=2 S={t['S']}: {name} = {r:.3f} (median of {t['rounds']} "
              "rounds)")
    print(f"gathering holds {t['gathered_kv_bytes'] / 2**20:.1f} MiB of K0/V0 per rank, the "
          f"ring {t['ring_kv_bytes'] / 2**20:.1f} MiB")
    print(f"wrote {out / 'eagle3.json'} in {data['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
