"""Packed documents: per-rank work balance of each layout, and masked-batch speed vs SDPA.

Legend: B batch, S global seq, L local seq, H heads, Hkv kv heads, D head dim, W world size.

Two parts, one JSON (``masks.json``):

* **balance** (no processes): packed batches of random documents (lengths log-normal with
  median ``--median`` tokens and shape ``--sigma``, clipped to [1, S], drawn until the pack
  reaches S; the last one is cut at S), one pack per seed. A rank's attention work is the
  number of visible (query, key) pairs of its queries under the document & causal mask: a
  query at global position p in a document starting at s sees p - s + 1 keys. For every
  layout (contiguous, striped, plain sequence-level zigzag ``Zigzag()``, and per-document
  zigzag ``DocumentZigzag``) and every (S, W, seed): max/mean and min/mean of the per-rank
  work, and the per-rank real-token counts; for one pack, also the pairs the CPU kernels
  compute under each rank's plan (``tile_balance``). ``masks_balance.png`` plots max/mean.
* **time** (gloo ranks, paired rounds): one document-masked causal fwd+bwd (seed-0 pack,
  same global inputs) by ringattn on W=2 ranks (one thread each) with the per-document
  zigzag, plain zigzag, contiguous and striped layouts, and in one process by
  ``F.scaled_dot_product_attention`` with the dense [S, S] boolean mask (the backend torch
  picks on CPU; recorded) on 1 and 2 threads, plus, for reference, SDPA run causally on each
  document in turn (2 threads: what a single process would do without a dense mask). Each
  round times every method back to back; ratios are per round. Before timing, every
  ringattn layout's out, dq, dk, dv (unsharded) are compared with the dense-mask SDPA's:
  ||x - ref|| / ||ref|| must be <= 1e-5. The JSON also keeps every rank's plan (kernel
  calls by class per ring step, visible pairs, and the (query, key) pairs its kernels
  compute, masked ones inside partial tiles included) and, at S=8192, a stopwatch around
  every block-kernel call (``TimedKernel``): where each rank's time goes. ``masks_time.png``
  plots the medians.

    python benchmarks/bench_masks.py                 # about 10 minutes on 2 cores
    python benchmarks/bench_masks.py --balance-only  # about 1 minute
    python benchmarks/bench_masks.py --smoke         # S=1024, 1 round: checks the script
    python benchmarks/bench_masks.py --replot        # redraw the PNGs from masks.json
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import ringattn
from common import RESULTS, Cluster, global_inputs, machine_info, write_json
from ringattn.layouts import Contiguous, Striped, Zigzag, get_layout, local_positions
from ringattn.masks import BlockKind
from ringattn.plan import make_plan

CHECK_TOL = 1e-5
"""||ringattn - SDPA dense mask|| / ||SDPA dense mask||, per tensor (out, dq, dk, dv), fp32."""
BALANCE_TOL = 0.10
"""The per-document zigzag's per-rank work must lie within this fraction of the mean."""

LAYOUT_NAMES = ("contiguous", "striped", "zigzag", "doc-zigzag")
"""Balance layouts: "zigzag" is the sequence-level ``Zigzag()``, "doc-zigzag" the
per-document ``DocumentZigzag`` (``get_layout("zigzag", cu_seqlens)``)."""

RING = ("ringattn-doc-zigzag", "ringattn-zigzag", "ringattn-contiguous", "ringattn-striped")
DENSE = "sdpa-dense"
PERDOC = "sdpa-per-doc"


# ---------------------------------------------------------------------------- documents


def pack_documents(s: int, seed: int, median: float, sigma: float) -> tuple[int, ...]:
    """cu_seqlens of one pack: log-normal lengths (median, sigma) clipped to [1, S], drawn
    until the pack reaches S; the last document is cut at S."""
    rng = random.Random(seed)
    cu = [0]
    while cu[-1] < s:
        n = min(max(round(rng.lognormvariate(math.log(median), sigma)), 1), s)
        cu.append(min(cu[-1] + n, s))
    return tuple(cu)


def layout_object(name: str, cu: tuple[int, ...]):
    return {"contiguous": Contiguous(), "striped": Striped(), "zigzag": Zigzag(),
            "doc-zigzag": get_layout("zigzag", cu)}[name]


# ---------------------------------------------------------------------------- balance


def rank_work(layout, cu: tuple[int, ...], world: int, s: int) -> tuple[list[int], list[int]]:
    """(visible (query, key) pairs of each rank's queries, real tokens of each rank) under the
    document & causal mask."""
    starts = torch.tensor(cu[:-1], dtype=torch.long)
    work, tokens = [], []
    for r in range(world):
        pos = local_positions(layout, r, world, s)
        pos = pos[pos < s]
        doc = torch.searchsorted(starts, pos, right=True) - 1
        work.append(int((pos - starts[doc] + 1).sum()))
        tokens.append(pos.numel())
    return work, tokens


def balance(ss, ws, seeds, median: float, sigma: float) -> dict:
    rows = []
    for s in ss:
        for seed in seeds:
            cu = pack_documents(s, seed, median, sigma)
            lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
            total = sum(n * (n + 1) // 2 for n in lengths)
            for w in ws:
                for name in LAYOUT_NAMES:
                    work, tokens = rank_work(layout_object(name, cu), cu, w, s)
                    if sum(work) != total or sum(tokens) != s:
                        raise RuntimeError(f"{name} S={s} W={w} seed={seed}: ranks hold "
                                           f"{sum(tokens)} tokens / {sum(work)} pairs, "
                                           f"expected {s} / {total}")
                    mean = total / w
                    rows.append({"layout": name, "S": s, "W": w, "seed": seed,
                                 "n_docs": len(lengths), "max_doc": max(lengths),
                                 "work": work, "tokens": tokens,
                                 "max_over_mean": max(work) / mean, "min_over_mean": min(work) / mean,
                                 "token_spread": max(tokens) - min(tokens)})
    worst = []
    for s in ss:
        for w in ws:
            for name in LAYOUT_NAMES:
                hit = [r for r in rows if (r["layout"], r["S"], r["W"]) == (name, s, w)]
                worst.append({"layout": name, "S": s, "W": w, "seeds": len(hit),
                              "worst_max_over_mean": max(r["max_over_mean"] for r in hit),
                              "median_max_over_mean": statistics.median(r["max_over_mean"] for r in hit),
                              "worst_min_over_mean": min(r["min_over_mean"] for r in hit),
                              "worst_token_spread": max(r["token_spread"] for r in hit)})
    doc = [r for r in rows if r["layout"] == "doc-zigzag"]
    within = all(abs(r["max_over_mean"] - 1) <= BALANCE_TOL and abs(r["min_over_mean"] - 1) <= BALANCE_TOL
                 for r in doc)
    return {"S": list(ss), "W": list(ws), "seeds": list(seeds), "median": median, "sigma": sigma,
            "rows": rows, "worst": worst, "doc_zigzag_within_tol": within,
            "doc_zigzag_worst_dev": max(max(abs(r["max_over_mean"] - 1), abs(r["min_over_mean"] - 1)) for r in doc)}


# ---------------------------------------------------------------------------- plans


def plan_stats(name: str, cu: tuple[int, ...], world: int, s: int) -> list[dict]:
    """Per rank: kernel calls (blocks) by class, blocks per ring step, and (query, key) pairs
    its kernels compute (every pair of a block, masked pairs of partial tiles included)."""
    lay = layout_object(name, cu)
    mask = ringattn.masks.document(cu) & ringattn.masks.causal()
    work, _ = rank_work(lay, cu, world, s)
    out = []
    for r in range(world):
        plan = make_plan(lay, mask, world, r, s)
        counts = plan.counts()
        computed = sum((b.q_stop - b.q_start) * (b.k_stop - b.k_start) for st in plan.steps for b in st)
        partial = sum((b.q_stop - b.q_start) * (b.k_stop - b.k_start) for st in plan.steps for b in st
                      if b.kind is BlockKind.PARTIAL)
        out.append({"rank": r, "full_blocks": counts[BlockKind.FULL],
                    "partial_blocks": counts[BlockKind.PARTIAL],
                    "blocks_per_step": [len(st) for st in plan.steps],
                    "visible_pairs": work[r], "computed_pairs": computed,
                    "computed_pairs_in_partial_blocks": partial})
    return out


def tile_balance(s: int, ws, seed: int, median: float, sigma: float) -> list[dict]:
    """Per (layout, W): the (query, key) pairs each rank's kernels compute under the plan
    (``plan_stats``), against the visible pairs. Classifying a pack at S=32768 takes seconds
    per (layout, W), so this runs for one pack."""
    cu = pack_documents(s, seed, median, sigma)
    rows = []
    for w in ws:
        for name in LAYOUT_NAMES:
            st = plan_stats(name, cu, w, s)
            mean_visible = sum(r["visible_pairs"] for r in st) / w
            computed = [r["computed_pairs"] for r in st]
            rows.append({"layout": name, "S": s, "W": w, "seed": seed, "per_rank": st,
                         "max_computed_over_mean_visible": max(computed) / mean_visible,
                         "mean_computed_over_mean_visible": sum(computed) / w / mean_visible,
                         "max_computed_over_mean_computed": max(computed) / (sum(computed) / w),
                         "max_calls": max(r["full_blocks"] + r["partial_blocks"] for r in st)})
    return rows


# ---------------------------------------------------------------------------- worker side


def _ring_layout(method: str):
    """The ``layout`` argument of shard/ring_attention for a ring method."""
    return {"ringattn-doc-zigzag": "zigzag", "ringattn-zigzag": Zigzag(),
            "ringattn-contiguous": "contiguous", "ringattn-striped": "striped"}[method]


def _leaves(*ts):
    return [t.detach().clone().contiguous().requires_grad_() for t in ts]


def _time_once(step, group) -> tuple[float, float]:
    """(slowest rank's seconds, this rank's seconds) of one ``step()``."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    step()
    own = time.perf_counter() - t0
    t = torch.tensor([own], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item(), own


def _ring_setup(s, h, hkv, d, cu, method, kernel=None):
    group = dist.group.WORLD
    layout = _ring_layout(method)
    q, k, v, do = global_inputs(s, h, hkv, d, torch.float32)
    with torch.no_grad():
        local = [ringattn.shard(t, group=group, layout=layout, seqlen=s, cu_seqlens=cu).contiguous()
                 for t in (q, k, v, do)]
    q, k, v = _leaves(*local[:3])

    def call():
        out = ringattn.ring_attention(q, k, v, group=group, causal=True, layout=layout,
                                      seqlen=s, cu_seqlens=cu, kernel=kernel)
        return out, torch.autograd.grad(out, (q, k, v), local[3])

    return group, layout, call


def ring_time_task(s, h, hkv, d, cu, method) -> tuple[float, float]:
    group, _, call = _ring_setup(s, h, hkv, d, cu, method)
    return _time_once(call, group)


def ring_check_task(s, h, hkv, d, cu, method):
    """Global (unsharded) out, dq, dk, dv on rank 0; None elsewhere."""
    group, layout, call = _ring_setup(s, h, hkv, d, cu, method)
    out, grads = call()
    full = [ringattn.unshard(t.detach(), group=group, layout=layout, seqlen=s, cu_seqlens=cu)
            for t in (out, *grads)]
    return full if dist.get_rank(group) == 0 else None


class TimedKernel:
    """torch's CPU kernel (``sdpa-cpu``) with a stopwatch: seconds, calls and (query, key)
    pairs per direction (fwd/bwd) and block class ("full": no mask; "masked": a PARTIAL
    tile, run with an additive mask that the kernel builds on each call). Passed to
    ``ring_attention(kernel=...)``; the plan is the same (same tiles)."""

    def __init__(self):
        from ringattn.kernels import get_kernel

        self.inner = get_kernel("sdpa-cpu", torch.device("cpu"), torch.float32)
        self.name = "sdpa-cpu-timed"
        self.tile = self.inner.tile
        self.reset()

    def reset(self):
        keys = [f"{p}_{k}" for p in ("fwd", "bwd") for k in ("full", "masked")]
        self.seconds = dict.fromkeys(keys, 0.0)
        self.calls = dict.fromkeys(keys, 0)
        self.pairs = dict.fromkeys(keys, 0)

    def supports(self, device, dtype) -> bool:
        return self.inner.supports(device, dtype)

    def _note(self, which, mask, q, k, t0):
        key = f"{which}_{'full' if mask is None else 'masked'}"
        self.seconds[key] += time.perf_counter() - t0
        self.calls[key] += 1
        self.pairs[key] += q.shape[1] * k.shape[1]

    def forward(self, q, k, v, scale, mask):
        t0 = time.perf_counter()
        r = self.inner.forward(q, k, v, scale, mask)
        self._note("fwd", mask, q, k, t0)
        return r

    def backward(self, dout, q, k, v, out, lse, scale, mask):
        t0 = time.perf_counter()
        r = self.inner.backward(dout, q, k, v, out, lse, scale, mask)
        self._note("bwd", mask, q, k, t0)
        return r


def ring_kernel_time_task(s, h, hkv, d, cu, method, calls: int) -> dict:
    """This rank's seconds inside the block kernel over ``calls`` fwd+bwd (mean), by block
    class, against the call's wall time."""
    kern = TimedKernel()
    group, _, call = _ring_setup(s, h, hkv, d, cu, method, kernel=kern)
    call()
    kern.reset()
    wall = 0.0
    for _ in range(calls):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        call()
        wall += time.perf_counter() - t0
    sec = {k: v / calls for k, v in kern.seconds.items()}
    return {"rank": dist.get_rank(group), "wall_s": wall / calls, "kernel_s": sec,
            "kernel_total_s": sum(sec.values()),
            "kernel_calls": {k: v // calls for k, v in kern.calls.items()},
            "kernel_pairs": {k: v // calls for k, v in kern.pairs.items()}}


_DENSE_MASKS: dict = {}


def dense_mask(cu: tuple[int, ...]) -> torch.Tensor:
    """[S, S] bool: document & causal (True = visible)."""
    if cu not in _DENSE_MASKS:
        _DENSE_MASKS.clear()
        lengths = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
        doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        _DENSE_MASKS[cu] = (doc[:, None] == doc[None, :]).tril_()
    return _DENSE_MASKS[cu]


def _sdpa_call(s, h, hkv, d, cu, method):
    q, k, v, do = (t.transpose(1, 2).contiguous() for t in global_inputs(s, h, hkv, d, torch.float32))
    q, k, v = _leaves(q, k, v)
    gqa = hkv != h
    if method == DENSE:
        mask = dense_mask(cu)

        def call():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
            return out, torch.autograd.grad(out, (q, k, v), do)
    elif method == PERDOC:
        def call():
            out = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                                            is_causal=True, enable_gqa=gqa)
                             for a, b in zip(cu[:-1], cu[1:])], dim=2)
            return out, torch.autograd.grad(out, (q, k, v), do)
    else:
        raise ValueError(f"unknown method {method!r}")
    return q, k, v, call


def sdpa_time_task(s, h, hkv, d, cu, method, threads) -> tuple[float, float]:
    torch.set_num_threads(threads)
    try:
        *_, call = _sdpa_call(s, h, hkv, d, cu, method)
        return _time_once(call, dist.group.WORLD)
    finally:
        torch.set_num_threads(1)


def sdpa_check_task(s, h, hkv, d, cu, method, threads):
    """Global out, dq, dk, dv in ringattn's [B, S, H(kv), D], and the backend torch picks."""
    torch.set_num_threads(threads)
    try:
        q, k, v, call = _sdpa_call(s, h, hkv, d, cu, method)
        backend = None
        if method == DENSE:
            from torch.nn.attention import SDPBackend
            choice = torch._fused_sdp_choice(q, k, v, dense_mask(cu), 0.0, False, enable_gqa=hkv != h)
            backend = SDPBackend(choice).name
        out, grads = call()
        return [t.detach().transpose(1, 2).contiguous() for t in (out, *grads)], backend
    finally:
        torch.set_num_threads(1)


# ---------------------------------------------------------------------------- driver


def _errors(x: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    out = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), x, ref):
        a, b = a.double(), b.double()
        out[name] = {"rel_norm": float((a - b).norm() / b.norm()),
                     "max_abs": float((a - b).abs().max()),
                     "max_abs_over_max_ref": float((a - b).abs().max() / b.abs().max())}
    return out


def timing(cases, rounds: int, threads1_max_s: int, profile_max_s: int, median: float,
           sigma: float, out_dir: Path, data: dict) -> None:
    """Checks, plans and paired rounds for every (S, Hkv) case; fills ``data["time"]``."""
    h, d = 8, 64
    single, ring = Cluster(1), Cluster(2)
    try:
        total = sum(1 + rounds + (s <= profile_max_s) for s, _ in cases)
        with tqdm(total=total, unit="round", dynamic_ncols=True) as bar:
            for s, hkv in cases:
                cu = pack_documents(s, 0, median, sigma)
                sdpa_methods = [(DENSE, 2)] + ([(DENSE, 1)] if s <= threads1_max_s else []) + [(PERDOC, 2)]
                names = [f"{m}-{t}t" for m, t in sdpa_methods] + list(RING)
                rec = {"S": s, "H": h, "Hkv": hkv, "D": d, "B": 1, "W": 2, "dtype": "fp32",
                       "cu_seqlens": list(cu), "doc_lengths": [b - a for a, b in zip(cu[:-1], cu[1:])],
                       "check": {}, "plans": {}, "times_s": {m: [] for m in names},
                       "loadavg_1min": []}
                # the check runs every method once, which also warms each up (plans are
                # classified and cached in the ranks): no separate warm-up round
                bar.set_postfix_str(f"check S={s} Hkv={hkv}")
                ref, backend = single.run(sdpa_check_task, s, h, hkv, d, cu, DENSE, 2)[0]
                rec["sdpa_backend"] = backend
                per_doc, _ = single.run(sdpa_check_task, s, h, hkv, d, cu, PERDOC, 2)[0]
                rec["check"][PERDOC] = _errors(per_doc, ref)
                for m in RING:
                    got = ring.run(ring_check_task, s, h, hkv, d, cu, m)[0]
                    rec["check"][m] = _errors(got, ref)
                del ref, per_doc, got
                single.run(sdpa_time_task, s, h, hkv, d, cu, DENSE, 1)  # 1-thread warm-up
                worst = max(e["rel_norm"] for m in RING for e in rec["check"][m].values())
                rec["check_worst_rel_norm"] = worst
                data["time"].append(rec)
                if worst > CHECK_TOL:
                    write_json(out_dir / "masks.json", data)
                    raise RuntimeError(f"ringattn and SDPA with the dense mask differ by {worst:.2e} "
                                       f"> {CHECK_TOL} at S={s} Hkv={hkv}: {rec['check']}")
                for m in RING:
                    rec["plans"][m] = plan_stats(m.removeprefix("ringattn-"), cu, 2, s)
                bar.update(1)
                for r in range(rounds):
                    bar.set_postfix_str(f"round {r + 1}/{rounds} S={s} Hkv={hkv}")
                    for m, t in sdpa_methods:
                        rec["times_s"][f"{m}-{t}t"].append(single.run(sdpa_time_task, s, h, hkv, d, cu, m, t)[0][0])
                    for m in RING:
                        rec["times_s"][m].append(ring.run(ring_time_task, s, h, hkv, d, cu, m)[0][0])
                    rec["loadavg_1min"].append(round(os.getloadavg()[0], 2))
                    bar.update(1)
                    write_json(out_dir / "masks.json", data)  # partial results survive a crash
                rec["ratios"] = {}
                for base in [f"{DENSE}-2t", f"{DENSE}-1t", f"{PERDOC}-2t"]:
                    if base not in rec["times_s"]:
                        continue
                    for m in RING:
                        rec["ratios"][f"{m} / {base}"] = [
                            a / b for a, b in zip(rec["times_s"][m], rec["times_s"][base])]
                rec["ratios"][f"{PERDOC}-2t / {DENSE}-2t"] = [
                    a / b for a, b in zip(rec["times_s"][f"{PERDOC}-2t"], rec["times_s"][f"{DENSE}-2t"])]
                rec["median_s"] = {m: statistics.median(x) for m, x in rec["times_s"].items()}
                write_json(out_dir / "masks.json", data)
                if s <= profile_max_s:  # where each rank's time goes (after the timed rounds)
                    bar.set_postfix_str(f"profile S={s} Hkv={hkv}")
                    rec["profile"] = {m: ring.run(ring_kernel_time_task, s, h, hkv, d, cu, m, PROFILE_CALLS)
                                      for m in RING}
                    bar.update(1)
                    write_json(out_dir / "masks.json", data)
    finally:
        single.close()
        ring.close()


PROFILE_CALLS = 3
"""fwd+bwd per ring method with the kernel stopwatch (after the timed rounds); its numbers
are their mean."""

NOTES = {
    "balance": "work = visible (query, key) pairs of a rank's queries under document & causal "
               "masking (query at p in a document starting at s: p - s + 1); max_over_mean / "
               "min_over_mean over the W ranks; tokens = real (non-padding) tokens per rank; "
               "zigzag = sequence-level Zigzag(), doc-zigzag = DocumentZigzag (per document).",
    "time": "seconds of one fwd+bwd; ring methods: max over the 2 ranks; sdpa-dense: F.scaled_dot_product_attention with the [S, S] bool "
            "document&causal mask; sdpa-per-doc: causal SDPA on each document in turn; -Nt = "
            "threads. Each round times every method back to back; ratios are per round.",
    "loadavg_1min": "the machine's 1-minute load average after each round (this benchmark "
                    "alone keeps it near 2 on 2 cores; more means another process competed).",
    "check": "per tensor: rel_norm = ||x - ref|| / ||ref||, max_abs, max_abs / max|ref|, "
             "x = unsharded ringattn (or per-document SDPA), ref = SDPA with the dense mask.",
    "plans": "per rank, make_plan(layout, document(cu) & causal(), W, rank, S) with the CPU "
             "kernel's (256, 128) tiles: blocks = kernel calls of one forward (the backward "
             "makes the same number); computed_pairs = sum of the blocks' rows x cols "
             "(the CPU kernel computes every pair of a block; a masked block's pairs cost "
             "more than an unmasked one's). tile_balance: the same per rank for one pack.",
    "profile": "per rank, mean over PROFILE_CALLS fwd+bwd with a stopwatch around each block "
               "kernel call (TimedKernel wrapping sdpa-cpu; the masked calls' time includes "
               "building their additive mask): wall_s, kernel seconds / calls / (q, k) pairs "
               "by direction and class (full = FULL block, masked = PARTIAL tile). wall - "
               "kernel = merging, gradient accumulation, communication and waiting for the "
               "other rank.",
}


# ---------------------------------------------------------------------------- plots


COLORS = {"contiguous": "tab:blue", "striped": "tab:green", "zigzag": "tab:orange",
          "doc-zigzag": "tab:red"}


def plot_balance(bal: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ss, ws = bal["S"], bal["W"]
    tiles = bal.get("tile_balance", [])
    fig, axes = plt.subplots(1, len(ss) + bool(tiles), figsize=(5.5 * (len(ss) + bool(tiles)), 4.8),
                             squeeze=False)
    width = 0.8 / len(LAYOUT_NAMES)
    for ax, s in zip(axes[0], ss):
        for i, name in enumerate(LAYOUT_NAMES):
            xs, med, lo, hi = [], [], [], []
            for j, w in enumerate(ws):
                vals = [r["max_over_mean"] for r in bal["rows"] if (r["layout"], r["S"], r["W"]) == (name, s, w)]
                m = statistics.median(vals)
                xs.append(j + (i - (len(LAYOUT_NAMES) - 1) / 2) * width)
                med.append(m)
                lo.append(m - min(vals))
                hi.append(max(vals) - m)
            ax.bar(xs, [m - 1 for m in med], width, bottom=1, color=COLORS[name],
                   yerr=[lo, hi], capsize=3, label=name)
        ax.axhline(1 + BALANCE_TOL, color="black", ls="--", lw=1, label=f"mean + {BALANCE_TOL:.0%}")
        ax.axhline(1, color="0.5", lw=0.8)
        ax.set_xticks(range(len(ws)), [f"W={w}" for w in ws])
        ax.set_title(f"S={s}: {len(bal['seeds'])} packs, doc lengths log-normal "
                     f"(median {bal['median']:g}, sigma {bal['sigma']:g})", fontsize=9)
        ax.set_ylabel("max / mean of per-rank work")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    top = max(ax.get_ylim()[1] for ax in axes[0][:len(ss)])
    for ax in axes[0][:len(ss)]:
        ax.set_ylim(0.9, top)
    if tiles:
        ax = axes[0][-1]
        for i, name in enumerate(LAYOUT_NAMES):
            xs, mx, mean = [], [], []
            for j, w in enumerate(ws):
                hit = [r for r in tiles if (r["layout"], r["W"]) == (name, w)]
                if not hit:
                    continue
                xs.append(j + (i - (len(LAYOUT_NAMES) - 1) / 2) * width)
                mx.append(hit[0]["max_computed_over_mean_visible"])
                mean.append(hit[0]["mean_computed_over_mean_visible"])
            ax.bar(xs, mx, width, color=COLORS[name], label=f"{name}: busiest rank")
            ax.scatter(xs, mean, marker="_", s=120, color="black", zorder=3,
                       label="mean over ranks" if i == 0 else None)
        ax.axhline(1, color="0.5", lw=0.8)
        ax.set_xticks(range(len(ws)), [f"W={w}" for w in ws])
        ax.set_ylabel("(q, k) pairs the kernels compute / mean visible pairs")
        ax.set_title(f"What the CPU kernels compute (tiles cut at segments), S={tiles[0]['S']}, "
                     f"pack {tiles[0]['seed']}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Document & causal mask: the busiest rank's visible (q, k) pairs over the mean "
                 "(bar: median over packs, whiskers: range)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_time(records: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    fig, axes = plt.subplots(1, len(records), figsize=(6 * len(records), 5), squeeze=False)
    for ax, rec in zip(axes[0], records):
        names = list(rec["times_s"])
        med = [statistics.median(rec["times_s"][m]) for m in names]
        lo = [m - min(rec["times_s"][n]) for m, n in zip(med, names)]
        hi = [max(rec["times_s"][n]) - m for m, n in zip(med, names)]
        colors = ["0.3" if n.startswith("sdpa-dense") else "0.7" if n.startswith("sdpa") else
                  COLORS[n.removeprefix("ringattn-")] for n in names]
        ax.bar(range(len(names)), med, color=colors, yerr=[lo, hi], capsize=3)
        for i, n in enumerate(names):
            key = f"{n} / {DENSE}-2t"
            if key in rec.get("ratios", {}):
                ax.text(i, (med[i] + hi[i]) * 1.04, f"{statistics.median(rec['ratios'][key]):.2f}x",
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), [n.replace("-", "\n", 1) for n in names], fontsize=8,
                      rotation=30)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_ylabel("fwd+bwd seconds, log scale (median, range over rounds)")
        ax.set_title(f"S={rec['S']}, Hkv={rec['Hkv']}, {len(rec['doc_lengths'])} documents; "
                     f"ringattn on W=2 ranks, SDPA in 1 process", fontsize=9)
        ax.grid(axis="y", alpha=0.3, which="both")
    fig.suptitle("Document-masked causal fwd+bwd (fp32, H=8, D=64); labels: median per-round "
                 "ratio to sdpa-dense-2t", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- main


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="S=1024 timing, small balance grid, 1 round")
    ap.add_argument("--balance-only", action="store_true", help="skip the timed part")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=8, help="packs per S in the balance part")
    ap.add_argument("--median", type=float, default=None,
                    help="median document length (default 1536; 256 with --smoke)")
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal shape of document lengths")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--replot", action="store_true", help="redraw the PNGs from <out>/masks.json")
    args = ap.parse_args(argv)
    out = args.out or (RESULTS / "smoke" if args.smoke else RESULTS)
    if args.replot:
        import json

        data = json.loads((out / "masks.json").read_text())
        plot_balance(data["balance"], out / "masks_balance.png")
        if data["time"]:
            plot_time(data["time"], out / "masks_time.png")
        return
    if args.median is None:
        args.median = 256 if args.smoke else 1536
    if args.smoke:
        bal_s, bal_w, seeds = (4096, 16384), (2, 4, 8), range(2)
        cases, rounds, threads1_max_s, tile_s = [(1024, 8), (1024, 2)], 1, 1024, 4096
    else:
        bal_s, bal_w, seeds = (32768, 131072), (2, 4, 8), range(args.seeds)
        cases, rounds, threads1_max_s, tile_s = [(8192, 8), (8192, 2), (16384, 8)], args.rounds, 8192, 32768
    t0 = time.monotonic()
    data = {"machine": machine_info(), "notes": NOTES, "check_tol": CHECK_TOL,
            "balance_tol": BALANCE_TOL, "rounds": rounds, "profile_calls": PROFILE_CALLS,
            "loadavg_1min_at_start": round(os.getloadavg()[0], 2), "time": []}
    data["balance"] = bal = balance(bal_s, bal_w, seeds, args.median, args.sigma)
    bal["tile_balance"] = tile_balance(tile_s, bal_w, 0, args.median, args.sigma)
    data["balance_elapsed_s"] = round(time.monotonic() - t0, 1)
    out.mkdir(parents=True, exist_ok=True)
    plot_balance(bal, out / "masks_balance.png")
    write_json(out / "masks.json", data)
    for r in bal["worst"]:
        print(f"balance S={r['S']} W={r['W']} {r['layout']:>10}: max/mean worst {r['worst_max_over_mean']:.3f} "
              f"(median {r['median_max_over_mean']:.3f}), min/mean worst {r['worst_min_over_mean']:.3f}, "
              f"token spread {r['worst_token_spread']}")
    print(f"doc-zigzag within {BALANCE_TOL:.0%} of the mean everywhere: {bal['doc_zigzag_within_tol']} "
          f"(worst deviation {bal['doc_zigzag_worst_dev']:.2e})")
    for r in bal["tile_balance"]:
        print(f"kernel pairs S={r['S']} W={r['W']} {r['layout']:>10}: busiest rank / mean visible "
              f"{r['max_computed_over_mean_visible']:.2f}, mean computed / visible "
              f"{r['mean_computed_over_mean_visible']:.2f}, max calls {r['max_calls']}")
    if not args.balance_only:
        timing(cases, rounds, threads1_max_s, threads1_max_s, args.median, args.sigma, out, data)
        plot_time(data["time"], out / "masks_time.png")
        for rec in data["time"]:
            print(f"S={rec['S']} Hkv={rec['Hkv']} ({len(rec['doc_lengths'])} docs, backend "
                  f"{rec['sdpa_backend']}): check worst rel {rec['check_worst_rel_norm']:.1e}")
            for name, xs in rec["ratios"].items():
                print(f"  {name}: median {statistics.median(xs):.3f} (range {min(xs):.3f}..{max(xs):.3f})")
            for m, per_rank in rec.get("profile", {}).items():
                print(f"  profile {m}: " + "; ".join(
                    f"rank {p['rank']} wall {p['wall_s']:.2f} s, kernels {p['kernel_total_s']:.2f} s "
                    f"(masked {p['kernel_s']['fwd_masked'] + p['kernel_s']['bwd_masked']:.2f} s)"
                    for p in per_rank))
    data["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(out / "masks.json", data)
    print(f"wrote {out / 'masks.json'} in {data['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
