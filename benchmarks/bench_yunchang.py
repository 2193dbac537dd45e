"""ringattn's strategies beside yunchang's Ulysses, and ``strategy="auto"`` against the
fastest of them, on the same global inputs.

yunchang (``pip install --no-deps yunchang``, 0.6.4 here) runs only its all-to-all on CPU:
its Ulysses layer calls flash-attention, or CUDA-only torch ops for its "torch" kernels.
The adapter below therefore takes yunchang's own sequence<->head all-to-all
(``yunchang.comm.all_to_all.SeqAllToAll4D``, what ``UlyssesAttention`` does) around torch's
SDPA as the local attention, on contiguous shards (its layout). yunchang cannot split kv
heads that do not divide W (its README: "not suitable for GQA/MQA"); there, as its users do,
the adapter expands K/V to H heads first, and the record says so.

One run, paired rounds (each round times one fwd+bwd of every contender back to back),
fp32, B=1, H=8, D=64, causal and full, Hkv 8 and 2, W 2, 4, 8, zigzag shards for
ringattn: ring, Ulysses, all-gather, the hybrid (W/2 x 2 mesh), auto (the cost model's
choice, measured once per cluster), yunchang, and PyTorch's own ring (``torch_ring.py``:
all-gather rotation, head-tail shards when causal, the same CPU flash op). Per-rank peak
of allocated tensors for ringattn's ring and Ulysses, yunchang's and torch's ring.

    python benchmarks/bench_yunchang.py                  # S=8192, 2 rounds: about 15 minutes
    python benchmarks/bench_yunchang.py --smoke          # S=1024, W 2 and 4, 1 round
    python benchmarks/bench_yunchang.py --peaks-only --worlds 8 --masks full --rounds 2

Writes results/yunchang.json and results/yunchang.png.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from common import RESULTS, Cluster, TensorBytes, global_inputs, machine_info, timed, write_json

CONTENDERS = ("ring", "ulysses", "allgather", "hybrid", "auto", "yunchang", "torch-ring")


def _yunchang_step(s, causal, hkv):
    """Rank side: yunchang's all-to-alls around SDPA on contiguous shards."""
    import torch.distributed as dist
    from yunchang.comm.all_to_all import SeqAllToAll4D

    w, r = dist.get_world_size(), dist.get_rank()
    q, k, v, do = global_inputs(s, 8, hkv, 64, torch.float32)
    expand = hkv % w != 0
    if expand:  # yunchang cannot split these kv heads: users repeat them to H
        k, v = (t.repeat_interleave(8 // hkv, dim=2) for t in (k, v))
    n = s // w
    shards = [t[:, r * n:(r + 1) * n].contiguous() for t in (q, k, v, do)]
    leaves = [t.requires_grad_() for t in shards[:3]]
    group = dist.group.WORLD

    def step():
        for t in leaves:
            t.grad = None
        qh, kh, vh = (SeqAllToAll4D.apply(group, t, 2, 1, False) for t in leaves)
        g = qh.shape[2] // kh.shape[2]
        kh, vh = (t.repeat_interleave(g, dim=2) for t in (kh, vh))
        out = torch.nn.functional.scaled_dot_product_attention(
            qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), is_causal=causal)
        out = SeqAllToAll4D.apply(group, out.transpose(1, 2).contiguous(), 1, 2, False)
        out.backward(shards[3])

    return step, expand


_MESHES: dict = {}


def _ringattn_step(name, s, causal, hkv):
    """Rank side: one fwd+bwd of ``ra.attention(strategy=name)`` on zigzag shards."""
    import torch.distributed as dist

    import ringattn as ra

    w = dist.get_world_size()
    q, k, v, do = global_inputs(s, 8, hkv, 64, torch.float32)
    shards = [ra.shard(t, seqlen=s).detach() for t in (q, k, v, do)]
    leaves = [t.requires_grad_() for t in shards[:3]]
    group = None
    if name == "hybrid" or (name == "auto" and w >= 4):
        if w not in _MESHES:
            _MESHES[w] = ra.hybrid_mesh(ulysses=2)
        group = _MESHES[w]

    def step():
        for t in leaves:
            t.grad = None
        out = ra.attention(*leaves, group=group, strategy=name, causal=causal, seqlen=s)
        out.backward(shards[3])

    return step


def _torch_ring_step(s, causal, hkv):
    """Rank side: PyTorch's own CP ring (``torch_ring.py``: its templated ring attention
    with the CPU flash op, all-gather rotation, head-tail shards when causal)."""
    from torch_ring import shard, torch_ring_attention

    q, k, v, do = (t.transpose(1, 2) for t in global_inputs(s, 8, hkv, 64, torch.float32))
    shards = [shard(t, causal=causal) for t in (q, k, v, do)]
    leaves = [t.requires_grad_() for t in shards[:3]]

    def step():
        for t in leaves:
            t.grad = None
        torch_ring_attention(*leaves, causal=causal).backward(shards[3])

    return step


def _step(name, s, causal, hkv):
    if name == "yunchang":
        return _yunchang_step(s, causal, hkv)[0]
    if name == "torch-ring":
        return _torch_ring_step(s, causal, hkv)
    return _ringattn_step(name, s, causal, hkv)


def time_task(name, s, causal, hkv):
    """Rank side: seconds of one fwd+bwd (max over ranks)."""
    return timed(_step(name, s, causal, hkv), iters=1, warmup=0)[0]


def peak_task(name, s, causal, hkv):
    step = _step(name, s, causal, hkv)
    step()
    with TensorBytes() as mem:
        step()
    return mem.peak


def chosen_task(s, causal, hkv):
    """Rank side: the strategy ``auto`` picks for this call (on the W/2 x 2 mesh, W >= 4)."""
    import torch.distributed as dist

    import ringattn as ra
    from ringattn.strategies.auto import call_shape, choose, measure

    w = dist.get_world_size()
    group = _MESHES.setdefault(w, ra.hybrid_mesh(ulysses=2)) if w >= 4 else None
    q = ra.shard(torch.zeros(1, s, 8, 64), seqlen=s).requires_grad_()
    k = ra.shard(torch.zeros(1, s, hkv, 64), seqlen=s).requires_grad_()
    return choose(call_shape(q, k, k, group, causal=causal, seqlen=s), measure(group))


def _has_yunchang() -> bool:
    import importlib.util

    return importlib.util.find_spec("yunchang") is not None


def peaks_only(s: int, rounds: int, worlds, masks) -> None:
    """Per-rank peaks (MiB) of ringattn's Ulysses and yunchang's, ``rounds`` times per
    point, printed: how much a peak moves between measurements."""
    grid = [(causal, hkv) for causal in (True, False) for hkv in (8, 2)
            if ("causal" if causal else "full") in masks]
    for w in worlds:
        cluster = Cluster(w)
        try:
            for causal, hkv in grid:
                for _ in range(rounds):
                    for n in ("ulysses", "yunchang"):
                        mib = [round(x / 2**20, 1) for x in cluster.run(peak_task, n, s, causal, hkv)]
                        print(f"W={w} {'causal' if causal else 'full'} Hkv={hkv} {n}: {mib}",
                              flush=True)
        finally:
            cluster.close()


def run(s: int, rounds: int, worlds, out_dir: Path, masks=("causal", "full")) -> dict:
    names = [n for n in CONTENDERS if n != "yunchang" or _has_yunchang()]
    if "yunchang" not in names:
        print("yunchang is not importable: its rows are left out (pip install --no-deps yunchang)")
    data = {"machine": machine_info(), "S": s, "dtype": "fp32", "H": 8, "D": 64,
            "rounds": rounds, "cases": []}
    t0 = time.monotonic()
    grid = [(causal, hkv) for causal in (True, False) for hkv in (8, 2)
            if ("causal" if causal else "full") in masks]
    with tqdm(total=len(worlds) * len(grid) * (rounds + 2), unit="round") as bar:
        for w in worlds:
            cluster = Cluster(w)
            try:
                here = [n for n in names if n != "hybrid" or w >= 4]
                for causal, hkv in grid:
                    rec = {"W": w, "causal": causal, "Hkv": hkv,
                           "times_s": {n: [] for n in here},
                           "auto_chose": cluster.run(chosen_task, s, causal, hkv)[0],
                           "yunchang_expanded_kv": hkv % w != 0}
                    for r in range(rounds + 1):  # round 0 warms up and is dropped
                        for n in here:
                            x = cluster.run(time_task, n, s, causal, hkv)[0]
                            if r:
                                rec["times_s"][n].append(x)
                        bar.update(1)
                    rec["peak_bytes"] = {n: max(cluster.run(peak_task, n, s, causal, hkv))
                                         for n in ("ring", "ulysses", "yunchang", "torch-ring")
                                         if n in here}
                    bar.update(1)
                    med = {n: statistics.median(v) for n, v in rec["times_s"].items()}
                    ours = [n for n in ("ring", "ulysses", "allgather", "hybrid") if n in med]
                    fastest = min(ours, key=med.get)
                    rec["fastest_ringattn"] = fastest
                    rec["auto / fastest"] = statistics.median(
                        a / b for a, b in zip(rec["times_s"]["auto"], rec["times_s"][fastest]))
                    if "yunchang" in med:
                        rec["ulysses / yunchang"] = statistics.median(
                            a / b for a, b in zip(rec["times_s"]["ulysses"],
                                                  rec["times_s"]["yunchang"]))
                        rec["peak ulysses / yunchang"] = (rec["peak_bytes"]["ulysses"]
                                                          / rec["peak_bytes"]["yunchang"])
                    rec["ring / torch-ring"] = statistics.median(
                        a / b for a, b in zip(rec["times_s"]["ring"], rec["times_s"]["torch-ring"]))
                    data["cases"].append(rec)
                    write_json(out_dir / "yunchang.json", data)
            finally:
                cluster.close()
    data["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(out_dir / "yunchang.json", data)
    return data


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = data["cases"]
    labels = [f"W={c['W']} {'causal' if c['causal'] else 'full'} Hkv={c['Hkv']}" for c in cases]
    names = [n for n in CONTENDERS if any(n in c["times_s"] for c in cases)]
    fig, ax = plt.subplots(figsize=(12, 4.8))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        xs = [j + (i - len(names) / 2) * width for j in range(len(cases))]
        ys = [statistics.median(c["times_s"][n]) / statistics.median(c["times_s"]["ring"])
              if n in c["times_s"] else 0 for c in cases]
        ax.bar(xs, ys, width, label=n)
    ax.set_xticks(range(len(cases)), labels, rotation=40, ha="right", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("fwd+bwd time / ringattn ring's")
    ax.set_title(f"ringattn strategies, yunchang's Ulysses and torch's ring, S={data['S']}, fp32, H=8, D=64, "
                 f"2-core CPU, gloo", fontsize=10)
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="S=1024, W 2 and 4, 1 round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--masks", nargs="+", default=["causal", "full"], choices=["causal", "full"])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--peaks-only", action="store_true",
                    help="only the per-rank peaks of Ulysses and yunchang, --rounds times, printed")
    args = ap.parse_args(argv)
    if args.peaks_only:
        return peaks_only(args.seqlen, args.rounds, args.worlds, args.masks)
    s, rounds, worlds = (1024, 1, [2, 4]) if args.smoke else (args.seqlen, args.rounds, args.worlds)
    out = args.out or (RESULTS / "smoke" if args.smoke else RESULTS)
    data = run(s, rounds, worlds, out, args.masks)
    plot(data, out / "yunchang.png")
    for c in data["cases"]:
        name = f"W={c['W']} {'causal' if c['causal'] else 'full'} Hkv={c['Hkv']}"
        extra = (f"; Ulysses / yunchang {c['ulysses / yunchang']:.2f}, peak "
                 f"{c['peak ulysses / yunchang']:.2f}" if "ulysses / yunchang" in c else "")
        print(f"{name}: fastest {c['fastest_ringattn']}, auto chose {c['auto_chose']} "
              f"({c['auto / fastest']:.2f}x the fastest){extra}; ring / torch's ring "
              f"{c['ring / torch-ring']:.2f}")
    print(f"wrote {out / 'yunchang.json'} in {data['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
