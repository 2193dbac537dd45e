"""What ``strategy="auto"`` picks on 8 nodes x 8 H100s, by its cost model (no GPU involved).

The machine is given, not measured: per GPU 400 TFLOP/s of attention (bf16, fwd and bwd
alike), NVLink within a node (350 GB/s per direction per GPU, 10 us per collective), one
400 Gb/s InfiniBand NIC per GPU across nodes (45 GB/s, 25 us). The mesh is 8 (ring, across
nodes) x 8 (ulysses, within a node); the one-dimensional strategies run over all 64 GPUs.
Calls: B=1, bf16, causal, zigzag, forward + backward, for a Llama-3-8B-like attention
(H=32, Hkv=8, D=128) and a 70B-like one (H=64, Hkv=8, D=128), and packed documents of 8K
tokens for the 8B one.

    python benchmarks/strategy_table.py      # a second or two; prints the markdown table

Writes results/strategy_table.json.
"""

from __future__ import annotations

from common import RESULTS, write_json

from ringattn import CostModel, Link
from ringattn.strategies.auto import CallShape, choose, estimate
from ringattn.layouts import Zigzag, get_layout

H100_8x8 = CostModel(flops=400e12, inner=Link(350e9, 10e-6), outer=Link(45e9, 25e-6))
MODELS = {"8B (H=32, Hkv=8)": (32, 8), "70B (H=64, Hkv=8)": (64, 8)}
LENGTHS = (131072, 262144, 524288, 1048576)


def rows():
    out = []
    cases = [(name, heads, False) for name, heads in MODELS.items()]
    cases.append(("8B, 8K-token documents", MODELS["8B (H=32, Hkv=8)"], True))
    for name, (h, hkv), docs in cases:
        for s in LENGTHS:
            cu = tuple(range(0, s + 1, 8192)) if docs else None
            lay = get_layout("zigzag", cu) if docs else Zigzag()
            shape = CallShape(1, s, h, hkv, 128, 128, 2, True, lay, True, (-1, -1), cu, (8, 8), 64)
            est = estimate(shape, H100_8x8)
            out.append({"model": name, "seqlen": s, "choice": choose(shape, H100_8x8),
                        **{k: {"total_ms": e.total * 1e3, "compute_ms": e.compute * 1e3,
                               "comm_ms": e.comm * 1e3} for k, e in est.items()}})
    return out


def markdown(table) -> str:
    names = ("ring", "ulysses", "allgather", "hybrid")
    lines = ["| attention | S | " + " | ".join(f"{n} ms (exposed comm)" for n in names)
             + " | auto picks |", "|---|---|" + "---|" * (len(names) + 1)]
    for r in table:
        cells = [f"{r[n]['total_ms']:.1f} ({r[n]['comm_ms']:.1f})" for n in names]
        lines.append(f"| {r['model']} | {r['seqlen'] // 1024}K | " + " | ".join(cells)
                     + f" | **{r['choice']}** |")
    return "\n".join(lines)


def main():
    table = rows()
    write_json(RESULTS / "strategy_table.json", {"machine": repr(H100_8x8), "rows": table})
    print(markdown(table))


if __name__ == "__main__":
    main()
