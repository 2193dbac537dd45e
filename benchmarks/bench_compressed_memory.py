"""DeepSeek-V4 under CP at a fixed S / W: per-rank memory and time of a training step.

Legend: S global seq, W world size, L = S / W tokens per rank, m a compress rate, T = S / m
compressed entries of a layer, k the indexer's top k.

The model is a DeepSeek-V4 decoder of two layers, one compressed sparse attention layer
(m = 4, an indexer of 4 heads of 32 keeping k = 64 entries) and one heavily compressed
attention layer (m = 128), sliding window 128, hidden 256, head dim 64, 8 heads, a small MoE,
fp32, random weights, converted by ``ra_hf.convert``; one row of S random tokens through
``prepare_batch`` (zigzag), one forward and backward. Measured on every rank, the max over
ranks reported:

* the growth of live tensor bytes over the step (``common.TensorBytes``: its peak minus the
  bytes live when it starts);
* the step's seconds (the median of ``--rounds`` steps).

Every rank holds every entry of each layer (the all-gather ringattn uses: any query may see
any entry), [B, T, head dim] for the compressor and [B, T, index head dim] for the indexer:
O(S / m) per rank, the only term that grows with S at a fixed L; the table prints its size
beside the measured growth. Everything else is O(L): the window keys on the ring, the halo
(every chunk's last 2m - 1 projected slots), each query's k gathered entries.

Writes ``results/compressed_memory.json`` and ``compressed_memory.png``.

    python benchmarks/bench_compressed_memory.py               # L 1024 and 4096, W 1, 2, 4
    python benchmarks/bench_compressed_memory.py --quick       # L 256, W 1 and 2
    python benchmarks/bench_compressed_memory.py --table       # the last run's table
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

HEAD_DIM, INDEX_DIM, CSA, HCA = 64, 32, 4, 128


def _model(seqlen: int, topk: int):
    import transformers as tf

    config = tf.DeepseekV4Config(
        vocab_size=128, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1, head_dim=HEAD_DIM,
        q_lora_rank=64, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        sliding_window=128, max_position_embeddings=seqlen + 8,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA},
        mlp_layer_types=["moe", "moe"], hc_mult=2, o_groups=2, o_lora_rank=64,
        index_n_heads=4, index_head_dim=INDEX_DIM, index_topk=topk, num_nextn_predict_layers=0,
        pad_token_id=0)
    config._attn_implementation = "ringattn"
    torch.manual_seed(0)
    return tf.DeepseekV4ForCausalLM(config).float().train()


def step_task(seqlen: int, topk: int, rounds: int) -> dict:
    """(peak growth bytes, median seconds) of this rank's training step."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    model = ra_hf.convert(_model(seqlen, topk))
    g = torch.Generator().manual_seed(seqlen)
    ids = torch.randint(1, 128, (1, seqlen), generator=g)
    local = ra_hf.prepare_batch(model, dict(input_ids=ids, labels=ids.clone()), layout="zigzag")
    growth, times = 0, []
    for _ in range(rounds + 1):  # the first step warms up
        model.zero_grad(set_to_none=True)
        mode = TensorBytes()
        with mode:
            base = mode.live
            t0 = time.perf_counter()
            model(**local, use_cache=False).loss.backward()
            times.append(time.perf_counter() - t0)
            growth = max(growth, mode.peak - base)
    got = torch.tensor([growth, statistics.median(times[1:])], dtype=torch.float64)
    dist.all_reduce(got, op=dist.ReduceOp.MAX)
    return {"growth_bytes": int(got[0]), "seconds": float(got[1])}


def entry_bytes(seqlen: int) -> int:
    """Bytes of every layer's gathered entries on one rank (fp32, one row)."""
    return 4 * ((seqlen // CSA) * (HEAD_DIM + INDEX_DIM) + (seqlen // HCA) * HEAD_DIM)


def run(args) -> dict:
    data = {"machine": machine_info(), "topk": args.topk,
            "memory": "growth of live tensor bytes over a forward and backward "
                      "(common.TensorBytes), max over ranks", "runs": []}
    for w in args.worlds:
        cluster = Cluster(w)
        try:
            for per_rank in args.per_rank:
                s = per_rank * w
                r = cluster.run(step_task, s, args.topk, args.rounds, timeout=3600)[0]
                data["runs"].append({"W": w, "S": s, "L": per_rank, **r,
                                     "entry_bytes": entry_bytes(s)})
                print(f"W={w} S={s}: {r['growth_bytes'] / 2**20:.2f} MiB, "
                      f"{r['seconds']:.3f} s", flush=True)
        finally:
            cluster.close(force=True)
    return data


def markdown(data) -> str:
    lines = [f"DeepSeek-V4 training step (CSA m={CSA} top {data['topk']}, HCA m={HCA}), "
             "growth of live MiB over the step / seconds, max over ranks:", "",
             "| L = S / W | W | S | step MiB | of which gathered entries | seconds |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(data["runs"], key=lambda r: (r["L"], r["W"])):
        lines.append(f"| {r['L']} | {r['W']} | {r['S']} | {r['growth_bytes'] / 2**20:.2f} | "
                     f"{r['entry_bytes'] / 2**20:.2f} | {r['seconds']:.3f} |")
    for per_rank in sorted({r["L"] for r in data["runs"]}):
        vals = [r["growth_bytes"] for r in data["runs"] if r["L"] == per_rank]
        lines.append(f"\nL = {per_rank}: step memory max / min over W "
                     f"{max(vals) / min(vals):.3f}")
    return "\n".join(lines)


def plot(data, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for per_rank in sorted({r["L"] for r in data["runs"]}):
        rs = sorted((r for r in data["runs"] if r["L"] == per_rank), key=lambda r: r["W"])
        a.plot([r["W"] for r in rs], [r["growth_bytes"] / 2**20 for r in rs], "-o",
               label=f"step, L={per_rank}")
        a.plot([r["W"] for r in rs], [r["entry_bytes"] / 2**20 for r in rs], ":",
               label=f"gathered entries, L={per_rank}")
        b.plot([r["W"] for r in rs], [r["seconds"] for r in rs], "-o", label=f"L={per_rank}")
    finish_plot(fig, ((a, "live tensor MiB growth per rank"), (b, "step seconds")),
                "W (S = L x W)", "DeepSeek-V4 training step at a fixed S / W", path)


def main(argv=None) -> None:
    ap = fixed_share_parser(__doc__, "L 256, W 1 and 2, one round")
    ap.add_argument("--topk", type=int, default=64)
    args = ap.parse_args(argv)

    def quick(a):
        a.per_rank, a.worlds, a.rounds = [256], [1, 2], 1

    data, out = load_or_run(args, "compressed_memory", run, quick)
    plot(data, out / "compressed_memory.png")
    print(markdown(data))


if __name__ == "__main__":
    main()
