"""The strategies side by side: ring, Ulysses and all-gather KV on the same global inputs.

Paired rounds (see bench_paired.py: on a shared 2-core machine timings drift, so each round
times ONE fwd+bwd of every strategy back to back and gives its own ratios): fp32, B=1,
H=8, D=64, zigzag shards, causal and full, Hkv 8 and 2, W 2 and 4. Also each strategy's
per-rank peak of live tensor bytes during one fwd+bwd (``common.TensorBytes``: what torch
allocates; the inputs' own shards excluded).

    python benchmarks/bench_strategies.py            # S=8192, 3 rounds, about 10 minutes
    python benchmarks/bench_strategies.py --smoke    # S=1024, 1 round

Writes results/strategies.json and results/strategies.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from common import RESULTS, Cluster, TensorBytes, global_inputs, machine_info, timed, write_json

STRATEGIES = ("ring", "ulysses", "allgather")


def _step(strategy, s, causal, hkv):
    """Rank side: a closure running one fwd+bwd of ``strategy`` on this rank's shards."""
    import ringattn as ra
    from ringattn.strategies.auto import STRATEGIES as FUNCS

    q, k, v, do = global_inputs(s, 8, hkv, 64, torch.float32)
    shards = [ra.shard(t, seqlen=s).detach() for t in (q, k, v, do)]
    leaves = [t.requires_grad_() for t in shards[:3]]
    attend = FUNCS[strategy]

    def step():
        for t in leaves:
            t.grad = None
        out = attend(*leaves, causal=causal, seqlen=s)
        out.backward(shards[3])

    return step


def time_task(strategy, s, causal, hkv):
    """Rank side: seconds of one fwd+bwd (max over ranks)."""
    return timed(_step(strategy, s, causal, hkv), iters=1, warmup=0)[0]


def peak_task(strategy, s, causal, hkv):
    """Rank side: peak live tensor bytes allocated during one fwd+bwd."""
    step = _step(strategy, s, causal, hkv)
    step()  # plans and caches made outside the measured call
    with TensorBytes() as mem:
        step()
    return mem.peak


def run(s: int, rounds: int, worlds, out_dir: Path) -> dict:
    data = {"machine": machine_info(), "S": s, "dtype": "fp32", "H": 8, "D": 64,
            "layout": "zigzag", "rounds": rounds, "cases": []}
    grid = [(w, causal, hkv) for w in worlds for causal in (True, False) for hkv in (8, 2)]
    t0 = time.monotonic()
    with tqdm(total=len(grid) * (rounds + 2), unit="round") as bar:
        for w in worlds:
            cluster = Cluster(w)
            try:
                for ww, causal, hkv in grid:
                    if ww != w:
                        continue
                    rec = {"W": w, "causal": causal, "Hkv": hkv,
                           "times_s": {m: [] for m in STRATEGIES}}
                    for r in range(rounds + 1):  # round 0 warms up (plans, caches) and is dropped
                        for m in STRATEGIES:
                            x = cluster.run(time_task, m, s, causal, hkv)[0]
                            if r:
                                rec["times_s"][m].append(x)
                        bar.update(1)
                    rec["peak_bytes"] = {m: max(cluster.run(peak_task, m, s, causal, hkv))
                                         for m in STRATEGIES}
                    bar.update(1)
                    rec["ratios"] = {f"{m} / ring": [a / b for a, b in zip(rec["times_s"][m],
                                                                          rec["times_s"]["ring"])]
                                     for m in STRATEGIES[1:]}
                    data["cases"].append(rec)
                    write_json(out_dir / "strategies.json", data)
            finally:
                cluster.close()
    data["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(out_dir / "strategies.json", data)
    return data


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = data["cases"]
    labels = [f"W={c['W']} {'causal' if c['causal'] else 'full'} Hkv={c['Hkv']}" for c in cases]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.27
    for i, m in enumerate(STRATEGIES):
        xs = [j + (i - 1) * width for j in range(len(cases))]
        ax_t.bar(xs, [1.0 if m == "ring" else statistics.median(c["ratios"][f"{m} / ring"])
                      for c in cases], width, label=m)
        ax_m.bar(xs, [c["peak_bytes"][m] / 2**20 for c in cases], width, label=m)
    for ax, title in ((ax_t, "fwd+bwd time / ring's (median of the paired rounds' ratios)"),
                      (ax_m, "per-rank peak of allocated tensors (MiB)")):
        ax.set_xticks(range(len(cases)), labels, rotation=40, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    ax_t.axhline(1.0, color="grey", lw=0.8)
    fig.suptitle(f"Strategies, S={data['S']}, fp32, H=8, D=64, zigzag, 2-core CPU, gloo",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="S=1024, 1 round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON")
    args = ap.parse_args(argv)
    s, rounds = (1024, 1) if args.smoke else (args.seqlen, args.rounds)
    out = args.out or (RESULTS / "smoke" if args.smoke else RESULTS)
    if args.replot:
        plot(json.loads((out / "strategies.json").read_text()), out / "strategies.png")
        return
    data = run(s, rounds, args.worlds, out)
    plot(data, out / "strategies.png")
    for c in data["cases"]:
        name = f"W={c['W']} {'causal' if c['causal'] else 'full'} Hkv={c['Hkv']}"
        ratios = ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in c["ratios"].items())
        peaks = ", ".join(f"{m} {b / 2**20:.0f}" for m, b in c["peak_bytes"].items())
        print(f"{name}: {ratios}; peak MiB {peaks}")
    print(f"wrote {out / 'strategies.json'} in {data['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
