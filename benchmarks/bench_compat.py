"""What the compat entry points cost over the native calls they wrap.

Legend: B batch, S global seq, T packed tokens, H heads, Hkv kv heads, D head dim, W world.

On W=2 gloo ranks, fp32, H=8, Hkv=4, D=64, causal, fwd+bwd: each pair below runs the same
inputs through the compat function and through the ringattn call it maps to, alternating
(one compat step, one native step, ...) so that drifting machine load falls on both; the
ratio is median(compat) / median(native), each step the max over ranks.

* ``zigzag_ring_flash_attn_func`` vs ``ra.ring_attention(layout="zigzag")`` (B=1, S=4096)
* ``stripe_flash_attn_qkvpacked_func`` vs ``ra.ring_attention(layout="striped")``
* ``zigzag_ring_flash_attn_varlen_func`` vs ``ra.ring_attention(cu_seqlens=...)`` (T=4096,
  documents of 1024, 2048, 1024)
* ``llama3_flash_attn_varlen_func`` vs ``ra.allgather_attention(layout="contiguous",
  heads_k_stride=1)``
* ``ra.varlen_attention`` vs ``ra.ring_attention(cu_seqlens=...)``
* ``compat.yunchang.UlyssesAttention`` vs ``ra.ulysses_attention`` (when importable)

    python benchmarks/bench_compat.py            # about 2 minutes

Writes results/compat.json and results/compat.png.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from common import RESULTS, Cluster, machine_info, write_json

S, H, HKV, D = 4096, 8, 4, 64
CU = [0, 1024, 3072, 4096]


def _max_over_ranks(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def pairs(iters: int) -> dict:
    """Rank side: {name: (compat seconds, native seconds)} medians of alternating steps."""
    import time

    import ringattn as ra
    from ringattn.compat import ring_flash_attn as rfa

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)

    def leaves(*shapes):
        return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]

    n = S // world
    q, k, v = leaves((1, n, H, D), (1, n, HKV, D), (1, n, HKV, D))
    qkv = torch.randn(1, n, 3, H, D, generator=g).requires_grad_()
    tq, tk, tv = leaves((n, H, D), (n, HKV, D), (n, HKV, D))
    local_cu = torch.tensor(CU, dtype=torch.int32) // world
    prepared = rfa.llama3_flash_attn_prepare_cu_seqlens(torch.tensor(CU), True, rank, world)

    def zero(*ts):
        for t in ts:
            t.grad = None

    cases = {
        "zigzag_ring_flash_attn_func": (
            lambda: rfa.zigzag_ring_flash_attn_func(q, k, v, causal=True),
            lambda: ra.ring_attention(q, k, v, causal=True, layout="zigzag", seqlen=S), (q, k, v)),
        "stripe_flash_attn_qkvpacked_func": (
            lambda: rfa.stripe_flash_attn_qkvpacked_func(qkv, causal=True),
            lambda: ra.ring_attention(*qkv.unbind(2), causal=True, layout="striped", seqlen=S),
            (qkv,)),
        "zigzag_ring_flash_attn_varlen_func": (
            lambda: rfa.zigzag_ring_flash_attn_varlen_func(tq, tk, tv, local_cu, 2048 // world,
                                                           causal=True),
            lambda: ra.ring_attention(tq[None], tk[None], tv[None], causal=True, cu_seqlens=CU)[0],
            (tq, tk, tv)),
        "llama3_flash_attn_varlen_func": (
            lambda: rfa.llama3_flash_attn_varlen_func(tq, tk, tv, *prepared[:4], 1, prepared[4],
                                                      causal=True),
            lambda: ra.allgather_attention(tq[None], tk[None], tv[None], causal=True,
                                           cu_seqlens=CU, layout="contiguous",
                                           heads_k_stride=1)[0], (tq, tk, tv)),
        "ra.varlen_attention": (
            lambda: ra.varlen_attention(tq, tk, tv, CU, CU, 2048, 2048, causal=True),
            lambda: ra.ring_attention(tq[None], tk[None], tv[None], causal=True, cu_seqlens=CU)[0],
            (tq, tk, tv)),
    }
    try:
        from ringattn.compat import yunchang as yc

        if hasattr(yc, "UlyssesAttention"):
            uly = yc.UlyssesAttention()
            cases["yunchang.UlyssesAttention"] = (
                lambda: uly(q, k, v, causal=True),
                lambda: ra.ulysses_attention(q, k, v, causal=True, layout="contiguous",
                                             seqlen=S),
                (q, k, v))
    except ImportError:
        pass
    out = {}
    for name, (compat, native, ts) in cases.items():
        times = {"compat": [], "native": []}
        for i in range(2 + iters):
            for which, fn in (("compat", compat), ("native", native)):
                zero(*ts)
                dist.barrier()
                t0 = time.perf_counter()
                fn().square().sum().backward()
                seconds = _max_over_ranks(time.perf_counter() - t0)
                if i >= 2:
                    times[which].append(seconds)
        out[name] = (statistics.median(times["compat"]), statistics.median(times["native"]))
    return out


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    ratios = [results[n]["compat / native"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.5 * len(names)))
    ax.barh(names, ratios, color="tab:blue")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.axvline(1.05, color="tab:red", lw=0.8, ls="--", label="1.05 (the target)")
    ax.set_xlabel("compat / native time, fwd+bwd (W=2 gloo, fp32)")
    ax.set_xlim(0.8, max(1.2, max(ratios) + 0.05))
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=9)
    args = ap.parse_args()
    cluster = Cluster(2)
    try:
        per = cluster.run(pairs, args.iters, timeout=1800)[0]
    finally:
        cluster.close()
    results = {name: {"compat_s": c, "native_s": n, "compat / native": c / n}
               for name, (c, n) in per.items()}
    for name, r in results.items():
        print(f"{name:38s} {r['compat / native']:.3f}x  ({r['compat_s'] * 1e3:.1f} ms vs "
              f"{r['native_s'] * 1e3:.1f} ms)", flush=True)
    write_json(RESULTS / "compat.json", {"machine": machine_info(), "iters": args.iters,
                                         "shape": dict(S=S, H=H, Hkv=HKV, D=D, W=2, cu=CU),
                                         "pairs": results})
    plot(results, RESULTS / "compat.png")


if __name__ == "__main__":
    main()
