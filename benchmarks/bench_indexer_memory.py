"""The DSA indexer's selection under CP at a fixed S / W: per-rank memory and time of the
ring's running top k (``indexer_ties(model, "position")``) against whole score rows (the
``"topk"`` rule's path when a row ties at its k-th score: every rank scores its queries
against all S keys, in chunks).

Legend: S global seq, W world size, L = S / W tokens per rank, k the indexer's top k.

The model is bench_indexer.py's DeepSeek-V3.2 decoder (one layer, hidden 128, 4 indexer
heads of 32, top ``--topk``, fp32, random weights), converted by ``ra_hf.convert``, one row
of S random tokens through ``prepare_batch`` (zigzag), one forward without gradients (the
indexer has none). With these weights some row ties at its k-th score (exact zeros of the
ReLU), so the "topk" rule takes whole rows on every call: the two columns are the two
paths. Measured on every rank, the max over ranks reported:

* the growth of live tensor bytes during the indexer's call (``common.TensorBytes``: its
  peak over the call minus the bytes live when it starts; the selection it returns
  included);
* the call's seconds (the median of ``--rounds`` forwards).

Writes ``results/indexer_memory.json`` and ``indexer_memory.png``.

    python benchmarks/bench_indexer_memory.py                  # L 1024 and 4096, W 1, 2, 4
    python benchmarks/bench_indexer_memory.py --quick          # L 256, W 1 and 2
    python benchmarks/bench_indexer_memory.py --table          # the last run's table
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (Cluster, TensorBytes, finish_plot, fixed_share_parser,  # noqa: E402
                    load_or_run, machine_info)

RULES = ("position", "topk")
PATHS = {"position": "ring top k", "topk": "whole rows"}


def select_task(seqlen: int, topk: int, rules: tuple, rounds: int) -> dict:
    """{rule: (peak growth bytes, median seconds, paths taken)} of this rank's indexer."""
    import bench_indexer

    from ringattn.integrations import transformers as ra_hf
    from ringattn.integrations.transformers.families import indexer

    ra_hf.register()
    out = {}
    for rule in rules:
        model = ra_hf.indexer_ties(
            ra_hf.convert(bench_indexer._model("ringattn", topk, 1, seqlen)), rule)
        local = ra_hf.prepare_batch(model, bench_indexer._batch(seqlen), layout="zigzag")
        seen = {"growth": 0, "times": []}
        mode = TensorBytes()
        module = next(m for m in model.modules() if isinstance(m, indexer._Indexer))

        def pre(m, args):
            seen["base"] = mode.live
            mode.peak = mode.live
            seen["t0"] = time.perf_counter()

        def post(m, args, result):
            seen["times"].append(time.perf_counter() - seen["t0"])
            seen["growth"] = max(seen["growth"], mode.peak - seen["base"])

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        before = dict(indexer.STATS)
        with torch.no_grad():
            for _ in range(rounds):
                with mode:
                    model(**local, use_cache=False)
        paths = {k: indexer.STATS[k] - before[k] for k in before}
        got = torch.tensor([seen["growth"], statistics.median(seen["times"])],
                           dtype=torch.float64)
        dist.all_reduce(got, op=dist.ReduceOp.MAX)
        out[rule] = {"growth_bytes": int(got[0]), "seconds": float(got[1]), "paths": paths}
    return out


def run(args) -> dict:
    data = {"machine": machine_info(), "topk": args.topk, "rules": list(RULES),
            "memory": "growth of live tensor bytes during the indexer's call "
                      "(common.TensorBytes), max over ranks", "runs": []}
    for w in args.worlds:
        cluster = Cluster(w)
        try:
            for per_rank in args.per_rank:
                s = per_rank * w
                got = cluster.run(select_task, s, args.topk, RULES, args.rounds,
                                  timeout=3600)[0]
                for rule in RULES:
                    r = got[rule]
                    data["runs"].append({"W": w, "S": s, "L": per_rank, "rule": rule, **r})
                    print(f"W={w} S={s} {rule}: {r['growth_bytes'] / 2**20:.2f} MiB, "
                          f"{r['seconds']:.3f} s, {r['paths']}", flush=True)
        finally:
            cluster.close(force=True)
    return data


def markdown(data) -> str:
    lines = [f"DSA indexer selection (top {data['topk']}), growth of live MiB during the call "
             "/ seconds, max over ranks:", "",
             "| L = S / W | W | S | ring top k (\"position\") | whole rows (\"topk\") | "
             "seconds, ring / whole |", "|---:|---:|---:|---:|---:|---:|"]
    runs = {(r["L"], r["W"], r["rule"]): r for r in data["runs"]}
    for per_rank in sorted({r["L"] for r in data["runs"]}):
        for w in sorted({r["W"] for r in data["runs"]}):
            a, b = runs.get((per_rank, w, "position")), runs.get((per_rank, w, "topk"))
            if a is None or b is None:
                continue
            lines.append(f"| {per_rank} | {w} | {a['S']} | {a['growth_bytes'] / 2**20:.2f} | "
                         f"{b['growth_bytes'] / 2**20:.2f} | {a['seconds']:.3f} / "
                         f"{b['seconds']:.3f} |")
    for per_rank in sorted({r["L"] for r in data["runs"]}):
        vals = [r["growth_bytes"] for r in data["runs"]
                if r["L"] == per_rank and r["rule"] == "position"]
        whole = [r["growth_bytes"] for r in data["runs"]
                 if r["L"] == per_rank and r["rule"] == "topk"]
        lines.append(f"\nL = {per_rank}: ring top k max / min over W {max(vals) / min(vals):.3f}"
                     f"; whole rows {max(whole) / min(whole):.3f}")
    return "\n".join(lines)


def plot(data, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for per_rank in sorted({r["L"] for r in data["runs"]}):
        for rule, style in (("position", "-o"), ("topk", "--s")):
            rs = sorted((r for r in data["runs"] if r["L"] == per_rank and r["rule"] == rule),
                        key=lambda r: r["W"])
            label = f"{PATHS[rule]}, L={per_rank}"
            a.plot([r["W"] for r in rs], [r["growth_bytes"] / 2**20 for r in rs], style,
                   label=label)
            b.plot([r["W"] for r in rs], [r["seconds"] for r in rs], style, label=label)
    finish_plot(fig, ((a, "indexer call: live tensor MiB growth"),
                      (b, "indexer call seconds")), "W (S = L x W)",
                f"DSA indexer selection at a fixed S / W (top {data['topk']})", path)


def main(argv=None) -> None:
    ap = fixed_share_parser(__doc__, "L 256, W 1 and 2, top 64")
    ap.add_argument("--topk", type=int, default=256)
    args = ap.parse_args(argv)

    def quick(a):
        a.per_rank, a.worlds, a.topk, a.rounds = [256], [1, 2], 64, 1

    data, out = load_or_run(args, "indexer_memory", run, quick)
    plot(data, out / "indexer_memory.png")
    print(markdown(data))


if __name__ == "__main__":
    main()
