"""DeepSeek sparse attention (indexer top-k) under CP against one process: time and peak.

Legend: B batch (1), S global seq, W world size, k the indexer's top k.

A DeepSeek-V3.2 decoder (transformers' ``DeepseekV32ForCausalLM``: MLA, a DSA indexer
keeping ``--topk`` keys per query, dense MLP, ``--layers`` layers, random weights, fp32)
runs one forward + backward of a causal-LM loss on one row of S random tokens:

* **cp**: converted by ``ra_hf.convert`` on W gloo ranks (one thread each), the batch
  through ``prepare_batch`` (zigzag): per step the max over the ranks; the time the indexers
  take (their forward, all-gather and selection included) is reported apart; per-rank peak
  RSS over one step (``rss_peak``, the largest rank);
* **one process**: the same model with transformers' eager attention (it builds the dense
  [S, S] mask and the [H, S, S] scores), 1 thread; skipped above ``--max-one-process``.

Before timing, the CP loss is checked against one process's (where it runs) to 1e-5.

    python benchmarks/bench_indexer.py --seqlens 1024 2048 --worlds 2 4     # a few minutes
    python benchmarks/bench_indexer.py --seqlens 8192 32768 --worlds 2 4    # the issue's sizes
    python benchmarks/bench_indexer.py --replot
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, Cluster, machine_info, rss_peak, summary, timed, write_json

OUT_JSON = RESULTS / "indexer.json"
OUT_PNG = RESULTS / "indexer.png"


def _model(attn: str, topk: int, layers: int, seqlen: int):
    import transformers as tf

    config = tf.DeepseekV32Config(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seqlen + 8,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32,
        v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=64, n_group=1, topk_group=1, index_topk=topk, index_head_dim=32,
        index_n_heads=4, mlp_layer_types=["dense"] * layers, pad_token_id=0)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return tf.DeepseekV32ForCausalLM(config).float().train()


def _batch(seqlen: int) -> dict:
    g = torch.Generator().manual_seed(seqlen)
    ids = torch.randint(1, 128, (1, seqlen), generator=g)
    return dict(input_ids=ids, labels=ids.clone())


def _indexer_clock(model, clock: list):
    import time

    for m in model.modules():
        if hasattr(m, "index_topk"):
            m.register_forward_pre_hook(lambda *a: clock.append(-time.perf_counter()))
            m.register_forward_hook(lambda *a: clock.append(time.perf_counter()))


def cp_rank(seqlen: int, topk: int, layers: int, iters: int) -> dict:
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    model = ra_hf.convert(_model("ringattn", topk, layers, seqlen))
    local = ra_hf.prepare_batch(model, _batch(seqlen), layout="zigzag")
    clock: list = []
    _indexer_clock(model, clock)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(**local, use_cache=False)
        out.loss.backward()
        return out.loss

    loss = step().detach().clone()
    dist.all_reduce(loss)
    clock.clear()
    times = timed(step, iters=iters, warmup=0)
    indexer = torch.tensor([sum(clock) / iters], dtype=torch.float64)
    dist.all_reduce(indexer, op=dist.ReduceOp.MAX)
    peak = torch.tensor([rss_peak(step)["delta"]], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"loss": float(loss), "time": summary(times), "indexer_s": float(indexer),
            "peak_rss_delta_bytes": int(peak)}


def one_process(seqlen: int, topk: int, layers: int, iters: int) -> dict:
    model = _model("eager", topk, layers, seqlen)
    batch = _batch(seqlen)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(**batch, use_cache=False)
        out.loss.backward()
        return out.loss

    loss = float(step().detach())
    times = timed(step, iters=iters, warmup=0)
    peak = rss_peak(step)["delta"]
    return {"loss": loss, "time": summary(times), "peak_rss_delta_bytes": int(peak)}


def plot(data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    runs = data["runs"]
    for name in sorted({r["name"] for r in runs}):
        rs = sorted((r for r in runs if r["name"] == name), key=lambda r: r["seqlen"])
        s = [r["seqlen"] for r in rs]
        a.plot(s, [r["time"]["median_s"] for r in rs], marker="o", label=name)
        if name != "one process":
            a.plot(s, [r["indexer_s"] for r in rs], marker="x", ls="--",
                   label=f"{name}: indexers")
        b.plot(s, [r["peak_rss_delta_bytes"] / 2**20 for r in rs], marker="o", label=name)
    for ax, what in ((a, "fwd+bwd seconds (median)"), (b, "peak RSS over a step, MiB (max rank)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("S")
        ax.set_ylabel(what)
        ax.legend(fontsize=7)
    fig.suptitle(f"DeepSeek-V3.2 DSA (top {data['topk']}), {data['layers']} layers: CP vs one "
                 f"process (CPU, gloo)")
    fig.tight_layout()
    OUT_PNG.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT_PNG, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--topk", type=int, default=256)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--max-one-process", type=int, default=8192)
    p.add_argument("--replot", action="store_true")
    args = p.parse_args()
    if args.replot:
        import json

        plot(json.loads(OUT_JSON.read_text()))
        return
    runs = []
    with_one = [s for s in args.seqlens if s <= args.max_one_process]
    if with_one:
        c = Cluster(1)
        try:
            for s in with_one:
                r = c.run(one_process, s, args.topk, args.layers, args.iters, timeout=3600)[0]
                runs.append({"name": "one process", "seqlen": s, **r})
                print(f"one process S={s}: {r['time']['median_s']:.3f} s", flush=True)
        finally:
            c.close()
    for w in args.worlds:
        c = Cluster(w, memory=False)
        try:
            for s in args.seqlens:
                r = c.run(cp_rank, s, args.topk, args.layers, args.iters, timeout=3600)[0]
                one = next((x for x in runs if x["name"] == "one process" and x["seqlen"] == s),
                           None)
                if one is not None:
                    err = abs(r["loss"] - one["loss"]) / abs(one["loss"])
                    r["loss_rel_err"] = err
                    assert err <= 1e-5, (s, w, err)
                runs.append({"name": f"cp W={w}", "seqlen": s, "world": w, **r})
                print(f"cp W={w} S={s}: {r['time']['median_s']:.3f} s (indexers "
                      f"{r['indexer_s']:.3f} s), peak {r['peak_rss_delta_bytes'] / 2**20:.0f} MiB",
                      flush=True)
        finally:
            c.close()
    data = {"machine": machine_info(), "topk": args.topk, "layers": args.layers, "runs": runs}
    write_json(OUT_JSON, data)
    plot(data)
    print(f"wrote {OUT_JSON} and {OUT_PNG}")


if __name__ == "__main__":
    main()
