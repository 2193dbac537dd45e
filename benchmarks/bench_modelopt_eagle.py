"""ModelOpt's Eagle3 training step under ringattn's CP: the teacher and the TTT loss in tiles
beside ModelOpt's logits, per-rank step memory at cp = 1, 2, 4.

Legend: S global seq, L local seq (S / W), W cp size (ranks), V target vocab, Vd draft vocab.

The target is Llama-3-shaped where it matters for memory (V = 128256; ModelOpt's
``EAGLE3_DEFAULT_CFG`` with a draft vocabulary of Vd = 32000) and small elsewhere (hidden
128, 2 decoder layers, 4 heads, 2 kv heads; ModelOpt's one-layer draft with its default TTT
steps), fp32, B = 1, a row right-padded by 37 tokens, layout zigzag. A step is what
``EagleRingTrainer`` runs for one batch: ``shard_eagle_batch``, ``RingEagleModel``'s forward
under CP, the backward and the all-reduce of the draft's gradients. ``teacher`` is
``RingEagleModel.forward``'s: "logits" (ModelOpt's own computation: the base model's
[L, V] logits, the [L, Vd] teacher, every TTT step's [L, Vd] draft logits kept for the
backward) or "tiled" (the default "auto" here: one position's logits, then the teacher and
the loss from the final hidden states one tile at a time, ``ringattn.loss.DEFAULT_TILE``).

Memory is the peak of live tensor bytes on a rank during one step (``common.TensorBytes``;
not the weights, made before), the max over ranks. Measured: the peak at a fixed S
(``--seqlen``) for each teacher and W, at a fixed L (``--flat-l`` tokens per rank) for each
teacher (the tiled one flat in W), and the step time of each teacher at W = 2, S =
``--seqlen`` (the median of ``--rounds`` paired rounds, each step the slowest rank's).

Writes ``<out>/modelopt_eagle.json`` and ``modelopt_eagle.png``.

    python benchmarks/bench_modelopt_eagle.py            # about 5 minutes
    python benchmarks/bench_modelopt_eagle.py --quick    # V 8192, Vd 2048, W 1 and 2
    python benchmarks/bench_modelopt_eagle.py --table    # the table of the last run
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, Cluster, machine_info, paired_rounds, step_peaks,  # noqa: E402
                    run_once, write_json)

MODEL = dict(vocab=128256, draft_vocab=32000, hidden=128, heads=4, kv_heads=2, head_dim=32,
             intermediate=256, layers=2)
TEACHERS = ("logits", "tiled")
WORLDS = (1, 2, 4)
PAD = 37


# ---------------------------------------------------------------------------- rank side


def _setup(model: dict):
    """(a step(S, teacher) function, the TTT steps) on this rank: the converted model."""
    import warnings

    warnings.filterwarnings("ignore")
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG
    from transformers import LlamaConfig, LlamaForCausalLM

    from ringattn.integrations import modelopt as ra_mo

    ra_mo.register(LlamaForCausalLM)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=model["hidden"], intermediate_size=model["intermediate"],
                      num_hidden_layers=model["layers"], num_attention_heads=model["heads"],
                      num_key_value_heads=model["kv_heads"], head_dim=model["head_dim"],
                      vocab_size=model["vocab"], max_position_embeddings=1 << 17,
                      pad_token_id=0)
    cfg._attn_implementation = "ringattn"
    target = LlamaForCausalLM(cfg).float()
    eagle = copy.deepcopy(EAGLE3_DEFAULT_CFG["config"])
    eagle.update(eagle_use_torch_compile=False)
    eagle["eagle_architecture_config"].update(
        num_attention_heads=model["heads"], num_key_value_heads=model["kv_heads"],
        head_dim=model["head_dim"], intermediate_size=model["intermediate"],
        draft_vocab_size=model["draft_vocab"])
    torch.manual_seed(1)
    mtsp.convert(target, [("eagle", eagle)])
    target.train()
    params = [p for p in target.parameters() if p.requires_grad]
    group = dist.group.WORLD  # W = 1: the same code on a one-rank group

    def step(s: int, teacher: str) -> float:
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(1, model["vocab"], (1, s), generator=g)
        mask = (torch.arange(s) < s - PAD).long()[None]
        batch = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}
        for p in params:
            p.grad = None
        local = ra_mo.shard_eagle_batch(batch, group=group)
        out = target(**local, teacher="logits" if teacher == "logits" else "auto")
        out.loss.backward()
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
        total = out.loss.detach().clone()
        dist.all_reduce(total, group=group)
        return float(total)

    step(256, "tiled")
    step(256, "logits")
    return step, target.eagle_ttt_steps


def peak_task(model: dict, cases: list) -> list:
    """[{teacher, S, peak_mib, loss}] of each (teacher, S) in ``cases`` on this rank."""
    step, _ = _setup(model)
    return step_peaks(step, cases, "teacher")


def time_task(model: dict, s: int, rounds: int) -> dict:
    step, ttt = _setup(model)
    times = paired_rounds({t: functools.partial(step, s, t) for t in TEACHERS}, rounds)
    return {"median_s": {t: statistics.median(v) for t, v in times.items()},
            "rounds_s": times, "ttt_steps": ttt}


# ---------------------------------------------------------------------------- parent side


def run(args, out: Path) -> dict:
    model = {**MODEL, "vocab": args.vocab, "draft_vocab": args.draft_vocab}
    from ringattn.loss import DEFAULT_TILE

    data = {"machine": machine_info(), "model": model, "dtype": "fp32", "B": 1, "pad": PAD,
            "tile": DEFAULT_TILE, "seqlen": args.seqlen, "flat_l": args.flat_l,
            "memory": "peak live tensor bytes of one step (common.TensorBytes), max over ranks",
            "fixed": [], "flat": [], "time": None}
    t0 = time.monotonic()
    bar = tqdm(total=len(args.worlds) + 1, unit="world", dynamic_ncols=True)
    for w in args.worlds:
        bar.set_postfix_str(f"W={w}")
        cluster = Cluster(w, memory=True)
        cases = [(t, args.seqlen) for t in TEACHERS] + [(t, args.flat_l * w) for t in TEACHERS]
        try:
            ranks = cluster.run(peak_task, model, cases, timeout=3600)
        finally:
            cluster.close(force=True)
        for i, (t, s) in enumerate(cases):
            row = {"teacher": t, "W": w, "S": s, "L": s / w,
                   "peak_mib": max(r[i]["peak_mib"] for r in ranks), "loss": ranks[0][i]["loss"]}
            data["fixed" if i < len(TEACHERS) else "flat"].append(row)
        write_json(out / "modelopt_eagle.json", data)
        bar.update(1)
    if 2 in args.worlds:
        bar.set_postfix_str(f"time W=2 S={args.seqlen}")
        got = run_once(2, time_task, model, args.seqlen, args.rounds)[0]
        med = got["median_s"]
        data["time"] = {"W": 2, "S": args.seqlen, **got,
                        "tiled_over_logits": med["tiled"] / med["logits"],
                        "load_average": list(os.getloadavg())}
    bar.update(1)
    bar.close()
    data["summary"] = summarize(data)
    data["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(out / "modelopt_eagle.json", data)
    return data


def summarize(data) -> dict:
    def peaks(rows, t):
        return {r["W"]: r["peak_mib"] for r in rows if r["teacher"] == t}

    fixed = {t: peaks(data["fixed"], t) for t in TEACHERS}
    flat = {t: peaks(data["flat"], t) for t in TEACHERS}
    return {
        "logits_over_tiled_at_fixed_S": {w: fixed["logits"][w] / fixed["tiled"][w]
                                         for w in fixed["tiled"]},
        "flat_max_over_min": {t: max(v.values()) / min(v.values()) for t, v in flat.items()},
        "losses_agree": all(abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"])
                            for a in data["fixed"] for b in data["fixed"]
                            if a["W"] == b["W"] and a["teacher"] != b["teacher"]),
    }


def markdown(data) -> str:
    s = data["summary"]
    worlds = sorted({r["W"] for r in data["fixed"]})
    lines = [f"ModelOpt Eagle3 step (V = {data['model']['vocab']}, Vd = "
             f"{data['model']['draft_vocab']}, fp32, B = 1), peak live tensor MiB per rank:", "",
             "| teacher | " + " | ".join(f"S = {data['seqlen']}, W = {w}" for w in worlds)
             + " | " + " | ".join(f"L = {data['flat_l']}, W = {w}" for w in worlds) + " |",
             "|---|" + "---:|" * (2 * len(worlds))]
    for t in TEACHERS:
        row = [next(r["peak_mib"] for r in data["fixed"] if r["teacher"] == t and r["W"] == w)
               for w in worlds]
        row += [next(r["peak_mib"] for r in data["flat"] if r["teacher"] == t and r["W"] == w)
                for w in worlds]
        lines.append(f"| {t} | " + " | ".join(f"{x:.0f}" for x in row) + " |")
    lines += ["", "logits / tiled at the fixed S: " + ", ".join(
        f"W = {w}: {v:.1f}x" for w, v in s["logits_over_tiled_at_fixed_S"].items()),
        "at a fixed L, max / min over W: " + ", ".join(
            f"{t} {v:.3f}" for t, v in s["flat_max_over_min"].items()),
        f"losses of the two teachers agree (1e-5 relative): {s['losses_agree']}"]
    if data["time"]:
        tm = data["time"]
        lines.append(f"step time at W = 2, S = {tm['S']}: tiled / logits "
                     f"{tm['tiled_over_logits']:.2f}x (medians of {len(tm['rounds_s']['tiled'])}"
                     f" paired rounds; {tm['ttt_steps']} TTT steps)")
    return "\n".join(lines)


def plot(data, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["W"] for r in data["fixed"]})
    fig, ax = plt.subplots(figsize=(6, 4))
    for rows, what, style in ((data["fixed"], f"S={data['seqlen']}", "-"),
                              (data["flat"], f"L={data['flat_l']}", "--")):
        for t in TEACHERS:
            ax.plot(worlds, [next(r["peak_mib"] for r in rows if r["teacher"] == t
                                  and r["W"] == w) for w in worlds],
                    marker="o", ls=style, label=f"{t} teacher, {what}")
    ax.set_xlabel("cp (W)")
    ax.set_ylabel("peak live tensor MiB per rank")
    ax.set_yscale("log")
    ax.set_xticks(worlds)
    ax.legend(fontsize=7)
    ax.set_title(f"ModelOpt Eagle3 step, V={data['model']['vocab']}, "
                 f"Vd={data['model']['draft_vocab']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=MODEL["vocab"])
    ap.add_argument("--draft-vocab", type=int, default=MODEL["draft_vocab"])
    ap.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    ap.add_argument("--seqlen", type=int, default=2048, help="the fixed S of the peak table")
    ap.add_argument("--flat-l", type=int, default=512, help="tokens per rank of the flat runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="V 8192, Vd 2048, W 1 and 2, S 256")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--table", action="store_true",
                    help="print the table of the last run's JSON and redraw its plot")
    args = ap.parse_args(argv)
    out = args.out or (RESULTS / "smoke" if args.quick else RESULTS)
    if args.table:
        done = json.loads((out / "modelopt_eagle.json").read_text())
        plot(done, out / "modelopt_eagle.png")
        print(markdown(done))
        return
    if args.quick:
        args.vocab, args.draft_vocab, args.worlds = 8192, 2048, [1, 2]
        args.seqlen, args.flat_l, args.rounds = 256, 128, 1
    out.mkdir(parents=True, exist_ok=True)
    data = run(args, out)
    plot(data, out / "modelopt_eagle.png")
    print(markdown(data))


if __name__ == "__main__":
    main()
