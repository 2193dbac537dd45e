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

On entry, every rank checks the model (``check_attention``, ``check_model``) and the
settings, and the ranks agree on the outcome and on the settings (layout, strategy,
gather_logits, extra_keys, ignore_index, the model's class) in one exchange: a model
refused on one rank only, or settings that differ, raise the same ValueError on EVERY rank
(naming the cause) instead of leaving the others waiting for it.

What the manager does, per call of the model it was given (a forward pre-hook, run before
any pre-hook registered earlier on that module, such as ``convert``'s for hybrid families,
so they see the ``ring_context``; and a forward hook, run after the module's other forward
hooks; both on that module, the top-level one: the DDP wrapper when given one, so DDP sees
the shard; nothing else is hooked and nothing is patched):

* before the forward: every rank checks that the WHOLE call is the same on all of them, by
  construction rather than by a list of known arguments: each keyword argument's presence,
  each batch tensor's shape, dtype and a CRC of its bytes, each other value by a CRC of a
  canonical text of it (``ringattn.validate.option_text``: by value, so ``1`` and ``1.0``
  agree, and a 0-d tensor by its value: ``num_items_in_batch``, ``return_dict``,
  ``output_router_logits``, a flattening collator's ``max_length_q``, ... and whatever a
  later transformers adds).
  One exchange of a small integer row through ringattn's agreement: the batch tensors each
  get their own fields, the other arguments one combined digest; when anything differs,
  the ranks exchange the arguments' descriptions once more, so a rank with another batch, a
  differing or missing argument, or a refused argument makes EVERY rank raise a ValueError
  naming the argument instead of hanging or training on a mixture. Then the batch is
  replaced with this rank's shard from ``prepare_batch`` (labels shifted on the global
  sequence, ``num_items_in_batch`` the GLOBAL target count, the ``RingContext``), and
  ``use_cache=False`` is set;
* after the forward: ``out.loss`` (this rank's share of the global mean) is summed over the
  group, so every rank holds the one-process loss; with ``gather_logits=True`` the logits
  of the whole sequence ([B, S, V], O(S V) memory per rank) replace the local ones.
* with labels, the loss is computed in tiles (``loss_tile``, on by default: the decoder's
  hidden states against the shard's targets, one tile of logits alive at a time, forward
  and backward; ``ringattn.tiled_lm_loss``) and ``out.logits`` is a ``LogitsNotComputed``
  that raises on any use, saying how to get them: ``loss_tile=None`` or
  ``gather_logits=True`` keep the model's own untiled loss and its logits.

Targets: ``out.loss`` counts exactly the targets the model's own loss counts on the whole
batch in one process (token i predicts ``labels[i + 1]`` unless that is ``ignore_index``):

* packed rows (position ids restarting at 0, or ``cu_seq_lens_q``): MATCHED. One process
  counts the target of a document's last token in the next document's first label (with
  labels = input_ids); so does every entry point (``shard_batch``, ``prepare_batch``, the
  trainers, this manager), and that token's logits, computed in its own document, are one
  process's. A flattening collator's labels (-100 at each document's first token) have no
  such target either way.
* ``ignore_index``: the label that marks no target in the caller's labels; the model's
  shard carries -100 there, the label transformers' loss ignores.
* padding (``attention_mask`` 0): REFUSED when a target would involve it. A padding
  token's prediction (left padding: its query sees no real key) cannot be computed on
  shards as one process computes it, and the target of a real token in a padding label is
  not kept by the sharded shift; so labels that give a padding token a target, or make a
  padding label a target (labels = input_ids with padding; the first real token after
  left padding, as language-modelling collators leave it), raise a ValueError on every
  rank naming the row and token; put ``ignore_index`` there.

Gradients: a global tensor (``out.loss``, gathered logits) counts once ON EACH RANK, so
each rank's ``backward`` leaves ``W`` times its share of the gradient (the loss's backward
multiplies by W; no communication), and the AVERAGE of the ranks' gradients over the group
is the one-process gradient. DDP over the group averages them (nothing to add); without DDP
call ``average_gradients(model, group)`` after ``backward`` (an all-reduce sum / W of every
gradient, a None gradient on some ranks counting as zeros). Under dp x cp, DDP over all the
ranks averages the replicas' one-process gradients, as plain data parallelism would. A
loss built from LOCAL outputs (logits without ``gather_logits``, hidden states) is this
rank's shard only and is not scaled: gather first.

Refused, with a ValueError or TypeError on every rank: a model whose attention is not ring
attention (``check_attention``) or that ``check_model`` refuses (on entry, on any rank);
entering twice on the same model (also through a wrapper and the model it wraps);
positional arguments; a per-token tensor argument it does not know (``inputs_embeds``, ...;
name extra ones in ``extra_keys``); a call that differs between ranks; ``return_dict=False``;
``logits_to_keep`` (it would keep the last logits of each shard); a KV cache
(``past_key_values``, ``use_cache=True``): ``model.generate`` runs decoding steps that
cannot be sharded, so it is refused under the manager (generate outside it, with a
non-ring attention implementation); labels with targets involving padding (above).
Without labels the forward runs sharded and ``out.loss`` stays None (logits: local, or
gathered with ``gather_logits``).
"""

from __future__ import annotations

import contextlib
import re
import zlib

import torch
import torch.distributed as dist

from ... import comm
from ...comm import ROW_INTS, agree, collective, resolve_group
from ...layouts import DEFAULT_LAYOUT
from ...loss import DEFAULT_TILE, check_loss_tile
from ...sharding import unshard
from ...validate import check_strategy, option_text
from .attention import check_attention
from .batch import MODEL_IGNORE, shard_for
from .checks import check_model
from .head import tiled_call

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

_PER_KEY = 4
"""Agreement fields of each batch key (its dims, B, S and contents)."""
_REST = "the other arguments"
"""The agreement field digesting every keyword argument that is not a batch key."""
_MAX_KEYS = (ROW_INTS - 3 - 1) // _PER_KEY
"""Batch keys (BATCH_KEYS and extra_keys) one agreement row holds beside ``_REST``."""


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


def _crc(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _digest(t: torch.Tensor) -> int:
    """A CRC of a tensor's dtype, shape and bytes (its contents, as the ranks must agree on
    them; not its device, which differs between ranks)."""
    data = t.detach().to("cpu").contiguous()
    if data.dtype == torch.bool:
        data = data.to(torch.uint8)
    head = f"{t.dtype}{tuple(t.shape)}".encode()
    return zlib.crc32(data.reshape(-1).view(torch.uint8).numpy().tobytes(),
                      zlib.crc32(head)) & 0x7FFFFFFF


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _object_text(value) -> str:
    """An object that is no plain value: its type and its repr without memory addresses
    (which differ between processes)."""
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    try:
        text = _ADDRESS.sub("", repr(value))
    except (AttributeError, TypeError, ValueError, RuntimeError):  # the type alone
        text = ""
    return f"{kind} {text}" if text else kind


def _canonical(value) -> str:
    """A text of a keyword argument's value that is the same on ranks given the same value:
    ``ringattn.validate.option_text`` (numbers by value, so ``1`` and ``1.0`` agree and NaN
    agrees with NaN; a tensor by its shape and values, written out when small; containers
    item by item), other objects by their type and their repr without memory addresses."""
    return option_text(value, _object_text)


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


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


def _agree_all(pg, fields: dict, texts: dict, error, what: str, intro: str,
               arguments: dict | None = None) -> None:
    """Every rank raises the same exception if any rank failed (``error``) or the ranks'
    ``fields`` (ints) differ: one agreement of all of them; only when some differ, one more
    exchange of ``texts`` (each field's description) and ``arguments`` (the description of
    each argument that the field ``_REST`` digests), to name the first differing field, or,
    for ``_REST``, the first differing argument. ``intro`` starts the message.

    Raises:
        ValueError or TypeError: as ``agree``; ValueError "ranks disagree on NAME: ...".
    """
    got = agree(pg, fields, error, per_rank=tuple(fields), what=what)
    differing = [name for name in fields if any(v != got[name][0] for v in got[name])]
    if not differing:
        return
    # every rank sees the same table, so every rank makes this second exchange
    world = dist.get_world_size(pg)
    said: list = [None] * world
    dist.all_gather_object(said, (texts, arguments or {}), group=comm.control_group(pg))
    name = differing[0]
    if name == _REST:  # the first argument whose description differs between ranks
        keys = sorted(set().union(*(set(a) for _, a in said)))
        for key in keys:
            per_rank = {r: said[r][1].get(key, "none (not passed)") for r in range(world)}
            if len(set(per_rank.values())) > 1:
                break
        else:  # the digests differ but not the descriptions (a CRC collision of texts)
            per_rank = {r: f"digest {got[name][r]:#010x}" for r in range(world)}
            key = "the other arguments"
        name = key
    else:
        per_rank = {r: said[r][0].get(name, "?") for r in range(world)}
    has = ", ".join(f"{comm._ranks(rs)} {'have' if len(rs) > 1 else 'has'} {_short(v)}"
                    for v, rs in comm._by_value(per_rank))
    raise ValueError(f"{intro}ranks disagree on {name}: {has}")


def _call_fields(keys, kwargs: dict, error) -> tuple[dict, dict, dict]:
    """(fields, their descriptions, the other arguments' descriptions) of one call: each of
    ``keys`` (the batch keys) by its dims, B, S and contents; every other keyword argument
    (not None) in one digest of its name and canonical value."""
    fields, texts = {}, {}
    for key in keys:
        t = kwargs.get(key)
        if isinstance(t, (list, tuple)):
            try:
                t = torch.tensor(t)
            except (TypeError, ValueError, RuntimeError):
                pass
        names = (f"{key}'s dims", f"{key}'s B", f"{key}'s S", key)
        if error is not None:
            values, said = (-1,) * 4, ("?",) * 4
        elif t is None:
            values, said = (-2,) * 4, ("none",) * 4
        elif not isinstance(t, torch.Tensor):
            text = _canonical(t)
            values, said = (-4, -4, -4, _crc(text)), ("no tensor",) * 3 + (text,)
        else:
            b = t.shape[0] if t.dim() > 0 else -3
            s = t.shape[1] if t.dim() > 1 else -3
            values = (t.dim(), b, s, _digest(t))
            said = (str(t.dim()), str(b) if b >= 0 else "no such dim",
                    str(s) if s >= 0 else "no such dim",
                    f"contents with CRC {values[3]:#010x}")
        fields.update(zip(names, values))
        texts.update(zip(names, said))
    arguments = {} if error is not None else {
        k: _canonical(v) for k, v in kwargs.items() if k not in keys and v is not None}
    fields[_REST] = -1 if error is not None else _crc(
        "\n".join(f"{k}={v}" for k, v in sorted(arguments.items())))
    texts[_REST] = "?"
    return fields, texts, arguments


def _check_targets(batch: dict, ignore_index: int) -> None:
    """Refuse labels whose targets involve padding (see the module doc): token i predicts
    ``labels[i + 1]``; with ``attention_mask`` 0 at i or at i + 1 that target must be
    ``ignore_index``.

    Raises:
        ValueError: naming the first such token.
    """
    labels, keep = batch.get("labels"), batch.get("attention_mask")
    if (not isinstance(labels, torch.Tensor) or not isinstance(keep, torch.Tensor)
            or labels.dim() != 2 or labels.shape != keep.shape or labels.shape[1] < 2):
        return  # nothing to check, or shard_batch refuses the shapes
    real = keep.to(torch.bool)
    target = labels[:, 1:] != ignore_index
    from_padding = target & ~real[:, :-1] & real[:, 1:]
    to_padding = target & ~real[:, 1:]
    for bad, how in ((from_padding, ("is predicted by a padding token (attention_mask 0), "
                                     "which attends to padding only: its logits cannot be "
                                     "computed on shards as one process computes them")),
                     (to_padding, ("is a padding token's label (attention_mask 0) that one "
                                   "process counts as a target and the sharded shift does "
                                   "not"))):
        found = torch.nonzero(bad)
        if found.numel():
            row, i = (int(x) for x in found[0])
            raise ValueError(
                f"context_parallel computes the one-process loss, but labels[{row}, {i + 1}] "
                f"{how} ({int(bad.sum())} such target(s)); set the labels of padding, and of "
                f"the first real token after left padding, to ignore_index "
                f"({ignore_index}, e.g. -100), as one process should not count them either")


def average_gradients(model, group=None) -> None:
    """Average every parameter's gradient over ``group`` (an all-reduce sum divided by W):
    without DDP, what makes the gradients after ``backward`` under ``context_parallel``
    the one-process gradients.

    The ranks first agree on the parameter list (names, shapes, dtypes: one agreement) and
    on which parameters have a gradient on some rank (one small all-reduce of a flag per
    parameter), so every rank makes the same all-reduces, one per such parameter. A
    parameter whose ``.grad`` is None on some ranks but not on others (its tokens reached
    it on those ranks only: an expert no local token was routed to, a rank with no tokens
    for it) counts as zeros there, the share of a rank whose tokens did not reach it: it
    gets a zero gradient before the sum, and every rank ends with the average. A parameter
    without a gradient on every rank keeps None (optimizers skip it, as in one process).

    Raises:
        ValueError: on every rank, naming the first parameter whose name, shape or dtype
            differs between ranks (or that only some ranks have).
        PeerError: a rank did not make the call.
    """
    pg = resolve_group(group)
    world = dist.get_world_size(pg)
    params = list(model.named_parameters())
    listing = {name: f"shape {tuple(p.shape)}, {p.dtype}" for name, p in params}
    fields = {"parameters": len(params),
              "parameter list": _crc("\n".join(f"{n}: {t}" for n, t in listing.items()))}
    got = agree(pg, fields, None, per_rank=tuple(fields), what="average_gradients")
    if any(len(set(col)) > 1 for col in got.values()):
        said: list = [None] * world
        dist.all_gather_object(said, list(listing.items()), group=comm.control_group(pg))
        names = list(dict.fromkeys(n for rank_list in said for n, _ in rank_list))
        for name in names:
            per_rank = {r: dict(said[r]).get(name, "none") for r in range(world)}
            if len(set(per_rank.values())) > 1:
                has = ", ".join(f"{comm._ranks(rs)} {'have' if len(rs) > 1 else 'has'} {v}"
                                for v, rs in comm._by_value(per_rank))
                break
        else:  # the same parameters in another order
            name, has = "the order of the parameters", ", ".join(
                f"rank {r} has {[n for n, _ in said[r]][:8]}..." for r in range(world))
        raise ValueError(f"average_gradients needs the same parameters on every rank of the "
                         f"group; ranks disagree on parameter {name!r}: {has}")
    if world == 1 or not params:
        return
    flags = torch.tensor([p.grad is not None for _, p in params], dtype=torch.int32,
                         device=comm.metadata_device(pg))
    collective("average_gradients' agreement on which parameters have gradients", pg,
               lambda: dist.all_reduce(flags, group=pg, async_op=True))
    for (_, p), count in zip(params, flags.tolist()):
        if count == 0:  # no rank has a gradient: stays None
            continue
        if p.grad is None:  # the tokens of this rank did not reach it: its share is zero
            p.grad = torch.zeros_like(p)
        collective("average_gradients' all-reduce", pg,
                   lambda g=p.grad: dist.all_reduce(g, group=pg, async_op=True))
        p.grad.div_(world)


@contextlib.contextmanager
def context_parallel(model, group=None, *, layout: str = DEFAULT_LAYOUT, strategy: str = "ring",
                     gather_logits: bool = False, extra_keys=(), ignore_index: int = -100,
                     loss_tile: int | str | None = DEFAULT_TILE):
    """Shard every batch ``model`` is called with over ``group``; make the loss global.

    Arguments:
        model: a transformers causal LM with ``attn_implementation="ringattn"``, or a
            DDP (any ``.module``) wrapper of one: the hooks go on this top-level module.
        group: the context-parallel group (ProcessGroup, 1-D DeviceMesh, None: the default
            group), or the hybrid's 2-D ("ring", "ulysses") DeviceMesh.
        layout, strategy, extra_keys, ignore_index: as for ``ringattn.shard_batch``.
        gather_logits: replace ``out.logits`` (this rank's shard [B, L, V], in the layout's
            order) by the whole sequence's [B, S, V] on every rank (O(S V) memory).
        loss_tile: with labels, compute the loss from the decoder's hidden states in tiles
            (``ringattn.tiled_lm_loss``: one tile's logits alive at a time, forward and
            backward; the same loss and gradients) of this many tokens (an int) or of as
            many as a budget of one tile's logits allows (a string: ``"16MiB"``, the
            default); ``out.logits`` then raises on use (``head.LogitsNotComputed``); None:
            the model's own untiled loss and logits. Families whose head the
            tiles cannot follow run untiled (``head.tile_problem``); ``gather_logits``
            turns tiling off.

    Yields:
        ``model``. Inside, ``model(**batch)`` with the GLOBAL batch (the same on every rank)
        returns the one-process ``loss`` on every rank; see the module doc for gradients.

    Raises:
        ValueError: on every rank (one agreement): the model's attention is not ring
            attention, ``check_model`` refuses it, or a manager is already active on it (or
            on a module it wraps or that wraps it), on any rank; an unknown strategy; too
            many extra_keys; settings that differ between ranks. Per call: see the module
            doc.
    """
    pg = resolve_group(group)
    world = dist.get_world_size(pg)
    inner = _unwrap(model)
    members = _members(model)
    extra_keys = tuple(extra_keys)
    keys = (*BATCH_KEYS, *[k for k in extra_keys if k not in BATCH_KEYS])
    error = None
    try:  # local checks; their outcome travels in the entry's agreement
        check_attention(inner)
        check_model(inner)
        check_strategy(strategy, group)
        busy = [type(m).__name__ for m in members if getattr(m, _ACTIVE_ATTR, False)]
        if busy:
            raise ValueError(f"context_parallel is already active on {busy[0]} (nested or "
                             f"re-entered, on it or on a module that wraps it or that it "
                             f"wraps): each batch would be sharded twice; use one context "
                             f"per model")
        if len(keys) > _MAX_KEYS:
            raise ValueError(f"context_parallel takes at most {_MAX_KEYS - len(BATCH_KEYS)} "
                             f"extra_keys, got {len(extra_keys)}")
    except (TypeError, ValueError) as exc:
        error = exc
    if loss_tile is not None:
        loss_tile = check_loss_tile(loss_tile, "loss_tile")
    if gather_logits:
        loss_tile = None
    settings = {"layout": layout, "strategy": strategy, "gather_logits": bool(gather_logits),
                "loss_tile": loss_tile,
                "extra_keys": extra_keys, "ignore_index": ignore_index,
                "the model's class": f"{type(inner).__module__}.{type(inner).__qualname__}"}
    texts = {k: _canonical(v) for k, v in settings.items()}
    _agree_all(pg, {k: _crc(t) for k, t in texts.items()}, texts, error,
               what="context_parallel's entry",
               intro="context_parallel needs the same model and settings on every rank of "
                     "the group; ")
    current: dict = {}

    def before(module, args, kwargs):
        batch, rest, error = {}, {}, None
        try:
            batch, rest = _split_call(args, kwargs, extra_keys)
        except (TypeError, ValueError) as exc:
            error = exc
        fields, texts, arguments = _call_fields(keys, kwargs, error)
        # raises on every rank if any rank failed or the calls differ
        _agree_all(pg, fields, texts, error, what="context_parallel's batch",
                   intro="context_parallel needs the same global batch and arguments on "
                         "every rank of the group; ", arguments=arguments)
        _check_targets(batch, ignore_index)  # the same batch everywhere: every rank raises
        if "num_items_in_batch" in rest:  # the caller's global count (gradient accumulation)
            batch["num_items_in_batch"] = rest.pop("num_items_in_batch")
        count = batch.pop("num_items_in_batch", None)
        local = shard_for(inner, batch, group=group, layout=layout, strategy=strategy,
                          extra_keys=extra_keys, ignore_index=ignore_index)
        if count is not None and "num_items_in_batch" in local:
            local["num_items_in_batch"] = count
        current["ctx"] = local["ring_context"]
        stale = current.pop("call", None)
        if stale is not None:  # an earlier call that raised before its forward hook ran
            stale.abandon()
        call = tiled_call(inner, local, loss_tile, MODEL_IGNORE) if "shift_labels" in local \
            else None
        if call is not None:
            current["call"], local = call, call.kwargs
        return (), {**rest, **local, "use_cache": False}

    def after(module, args, kwargs, output):
        ctx = current.pop("ctx")
        ctx.check_consumed(inner)
        call = current.pop("call", None)
        if call is not None:
            output = call.finish(output)
        if getattr(output, "loss", None) is not None:
            output["loss"] = _GlobalLoss.apply(output.loss, pg, world)
        if gather_logits and getattr(output, "logits", None) is not None:
            full = unshard(output.logits, group=ctx.group, layout=ctx.layout, dim=1,
                           seqlen=ctx.seqlen, cu_seqlens=ctx.cu_seqlens)
            output["logits"] = _Counted.apply(full, world)
        return output

    # the pre-hook runs first, whatever was registered before (convert's hybrid pre-hooks
    # read the ring_context it adds); the forward hook runs last (after convert's, which
    # adjust out.loss)
    handles = [model.register_forward_pre_hook(before, with_kwargs=True, prepend=True),
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
