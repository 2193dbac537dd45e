"""The peers of ``bench_longest.py``: one training step of the same model under PyTorch's own
context parallelism (here) and under ALST (``longest_alst.py``, in its own venv).

Legend: S global seq, L local seq (S / W), V vocabulary, W world size.

The model (``build_model``) is the issue's Llama shape: V=128256, hidden 128, MLP 512, 2
layers, 4 heads, 2 KV heads, fp32, random init from a fixed seed, SDPA attention. The batch
(``global_batch``) is [1, S] random token ids with ``labels = input_ids`` (transformers'
convention: the model predicts token t+1 at t, so S - 1 tokens are scored); every rank holds
the same global batch. The loss of every step is transformers' causal-LM loss of one process:
the mean cross-entropy over the S - 1 scored tokens.

PyTorch CP: ``torch_cp_step``
==============================

``torch_cp_step(model, optimizer, input_ids, labels, group)`` runs one step (forward,
backward, gradient all-reduce, ``optimizer.step()``) under PyTorch 2.13's public
``torch.distributed.tensor.experimental.context_parallel`` with a ``DeviceMesh`` over the
group on "cpu", ``buffers=[input_ids, shifted labels, position_ids]`` (sequence dim 1) and
torch's default load balancing (head-tail shards when S divides by 2W). The labels are shifted
over the whole sequence before they are sharded (a shard's last token's target lives on
another rank), each rank sums its tokens' cross-entropy and divides by the global count of
scored tokens, and the parameters' gradients are summed over the group: the loss and the
gradients are those of one process.

What refuses, exactly (torch 2.13.0+cpu, transformers 5.24.0, gloo):

1. torch's CP ring has handlers for the CUDA SDPA ops only
   (``aten._scaled_dot_product_{flash,efficient,cudnn}_attention`` and their backwards). On
   CPU, SDPA on the sharded DTensor q/k/v dispatches to
   ``aten._scaled_dot_product_flash_attention_for_cpu``, and DTensor raises::

       NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default
       does not have a sharding strategy registered.

   (``_sdpa_handler``, were it reached, says "CP only supports flash attention and memory
   efficient attention now."). No documented switch changes this: ``set_rotate_method``
   ("allgather"/"alltoall") only picks how K/V rotate once the ring runs, and
   ``torch.nn.attention.sdpa_kernel`` cannot select a CUDA kernel on CPU.
2. With transformers' models, the load-balanced ``position_ids`` buffer (rank 0 of 2 holds
   positions 0..S/4-1 and 3S/4..S-1) makes transformers' mask builder see a packed sequence
   (``masking_utils.find_packed_sequence_indices``: a jump in position_ids starts a new
   document) when no ``attention_mask`` is passed, so rank 0 builds a block-diagonal local
   mask and calls SDPA with ``attn_mask`` while rank 1 calls it with ``is_causal=True``: the
   ranks take different DTensor paths, and rank 0 hung in an all-gather
   (``redistribute_local_args``) while rank 1 raised the error above. Passing an all-ones
   2-D ``attention_mask`` of the local length makes transformers skip the packed check and
   call SDPA with ``is_causal=True`` on every rank (its causal mask is then torch's
   head-tail-aware ring mask), which is what ``torch_cp_step`` does.

What runs: the same ring torch uses on CUDA. Inside the context, ``torch_cp_step`` adds two
entries to the DTensor custom-op table that ``context_parallel`` installs (private torch
state, set only for the duration of the step, removed when the context exits):
``_scaled_dot_product_flash_attention_for_cpu`` (forward) and its backward go to torch's own
``_templated_ring_attention`` / ``_templated_ring_attention_backward`` with the CPU flash op
as the local kernel, exactly as torch's handlers do for the CUDA flash op (and as
``torch_ring.py`` calls them for attention alone). Everything else is public
``context_parallel``: its buffer sharding, its load balancer, its rotation (default
all-gather; ``set_rotate_method("alltoall")`` runs and is exact too). ``check_task`` compares
the loss and every parameter gradient with one process: at S=64 the loss is within 5e-8 and
every gradient within 1.4e-6 relative of one process at W = 1, 2, 4.

Memory: ``peak_task`` runs one warm-up step at a small S (AdamW's states and the parameters
exist before the measured step, as in a training loop), then the measured step under
``common.TensorBytes`` (live tensor bytes allocated inside the step; gradients are freed by
``zero_grad(set_to_none=True)`` before it, so they count). Ops under a TorchDispatchMode run
with the mode popped, so what torch's DTensor dispatch allocates for the ring (its local
out/logsumexp, the gathered K/V) would be invisible; the CPU handlers re-enter the measuring
mode around the ring so that it is counted.

ALST on CPU
===========

Versions: deepspeed 0.19.8 (sdist, no ops prebuilt), arctic-training 0.8.0 (wheel),
torch 2.13.0+cpu, transformers 5.24.0, Python 3.11.

* arctic-training 0.8.0 declares ``transformers<5.0.0,>=4.56`` (and wandb, openai, vllm
  extras...): it cannot be installed next to transformers 5.24 without downgrading
  transformers, so it is not installed. Nothing of it is needed: every ALST component
  named in the issue lives in DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp``
  (``UlyssesSPAttentionHF``, ``TiledFusedLogitsLoss``, ``TiledMLP``,
  ``sequence_tiled_compute``); arctic-training only applies them (its
  ``tiled_mlp_forward_common`` patch of the model's MLP and its SFT loss recipe), which
  ``longest_alst.py`` does the same way in a few lines.
* DeepSpeed runs on CPU ranks over gloo: with ``DS_ACCELERATOR=cpu`` its accelerator is
  "cpu" with communication backend "gloo" (oneCCL is not installed);
  ``deepspeed.comm.init_distributed(dist_backend="gloo")`` adopts the torch process group
  already initialised, and on first use JIT-builds its ``deepspeed_shm_comm_op`` (needs a
  C++ compiler and ninja; it built here). No DeepSpeed engine (ZeRO) is used: the step is
  plain AdamW, with the gradients summed over the group as the engine would reduce them.
* The loss, the gradients of every parameter and the step run at W = 1, 2 and 4
  (``longest_alst.py --check``: within 5e-7 relative of one process), with one caveat of
  ``TiledFusedLogitsLoss`` found by that check: it runs each tile's backward inside its
  forward with an incoming gradient of 1 and later scales only the hidden states' gradient,
  so the head weight's gradient ignores any factor applied to its output afterwards;
  dividing the tiled sum by the token count afterwards (arctic-training's SFT trainer) made
  ``lm_head.weight.grad`` 63 times too large at S=64 (63 scored tokens) in this plain-AdamW
  use. ``longest_alst.py`` divides inside the tiles, which is exact.

See ``longest_alst.py`` for the ALST step and its checks.

Usage (from the repository root)::

    python benchmarks/longest_peers.py --check            # S=64, W=2, 1, 4: CP vs one process
    python benchmarks/longest_peers.py --seqlens 1024,4096 --worlds 1,2 --cap-mib 4096
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Cluster, TensorBytes, TensorMemoryCapExceeded

__all__ = [
    "MODEL",
    "build_model",
    "check_task",
    "global_batch",
    "measure",
    "peak_task",
    "reference_step",
    "torch_cp_step",
]

MODEL = {"vocab_size": 128256, "hidden_size": 128, "intermediate_size": 512,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
"""The issue's Llama shape."""

SEED = 0
IGNORE = -100
WARMUP_S = 64
"""The warm-up step's S (creates AdamW's states before the measured step)."""


# ---------------------------------------------------------------------------- model, batch


def build_model(*, seed: int = SEED, attn_implementation: str = "sdpa", **overrides):
    """The issue's ``LlamaForCausalLM``: fp32, train mode, random init from ``seed`` (the
    same in every process); ``overrides`` replace ``MODEL`` entries (e.g. a small vocab)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**MODEL, **overrides}, max_position_embeddings=1 << 22,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         tie_word_embeddings=False)
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()
    return model.train()


def global_batch(s: int, vocab_size: int = MODEL["vocab_size"], *, seed: int = 1):
    """(input_ids, labels), each [1, S] int64, the same in every process; labels = input_ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (1, s), generator=g)
    return ids, ids.clone()


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets per position: labels[t + 1], IGNORE at the last position ([B, S])."""
    pad = torch.full_like(labels[:, :1], IGNORE)
    return torch.cat([labels[:, 1:], pad], dim=1)


def reference_step(model, optimizer, input_ids, labels) -> float:
    """One process, the same step (transformers' own loss); returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=labels, use_cache=False)
    out.loss.backward()
    optimizer.step()
    return out.loss.item()


# ---------------------------------------------------------------------------- torch CP

_MEASURE: TensorBytes | None = None
"""The TensorBytes mode measuring the current step, re-entered around the CPU ring."""


def _reenter_measure():
    return _MEASURE if _MEASURE is not None else contextlib.nullcontext()


def _cpu_flash_handlers():
    """DTensor custom-op handlers that send the CPU flash SDPA ops to torch's CP ring."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    aten = torch.ops.aten
    seq_dim = 2

    def local(t, name):
        if not isinstance(t, DTensor) or tuple(t.placements) != (Shard(seq_dim),):
            raise NotImplementedError(f"CPU CP handler: {name} must be a DTensor sharded on "
                                      f"dim {seq_dim}, got {type(t).__name__}")
        return t.to_local(), t.device_mesh

    def wrap(results, mesh):
        w = mesh.size()
        out = []
        for r in results:
            shape = list(r.shape)
            shape[seq_dim] *= w
            stride = torch.empty(shape, device="meta").stride()
            spec = DTensorSpec(mesh, (Shard(seq_dim),),
                               tensor_meta=TensorMeta(torch.Size(shape), stride, r.dtype))
            out.append(DTensor(r, spec, requires_grad=False))
        return tuple(out)

    def arg(args, kwargs, i, name, default):
        return args[i] if len(args) > i else kwargs.get(name, default)

    def forward(op_call, args, kwargs):
        q, mesh = local(args[0], "query")
        k, _ = local(args[1], "key")
        v, _ = local(args[2], "value")
        dropout_p = arg(args, kwargs, 3, "dropout_p", 0.0)
        is_causal = arg(args, kwargs, 4, "is_causal", False)
        if kwargs.get("attn_mask") is not None or dropout_p:
            raise NotImplementedError("torch's CP ring takes no attn_mask and no dropout")
        with _reenter_measure():
            out, lse = cp._templated_ring_attention(
                mesh.get_group(), seq_dim, op_call, q, k, v, is_causal=is_causal,
                scale=kwargs.get("scale"))
        return wrap((out, lse), mesh)

    def backward(op_call, args, kwargs):
        names = ("grad_out", "query", "key", "value", "out", "logsumexp")
        (dout, mesh), (q, _), (k, _), (v, _), (o, _), (lse, _) = (
            local(args[i], n) for i, n in enumerate(names))
        dropout_p = arg(args, kwargs, 6, "dropout_p", 0.0)
        is_causal = arg(args, kwargs, 7, "is_causal", False)
        if kwargs.get("attn_mask") is not None or dropout_p:
            raise NotImplementedError("torch's CP ring takes no attn_mask and no dropout")
        with _reenter_measure():
            dq, dk, dv = cp._templated_ring_attention_backward(
                mesh.get_group(), seq_dim, op_call, dout.contiguous(), "grad_out", q, k, v, o,
                lse, is_causal, dropout_p=0.0, scale=kwargs.get("scale"))
        return wrap((dq, dk, dv), mesh)

    return {aten._scaled_dot_product_flash_attention_for_cpu.default: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default: backward}


@contextlib.contextmanager
def _cpu_ring():
    """Inside ``context_parallel``: route the CPU flash SDPA ops to torch's ring."""
    from torch.distributed.tensor import DTensor

    table = DTensor._op_dispatcher._custom_op_handlers  # the dict context_parallel installed
    handlers = _cpu_flash_handlers()
    saved = {op: table[op] for op in handlers if op in table}
    table.update(handlers)
    try:
        yield
    finally:
        for op in handlers:
            table.pop(op, None)
        table.update(saved)


def torch_cp_step(model, optimizer, input_ids, labels, group=None, *, cpu_ring: bool = True):
    """One training step under ``torch.distributed.tensor.experimental.context_parallel``.

    Run on every rank of ``group`` with the same model (``attn_implementation="sdpa"``), the
    same optimizer over its parameters and the same global batch.

    Arguments:
        model: a transformers causal LM (its ``.model`` the decoder, ``.lm_head`` the head).
        optimizer: over ``model.parameters()``; stepped once.
        input_ids, labels: [1, S] int64, the global batch (not modified); labels in
            transformers' convention (unshifted; IGNORE (-100) tokens are not scored).
        group: the CP process group (default: the world).
        cpu_ring: route the CPU flash SDPA ops to torch's ring (see the module docstring);
            False runs torch's CP as shipped, which raises on CPU.

    Returns:
        The loss of one process over the whole sequence (a float, the same on every rank).
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    group = dist.group.WORLD if group is None else group
    s = input_ids.shape[1]
    targets = shift_labels(labels)
    count = int((targets != IGNORE).sum())
    ids = input_ids.clone()
    pos = torch.arange(s, dtype=torch.long)[None]
    mesh = DeviceMesh.from_group(group, "cpu")
    optimizer.zero_grad(set_to_none=True)
    with (context_parallel(mesh, buffers=[ids, targets, pos], buffer_seq_dims=[1, 1, 1],
                           no_restore_buffers={ids, targets, pos}),
          _cpu_ring() if cpu_ring else contextlib.nullcontext()):
        # an all-ones mask: transformers skips its packed-sequence check (the head-tail
        # positions would read as two documents) and calls SDPA with is_causal=True
        mask = torch.ones_like(ids)
        hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                             use_cache=False).last_hidden_state
        logits = model.lm_head(hidden).float()
        loss_sum = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1),
                                   ignore_index=IGNORE, reduction="sum")
        del logits
        (loss_sum / count).backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    optimizer.step()
    total = loss_sum.detach().reshape(1).clone()
    dist.all_reduce(total, group=group)
    return total.item() / count


# ---------------------------------------------------------------------------- rank tasks


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def check_task(s: int, vocab_size: int = MODEL["vocab_size"]) -> dict:
    """On every rank: the CP step's loss and gradients against one process's (this rank
    also runs the one-process step). Returns max relative errors (max |diff| / max |ref|).

    ``param_rel_after_step`` is larger than the gradients' error by design of AdamW, not of
    CP: its first step moves each weight by about lr * g / (|g| + eps), so gradient entries
    near eps (1e-8) turn fp32 rounding into differences up to lr."""
    torch.manual_seed(0)
    ids, labels = global_batch(s, vocab_size)
    ref = build_model(vocab_size=vocab_size)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_loss = reference_step(ref, opt_ref, ids, labels)
    model = build_model(vocab_size=vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = torch_cp_step(model, opt, ids, labels)
    grads = {n: _max_rel(p.grad, r.grad) for (n, p), r in zip(model.named_parameters(),
                                                               ref.parameters())}
    params = max(_max_rel(p.detach(), r.detach()) for p, r in zip(model.parameters(),
                                                                   ref.parameters()))
    worst = max(grads, key=grads.get)
    return {"rank": dist.get_rank(), "loss": loss, "ref_loss": ref_loss,
            "loss_rel": abs(loss - ref_loss) / abs(ref_loss), "grad_rel_max": grads[worst],
            "grad_rel_worst_param": worst, "param_rel_after_step": params}


def peak_task(s: int, cap_mib: float | None, abort_mib: float | None = None,
              vocab_size: int = MODEL["vocab_size"]) -> dict:
    """On every rank: a warm-up CP step at ``WARMUP_S``, then one CP step at S measured with
    ``TensorBytes``. ``fits``: the peak is at most ``cap_mib``; a rank whose live bytes pass
    ``abort_mib`` raises out of the step (the other ranks then wait in a collective until
    the cluster's timeout). Returns this rank's numbers."""
    global _MEASURE
    model = build_model(vocab_size=vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch_cp_step(model, opt, *global_batch(WARMUP_S, vocab_size))
    ids, labels = global_batch(s, vocab_size)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    mode = TensorBytes(cap=None if abort_mib is None else int(abort_mib * 2**20))
    err, loss = None, math.nan
    t0 = time.perf_counter()
    try:
        _MEASURE = mode
        with mode:
            loss = torch_cp_step(model, opt, ids, labels)
    except TensorMemoryCapExceeded as e:
        err = str(e)
    finally:
        _MEASURE = None
    peak = mode.peak / 2**20
    return {"rank": dist.get_rank(), "S": s, "peak_mib": peak, "error": err,
            "fits": err is None and (cap_mib is None or peak <= cap_mib), "loss": loss,
            "step_s": time.perf_counter() - t0}


def measure(w: int, seqlens: list[int], *, cap_mib: float | None = None,
            abort_mib: float | None = None, vocab_size: int = MODEL["vocab_size"],
            timeout_s: float = 3600, collective_timeout_s: float = 300) -> list[dict]:
    """PyTorch CP's per-rank peak live tensor bytes of one step at each S on W fresh gloo
    ranks (``Cluster(w, memory=True)``, one per S).

    Returns one record per S: {"peer": "torch_cp", "W", "S", "peak_mib" (max over ranks),
    "fits" (every rank's peak at most ``cap_mib``), "loss", "step_s", "ranks"}; a rank that
    passed ``abort_mib`` (default 4x the cap) gives {"fits": False, "error", ...}; ranks left
    waiting in a collective give up after ``collective_timeout_s`` (gloo's timeout).
    """
    if abort_mib is None and cap_mib is not None:
        abort_mib = 4 * cap_mib
    return run_peer("torch_cp", peak_task, w, seqlens, (cap_mib, abort_mib, vocab_size),
                    timeout_s=timeout_s, collective_timeout_s=collective_timeout_s)


def run_peer(peer: str, task, w: int, seqlens: list[int], task_args: tuple, *,
             timeout_s: float, collective_timeout_s: float, keep=()) -> list[dict]:
    """``task(s, *task_args)`` on W fresh gloo ranks for each S: one record per S, the peak
    the max over ranks (``keep``: more fields taken from rank 0's result)."""
    recs = []
    for s in seqlens:
        cluster = Cluster(w, memory=True, timeout_s=collective_timeout_s)
        try:
            ranks = cluster.run(task, s, *task_args, timeout=timeout_s)
        except (TimeoutError, AssertionError) as e:  # a rank aborted; the others hung
            recs.append({"peer": peer, "W": w, "S": s, "fits": False, "peak_mib": None,
                         "error": str(e).splitlines()[0]})
            continue
        finally:
            cluster.close(force=True)
        recs.append({"peer": peer, "W": w, "S": s,
                     "peak_mib": max(r["peak_mib"] for r in ranks),
                     "fits": all(r["fits"] for r in ranks),
                     "error": next((r["error"] for r in ranks if r["error"]), None),
                     "loss": ranks[0]["loss"], "step_s": max(r["step_s"] for r in ranks),
                     **{k: ranks[0][k] for k in keep}, "ranks": ranks})
    return recs


# ---------------------------------------------------------------------------- main


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="compare the CP step with one process (S=64, W=2, 1, 4)")
    ap.add_argument("--seqlens", default="1024,4096")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--cap-mib", type=float, default=None, help="per-rank cap on the peak")
    ap.add_argument("--abort-mib", type=float, default=None,
                    help="a rank raises past this many live MiB (default 4x the cap)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.check:
        for w, s in ((2, 64), (1, 64), (4, 64)):
            c = Cluster(w)
            try:
                res = c.run(check_task, s)
            finally:
                c.close()
            for r in res:
                print(f"W={w} S={s} rank {r['rank']}: loss {r['loss']:.7f} (one process "
                      f"{r['ref_loss']:.7f}, rel {r['loss_rel']:.1e}); grads max rel "
                      f"{r['grad_rel_max']:.1e} ({r['grad_rel_worst_param']}); params after "
                      f"AdamW rel {r['param_rel_after_step']:.1e}")
        return
    out = []
    for w in (int(x) for x in args.worlds.split(",")):
        for rec in measure(w, [int(x) for x in args.seqlens.split(",")], cap_mib=args.cap_mib,
                           abort_mib=args.abort_mib):
            print(f"torch CP W={w} S={rec['S']}: peak {rec['peak_mib']} MiB, fits {rec['fits']}")
            out.append(rec)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
