"""What torch.compile costs each strategy: fwd+bwd eager against compiled.

Legend: B batch, S global seq, H heads, Hkv kv heads, D head dim, W world size.

On W=2 gloo ranks, fp32, B=1, S=4096, H=Hkv=8, D=64, causal, zigzag: a function calling
``ring_attention``, ``ulysses_attention`` or ``allgather_attention``, run eagerly and as
``torch.compile(fullgraph=True, backend="aot_eager")``; median of ``--iters`` fwd+bwd after
2 warm-ups, each the max over ranks. Compiled and eager results are compared first (max
relative difference of out and the gradients; they run the same kernels).

    python benchmarks/bench_compile.py          # about 1 minute

Writes results/compile.json.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from common import RESULTS, Cluster, machine_info, timed, write_json

S = 4096
STRATEGIES = ("ring_attention", "ulysses_attention", "allgather_attention")


def compare(strategy: str, iters: int) -> dict:
    """Rank side: {"eager": s, "compiled": s, "max_rel_diff": x}."""
    import ringattn as ra

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (ra.shard(torch.randn(1, S, 8, 64, generator=g), seqlen=S) for _ in range(4))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    attend = getattr(ra, strategy)

    def f(a, b, c):
        return attend(a, b, c, causal=True, seqlen=S)

    result, seen = {}, []
    for name, fn in (("eager", f), ("compiled", torch.compile(f, fullgraph=True, backend="aot_eager"))):
        def step(fn=fn):
            for t in leaves:
                t.grad = None
            out = fn(*leaves)
            out.backward(do)
            return out

        out = step()
        seen.append([out.detach()] + [t.grad.clone() for t in leaves])
        result[name] = statistics.median(timed(step, iters=iters, warmup=2))
    result["max_rel_diff"] = max(float((a - b).norm() / b.norm()) for a, b in zip(*seen))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    cluster = Cluster(2)
    out = {"machine": machine_info(), "shape": dict(B=1, S=S, H=8, Hkv=8, D=64, W=2),
           "strategies": {}}
    try:
        for name in STRATEGIES:
            r = max(cluster.run(compare, name, args.iters, timeout=900),
                    key=lambda x: x["compiled"])
            r["compiled / eager"] = r["compiled"] / r["eager"]
            out["strategies"][name] = r
            print(f"{name:20s} eager {r['eager']:.3f} s, compiled {r['compiled']:.3f} s: "
                  f"{r['compiled / eager']:.2f}x (max relative difference {r['max_rel_diff']:.1e})",
                  flush=True)
    finally:
        cluster.close()
    write_json(RESULTS / "compile.json", out)


if __name__ == "__main__":
    main()
