"""Attention fwd+bwd time and per-rank peak memory: ringattn vs PyTorch's ring vs torch SDPA.

Legend: B batch, S global seq, L local seq (S / W), H heads, Hkv kv heads, D head dim,
W world size.

One run, one set of global inputs per configuration (seed 0), three kinds of method:

* ``ringattn-<layout>``: ``ringattn.ring_attention`` on W gloo ranks, one thread each, for
  each layout (at W=1 every layout is the identity placement, so only "contiguous" runs
  unless ``--full``);
* ``torch-ring``: PyTorch's context-parallel ring (``torch_ring.py``) on the same ranks,
  head-tail (zigzag) shards for causal, contiguous for full; cross-checked against ringattn
  on every (W, mask, Hkv) before any timing;
* ``sdpa``: ``F.scaled_dot_product_attention`` (flash backend, ``enable_gqa``) on the whole
  sequence in one process with 1 thread and with W threads.

Each method gets its inputs in its own layout, contiguous: ringattn [B, L, H, D], torch's
ring and SDPA [B, H, S, D]. A timed iteration is one forward and one backward
(``torch.autograd.grad``); its time is the max over ranks (barrier before, all-reduce MAX
after); each result keeps every iteration, the median and the spread.

Memory runs are separate from timing runs, in processes started with
MALLOC_MMAP_THRESHOLD_=65536: per rank, the peak live tensor bytes of one fwd+bwd (inputs
q, k, v and the upstream gradient are cloned inside the measured region, so they count)
and the RSS high water over one fwd+bwd (absolute and over the RSS before the call).

Writes ``<out>/attention.json`` (every raw number and the machine), ``attention_time.png``
and ``memory.png``.

    python benchmarks/bench_attention.py            # --quick: ~16 min on 2 cores
    python benchmarks/bench_attention.py --full     # the whole grid (hours on 2 cores)
    python benchmarks/bench_attention.py --smoke    # S=1024, 1 iteration: checks the script
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

import ringattn
import torch_ring
from common import (DTYPES, RESULTS, Cluster, TensorBytes, global_inputs, machine_info,
                    rss_peak, summary, timed, write_json)

LAYOUTS = ("contiguous", "zigzag", "striped")
CHECK_TOL = 1e-5
"""Max abs difference allowed between torch's ring and ringattn (fp32). Each is within
~5e-7 (forward) and ~5e-6 (backward) of float64 on this kernel (docs/platform.md); the two
measured ~5e-7 apart at S=1024. A larger gap means they are not computing the same thing."""


@dataclass(frozen=True)
class Point:
    """One configuration; ``w`` is None for single-process SDPA."""

    s: int
    causal: bool
    dtype: str
    hkv: int
    w: int | None
    h: int = 8
    d: int = 64
    iters: int = 3
    warmup: int = 1

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        where = f"W={self.w}" if self.w else "1 process"
        return f"S={self.s} {mask} {self.dtype} Hkv={self.hkv} {where}"


# ---------------------------------------------------------------------------- worker side


OVERLAP = {"-overlap=kv": "kv", "-overlap=none": "none"}
"""Method suffixes: ringattn with that ``backward_overlap`` (the default, "all", has none)."""
LOWMEM = "-overlap=none"


def _ring_layout(method: str) -> str:
    name = method.removeprefix("ringattn-")
    for suffix in OVERLAP:
        name = name.removesuffix(suffix)
    return name


def _ring_overlap(method: str) -> str:
    return next((v for k, v in OVERLAP.items() if method.endswith(k)), "all")


def _leaves(*ts):
    return [t.detach().contiguous().requires_grad_() for t in ts]


def _local_inputs(p: Point, method: str, group):
    """(q, k, v, dout) of this rank for ``method``, in that method's layout."""
    q, k, v, do = global_inputs(p.s, p.h, p.hkv, p.d, DTYPES[p.dtype])
    if method.startswith("ringattn-"):
        layout = _ring_layout(method)
        with torch.no_grad():
            return tuple(ringattn.shard(t, group=group, layout=layout).contiguous() for t in (q, k, v, do))
    bhsd = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    if method == "torch-ring":
        return tuple(torch_ring.shard(t, group=group, causal=p.causal) for t in bhsd)
    return tuple(bhsd)  # sdpa: the whole sequence


def _fwd_bwd(p: Point, method: str, group):
    """A function (q, k, v, dout) -> (dq, dk, dv) running one forward and backward."""
    if method.startswith("ringattn-"):
        layout = _ring_layout(method)
        overlap = _ring_overlap(method)

        def call(q, k, v, do):
            out = ringattn.ring_attention(q, k, v, group=group, causal=p.causal, layout=layout,
                                          backward_overlap=overlap, seqlen=p.s)
            return torch.autograd.grad(out, (q, k, v), do)
    elif method == "torch-ring":
        def call(q, k, v, do):
            out = torch_ring.torch_ring_attention(q, k, v, group=group, causal=p.causal)
            return torch.autograd.grad(out, (q, k, v), do)
    elif method == "sdpa":
        def call(q, k, v, do):
            # flash only: a silent fall-back to the math backend would materialise S x S
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=p.causal,
                                                     enable_gqa=p.hkv != p.h)
            return torch.autograd.grad(out, (q, k, v), do)
    else:
        raise ValueError(f"unknown method {method!r}")
    return call


def time_task(p: Point, method: str, threads: int = 1) -> list[float]:
    """Every timed iteration's seconds (max over ranks); runs on every rank."""
    group = dist.group.WORLD
    torch.set_num_threads(threads)
    try:
        q, k, v, do = _local_inputs(p, method, group)
        q, k, v = _leaves(q, k, v)
        call = _fwd_bwd(p, method, group)
        return timed(lambda: call(q, k, v, do), iters=p.iters, warmup=p.warmup, group=group)
    finally:
        torch.set_num_threads(1)


def memory_task(p: Point, method: str) -> dict:
    """This rank's peak tensor bytes and RSS high water over one fwd+bwd."""
    group = dist.group.WORLD
    local = _local_inputs(p, method, group)
    call = _fwd_bwd(p, method, group)
    call(*_leaves(*local[:3]), local[3])  # warm-up: lazy initialisation is not the call's memory
    gc.collect()
    dist.barrier(group=group)
    with TensorBytes() as tracker:
        # inputs made inside the measured region, so the peak includes them
        q, k, v, do = (t.clone() for t in local)
        q, k, v = _leaves(q, k, v)
        grads = call(q, k, v, do)
        del q, k, v, do, grads
    dist.barrier(group=group)
    q, k, v = _leaves(*local[:3])
    rss = rss_peak(lambda: call(q, k, v, local[3]))
    return {"tensor_peak_bytes": tracker.peak, "input_bytes": sum(t.nbytes for t in local), **rss}


def check_task(p: Point) -> dict:
    q, k, v, do = global_inputs(p.s, p.h, p.hkv, p.d, DTYPES[p.dtype])
    return torch_ring.self_check(q, k, v, do, causal=p.causal)


# ---------------------------------------------------------------------------- the grid


def _iters(s: int, mode: str) -> tuple[int, int]:
    """(warmup, iters) by sequence length; a call at S=8192 takes seconds on 2 cores.

    Above S=2048 there is no separate warm-up: every (method, W) has already run the same
    call at S=2048 in the same process (points run in order of S), and the median of three
    discounts one slow first iteration, which still shows in the spread.
    """
    if mode == "smoke":
        return 0, 1
    if s <= 2048:
        return 1, 3
    if s <= 8192:
        return 0, 3
    return 0, 1  # S=32768: one call is tens of seconds


def grid(mode: str) -> list[Point]:
    """Ring points (w set); SDPA points are derived from them."""
    pts: list[Point] = []

    def add(ss, ws, causals, hkvs, dtypes):
        for s in ss:
            wu, it = _iters(s, mode)
            for w in ws:
                for causal in causals:
                    for hkv in hkvs:
                        for dt in dtypes:
                            pts.append(Point(s, causal, dt, hkv, w, iters=it, warmup=wu))

    if mode == "smoke":
        add([1024], [1, 2, 4], [True, False], [8, 2], ["fp32"])
        add([1024], [2], [True, False], [2], ["bf16"])
    elif mode == "quick":
        add([2048, 8192], [1, 2, 4], [True, False], [8, 2], ["fp32"])
        add([2048, 8192], [2], [True, False], [2], ["bf16"])
        add([32768], [2], [True], [2], ["fp32"])
    elif mode == "full":
        add([2048, 8192, 32768], [1, 2, 4], [True, False], [8, 2], ["fp32", "bf16"])
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return pts


def ring_methods(w: int, mode: str) -> list[str]:
    layouts = LAYOUTS if (w > 1 or mode == "full") else ("contiguous",)
    return [f"ringattn-{lay}" for lay in layouts] + ["torch-ring"]


def sdpa_points(pts: list[Point], mode: str) -> dict[Point, set[int]]:
    """Single-process points with the thread counts to run each at: 1 and every W.

    ``--quick`` skips the 1-thread run at S=32768 (about a minute, and no target uses it).
    """
    out: dict[Point, set[int]] = {}
    for p in pts:
        threads = out.setdefault(replace(p, w=None), set())
        threads.add(p.w)
        if mode != "quick" or p.s <= 8192:
            threads.add(1)
    return out


def memory_points(mode: str) -> list[Point]:
    """Causal, fp32, H = Hkv = 8 (K/V as large as Q: the worst case for an all-gather)."""
    ss = {"smoke": [1024], "quick": [2048, 8192], "full": [2048, 8192, 32768]}[mode]
    return [Point(s, True, "fp32", 8, w) for s in ss for w in (1, 2, 4)]


# ---------------------------------------------------------------------------- driver


def _record(p: Point, **fields) -> dict:
    return {"S": p.s, "W": p.w, "causal": p.causal, "dtype": p.dtype, "H": p.h, "Hkv": p.hkv,
            "D": p.d, "B": 1, **fields}


def run(mode: str, out_dir: Path, phases: set[str], iters: int | None, warmup: int | None) -> dict:
    pts = grid(mode)
    if iters is not None or warmup is not None:
        pts = [replace(p, iters=p.iters if iters is None else iters,
                       warmup=p.warmup if warmup is None else warmup) for p in pts]
    sdpa = sdpa_points(pts, mode)
    mem = memory_points(mode) if "memory" in phases else []

    # work per world size: (kind, point, method, threads); S ascending inside each world
    work: dict[int, list] = {1: [], 2: [], 4: []}
    if "time" in phases:
        checked = set()
        for p in sorted(pts, key=lambda p: p.s):
            key = (p.w, p.causal, p.hkv)
            if p.dtype == "fp32" and key not in checked:  # smallest S of each (W, mask, Hkv)
                checked.add(key)
                work[p.w].append(("check", p, "torch-ring", 1))
            work[p.w] += [("time", p, m, 1) for m in ring_methods(p.w, mode)]
            if p.w > 1 and p.dtype == "fp32" and p.s <= 8192:  # the memory-lean schedules' cost
                work[p.w].append(("time", p, "ringattn-zigzag" + LOWMEM, 1))
        for p, threads in sorted(sdpa.items(), key=lambda kv: kv[0].s):
            work[1] += [("time", p, "sdpa", t) for t in sorted(threads)]
    mem_work: dict[int, list] = {1: [], 2: [], 4: []}
    for p in mem:
        mem_work[p.w] += [("memory", p, m, 1) for m in
                          ("ringattn-zigzag", *(f"ringattn-zigzag{x}" for x in OVERLAP), "torch-ring")]
        if p.w == 1:
            mem_work[1].append(("memory", replace(p, w=None), "sdpa", 1))

    data = {"machine": machine_info(), "mode": mode, "check_tol": CHECK_TOL,
            "notes": NOTES, "time": [], "memory": [], "check": []}
    out_dir.mkdir(parents=True, exist_ok=True)
    total = sum(map(len, work.values())) + sum(map(len, mem_work.values()))
    t_start = time.monotonic()
    with tqdm(total=total, unit="run", dynamic_ncols=True) as bar:
        for memory, plan in ((False, work), (True, mem_work)):
            for w, items in plan.items():
                if not items:
                    continue
                bar.set_postfix_str(f"starting {w} {'memory ' if memory else ''}rank(s)")
                cluster = Cluster(w, memory=memory)
                try:
                    for kind, p, method, threads in items:
                        bar.set_postfix_str(f"{kind} {method}{f' {threads}t' if method == 'sdpa' else ''} {p.label()}")
                        if kind == "check":
                            errs = cluster.run(check_task, p)
                            worst = max(max(e[n] for n in ("out", "dq", "dk", "dv")) for e in errs)
                            data["check"].append(_record(p, per_rank=errs, max_err=worst,
                                                         ok=worst <= CHECK_TOL))
                            if worst > CHECK_TOL:
                                write_json(out_dir / "attention.json", data)
                                raise RuntimeError(f"torch's ring and ringattn differ by {worst:.2e} "
                                                   f"> {CHECK_TOL} at {p.label()}: {errs}")
                        elif kind == "time":
                            times = cluster.run(time_task, p, method, threads)[0]
                            data["time"].append(_record(p, method=method, threads=threads,
                                                        iters=p.iters, warmup=p.warmup,
                                                        times_s=times, **summary(times)))
                        else:
                            per_rank = cluster.run(memory_task, p, method)
                            data["memory"].append(_record(
                                p, method=method, per_rank=per_rank,
                                max_tensor_peak_bytes=max(r["tensor_peak_bytes"] for r in per_rank),
                                max_vmhwm=max(r["vmhwm"] for r in per_rank),
                                max_rss_delta=max(r["delta"] for r in per_rank)))
                        bar.update(1)
                        write_json(out_dir / "attention.json", data)  # partial results survive a crash
                finally:
                    cluster.close()
    data["elapsed_s"] = round(time.monotonic() - t_start, 1)
    data["targets"] = targets(data)
    write_json(out_dir / "attention.json", data)
    return data


NOTES = {
    "time": "fwd+bwd seconds; each iteration the max over ranks; median, min, max of the "
            "timed iterations after `warmup` untimed ones. W=None: single-process SDPA with "
            "`threads` threads. Ring ranks use one thread each.",
    "memory": "per rank, one fwd+bwd, causal fp32: tensor_peak_bytes = high water of live "
              "tensor storage bytes (TorchDispatchMode; q, k, v, dout cloned inside the "
              "region, so input_bytes is included; kernel-internal scratch is not); vmhwm = "
              "RSS high water (VmHWM after clear_refs=5, malloc_trim(0), "
              "MALLOC_MMAP_THRESHOLD_=65536), delta = vmhwm - rss_before.",
    "check": "max abs difference of out, dq, dk, dv between torch's ring and ringattn "
             "(zigzag causal / contiguous full) on each rank, plus ringattn vs whole-sequence "
             "SDPA (out_vs_sdpa).",
}


# ---------------------------------------------------------------------------- report


def _median(data, method, s, w, causal, hkv=8, dtype="fp32", threads=1):
    for r in data["time"]:
        if (r["method"], r["S"], r["W"], r["causal"], r["Hkv"], r["dtype"], r["threads"]) == \
                (method, s, w, causal, hkv, dtype, threads):
            return r["median_s"]
    return None


def _mem(data, method, s, w):
    for r in data["memory"]:
        if (r["method"], r["S"], r["W"]) == (method, s, w):
            return r["max_tensor_peak_bytes"]
    return None


def targets(data) -> dict:
    """The issue's target ratios, where this run measured both sides (Hkv=8, fp32)."""
    def ratio(a, b):
        return None if a is None or b is None else round(a / b, 3)

    s = 8192
    return {
        "causal S=8192 W=2 ringattn-zigzag / sdpa 2 threads (<= 1.05)": ratio(
            _median(data, "ringattn-zigzag", s, 2, True), _median(data, "sdpa", s, None, True, threads=2)),
        "causal S=8192 W=2 ringattn-zigzag / torch-ring (<= 1.0)": ratio(
            _median(data, "ringattn-zigzag", s, 2, True), _median(data, "torch-ring", s, 2, True)),
        "full S=8192 W=2 ringattn-contiguous / sdpa 2 threads (<= 1.05)": ratio(
            _median(data, "ringattn-contiguous", s, 2, False), _median(data, "sdpa", s, None, False, threads=2)),
        "memory S=8192 W=4 ringattn / torch-ring (<= 0.5)": ratio(
            _mem(data, "ringattn-zigzag", s, 4), _mem(data, "torch-ring", s, 4)),
        "memory S=8192 ringattn W=4 / W=1 (<= 0.35)": ratio(
            _mem(data, "ringattn-zigzag", s, 4), _mem(data, "ringattn-zigzag", s, 1)),
        **{f"memory S=8192 W=4 ringattn backward_overlap={v} / torch-ring (<= 0.5)": ratio(
            _mem(data, f"ringattn-zigzag{x}", s, 4), _mem(data, "torch-ring", s, 4))
           for x, v in OVERLAP.items()},
        **{f"memory S=8192 ringattn backward_overlap={v} W=4 / W=1 (<= 0.35)": ratio(
            _mem(data, f"ringattn-zigzag{x}", s, 4), _mem(data, f"ringattn-zigzag{x}", s, 1))
           for x, v in OVERLAP.items()},
    }


STYLE = {"ringattn-contiguous": ("tab:blue", "o"), "ringattn-zigzag": ("tab:orange", "s"),
         "ringattn-striped": ("tab:green", "^"), "torch-ring": ("tab:red", "D"),
         "ringattn-zigzag-overlap=kv": ("tab:purple", "v"),
         "ringattn-zigzag-overlap=none": ("tab:brown", "<"),
         "sdpa 1 thread": ("0.55", "x"), "sdpa W threads": ("black", "+")}


def plot_time(data, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = sorted({r["W"] for r in data["time"] if r["W"] is not None})
    fig, axes = plt.subplots(2, len(ws), figsize=(4.6 * len(ws), 8), sharex=True, squeeze=False)
    for row, causal in enumerate((True, False)):
        for col, w in enumerate(ws):
            ax = axes[row][col]
            for hkv, ls in ((8, "-"), (2, "--")):
                series = {}
                for r in data["time"]:
                    if r["causal"] != causal or r["Hkv"] != hkv or r["dtype"] != "fp32":
                        continue
                    if r["W"] == w:
                        name = r["method"]
                    elif r["W"] is None and r["threads"] == 1:
                        name = "sdpa 1 thread"
                    elif r["W"] is None and r["threads"] == w and w > 1:
                        name = "sdpa W threads"
                    else:
                        continue
                    series.setdefault(name, []).append((r["S"], r["median_s"], r["min_s"], r["max_s"]))
                for name, pts in sorted(series.items()):
                    pts.sort()
                    xs, med, lo, hi = zip(*pts)
                    color, marker = STYLE[name]
                    ax.errorbar(xs, med, yerr=[[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]],
                                color=color, marker=marker, ls=ls, ms=5, capsize=2,
                                label=name if hkv == 8 else "_nolegend_")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{'causal' if causal else 'full'}, W={w}")
            ax.grid(True, which="both", alpha=0.3)
            if col == 0:
                ax.set_ylabel("fwd+bwd time (s), median, bars: min..max")
            if row == 1:
                ax.set_xlabel("global sequence length S")
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    order = [n for n in STYLE if n in handles]
    fig.legend([handles[n] for n in order], order, loc="lower center", ncol=len(order), fontsize=8)
    m = data["machine"]
    fig.suptitle(f"Attention fwd+bwd, fp32, B=1 H=8 D=64 (solid Hkv=8, dashed Hkv=2); "
                 f"torch {m['torch']}, {m['nproc']} cores, {m['date'][:10]}", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(data, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = {1: "tab:blue", 2: "tab:orange", 4: "tab:green"}
    for ax, key, title in ((axes[0], "tensor_peak_bytes", "peak live tensor bytes per rank"),
                           (axes[1], "delta", "RSS high water over RSS before, per rank")):
        for method, ls, marker in (("ringattn-zigzag", "-", "o"), ("ringattn-zigzag-overlap=kv", "-.", "v"),
                                   ("ringattn-zigzag-overlap=none", (0, (1, 1)), "<"),
                                   ("torch-ring", "--", "D"), ("sdpa", ":", "x")):
            by_w: dict = {}
            for r in data["memory"]:
                if r["method"] == method:
                    by_w.setdefault(r["W"], []).append((r["S"], max(x[key] for x in r["per_rank"])))
            for w, pts in sorted(by_w.items(), key=lambda kv: kv[0] or 0):
                pts.sort()
                xs, ys = zip(*pts)
                label = f"{method} W={w}" if w else "sdpa, 1 process"
                ax.plot(xs, [y / 2**20 for y in ys], ls=ls, marker=marker,
                        color=colors.get(w, "0.4"), label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("global sequence length S")
        ax.set_ylabel("MiB (max over ranks)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    m = data["machine"]
    fig.suptitle(f"Per-rank peak memory, fwd+bwd, causal fp32 B=1 H=Hkv=8 D=64; "
                 f"torch {m['torch']}, {m['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(data) -> None:
    rows = {}
    for r in data["time"]:
        key = (r["S"], r["causal"], r["dtype"], r["Hkv"])
        name = r["method"] + (f"@{r['W']}" if r["W"] else f"{r['threads']}t")
        rows.setdefault(key, []).append(f"{name}={r['median_s']:.3g}")
    print("\nfwd+bwd median seconds (method@W, sdpa<threads>t):")
    for (s, causal, dt, hkv), cells in sorted(rows.items()):
        print(f"  S={s} {'causal' if causal else 'full'} {dt} Hkv={hkv}: " + ", ".join(cells))
    if data["memory"]:
        print("peak tensor MiB per rank (max over ranks) / RSS delta MiB:")
        for r in data["memory"]:
            print(f"  {r['method']} S={r['S']} W={r['W']}: {r['max_tensor_peak_bytes'] / 2**20:.1f}"
                  f" / {r['max_rss_delta'] / 2**20:.1f}")
    if data["check"]:
        print(f"torch ring vs ringattn, worst max abs error: {max(c['max_err'] for c in data['check']):.2e}")
    print("targets:", *(f"  {k}: {v}" for k, v in data.get("targets", {}).items()), sep="\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="mode", action="store_const", const="quick",
                   help="S in {2048, 8192} fully, S=32768 causal fp32 Hkv=2 W=2 once (default)")
    g.add_argument("--full", dest="mode", action="store_const", const="full", help="the whole grid")
    g.add_argument("--smoke", dest="mode", action="store_const", const="smoke",
                   help="S=1024, 1 iteration: checks that everything runs")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"output folder (default {RESULTS}, {RESULTS / 'smoke'} for --smoke)")
    ap.add_argument("--phases", default="time,memory", help="comma list of time, memory")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (default by S)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed iterations (default by S)")
    args = ap.parse_args(argv)
    mode = args.mode or "quick"
    out = args.out or (RESULTS / "smoke" if mode == "smoke" else RESULTS)
    phases = set(args.phases.split(","))
    if not phases <= {"time", "memory"}:
        ap.error(f"--phases takes time and/or memory, got {args.phases!r}")
    data = run(mode, out, phases, args.iters, args.warmup)
    if data["time"]:
        plot_time(data, out / "attention_time.png")
    if data["memory"]:
        plot_memory(data, out / "memory.png")
    print_table(data)
    print(f"wrote {out / 'attention.json'} in {data['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
