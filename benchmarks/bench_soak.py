"""Soak: many forward+backward calls with new batches on 2 gloo ranks; RSS must stay flat.

Legend: B batch, S global seq, H heads, Hkv kv heads, D head dim, W world size.

Each rank makes ``--calls`` ring_attention forward+backward calls (fp32, B=1, S=2048, H=4,
Hkv=2, D=32, zigzag), every call on new random inputs, in three workloads:

* ``causal``: the plain causal mask (plans are analytic, nothing is cached per batch);
* ``documents``: packed documents with new random ``cu_seqlens`` every call (a new
  general-mask plan per batch: the plan cache must stay bounded);
* ``function-mask``: a new ``masks.from_function`` object every call for the same mask
  (the case that used to hold hundreds of MiB: every new object is planned and cached
  apart; the cache is bounded by bytes and says so once).

Every rank reads its resident set (VmRSS) every ``--every`` calls. The figure that matters
is the growth after warm-up: RSS at the end minus RSS after the first ``--warmup`` calls,
per rank (printed, and in ``soak.json``); ``soak.png`` plots RSS against calls.

    python benchmarks/bench_soak.py                # 1000 calls per workload, about 4 minutes
    python benchmarks/bench_soak.py --smoke        # 60 calls, checks the script
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist

import ringattn as ra
from common import RESULTS, Cluster, _proc_status_kib, machine_info, write_json

S, H, HKV, D = 2048, 4, 2, 32
WORKLOADS = ("causal", "documents", "function-mask")


def _docs(g) -> list[int]:
    cuts = sorted(set(torch.randint(1, S, (int(torch.randint(2, 12, (1,), generator=g)),),
                                    generator=g).tolist()))
    return [0, *cuts, S]


def soak(workload: str, calls: int, every: int, seed: int):
    """Rank side: (call index, VmRSS bytes) samples, and seconds per call."""
    g = torch.Generator().manual_seed(seed)  # the same draws on every rank
    samples = []
    t0 = time.perf_counter()
    for i in range(calls):
        q, k, v, dout = (torch.randn(1, S, h, D, generator=g) for h in (H, HKV, HKV, H))
        kw = dict(causal=True, seqlen=S)
        if workload == "documents":
            kw["cu_seqlens"] = _docs(g)
        if workload == "function-mask":
            kw["mask"] = ra.masks.from_function(lambda b, hh, qq, kv: (qq - kv) % 5 != 3)
        ql, kl, vl = (ra.shard(t, seqlen=S, cu_seqlens=kw.get("cu_seqlens")).requires_grad_()
                      for t in (q, k, v))
        out = ra.ring_attention(ql, kl, vl, **kw)
        out.backward(ra.shard(dout, seqlen=S, cu_seqlens=kw.get("cu_seqlens")))
        del q, k, v, dout, ql, kl, vl, out
        if (i + 1) % every == 0 or i == 0:
            gc.collect()
            samples.append((i + 1, _proc_status_kib("VmRSS") * 1024))
    dist.barrier()
    return {"samples": samples, "seconds_per_call": (time.perf_counter() - t0) / calls,
            "plan_cache_mib": ra.plan.PLAN_CACHE.bytes() / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.calls, args.every, args.warmup = 60, 10, 20
    out_dir = RESULTS / ("smoke" if args.smoke else "")
    result = {"machine": machine_info(), "shape": dict(B=1, S=S, H=H, Hkv=HKV, D=D, W=2),
              "calls": args.calls, "warmup": args.warmup, "workloads": {}}
    cluster = Cluster(2)
    try:
        for n, workload in enumerate(WORKLOADS):
            per_rank = cluster.run(soak, workload, args.calls, args.every, n, timeout=3600)
            growth = []
            for r in per_rank:
                at = dict(r["samples"])
                base = max(c for c in at if c <= args.warmup)
                growth.append(at[max(at)] - at[base])
            result["workloads"][workload] = {"per_rank": per_rank, "growth_bytes": growth}
            print(f"{workload:14s} RSS after warm-up ({args.warmup} calls) -> after "
                  f"{args.calls}: " + ", ".join(
                      f"rank {i} {dict(r['samples'])[max(c for c, _ in r['samples'] if c <= args.warmup)] / 2**20:.1f} -> "
                      f"{r['samples'][-1][1] / 2**20:.1f} MiB ({g / 2**20:+.1f})"
                      for i, (r, g) in enumerate(zip(per_rank, growth)))
                  + f"; {per_rank[0]['seconds_per_call'] * 1e3:.1f} ms/call, plan cache "
                    f"{per_rank[0]['plan_cache_mib']:.1f} MiB", flush=True)
    finally:
        cluster.close()
    write_json(out_dir / "soak.json", result)
    plot(result, out_dir / "soak.png")


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for workload, data in result["workloads"].items():
        for rank, r in enumerate(data["per_rank"]):
            calls, rss = zip(*r["samples"])
            ax.plot(calls, [x / 2**20 for x in rss], label=f"{workload}, rank {rank}",
                    linestyle="-" if rank == 0 else "--")
    ax.axvline(result["warmup"], color="grey", linewidth=0.8)
    ax.set_xlabel("forward+backward calls (new inputs each)")
    ax.set_ylabel("VmRSS per rank (MiB)")
    s = result["shape"]
    ax.set_title(f"ringattn soak: W={s['W']}, S={s['S']}, H={s['H']}, Hkv={s['Hkv']}, D={s['D']}, fp32")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
