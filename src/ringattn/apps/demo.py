"""The demo: a transformers causal LM trained under context parallelism trains like one process.

The model, the data and the training loop are ``ringattn.apps.train``'s: a tiny random-weight
``LlamaForCausalLM`` (GQA) on the copy task (a random first half, then its copy, so a
second-half token is predictable only by attending S/2 positions back, which the zigzag
layout puts on another rank). It is trained twice from the same seed on the same batches
with the same optimizer:

* context-parallel: W gloo ranks, ``attn_implementation="ringattn"``, trained by
  ``RingTrainer`` (each rank calls the model on its shard from ``ringattn.shard_batch``;
  DDP sums the gradients over the ranks);
* single-process: the whole sequences in one process with transformers' own "sdpa" (or
  "eager") attention, trained by transformers' plain ``Trainer``.

Exact attention means the two loss curves agree to float32 rounding at every step; the demo
fails (``result["failures"]`` non-empty, ``ringattn demo`` exits 1) when they do not, or when
the model did not learn to copy (judged in runs of at least ``LEARN_STEPS`` steps).
"""

from __future__ import annotations

import json
import os
import time

from .train import SINGLE_ATTN, TrainConfig, plot_curves, spawn, train

__all__ = ["LEARN_STEPS", "REL_TOL", "run_demo"]

REL_TOL = 1e-4
"""Largest allowed |loss_cp - loss_single| / loss_single at any step.

Both runs do the same float32 arithmetic except for summation order (per-rank partial sums
of the loss and of the gradients, blockwise LSE merging in the ring instead of one
softmax), so a step's loss differs by an ulp or two (~1e-7 relative), and so do the
updates. Training can amplify such differences (see ``TrainConfig.init_std``); with the
demo's configuration the runs stay within a few 1e-6, as transformers' own "sdpa" and
"eager" do against each other. 1e-4 leaves an order of magnitude of headroom, while a
real error in attention or in the loss (a dropped key, a padding slot counted) shows at the
first step.
"""

LEARN_RATIO = 0.7
"""The copied half's final loss must be below this fraction of its initial loss."""

LEARN_STEPS = 100
"""The shortest run whose learning is judged: the copy task's loss sits on a plateau for
its first few dozen steps, so a shorter run that has not learned yet is no failure. A
shorter run checks the curves only (``result["learning_judged"]`` False; ``ringattn demo``
says so)."""


def run_costs(cp: dict, single: dict, t0: float) -> dict:
    """``seconds``, ``tokens_per_s`` and ``peak_rss_mib`` of a CP run and its one-process
    twin (training results with those keys), for a demo's result; ``t0`` started both."""
    return {
        "seconds": {"cp": cp["seconds"], "single": single["seconds"],
                    "total": time.perf_counter() - t0},
        "tokens_per_s": {"cp": cp["tokens_per_s_mean"], "single": single["tokens_per_s_mean"]},
        "peak_rss_mib": {"cp": cp["peak_rss_mib"], "single": single["peak_rss_mib"][0]},
    }


def save_result(result: dict, out_dir: str, name: str, plot) -> None:
    """Write ``out_dir/name.json`` and, through ``plot(result, path)``, ``out_dir/name.png``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(out_dir, f"{name}.png"))


def _table(result: dict, every: int) -> str:
    steps = len(result["cp_loss"])
    rows = sorted(set(range(0, steps, every)) | {steps - 1})
    lines = [
        f"{'step':>5}  {'CP loss':>10}  {'single loss':>11}  {'rel diff':>9}  "
        f"{'copied half: CP':>15}  {'single':>8}"
    ]
    for i in rows:
        lines.append(
            f"{i + 1:>5}  {result['cp_loss'][i]:>10.6f}  {result['single_loss'][i]:>11.6f}  "
            f"{result['rel_diff'][i]:>9.2e}  {result['cp_copy_loss'][i]:>15.6f}  "
            f"{result['single_copy_loss'][i]:>8.6f}"
        )
    return "\n".join(lines)


def _plot(result: dict, path: str) -> None:
    cfg, world, attn = result["config"], result["world"], result["single_attn"]
    curves = []
    for key, color, what in (("loss", "tab:blue", "all targets"),
                             ("copy_loss", "tab:orange", "copied half")):
        curves.append((f"one process ({attn}), {what}", result[f"single_{key}"],
                       dict(color=color, lw=3, alpha=0.45)))
        curves.append((f"ring attention W={world}, {what}", result[f"cp_{key}"],
                       dict(color=color, lw=1, ls="--")))
    plot_curves(
        path, curves, rel_diff=result["rel_diff"], tolerance=result["tolerance"],
        title=f"LlamaForCausalLM (transformers), copy task, S={cfg['seqlen']}, "
        f"layout={cfg['layout']}\nring attention on {world} gloo ranks vs one process, "
        f"same seed and batches",
    )


def run_demo(
    world: int = 2,
    steps: int = TrainConfig.steps,
    out_dir: str = "demo_out",
    layout: str = TrainConfig.layout,
    seqlen: int = TrainConfig.seqlen,
    *,
    seed: int = 0,
    single_attn: str = "sdpa",
    tolerance: float = REL_TOL,
    verbose: bool = True,
) -> dict:
    """Train the model under ring attention on ``world`` CPU ranks and in one process; compare.

    Arguments:
        world: number of gloo ranks W of the context-parallel run.
        steps: AdamW steps of each run.
        out_dir: where ``losses.json`` and ``losses.png`` are written (created if missing).
        layout: "contiguous", "zigzag" or "striped".
        seqlen: global sequence length S (need not divide 2W).
        seed: seed of the weights and the batches.
        single_attn: transformers' attention of the single-process run, "sdpa" or "eager".
        tolerance: largest allowed relative difference of the two losses at any step.
        verbose: show progress bars and print the loss table.

    Returns:
        dict with ``config``, ``world``, ``single_attn``, per-step lists ``cp_loss``,
        ``single_loss``, ``cp_copy_loss``, ``single_copy_loss``, ``rel_diff``;
        ``max_rel_diff`` (and its step), ``tolerance``, ``learned``, ``seconds``,
        ``tokens_per_s`` and ``peak_rss_mib`` of both runs (per rank for CP), and
        ``failures`` (empty when the curves agree and the model learned; the learning check
        applies only to runs of at least ``LEARN_STEPS`` steps: ``learning_judged``). The
        same dict is written to ``out_dir/losses.json``.

    Raises:
        ValueError: on a bad argument, naming it, before any process starts.
        torch.multiprocessing.ProcessRaisedException: when a rank fails.
    """
    if not (isinstance(world, int) and not isinstance(world, bool) and world >= 1):
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    if not (isinstance(tolerance, float) and 0 < tolerance <= 1e-3):
        raise ValueError(f"tolerance must be a float in (0, 1e-3], got {tolerance!r}")
    if single_attn not in SINGLE_ATTN:
        raise ValueError(f"single_attn must be one of {SINGLE_ATTN}, got {single_attn!r}")
    cfg = TrainConfig(steps=steps, layout=layout, seqlen=seqlen, seed=seed, log_every=0)
    t0 = time.perf_counter()
    cp = spawn(cfg, world=world, progress=verbose)
    single = train(cfg, attn_implementation=single_attn, progress=verbose)
    rel_diff = [abs(a - b) / abs(b) for a, b in zip(cp["loss"], single["loss"])]
    worst = max(range(len(rel_diff)), key=rel_diff.__getitem__)
    tail = max(1, min(10, steps // 10))
    first, last = cp["copy_loss"][0], sum(cp["copy_loss"][-tail:]) / tail
    learned = last < LEARN_RATIO * first
    failures = []
    if rel_diff[worst] > tolerance:
        failures.append(
            f"ring attention loss left the single-process loss: relative difference "
            f"{rel_diff[worst]:.3e} at step {worst + 1} (CP {cp['loss'][worst]:.7f}, single "
            f"{single['loss'][worst]:.7f}) exceeds the fp32 tolerance {tolerance:g}"
        )
    judged = steps >= LEARN_STEPS
    if judged and not learned:
        failures.append(
            f"the model did not learn to copy: copied-half loss went from {first:.4f} to "
            f"{last:.4f} (mean of the last {tail} steps), not below {LEARN_RATIO} x {first:.4f}"
        )
    result = {
        "config": cp["config"],
        "world": world,
        "single_attn": single_attn,
        "cp_loss": cp["loss"],
        "single_loss": single["loss"],
        "cp_copy_loss": cp["copy_loss"],
        "single_copy_loss": single["copy_loss"],
        "rel_diff": rel_diff,
        "max_rel_diff": rel_diff[worst],
        "max_rel_diff_step": worst + 1,
        "tolerance": tolerance,
        "copy_loss_first": first,
        "copy_loss_last": last,
        "learned": learned,
        "learning_judged": judged,
        "learn_steps": LEARN_STEPS,
        **run_costs(cp, single, t0),
        "failures": failures,
    }
    save_result(result, out_dir, "losses", _plot)
    if verbose:
        print(_table(result, every=25))
        print(
            f"final loss: ring attention W={world} {cp['loss'][-1]:.6f}, one process "
            f"({single_attn}) {single['loss'][-1]:.6f}; largest relative difference "
            f"{rel_diff[worst]:.2e} at step {worst + 1} (tolerance {tolerance:g})\n"
            f"copied-half loss {first:.4f} -> {last:.4f}; ring {cp['seconds']:.1f}s "
            f"({cp['tokens_per_s_mean']:.0f} tokens/s), single {single['seconds']:.1f}s "
            f"({single['tokens_per_s_mean']:.0f} tokens/s); wrote "
            f"{os.path.join(out_dir, 'losses.json')} and losses.png"
        )
    return result


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
