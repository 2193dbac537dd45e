"""What the score modifications cost: ring_attention fwd+bwd with soft-capping, sinks or ALiBi
against the same call without, on one rank (so the kernel, not communication, is measured).

Soft-capping and ALiBi run on the pure-torch reference kernel (no fused op computes them);
sinks are folded into the final lse after the fused kernels. Paired rounds (every round
times each variant once, back to back; round 0 warms up and is dropped): fp32, causal,
S=4096, B=1, H=8, Hkv=2, D=64, one compute thread.

    python benchmarks/bench_features.py            # 5 rounds, about 1.5 minutes
    python benchmarks/bench_features.py --smoke    # S=1024, 1 round

Writes results/features.json and results/features.png.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from common import RESULTS, Cluster, global_inputs, machine_info, timed, write_json

VARIANTS = {
    "plain": {},
    "softcap": {"softcap": 30.0},
    "sinks": {"sinks": True},
    "alibi": {"alibi_slopes": [2.0 ** -(i + 1) for i in range(8)]},
}


def time_task(name, s):
    """Rank side: seconds of one fwd+bwd of ``VARIANTS[name]``."""
    import ringattn as ra

    q, k, v, do = global_inputs(s, 8, 2, 64, torch.float32)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    opts = dict(VARIANTS[name])
    if opts.pop("sinks", False):
        opts["sinks"] = torch.zeros(8, requires_grad=True)

    def step():
        out = ra.ring_attention(*leaves, causal=True, layout="contiguous", seqlen=s, **opts)
        out.backward(do)

    return timed(step, iters=1, warmup=0)[0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    s, rounds = (1024, 1) if args.smoke else (4096, args.rounds)
    out = args.out or (RESULTS / "smoke" if args.smoke else RESULTS)
    data = {"machine": machine_info(), "S": s, "H": 8, "Hkv": 2, "D": 64, "dtype": "fp32",
            "causal": True, "rounds": rounds, "times_s": {n: [] for n in VARIANTS}}
    t0 = time.monotonic()
    cluster = Cluster(1)
    try:
        for r in range(rounds + 1):
            for name in VARIANTS:
                x = cluster.run(time_task, name, s)[0]
                if r:
                    data["times_s"][name].append(x)
    finally:
        cluster.close()
    plain = data["times_s"]["plain"]
    data["ratios"] = {n: [a / b for a, b in zip(ts, plain)] for n, ts in data["times_s"].items()}
    data["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(out / "features.json", data)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(VARIANTS)
    ax.bar(names, [statistics.median(data["ratios"][n]) for n in names])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("fwd+bwd time / plain")
    ax.set_title(f"ring_attention, S={s}, causal, fp32, 1 rank", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "features.png", dpi=110)
    for n in names:
        xs = data["ratios"][n]
        print(f"{n}: {statistics.median(xs):.2f}x plain (range {min(xs):.2f}-{max(xs):.2f})")
    print(f"wrote {out / 'features.json'} in {data['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
