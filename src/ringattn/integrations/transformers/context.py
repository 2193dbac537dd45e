"""``context_parallel``: ring attention for a custom training loop, by one ``with`` line.

Legend: B batch, S global seq, L local seq, V vocabulary, W ranks of the group.

Every rank of the context-parallel group runs the same loop on the SAME global batches; the
model (``attn_implementation="ringattn"``) is called as in one process:

    from ringattn.integrations import transformers as ra_hf
    ra_hf.register()
    model = DDP(model, process_group=cp_group)       # or the bare model (see gradients)
    with ra_hf.context_parallel(model, cp_group):
        for batch in loader:                          # the same batch on every rank
            out = model(**batch)                      # input_ids, labels, attention_mask, ...
            out.loss.backward()                       # out.loss: the one-process loss
            optimizer.step(); optimizer.zero_grad()

What the manager does, per call of the model it was given (a forward pre-hook and a forward
hook on that module, the top-level one: the DDP wrapper when given one, so DDP sees the
shard; nothing else is hooked and nothing is patched):

* before the forward: every rank checks that the keyword batch is the same on all of them
  (shapes and a CRC of each tensor's bytes, one exchange of a small integer row through
  ringattn's agreement, so a rank with another batch or a refused argument makes EVERY rank
  raise a ValueError naming the entry instead of hanging or training on a mixture), then
  replaces it with this rank's shard from ``prepare_batch`` (labels shifted on the global
  sequence, ``num_items_in_batch`` the GLOBAL target count, the ``RingContext``), and sets
  ``use_cache=False``;
* after the forward: ``out.loss`` (this rank's share of the global mean) is summed over the
  group, so every rank holds the one-process loss; with ``gather_logits=True`` the logits
  of the whole sequence ([B, S, V], O(S V) memory per rank) replace the local ones.

Gradients: a global tensor (``out.loss``, gathered logits) counts once ON EACH RANK, so
each rank's ``backward`` leaves ``W`` times its share of the gradient (the loss's backward
multiplies by W; no communication), and the AVERAGE of the ranks' gradients over the group
is the one-process gradient. DDP over the group averages them (nothing to add); without DDP
call ``average_gradients(model, group)`` after ``backward`` (an all-reduce sum / W of every
gradient). Under dp x cp, DDP over all the ranks averages the replicas' one-process
gradients, as plain data parallelism would. A loss built from LOCAL outputs (logits without
``gather_logits``, hidden states) is this rank's shard only and is not scaled: gather first.

Refused, with a ValueError or TypeError on every rank: a model whose attention is not ring
attention (``check_attention``) or that ``check_model`` refuses (on entry); entering twice
on the same model (also through a wrapper and the model it wraps); positional arguments; a
per-token tensor argument it does not know (``inputs_embeds``, ...; name extra ones in
``extra_keys``); a batch that differs between ranks; ``return_dict=False``;
``logits_to_keep`` (it would keep the last logits of each shard); a KV cache
(``past_key_values``, ``use_cache=True``): ``model.generate`` runs decoding steps that
cannot be sharded, so it is refused under the manager (generate outside it, with a
non-ring attention implementation). Without labels the forward runs sharded and
``out.loss`` stays None (logits: local, or gathered with ``gather_logits``).
"""

from __future__ import annotations

import contextlib
import zlib

import torch
import torch.distributed as dist

from ...comm import ROW_INTS, agree, collective, resolve_group
from ...layouts import DEFAULT_LAYOUT
from ...sharding import unshard
from ...validate import check_strategy
from .attention import check_attention
from .batch import prepare_batch
from .checks import check_model

__all__ = ["average_gradients", "context_parallel"]

BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "cu_seq_lens_q",
              "cu_seq_lens_k", "cu_seqlens")
"""Keyword arguments that are the global batch: sharded (or read) by ``prepare_batch``,
never passed on to the model as given."""

_DROPPED = ("max_length_q", "max_length_k")
"""Flash-attention kwargs of a flattening collator that describe the global batch; the
shard's ``RingContext`` replaces them."""

_ACTIVE_ATTR = "_ringattn_context_parallel"
"""Set on a module (and the module a wrapper holds) while a manager is active on it."""


def _unwrap(model):
    """The transformers model inside DDP/FSDP-style wrappers (``.module`` chains)."""
    inner = model
    while isinstance(getattr(inner, "module", None), torch.nn.Module):
        inner = inner.module
    return inner


def _members(model) -> list:
    """The module given and every module it wraps."""
    found = [model]
    while isinstance(getattr(found[-1], "module", None), torch.nn.Module):
        found.append(found[-1].module)
    return found


class _GlobalLoss(torch.autograd.Function):
    """Forward: the sum of the ranks' shares (every rank gets the global loss). Backward:
    the incoming gradient times W: every rank's copy counts, so the ranks' gradients average
    to the one-process gradient (no communication in backward)."""

    @staticmethod
    def forward(ctx, share, group, world):
        ctx.world = world
        total = share.detach().clone()
        collective("context_parallel's loss all-reduce", group,
                   lambda: dist.all_reduce(total, group=group, async_op=True))
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.world, None, None


class _Counted(torch.autograd.Function):
    """Identity whose backward multiplies by W (a gathered tensor counts on every rank)."""

    @staticmethod
    def forward(ctx, x, world):
        ctx.world = world
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.world, None


def _digest(t: torch.Tensor) -> int:
    """A CRC of a tensor's bytes (its contents, as the ranks must agree on them)."""
    data = t.detach().to("cpu").contiguous()
    if data.dtype == torch.bool:
        data = data.to(torch.uint8)
    return zlib.crc32(data.view(-1).view(torch.uint8).numpy().tobytes()) & 0x7FFFFFFF


def _split_call(args, kwargs, extra_keys):
    """(global batch dict, the other kwargs) of one call.

    Raises:
        TypeError: positional arguments, a per-token tensor it does not know,
            ``return_dict=False``. ValueError: a KV cache (generation).
    """
    if args:
        raise TypeError(f"under context_parallel call the model with keyword arguments "
                        f"(model(input_ids=..., labels=...)), got {len(args)} positional "
                        f"argument(s)")
    if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
        raise ValueError(
            "context_parallel runs training and scoring forwards, not decoding: the call "
            "carries a KV cache (past_key_values or use_cache=True, as model.generate "
            "passes), whose steps cannot be sharded along the sequence; generate outside "
            "the context with a non-ring attention implementation")
    if kwargs.get("return_dict") is False:
        raise TypeError("context_parallel needs the model's output object (return_dict=False "
                        "gives a tuple whose loss it cannot make global)")
    if kwargs.get("logits_to_keep") not in (None, 0):
        raise TypeError(f"context_parallel computes the logits of every local token; "
                        f"logits_to_keep={kwargs['logits_to_keep']!r} would keep the last ones "
                        f"of each rank's shard, not of the sequence")
    batch = {k: kwargs[k] for k in (*BATCH_KEYS, *extra_keys) if kwargs.get(k) is not None}
    rest = {k: v for k, v in kwargs.items() if k not in batch and k not in BATCH_KEYS
            and k not in _DROPPED}
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise TypeError(f"context_parallel shards input_ids [B, S]; got "
                        f"{type(ids).__name__ if ids is None else tuple(ids.shape)} (pass "
                        f"input_ids by keyword; inputs_embeds is not supported)")
    unknown = sorted(k for k, v in rest.items() if isinstance(v, torch.Tensor) and v.dim() >= 1)
    if unknown:
        raise TypeError(f"context_parallel does not know how to shard the tensor argument(s) "
                        f"{unknown}: per-token tensors (sequence on dim 1) go in extra_keys=, "
                        f"others are not supported")
    return batch, rest


def _agree_on_batch(pg, keys, batch: dict, error) -> None:
    """Every rank raises if any rank failed or the ranks' batches differ (one exchange):
    the shapes of ``keys`` first, then their contents."""
    shapes, contents = {}, {}
    for key in keys:
        t = batch.get(key)
        if isinstance(t, (list, tuple)):
            t = torch.tensor(t)
        if error is not None or not isinstance(t, torch.Tensor):
            absent = -1 if error is not None else -2
            shapes[f"{key}'s dims"] = shapes[f"{key}'s B"] = shapes[f"{key}'s S"] = absent
            contents[key] = absent
            continue
        shapes[f"{key}'s dims"] = t.dim()
        shapes[f"{key}'s B"] = t.shape[0] if t.dim() > 0 else -3
        shapes[f"{key}'s S"] = t.shape[1] if t.dim() > 1 else -3
        contents[key] = _digest(t)

    def describe(name, value):
        if value == -2:
            return "none"
        if value == -3:
            return "no such dim"
        return f"contents with CRC {value:#010x}" if name in contents else str(value)

    try:
        agree(pg, {**shapes, **contents}, error, describe=describe,
              what="context_parallel's batch")
    except ValueError as exc:
        if error is not None or not str(exc).startswith("ranks disagree on "):
            raise
        raise ValueError(f"context_parallel needs the same global batch on every rank of the "
                         f"group; {exc}") from exc


def average_gradients(model, group=None) -> None:
    """Average every parameter's gradient over ``group`` (an all-reduce sum divided by W):
    without DDP, what makes the gradients after ``backward`` under ``context_parallel``
    the one-process gradients. A parameter without a gradient must have none on every rank."""
    pg = resolve_group(group)
    world = dist.get_world_size(pg)
    for p in model.parameters():
        if p.grad is not None:
            collective("average_gradients' all-reduce", pg,
                       lambda g=p.grad: dist.all_reduce(g, group=pg, async_op=True))
            p.grad.div_(world)


@contextlib.contextmanager
def context_parallel(model, group=None, *, layout: str = DEFAULT_LAYOUT, strategy: str = "ring",
                     gather_logits: bool = False, extra_keys=(), ignore_index: int = -100):
    """Shard every batch ``model`` is called with over ``group``; make the loss global.

    Arguments:
        model: a transformers causal LM with ``attn_implementation="ringattn"``, or a
            DDP (any ``.module``) wrapper of one: the hooks go on this top-level module.
        group: the context-parallel group (ProcessGroup, 1-D DeviceMesh, None: the default
            group), or the hybrid's 2-D ("ring", "ulysses") DeviceMesh.
        layout, strategy, extra_keys, ignore_index: as for ``ringattn.shard_batch``.
        gather_logits: replace ``out.logits`` (this rank's shard [B, L, V], in the layout's
            order) by the whole sequence's [B, S, V] on every rank (O(S V) memory).

    Yields:
        ``model``. Inside, ``model(**batch)`` with the GLOBAL batch (the same on every rank)
        returns the one-process ``loss`` on every rank; see the module doc for gradients.

    Raises:
        ValueError: the model's attention is not ring attention, ``check_model`` refuses
            it, or a manager is already active on it (or on a module it wraps or that wraps
            it); an unknown strategy. Per call: see the module doc.
    """
    inner = _unwrap(model)
    check_attention(inner)
    check_model(inner)
    check_strategy(strategy, group)
    pg = resolve_group(group)
    world = dist.get_world_size(pg)
    members = _members(model)
    busy = [type(m).__name__ for m in members if getattr(m, _ACTIVE_ATTR, False)]
    if busy:
        raise ValueError(f"context_parallel is already active on {busy[0]} (nested or "
                         f"re-entered, on it or on a module that wraps it or that it wraps): "
                         f"each batch would be sharded twice; use one context per model")
    extra_keys = tuple(extra_keys)
    keys = (*BATCH_KEYS, *[k for k in extra_keys if k not in BATCH_KEYS])
    if 3 + 4 * len(keys) > ROW_INTS:
        raise ValueError(f"context_parallel takes at most {(ROW_INTS - 3) // 4 - len(BATCH_KEYS)} "
                         f"extra_keys, got {len(extra_keys)}")
    current: dict = {}

    def before(module, args, kwargs):
        batch, rest, error = {}, {}, None
        try:
            batch, rest = _split_call(args, kwargs, extra_keys)
        except (TypeError, ValueError) as exc:
            error = exc
        _agree_on_batch(pg, keys, batch, error)  # raises on every rank if any rank failed
        if "num_items_in_batch" in rest:  # the caller's global count (gradient accumulation)
            batch["num_items_in_batch"] = rest.pop("num_items_in_batch")
        count = batch.pop("num_items_in_batch", None)
        local = prepare_batch(inner, batch, group=group, layout=layout, strategy=strategy,
                              extra_keys=extra_keys, ignore_index=ignore_index)
        if count is not None and "num_items_in_batch" in local:
            local["num_items_in_batch"] = count
        current["ctx"] = local["ring_context"]
        return (), {**rest, **local, "use_cache": False}

    def after(module, args, kwargs, output):
        ctx = current.pop("ctx")
        ctx.check_consumed(inner)
        if getattr(output, "loss", None) is not None:
            output["loss"] = _GlobalLoss.apply(output.loss, pg, world)
        if gather_logits and getattr(output, "logits", None) is not None:
            full = unshard(output.logits, group=ctx.group, layout=ctx.layout, dim=1,
                           seqlen=ctx.seqlen, cu_seqlens=ctx.cu_seqlens)
            output["logits"] = _Counted.apply(full, world)
        return output

    handles = [model.register_forward_pre_hook(before, with_kwargs=True),
               model.register_forward_hook(after, with_kwargs=True)]
    for m in members:
        setattr(m, _ACTIVE_ATTR, True)
    try:
        yield model
    finally:
        for h in handles:
            h.remove()
        for m in members:
            if hasattr(m, _ACTIVE_ATTR):
                delattr(m, _ACTIVE_ATTR)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
