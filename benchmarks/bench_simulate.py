"""The kernels' share of a W-rank ring step, simulated on one device (``ringattn.simulate``).

Legend: B batch, S global seq, H heads, Hkv kv heads, D head dim, W world size.

For W in {1, 2, 4, 8} every rank of a W-rank ring runs in this process (the real ring
loops; hops are copies between threads); its kernel calls are timed one at a time. A
W-rank step can take 1/W of the one-rank time only if the slowest rank's kernels take
1/W of the one-rank kernels: the figure is

    kernel ratio = max over ranks of (kernel seconds, fwd+bwd)  /  (W=1 kernel seconds / W)

(issue 15's target on a GPU: <= 1.1 at W=8, zigzag, causal, bf16, D=128). Each W is run
``--repeat`` times after a warm-up and the median is kept. The result is checked first:
every simulated rank's output against one plain ``ring_attention``-equivalent W=1 run.

    python benchmarks/bench_simulate.py                         # CPU: fp32, S=8192, H=8, D=64
    python benchmarks/bench_simulate.py --device cuda           # bf16, S=32768, H=16, Hkv=4, D=128

Writes results/simulate[_cuda].json.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from common import RESULTS, machine_info, write_json
from ringattn.simulate import local_positions_of, simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seqlen", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    s = args.seqlen or (32768 if cuda else 8192)
    h, hkv, d = (16, 4, 128) if cuda else (8, 8, 64)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, s, h, d, generator=g).to(args.device, dtype)
    k, v = (torch.randn(1, s, hkv, d, generator=g).to(args.device, dtype) for _ in range(2))
    dout = torch.randn(1, s, h, d, generator=g).to(args.device, dtype)
    result = {"machine": machine_info(), "device": torch.cuda.get_device_name() if cuda else "cpu",
              "shape": dict(B=1, S=s, H=h, Hkv=hkv, D=d, dtype=str(dtype)), "worlds": {}}
    if args.worlds[0] != 1:
        raise SystemExit("--worlds must start with 1 (the one-rank time the others are held to)")
    base = one = None
    for w in args.worlds:
        simulate(q, k, v, dout, world=w, causal=True)  # warm-up: plans, kernels
        runs = [simulate(q, k, v, dout, world=w, causal=True) for _ in range(args.repeat)]
        if base is None:  # W=1: the reference output and the one-rank kernel seconds
            base = runs[0]
            one = statistics.median(sum(r.kernel_seconds()) for r in runs)
        # every rank's output is the W=1 output at its positions
        ref = base.ranks[0].out
        worst = 0.0
        for r, res in enumerate(runs[0].ranks):
            pos = local_positions_of(runs[0], r, "zigzag", s)
            real = pos < s
            diff = (res.out[:, real].float() - ref[:, pos[real].to(ref.device)].float()).abs().max()
            worst = max(worst, float(diff))
        per_rank = [statistics.median(x) for x in zip(*(r.kernel_seconds() for r in runs))]
        ratio = max(per_rank) / (one / w)
        result["worlds"][w] = {"kernel_seconds_per_rank": per_rank, "kernel_ratio": ratio,
                               "calls_per_rank": [r.calls for r in runs[0].ranks],
                               "max_abs_diff_vs_W1": worst, "steps": runs[0].steps}
        print(f"W={w}: slowest rank's kernels {max(per_rank) * 1e3:.1f} ms, W=1 / W "
              f"{one / w * 1e3:.1f} ms: ratio {ratio:.2f}; kernel calls per rank "
              f"{[sum(c.values()) for c in (r.calls for r in runs[0].ranks)]}; "
              f"max |out - W=1 out| {worst:.1e}", flush=True)
    write_json(RESULTS / f"simulate{'_cuda' if cuda else ''}.json", result)


if __name__ == "__main__":
    main()
