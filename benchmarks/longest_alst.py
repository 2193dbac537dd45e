"""ALST's training step on CPU gloo ranks, for ``bench_longest.py``: DeepSpeed's Ulysses
sequence parallelism for transformers (``UlyssesSPAttentionHF``), its tiled logits+loss
(``TiledFusedLogitsLoss``) and tiled MLP (``TiledMLP``), with activation checkpointing.

Legend: S global seq, L local seq (S / W), H hidden, V vocabulary, W world size.

Runs in its own venv (DeepSpeed does not go into the project's)::

    python -m venv .venv-alst
    .venv-alst/bin/python -m pip install torch==2.13.0
    .venv-alst/bin/python -m pip install deepspeed==0.19.8 transformers==5.24.0 accelerate==1.15.0
    .venv-alst/bin/python -m pip install -e . --no-deps   # ringattn.testing for common.Cluster
    DS_ACCELERATOR=cpu .venv-alst/bin/python benchmarks/longest_alst.py --check
    DS_ACCELERATOR=cpu .venv-alst/bin/python benchmarks/longest_alst.py \\
        --seqlens 1024,2048 --world 2 --cap-mib 256 --json out.json

(``.venv-alst/`` is git-ignored. arctic-training itself is not installed: 0.8.0 requires
transformers<5; what it adds on top of DeepSpeed's components, the MLP patch and the loss
recipe, is done here; see "ALST on CPU" in ``longest_peers.py``.)

The step (``alst_step``), as ALST runs it with W ranks in one sequence-parallel group:

* the global batch is cut into W contiguous chunks of input_ids, position_ids and labels
  shifted over the whole sequence (what ``UlyssesSPDataLoaderAdapter`` does);
* attention: ``UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", W, 1)`` replaces
  transformers' "sdpa" attention by Ulysses' (all-to-all from sequence shards to head shards,
  SDPA over the whole sequence on H/W heads, all-to-all back); at W=1 it does nothing, as in
  ALST;
* MLP: each decoder layer's MLP runs through ``TiledMLP`` with ALST's tile count,
  ceil(L / H) tiles (max over ranks);
* logits and loss: ``TiledFusedLogitsLoss`` over the decoder's hidden states in tiles of
  ``loss_tile`` tokens (default: ALST's rule, tiles of about 1 GiB of fp32 logits,
  ceil(L V 4 / 2^30) tiles); each tile's cross-entropy sum is divided by the global count of
  scored tokens inside the tiled function, so the tiled output is this rank's share of the
  one-process mean loss;
* activation checkpointing of every decoder layer (transformers' gradient checkpointing,
  non-reentrant), as ALST's recipe turns on (its CPU offload of the checkpoints is moot
  on CPU);
* backward, the parameters' gradients summed over the group (what the DeepSpeed engine's
  reduction amounts to with replicated weights), ``AdamW.step()``.

Normalising inside the tiles, not after: ``TiledFusedLogitsLoss`` runs each tile's backward
inside its forward with an incoming gradient of 1 and, in its backward, scales only the
hidden states' gradient by the real incoming gradient; the head weight's gradient, already
accumulated, is not scaled. Dividing the tiled sum by the token count afterwards (as
arctic-training's SFT trainer does, ``total_loss_sum / total_good_items``) leaves the head's
gradient ``count`` times too large; ``--check`` measures that too (``head_grad_rel_after``).

Memory: one warm-up step at a small S (AdamW's states exist before the measured step), then
the measured step under ``common.TensorBytes``: the peak of live tensor bytes allocated in it
(gradients included, they are set to None first). ``fits``: the peak is at most the cap;
with ``--abort-mib`` (default 4x the cap) a rank whose live bytes pass that raises.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Cluster, TensorBytes, TensorMemoryCapExceeded
from longest_peers import (
    IGNORE,
    MODEL,
    WARMUP_S,
    build_model,
    global_batch,
    reference_step,
    run_peer,
    shift_labels,
)

__all__ = ["alst_setup", "alst_step", "check_task", "measure", "peak_task"]

LOGITS_TILE_BYTES = 2**30
"""ALST's default logits tile: about 1 GiB of fp32 logits (arctic-training's SFT trainer)."""

_SP: dict = {}
"""Per process: the sequence-parallel group ALST registered (register_with_transformers
replaces transformers' "sdpa" attention once per process)."""


# ---------------------------------------------------------------------------- setup


def _mlp_body(mlp, x):
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def _tiled_mlp_forward(mlp, x):
    """ALST's tiled MLP: ceil(L / H) tiles, the same count on every rank."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    n = torch.tensor(math.ceil(x.shape[-2] / x.shape[-1]))
    if mlp._alst_group is not None:
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=mlp._alst_group)
    params = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    return TiledMLP.apply(_mlp_body, mlp, x, int(n), params)


def alst_setup(model, group=None, *, tiled_mlp: bool = True, checkpointing: bool = True):
    """Make ``model`` (``attn_implementation="sdpa"``) an ALST model on ``group`` (the world:
    ALST's sequence-parallel group is built from the world); returns the SP group (None at
    W=1). Call once per model; Ulysses is registered once per process."""
    import deepspeed.comm as ds_dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    group = dist.group.WORLD if group is None else group
    w = dist.get_world_size(group)
    if w != dist.get_world_size():
        raise ValueError("ALST's register_with_transformers builds its SP group from the world; "
                         f"this group has {w} of {dist.get_world_size()} ranks")
    if not ds_dist.is_initialized():
        ds_dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    if "group" not in _SP:
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model, core_attn_implementation="sdpa", sequence_parallel_size=w,
            micro_batch_size=1, seq_length_is_variable=True)
        _SP["group"] = None if mpu is None else mpu.get_sequence_parallel_group()
        _SP["world"] = w
    elif _SP["world"] != w:
        raise RuntimeError(f"this process registered Ulysses for W={_SP['world']}, not {w}")
    sp_group = _SP["group"]
    if tiled_mlp:
        for layer in model.model.layers:
            layer.mlp._alst_group = sp_group
            layer.mlp.forward = types.MethodType(_tiled_mlp_forward, layer.mlp)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return sp_group


def loss_tiles(local_tokens: int, vocab_size: int, loss_tile: int | None) -> int:
    """Number of logits tiles: ``ceil(L / loss_tile)``, or ALST's ~1 GiB rule when None."""
    if loss_tile is None:
        return max(1, math.ceil(local_tokens * vocab_size * 4 / LOGITS_TILE_BYTES))
    return max(1, math.ceil(local_tokens / loss_tile))


# ---------------------------------------------------------------------------- the step


def alst_step(model, optimizer, input_ids, labels, group=None, *, loss_tile: int | None = None,
              normalize: str = "inside") -> float:
    """One ALST training step on every rank of ``group`` (after ``alst_setup``).

    Arguments:
        model, optimizer: the same on every rank (``alst_setup`` applied).
        input_ids, labels: [1, S] int64, the global batch, the same on every rank; labels
            unshifted (transformers' convention); S % W == 0.
        loss_tile: tokens per logits tile (None: ALST's ~1 GiB of fp32 logits per tile).
        normalize: "inside" (exact, see the module docstring) or "after" (the tiled sum
            divided afterwards, as arctic-training's trainer does; the head's gradient is
            then count times too large).

    Returns:
        The one-process loss over the whole sequence (the same float on every rank).
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    group = dist.group.WORLD if group is None else group
    w, rank = dist.get_world_size(group), dist.get_rank(group)
    s = input_ids.shape[1]
    if s % w:
        raise ValueError(f"S={s} does not split into {w} equal chunks")
    n = s // w
    targets = shift_labels(labels)
    count = int((targets != IGNORE).sum())
    chunk = slice(rank * n, (rank + 1) * n)
    ids = input_ids[:, chunk].contiguous()
    tgt = targets[:, chunk].contiguous()
    pos = torch.arange(rank * n, (rank + 1) * n, dtype=torch.long)[None]
    vocab = model.config.vocab_size
    scale = 1.0 / count if normalize == "inside" else 1.0

    def tile_loss(head_model, h, y):
        logits = head_model.lm_head(h).float()
        ce = torch.nn.functional.cross_entropy(logits.view(-1, vocab), y.view(-1),
                                               ignore_index=IGNORE, reduction="sum")
        return ce * scale

    optimizer.zero_grad(set_to_none=True)
    hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    tiles = loss_tiles(n, vocab, loss_tile)
    local = TiledFusedLogitsLoss.apply(tile_loss, model, hidden, tgt, None, tiles,
                                       [model.lm_head.weight], "sum")
    loss = local if normalize == "inside" else local / count
    loss.backward()
    del hidden
    if w > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
    optimizer.step()
    total = loss.detach().reshape(1).clone()
    if w > 1:
        dist.all_reduce(total, group=group)
    return total.item()


# ---------------------------------------------------------------------------- rank tasks


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def check_task(s: int, loss_tile: int | None, vocab_size: int = MODEL["vocab_size"]) -> dict:
    """On every rank: ALST's loss and gradients (normalised inside the tiles, and after)
    against one process's plain step. Returns max relative errors (max |diff| / max |ref|)."""
    ids, labels = global_batch(s, vocab_size)
    ref = build_model(vocab_size=vocab_size)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_loss = reference_step(ref, opt_ref, ids, labels)
    out = {"rank": dist.get_rank()}
    for normalize in ("inside", "after"):
        model = build_model(vocab_size=vocab_size)
        alst_setup(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = alst_step(model, opt, ids, labels, loss_tile=loss_tile, normalize=normalize)
        grads = {n: _max_rel(p.grad, r.grad) for (n, p), r in zip(model.named_parameters(),
                                                                   ref.parameters())}
        worst = max(grads, key=grads.get)
        out[normalize] = {"loss": loss, "ref_loss": ref_loss,
                          "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
                          "grad_rel_max": grads[worst], "grad_rel_worst_param": worst,
                          "head_grad_rel": grads["lm_head.weight"],
                          "grad_rel_max_except_head": max(v for k, v in grads.items()
                                                          if k != "lm_head.weight")}
    return out


def peak_task(s: int, cap_mib: float | None, abort_mib: float | None, loss_tile: int | None,
              tiled_mlp: bool, checkpointing: bool, vocab_size: int = MODEL["vocab_size"]) -> dict:
    """On every rank: a warm-up step at ``WARMUP_S``, then one step at S measured with
    ``TensorBytes`` (raising past ``abort_mib``). Returns this rank's numbers."""
    model = build_model(vocab_size=vocab_size)
    alst_setup(model, tiled_mlp=tiled_mlp, checkpointing=checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    alst_step(model, opt, *global_batch(WARMUP_S, vocab_size), loss_tile=loss_tile)
    ids, labels = global_batch(s, vocab_size)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    mode = TensorBytes(cap=None if abort_mib is None else int(abort_mib * 2**20))
    err, loss = None, math.nan
    t0 = time.perf_counter()
    try:
        with mode:
            loss = alst_step(model, opt, ids, labels, loss_tile=loss_tile)
    except TensorMemoryCapExceeded as e:
        err = str(e)
    peak = mode.peak / 2**20
    return {"rank": dist.get_rank(), "S": s, "peak_mib": peak, "error": err,
            "fits": err is None and (cap_mib is None or peak <= cap_mib), "loss": loss,
            "step_s": time.perf_counter() - t0,
            "loss_tiles": loss_tiles(s // dist.get_world_size(), vocab_size, loss_tile)}


def measure(w: int, seqlens: list[int], *, cap_mib: float | None = None,
            abort_mib: float | None = None, loss_tile: int | None = None,
            tiled_mlp: bool = True, checkpointing: bool = True,
            vocab_size: int = MODEL["vocab_size"], timeout_s: float = 3600,
            collective_timeout_s: float = 300) -> list[dict]:
    """ALST's per-rank peak live tensor bytes of one step at each S on W fresh gloo ranks.

    Returns one record per S: {"peer": "alst", "W", "S", "peak_mib" (max over ranks),
    "fits", "loss", "step_s", "loss_tiles", "ranks"}; a rank that passed ``abort_mib`` gives
    {"fits": False, "error", ...}; ranks left waiting in a collective give up after
    ``collective_timeout_s`` (gloo's timeout).
    """
    if abort_mib is None and cap_mib is not None:
        abort_mib = 4 * cap_mib
    return run_peer("alst", peak_task, w, seqlens,
                    (cap_mib, abort_mib, loss_tile, tiled_mlp, checkpointing, vocab_size),
                    timeout_s=timeout_s, collective_timeout_s=collective_timeout_s,
                    keep=("loss_tiles",))


# ---------------------------------------------------------------------------- main


def _versions() -> dict:
    import deepspeed
    import transformers

    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", default="1024,2048", help="global S, comma-separated")
    ap.add_argument("--world", type=int, default=2, help="W ranks (1, 2, 4)")
    ap.add_argument("--cap-mib", type=float, default=None, help="per-rank cap on the peak")
    ap.add_argument("--abort-mib", type=float, default=None,
                    help="a rank raises past this many live MiB (default 4x the cap)")
    ap.add_argument("--loss-tile", type=int, default=None,
                    help="tokens per logits tile (default: ALST's ~1 GiB of fp32 logits)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default the model's)")
    ap.add_argument("--no-tiled-mlp", action="store_true")
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--check", action="store_true",
                    help="loss and gradients against one process (S=64, W=2, 1, 4; "
                         "tiles of 16 tokens unless --loss-tile)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.check:
        for w in (2, 1, 4):
            c = Cluster(w)
            try:
                res = c.run(check_task, 64, args.loss_tile or 16)
            finally:
                c.close()
            for r in res:
                for k in ("inside", "after"):
                    e = r[k]
                    print(f"W={w} rank {r['rank']} normalize={k}: loss {e['loss']:.7f} (one "
                          f"process {e['ref_loss']:.7f}, rel {e['loss_rel']:.1e}); grads max rel "
                          f"{e['grad_rel_max']:.1e} ({e['grad_rel_worst_param']}), lm_head "
                          f"{e['head_grad_rel']:.1e}, others {e['grad_rel_max_except_head']:.1e}")
        return
    recs = measure(args.world, [int(x) for x in args.seqlens.split(",")], cap_mib=args.cap_mib,
                   abort_mib=args.abort_mib, loss_tile=args.loss_tile,
                   tiled_mlp=not args.no_tiled_mlp, checkpointing=not args.no_checkpointing,
                   **({} if args.vocab is None else {"vocab_size": args.vocab}))
    for r in recs:
        print(f"ALST W={r['W']} S={r['S']}: peak {r['peak_mib']} MiB, fits {r['fits']}"
              + (f" ({r['error']})" if r.get("error") else ""))
    if args.json:
        args.json.write_text(json.dumps({
            "peer": "alst", "W": args.world, "cap_mib": args.cap_mib,
            "abort_mib": args.abort_mib, "loss_tile": args.loss_tile,
            "tiled_mlp": not args.no_tiled_mlp, "checkpointing": not args.no_checkpointing,
            "versions": _versions(), "records": recs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
