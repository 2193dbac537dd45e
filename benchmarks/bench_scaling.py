"""Longest sequence that fits a per-process tensor-memory cap, and time per token vs S.

Legend: S global seq, L local seq (S / W), H heads, D head dim, W world size.

For each method, S grows by about 1.5x from ``--start`` until one fwd+bwd no longer fits: the run is
made under ``common.TensorBytes(cap=...)``, which raises as soon as the live tensor bytes
of a process (inputs q, k, v, dout cloned inside, outputs, gradients, every intermediate)
exceed the cap. Every S that fits is then timed without the tracker (median of
``--iters``). Small heads (H=2, D=32) keep each run short; memory is linear in S*H*D, so the
longest S scales with the cap. Methods:

* ``ringattn``: ringattn W=4 ranks (one thread each), causal zigzag;
* ``ringattn-lean``: the same with ``backward_overlap="none"``;
* ``torch-ring``: PyTorch's ring on the same ranks (head-tail shards), for reference;
* ``sdpa``: torch SDPA over the whole sequence in one process (``--sdpa-threads``, default
  every core).

A rank that exceeds the cap leaves its peers waiting in a collective; the parent then ends
that world's processes and starts the next method in fresh ones.

Writes ``<out>/scaling.json`` and ``scaling.png``.

    python benchmarks/bench_scaling.py            # cap 32 MiB, H=2, D=32 (about 2.5 min)
    python benchmarks/bench_scaling.py --smoke    # cap 1 MiB, from S=256
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

import bench_attention as ba
from common import (RESULTS, Cluster, RankFailure, TensorBytes, machine_info, summary,
                    write_json)

METHODS = {"ringattn": "ringattn-zigzag", "ringattn-lean": "ringattn-zigzag" + ba.LOWMEM,
           "torch-ring": "torch-ring", "sdpa": "sdpa"}


GROWTH = 1.5
"""Each S is about 1.5x the previous one (doubling cannot tell apart methods within 2x)."""


def next_len(s: int, multiple: int = 64) -> int:
    """The next S to try: ~GROWTH x s, a multiple of ``multiple`` (zigzag needs 2W | S)."""
    return max(s + multiple, round(s * GROWTH / multiple) * multiple)


def capped_task(p: ba.Point, method: str, cap: int) -> int:
    """Peak live tensor bytes of one fwd+bwd on this rank; raises past ``cap``."""
    group = dist.group.WORLD
    local = ba._local_inputs(p, method, group)
    call = ba._fwd_bwd(p, method, group)
    with TensorBytes(cap=cap) as tracker:
        q, k, v, do = (t.clone() for t in local)
        q, k, v = ba._leaves(q, k, v)
        call(q, k, v, do)
    return tracker.peak


def _cap_exceeded(err: RankFailure) -> bool:
    return any("TensorMemoryCapExceeded" in tb for tb in err.failed.values())


def run(args, out_dir: Path) -> dict:
    cap = int(args.cap_mib * 2**20)
    data = {"machine": machine_info(), "cap_bytes": cap, "H": args.heads, "Hkv": args.heads,
            "D": args.head_dim, "B": 1, "causal": True, "dtype": "fp32", "world": args.world,
            "sdpa_threads": args.sdpa_threads, "iters": args.iters, "warmup": args.warmup,
            "results": {}}
    t0 = time.monotonic()
    bar = tqdm(unit="run", dynamic_ncols=True)
    for name in args.methods:
        method = METHODS[name]
        w = 1 if name == "sdpa" else args.world
        threads = args.sdpa_threads if name == "sdpa" else 1
        rec = data["results"][name] = {"method": method, "W": w, "threads": threads,
                                       "points": [], "max_s": None, "failed_at": None}
        bar.set_postfix_str(f"starting {w} rank(s) for {name}")
        cluster = Cluster(w)
        try:
            s = args.start
            while s <= args.max_s:
                p = ba.Point(s, True, "fp32", args.heads, w if name != "sdpa" else None,
                             h=args.heads, d=args.head_dim, iters=args.iters, warmup=args.warmup)
                bar.set_postfix_str(f"{name} S={s} under the cap")
                try:
                    peaks = cluster.run(capped_task, p, method, cap)
                except RankFailure as err:
                    if not _cap_exceeded(err):
                        raise
                    rec["failed_at"] = {"S": s, "ranks": sorted(err.failed),
                                        "error": next(iter(err.failed.values())).strip().splitlines()[-1]}
                    bar.update(1)
                    break
                bar.update(1)
                bar.set_postfix_str(f"{name} S={s} timing")
                times = cluster.run(ba.time_task, p, method, threads)[0]
                bar.update(1)
                rec["points"].append({"S": s, "peak_bytes_per_rank": peaks, "times_s": times,
                                      **summary(times), "s_per_token": summary(times)["median_s"] / s})
                rec["max_s"] = s
                write_json(out_dir / "scaling.json", data)
                s = next_len(s)
        finally:
            cluster.close()
    bar.close()
    data["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(out_dir / "scaling.json", data)
    return data


def plot(data, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = {"ringattn": "tab:orange", "ringattn-lean": "tab:purple", "torch-ring": "tab:red",
              "sdpa": "black"}
    cap_mib = data["cap_bytes"] / 2**20
    for name, rec in data["results"].items():
        if not rec["points"]:
            continue
        xs = [pt["S"] for pt in rec["points"]]
        who = f"{name} W={rec['W']}" if name != "sdpa" else f"sdpa, 1 process, {rec['threads']} threads"
        fail = rec["failed_at"]
        label = f"{who}: max S={rec['max_s']}" + (f" (S={fail['S']} over cap)" if fail else "")
        ax_t.plot(xs, [pt["s_per_token"] * 1e6 for pt in rec["points"]], marker="o",
                  color=colors[name], label=label)
        ax_m.plot(xs, [max(pt["peak_bytes_per_rank"]) / 2**20 for pt in rec["points"]], marker="o",
                  color=colors[name], label=who)
    ax_m.axhline(cap_mib, color="0.5", ls="--", label=f"cap {cap_mib:g} MiB")
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global sequence length S")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("fwd+bwd time per token (us), median")
    ax_m.set_yscale("log", base=2)
    ax_m.set_ylabel("peak live tensor MiB per process")
    m = data["machine"]
    fig.suptitle(f"Longest S under a {cap_mib:g} MiB per-process tensor cap; causal fp32 B=1 "
                 f"H={data['H']} D={data['D']}; torch {m['torch']}, {m['nproc']} cores, "
                 f"{m['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="cap 1 MiB from S=256, 1 iteration")
    ap.add_argument("--cap-mib", type=float, default=32.0, help="per-process tensor cap (MiB)")
    ap.add_argument("--heads", type=int, default=2, help="H = Hkv")
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--world", type=int, default=4, help="ranks for the ring methods")
    ap.add_argument("--sdpa-threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--start", type=int, default=1024)
    ap.add_argument("--max-s", type=int, default=2**20, help="stop growing S here even if it fits")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--methods", default="sdpa,ringattn,ringattn-lean,torch-ring",
                    help=f"comma list of {', '.join(METHODS)}")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"output folder (default {RESULTS}, {RESULTS / 'smoke'} for --smoke)")
    args = ap.parse_args(argv)
    args.methods = args.methods.split(",")
    if unknown := set(args.methods) - set(METHODS):
        ap.error(f"unknown methods {sorted(unknown)}; choose from {sorted(METHODS)}")
    if args.smoke:
        args.cap_mib, args.start, args.iters, args.warmup = 1.0, 256, 1, 0
    if args.start % (2 * args.world):
        ap.error(f"--start {args.start} must divide into 2 * {args.world} zigzag chunks")
    out = args.out or (RESULTS / "smoke" if args.smoke else RESULTS)
    data = run(args, out)
    plot(data, out / "scaling.png")
    for name, rec in data["results"].items():
        fail = rec["failed_at"]
        print(f"{name} (W={rec['W']}, {rec['threads']} thread(s)): longest S = {rec['max_s']}"
              + (f"; S={fail['S']} exceeded the cap on rank(s) {fail['ranks']}" if fail else ""))
        for pt in rec["points"]:
            print(f"   S={pt['S']}: {pt['median_s'] * 1e3:.1f} ms, {pt['s_per_token'] * 1e6:.2f} us/token, "
                  f"peak {max(pt['peak_bytes_per_rank']) / 2**20:.2f} MiB")
    print(f"wrote {out / 'scaling.json'} in {data['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
