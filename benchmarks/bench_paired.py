"""The time targets, measured in paired rounds so that machine drift cancels.

On a shared 2-core machine, timings drift by 10% or more over minutes, so two methods timed
minutes apart (as the grid of ``bench_attention.py`` does) compare the machine as much as
the methods. Here each round times ONE fwd+bwd of every method back to back (single-process
SDPA with 2 threads in a 1-rank cluster, the ring methods on a 2-rank cluster), and each
round gives its own ratios; the JSON keeps every round, the report gives the median ratio
and its range. Same inputs, kernels and timer as ``bench_attention.py``.

    python benchmarks/bench_paired.py             # S=8192, 7 rounds, about 8 minutes
    python benchmarks/bench_paired.py --smoke     # S=1024, 2 rounds
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tqdm import tqdm

import bench_attention as ba
from common import RESULTS, Cluster, machine_info, write_json

LEAN = "ringattn-zigzag" + ba.LOWMEM
CASES = [  # (causal, Hkv, ring methods compared with SDPA 2 threads)
    (True, 8, ("ringattn-zigzag", LEAN, "torch-ring")),
    (True, 2, ("ringattn-zigzag", LEAN, "torch-ring")),
    (False, 8, ("ringattn-contiguous", "ringattn-zigzag", LEAN, "torch-ring")),
    (False, 2, ("ringattn-contiguous", "ringattn-zigzag", LEAN, "torch-ring")),
]


def run(s: int, rounds: int, out_dir: Path) -> dict:
    data = {"machine": machine_info(), "S": s, "W": 2, "dtype": "fp32", "H": 8, "D": 64,
            "rounds": rounds, "cases": []}
    single, ring = Cluster(1), Cluster(2)
    t0 = time.monotonic()
    try:
        with tqdm(total=len(CASES) * (rounds + 1), unit="round") as bar:
            for causal, hkv, methods in CASES:
                p_ring = ba.Point(s, causal, "fp32", hkv, 2, iters=1, warmup=0)
                p_sdpa = ba.Point(s, causal, "fp32", hkv, None, iters=1, warmup=0)
                rec = {"causal": causal, "Hkv": hkv, "times_s": {m: [] for m in ("sdpa-2t", *methods)}}
                for r in range(rounds + 1):  # round 0 warms every method up and is dropped
                    t = {"sdpa-2t": single.run(ba.time_task, p_sdpa, "sdpa", 2)[0][0]}
                    for m in methods:
                        t[m] = ring.run(ba.time_task, p_ring, m)[0][0]
                    if r:
                        for m, x in t.items():
                            rec["times_s"][m].append(x)
                    bar.update(1)
                base = rec["times_s"]["sdpa-2t"]
                rec["ratios"] = {}
                for m in methods:
                    vs_sdpa = [a / b for a, b in zip(rec["times_s"][m], base)]
                    rec["ratios"][f"{m} / sdpa-2t"] = vs_sdpa
                    if m != "torch-ring":
                        rec["ratios"][f"{m} / torch-ring"] = [
                            a / b for a, b in zip(rec["times_s"][m], rec["times_s"]["torch-ring"])]
                data["cases"].append(rec)
                write_json(out_dir / "paired.json", data)
    finally:
        single.close()
        ring.close()
    data["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(out_dir / "paired.json", data)
    return data


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="S=1024, 2 rounds")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    s, rounds = (1024, 2) if args.smoke else (args.seqlen, args.rounds)
    out = args.out or (RESULTS / "smoke" if args.smoke else RESULTS)
    data = run(s, rounds, out)
    for rec in data["cases"]:
        for name, xs in rec["ratios"].items():
            print(f"{'causal' if rec['causal'] else 'full'} Hkv={rec['Hkv']} {name}: median "
                  f"{statistics.median(xs):.3f} (range {min(xs):.3f}..{max(xs):.3f})")
    print(f"wrote {out / 'paired.json'} in {data['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
