"""Host time of one ring_attention call at tiny shapes, against its unavoidable ring hops.

Legend: B batch, S global seq, H heads, Hkv kv heads, D head dim, W world size.

On W=2 gloo ranks (one thread each), fp32, B=1, S=64, H=4, Hkv=4, D=32, causal, zigzag:
the compute is negligible, so a call's time is its host work and its communication. Timed
per call (median over ``--iters`` calls after warm-up, each the max over ranks, a barrier
before each):

* ``forward``: ``ring_attention`` without gradients;
* ``forward+backward``: with gradients and ``backward()``;
* ``hops``: the hops those calls cannot avoid, alone (the same buffers, ``RingComm.hop``):
  the forward's K/V hop; for forward+backward also the backward's K/V hop and the two
  dK/dV hops (on to the next rank, then home);
* ``agreement``: ``comm.agree`` with the call's fields alone (one exchange);
* ``local``: what remains of a forward call without communication: validation, plan
  lookup, the kernels and merges (the same call on a one-rank group of this process).

The issue's target is forward <= 1.5x its hops. Writes results/host.json. With
``--profile``, rank 0's forward calls run under cProfile and the functions with the most
time of their own are printed.

    python benchmarks/bench_host.py            # 300 calls each, about 1 minute
    python benchmarks/bench_host.py --profile  # and where a forward call's time goes
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from common import RESULTS, Cluster, machine_info, timed, write_json

S, H, D = 64, 4, 32


def measure(iters: int):
    """Rank side: {what: median seconds per call} (max over ranks)."""
    import ringattn as ra
    from ringattn.comm import RingComm, agree

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v = (ra.shard(torch.randn(1, S, H, D, generator=g), seqlen=S) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    comm = RingComm(dist.group.WORLD)
    kv = torch.cat([k, v], dim=3)
    spare = torch.empty_like(kv)
    fields = dict.fromkeys([f"f{i}" for i in range(30)], 7)
    singles = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    mine = singles[rank]

    def forward():
        with torch.no_grad():
            ra.ring_attention(q, k, v, causal=True, seqlen=S)

    def forward_backward():
        for t in leaves:
            t.grad = None
        ra.ring_attention(*leaves, causal=True, seqlen=S).sum().backward()

    def hops_forward():
        comm.hop(kv, spare, RingComm.KV_TAG).wait()

    def hops_backward():  # the forward's K/V hop, the backward's, dK/dV on and home
        comm.hop(kv, spare, RingComm.KV_TAG).wait()
        comm.hop(kv, spare, RingComm.KV_TAG).wait()
        comm.hop(kv, spare, RingComm.GRAD_TAG).wait()
        comm.hop(kv, spare, RingComm.GRAD_TAG, -1).wait()

    def agreement():
        agree(dist.group.WORLD, fields, None)

    ql = torch.randn(q.shape, generator=g)  # a plain tensor: the one-rank call's whole S

    def local():
        with torch.no_grad():
            ra.ring_attention(ql, ql, ql, causal=True, seqlen=ql.shape[1], group=mine)

    out = {}
    for name, fn in (("forward", forward), ("forward+backward", forward_backward),
                     ("hops (forward)", hops_forward), ("hops (forward+backward)", hops_backward),
                     ("agreement", agreement), ("local (one-rank call)", local)):
        out[name] = statistics.median(timed(fn, iters=iters, warmup=20))
    return out


def profile(iters: int) -> str:
    """Rank side: cProfile of ``iters`` forward calls (printed for rank 0)."""
    import cProfile
    import io
    import pstats

    import ringattn as ra

    g = torch.Generator().manual_seed(0)
    q, k, v = (ra.shard(torch.randn(1, S, H, D, generator=g), seqlen=S) for _ in range(3))

    def forward():
        with torch.no_grad():
            ra.ring_attention(q, k, v, causal=True, seqlen=S)

    for _ in range(20):
        forward()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        forward()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    return text.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    cluster = Cluster(2)
    try:
        if args.profile:
            print(cluster.run(profile, args.iters, timeout=1200)[0])
        res = cluster.run(measure, args.iters, timeout=1200)[0]
    finally:
        cluster.close()
    ratio = {"forward / its hops": res["forward"] / res["hops (forward)"],
             "forward+backward / its hops": res["forward+backward"] / res["hops (forward+backward)"]}
    for name, t in res.items():
        print(f"{name:26s} {t * 1e3:7.3f} ms")
    for name, r in ratio.items():
        print(f"{name:26s} {r:7.2f}x (target 1.5x)")
    write_json(RESULTS / "host.json", {"machine": machine_info(),
                                       "shape": dict(B=1, S=S, H=H, Hkv=H, D=D, W=2),
                                       "iters": args.iters, "seconds": res, "ratios": ratio})


if __name__ == "__main__":
    main()
