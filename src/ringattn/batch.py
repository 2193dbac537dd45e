"""Whole training batches under context parallelism: sharding, global labels, global metrics.

Legend: B batch, S global seq, L local seq, W world size.

``shard_batch`` turns the usual batch dict (``input_ids``, ``labels``, ``attention_mask``,
``position_ids``, packed-document ``cu_seq_lens_q``) into this rank's shard plus what ring
attention needs (a ``RingContext``), passed through the model's own keyword arguments, so
``model(**local)`` works with any model that forwards its kwargs to the attention
function (transformers models do; see ``ringattn.integrations.transformers``).

Labels are shifted on the GLOBAL sequence before sharding (``shift_labels``), so no token's
target is lost at a shard boundary, and the loss is normalised by the GLOBAL number of
target tokens (``num_items_in_batch``): each rank's loss is its share of the global mean,
and their sum over the group is the single-process loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .validate import check_strategy
from .comm import collective, is_hybrid_mesh, metadata_device, resolve_group
from .layouts import DEFAULT_LAYOUT, same_tag
from .masks import Mask, check_cu_seqlens, key_mask, key_padding, mask_key
from .sharding import positions, shard

__all__ = ["RingContext", "shard_batch", "all_reduce_metrics"]


@dataclass(eq=False)
class RingContext:
    """What an attention layer needs to run ring attention on one sharded batch."""

    group: dist.ProcessGroup
    layout: str
    seqlen: int
    """Global S of the batch."""
    cu_seqlens: tuple[int, ...] | None = None
    """Packed documents (flash-attn's offsets), or None."""
    mask: Mask | None = None
    """Key padding of the batch rows (None without padding); and-ed with causal/window."""
    left_padding: tuple[int, ...] | None = None
    """Padding tokens before the first real one, per batch row (None: no left padding);
    masks that count from a row's first token (Llama 4's chunks) need it."""
    strategy: str = "ring"
    """Which attention strategy the layers run (``ringattn.attention``'s ``strategy``)."""
    mesh: object = None
    """The hybrid's 2-D DeviceMesh when the batch was sharded over one (``group`` is then
    all of its ranks); the attention layers take it as their group."""
    mask_key: int = -1
    """``masks.mask_key(mask)``, set on creation: compiled code passes masks by key."""
    slot_positions: bool = False
    """``position_ids`` are the slot indices 0..S-1 that ``shard_batch`` made (the batch gave
    none) while a row has padding before a real token: models that count positions from
    the padding mask (OPT) would compute other ones, and their attention refuses this."""
    padded_ids: torch.Tensor | None = None
    """[B, L] this rank's ``input_ids`` with the batch's own ids at its left-padding slots,
    where ``input_ids`` hold the row's first real token (None without left padding): for
    models whose sequence layers read the padding positions (RWKV, xLSTM: transformers masks
    nothing there), which ``convert_mixers``' pre-hook gives them."""
    calls: int = 0
    """Attention calls that used this context (``record_call``): a model that never calls
    the registered attention function leaves it at 0 (``check_consumed``)."""

    def __post_init__(self) -> None:
        self.mask_key = mask_key(self.mask)

    def record_call(self) -> None:
        self.calls += 1

    def check_consumed(self, model=None) -> None:
        """Raise if no attention layer ran ring attention with this batch's context.

        Raises:
            ValueError: the model computed attention some other way (on its shard alone).
        """
        if self.calls == 0:
            what = "the model" if model is None else type(model).__name__
            if model is not None and "_ringattn_conversion" in getattr(model, "__dict__", {}):
                raise ValueError(
                    f"{what} was converted by ringattn, but none of its layers ran with this "
                    f"batch's ring context: the model was not called with the dict from "
                    f"shard_batch / prepare_batch (or a wrapper dropped its ring_context), so "
                    f"each rank mixed its shard alone")
            raise ValueError(
                f"{what} ran without calling ring attention or a converted sequence mixer: "
                f"it computes attention (or mixes the sequence) itself, so each rank saw its "
                f"shard alone (see integrations.transformers.check_model and convert)"
            )

    def attention_kwargs(self) -> dict:
        """Keyword arguments for ``ring_attention`` describing this batch (the mask by its
        key, so a compiled model guards on an int, not on a new mask object per batch)."""
        return dict(group=self.group if self.mesh is None else self.mesh, layout=self.layout,
                    seqlen=self.seqlen,
                    cu_seqlens=self.cu_seqlens, mask=self.mask_key)


def _check_seq_idx(seq_idx, cu, batch: int, seqlen: int) -> None:
    """A padding-free collator's ``seq_idx`` ([B, S] document index per token) must say
    what the documents do (zeros without them): the ring context carries the documents."""
    if seq_idx is None:
        return
    want = torch.zeros(seqlen, dtype=torch.long)
    for start in (cu or (0,))[1:-1]:
        want[start:] += 1
    if (not isinstance(seq_idx, torch.Tensor) or tuple(seq_idx.shape) != (batch, seqlen)
            or not bool((seq_idx.detach().cpu().long() == want).all())):
        raise ValueError(f"batch['seq_idx'] must be the [B={batch}, S={seqlen}] document index "
                         f"of each token, as the documents of position_ids / cu_seqlens "
                         f"{list(cu) if cu else None} give it")


def _documents(batch, seqlen):
    """cu_seqlens of a packed batch: given, or from position_ids that restart at 0."""
    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens"):
        if batch.get(key) is not None:
            return check_cu_seqlens(batch[key], seqlen)
    pos = batch.get("position_ids")
    if pos is None or pos.shape[0] != 1:
        return None
    starts = torch.nonzero(pos[0] == 0).flatten().tolist()
    if starts[:1] != [0] or len(starts) == 1:
        return None
    return check_cu_seqlens([*starts, seqlen], seqlen)


_READ = frozenset({"input_ids", "labels", "attention_mask", "position_ids", "cu_seqlens",
                   "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})
"""The batch entries ``shard_batch`` reads (flash-attn's offsets and lengths, and the
document index per token of padding-free collators, ``seq_idx``, describe the documents,
which the ring context carries; ``seq_idx`` is checked against them); any other entry must
be named in ``extra_keys``."""


def shard_batch(batch: dict, *, group=None, layout: str = DEFAULT_LAYOUT, extra_keys=(),
                ignore_index: int = -100, strategy: str = "ring") -> dict:
    """This rank's shard of a causal-LM batch, ready for ``model(**local)``.

    Arguments:
        batch: the global batch (the same on every rank): ``input_ids`` [B, S] and
            optionally ``labels`` [B, S] (unshifted, as transformers takes them),
            ``attention_mask`` [B, S] (1 real, 0 padding; left or right), ``position_ids``
            [B, S] (positions restarting at 0 mark packed documents when B = 1, as
            ``DataCollatorWithFlattening`` makes them) or ``cu_seq_lens_q`` (packed
            documents, flash-attn's offsets), and any tensor named in ``extra_keys``
            (sequence on dim 1).
        group: the context-parallel group (ProcessGroup, 1-D DeviceMesh or None), or the
            hybrid's 2-D ("ring", "ulysses") DeviceMesh.
        layout: "zigzag" (per document when the batch is packed), "contiguous", "striped".
        extra_keys: more per-token tensors to shard, returned under their own names.
        ignore_index: the label of tokens that have no target.
        strategy: "auto", "ring", "ulysses", "allgather" or "hybrid" (with the 2-D mesh):
            how the model's attention layers attend over the shards (``ringattn.attention``;
            the shards are the same for all of them).

    Returns:
        A dict: ``input_ids`` [B, L]; ``position_ids`` [B, L] (global positions, or
        positions inside each document when packed; RoPE needs these); when labels are
        given, ``labels`` and ``shift_labels`` [B, L] (the target of each local token,
        taken from the global sequence: token i's is ``labels[i + 1]``, as in one process;
        padding and the last token get ``ignore_index``; so does a padding token followed
        by a real one, whose prediction transformers counts although it attends to padding
        only. A packed row's document ends keep the next document's first label, as one
        process counts it with ``labels = input_ids``: give documents' first labels
        ``ignore_index``, as ``DataCollatorWithFlattening`` does, for no target across
        documents) and
        ``num_items_in_batch`` (the GLOBAL count of targets, so the model's loss is this
        rank's share of the global mean); ``ring_context`` (a ``RingContext`` for the
        attention function); and the ``extra_keys``.
        S need not divide W: padding slots get no target and are masked as keys, so no
        real token sees them. They, and a row's left padding (the tokens before its first
        real one), hold the row's first real token in ``input_ids``: such a query sees no
        key, so its attention output is 0, and a padding id with a zero embedding would
        leave its hidden state exactly 0 through the model, where roots of its magnitude
        (Gemma 3n's AltUp, without an epsilon) have an infinite gradient; that turns the
        zero gradient of these tokens into NaN in every parameter. Their logits are
        meaningless, as one process's are.

    Raises:
        ValueError: a missing or misshapen ``input_ids``, inconsistent shapes, bad
            documents, an entry it neither reads nor finds in ``extra_keys`` (the model
            would otherwise run without it, e.g. a prefix-LM's ``token_type_ids``). The
            batch is the same on every rank, so every rank raises; shapes that differ
            between ranks are caught by ``shard``'s agreement check.
    """
    pg = resolve_group(group)
    check_strategy(strategy, group)
    ids = original = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("batch['input_ids'] must be a [B, S] tensor")
    b, s = ids.shape
    for key in ("labels", "attention_mask", "position_ids", *extra_keys):
        t = batch.get(key)
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape[:2]) != (b, s)):
            raise ValueError(f"batch[{key!r}] must be a tensor of shape [B={b}, S={s}, ...]")
    unknown = sorted(str(k) for k, v in batch.items()
                     if v is not None and k not in _READ and k not in extra_keys)
    if unknown:  # the model would run without them: refuse rather than drop them
        raise ValueError(
            f"shard_batch does not shard batch entries {unknown}: the model would run without "
            f"them. Name per-token tensors ([B, S, ...]) in extra_keys= to shard them with "
            f"the batch; remove the others (pass them to the model yourself)")
    cu = _documents(batch, s)
    _check_seq_idx(batch.get("seq_idx"), cu, b, s)
    kw = dict(group=pg, layout=layout, seqlen=s, dim=1, cu_seqlens=cu)
    pos_local = positions(s, group=pg, layout=layout, cu_seqlens=cu)
    global_pos = pos_local[0] if cu is not None else pos_local
    real = global_pos < s  # local slots holding tokens (the rest pad S up to W shards)
    keep = batch.get("attention_mask")
    if keep is not None:  # left padding and the S-padding slots get the first real token
        leading_B = (keep.to(torch.bool).cumsum(1) == 0).sum(1).clamp(max=s - 1)
        first_B1 = ids.gather(1, leading_B[:, None].to(ids.device))
        ids = torch.where(torch.arange(s, device=ids.device) < leading_B[:, None].to(ids.device),
                          first_B1, ids)
    else:
        first_B1 = ids[:, :1]
    ids_local = shard(ids, **kw)
    local = {"input_ids": same_tag(torch.where(real.to(ids.device), ids_local, first_B1),
                                   ids_local)}
    if batch.get("position_ids") is not None:
        local["position_ids"] = shard(batch["position_ids"], **kw)
    elif cu is not None:  # RoPE restarts in every document
        local["position_ids"] = same_tag(pos_local[1].to(ids.device).expand(b, -1), ids_local)
    else:
        local["position_ids"] = shard(torch.arange(s, device=ids.device).expand(b, s), **kw)
    if batch.get("labels") is not None:
        labels = batch["labels"]
        shifted = torch.full_like(labels, ignore_index)
        shifted[:, :-1] = labels[:, 1:]
        if keep is not None:  # no target is padding, and no padding token has a target
            shifted[:, :-1].masked_fill_(keep[:, 1:] == 0, ignore_index)
            shifted.masked_fill_(keep == 0, ignore_index)
        shifted_local = shard(shifted, **kw)
        shifted_local = same_tag(shifted_local.masked_fill(~real.to(ids.device), ignore_index),
                                 shifted_local)
        local["labels"] = local["shift_labels"] = shifted_local
        local["num_items_in_batch"] = (shifted != ignore_index).sum()
    for key in extra_keys:
        local[key] = shard(batch[key], **kw)
    mask, left, slot_positions = None, None, False
    if keep is not None and bool((keep == 0).any()):
        real_keys = keep.to(torch.bool)
        leading = (real_keys.cumsum(1) == 0).sum(1)
        left = tuple(leading.tolist()) if bool((leading > 0).any()) else None
        lengths = real_keys.sum(1)
        if bool((real_keys == (torch.arange(s, device=keep.device) < lengths[:, None])).all()):
            mask = key_padding(lengths)  # right padding: equal lengths reuse one plan
        else:
            mask = key_mask(real_keys)  # value-keyed too: equal padding reuses one plan
        # padding before a real token: counting real tokens gives other positions than slots
        slot_positions = batch.get("position_ids") is None and cu is None and bool(
            (real_keys & (real_keys.cumsum(1) != torch.arange(1, s + 1, device=keep.device))).any())
    padded_ids = None
    if left is not None:  # the padding's own ids, for models that read them (RingContext)
        padded_ids = same_tag(torch.where(real.to(ids.device), shard(original, **kw),
                                          local["input_ids"]), ids_local)
    local["ring_context"] = RingContext(pg, layout, s, cu, mask, left, strategy,
                                        group if is_hybrid_mesh(group) else None,
                                        slot_positions=slot_positions, padded_ids=padded_ids)
    return local


def all_reduce_metrics(metrics: dict, group=None) -> dict:
    """Global means of per-rank (sum, count) pairs, with one all-reduce.

    Arguments:
        metrics: ``{name: (sum, count)}`` of this rank's tokens, e.g.
            ``{"loss": (loss_sum, n_tokens), "accuracy": (n_correct, n_tokens)}``
            (numbers or 0-d tensors).
        group: the group to reduce over (e.g. the context-parallel group).

    Returns:
        ``{name: global sum / global count}`` as Python floats (nan where the count is 0).
    """
    pg = resolve_group(group)
    names = list(metrics)
    flat = torch.tensor([float(x) for n in names for x in metrics[n]], dtype=torch.float64,
                        device=metadata_device(pg))
    collective("all_reduce_metrics", pg, lambda: dist.all_reduce(flat, group=pg, async_op=True))
    flat = flat.cpu().view(len(names), 2)
    return {n: float(flat[i, 0] / flat[i, 1]) if flat[i, 1] != 0 else float("nan")
            for i, n in enumerate(names)}


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
