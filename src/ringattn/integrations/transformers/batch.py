"""``prepare_batch``: this rank's shard of a batch for a transformers model, after the
model checks every rank agrees on.
"""

from __future__ import annotations

import zlib

import torch

from ...batch import shard_batch
from ...layouts import same_tag
from ...comm import agree, resolve_group
from ...layouts import DEFAULT_LAYOUT
from .attention import check_attention
from .checks import POSITIONS_FROM_MASK, check_model, global_router_loss
from .state import conversion

__all__ = ["MODEL_IGNORE", "prepare_batch", "shard_for"]

MODEL_IGNORE = -100
"""The label transformers' causal-LM loss ignores (its ``ignore_index``, which models do
not let a caller change): the targets handed to a model carry it where there is none,
whatever ``ignore_index`` marked them in the caller's labels."""


def prepare_batch(model, batch: dict, *, group=None, layout: str = DEFAULT_LAYOUT, **kwargs) -> dict:
    """``check_attention`` and ``check_model``, then ``ringattn.shard_batch``, with the
    position ids this model would compute on the whole batch (``shard_batch`` alone gives
    slot indices 0..S-1, what Llama-style models compute; OPT-style models count real
    tokens from the padding mask, and their attention refuses a left-padded batch from
    ``shard_batch`` alone).

    Arguments:
        model: the transformers model (attn_implementation "ringattn").
        batch, group, layout, kwargs: as for ``ringattn.shard_batch``.

    Returns:
        This rank's shard of the batch, for ``model(**local)``: ``labels`` and
        ``shift_labels`` hold -100 where there is no target (what the model's loss ignores),
        whatever ``ignore_index`` the caller's labels use.

    Raises:
        ValueError: from ``check_attention`` (the model's attention is not ring
            attention), ``check_model`` or ``shard_batch``; labels holding -100 beside
            another ``ignore_index``.
    """
    _agree_on_model(model, group)
    return shard_for(model, batch, group=group, layout=layout, **kwargs)


def shard_for(model, batch: dict, *, group=None, layout: str = DEFAULT_LAYOUT, **kwargs) -> dict:
    """``prepare_batch`` without its model checks, for a caller whose ranks agreed on them
    already (``context_parallel``, on entry: one exchange per call fewer)."""
    keep = batch.get("attention_mask")
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family in POSITIONS_FROM_MASK and keep is not None and batch.get("position_ids") is None:
        keep = keep.long()
        batch = {**batch, "position_ids": keep.cumsum(1) * keep - 1}
    ignore = kwargs.get("ignore_index", -100)
    labels = batch.get("labels")
    if ignore != MODEL_IGNORE and isinstance(labels, torch.Tensor) and bool(
            (labels == MODEL_IGNORE).any()):
        raise ValueError(f"labels hold {MODEL_IGNORE}, which transformers' loss ignores, while "
                         f"ignore_index={ignore} marks the tokens without a target: use one of "
                         f"the two")
    local = shard_batch(batch, group=group, layout=layout, **kwargs)
    if ignore != MODEL_IGNORE and "shift_labels" in local:  # the model's loss ignores -100
        targets = same_tag(local["shift_labels"].masked_fill(local["shift_labels"] == ignore,
                                                             MODEL_IGNORE),
                           local["shift_labels"])
        local["labels"] = local["shift_labels"] = targets
    return local


def _model_digest(model) -> int:
    """What the ranks' models must agree on: class, family and what ``convert`` did to
    this instance (its converted layers' classes and its global router loss)."""
    kinds = sorted({type(m).__name__ for m in model.modules()
                    if type(m).__module__.startswith("ringattn.")})
    said = (type(model).__qualname__, getattr(getattr(model, "config", None), "model_type", None),
            sorted((conversion(model) or {}).items()), kinds, global_router_loss(model),
            getattr(getattr(model, "config", None), "_attn_implementation", None))
    return zlib.crc32(repr(said).encode()) & 0x7FFFFFFF


def _agree_on_model(model, group) -> None:
    """``check_attention`` and ``check_model`` on this rank, then one small exchange, so a
    rank whose model is refused (or converted otherwise than its peers') makes every rank
    raise the same error before anything is sharded."""
    error, digest = None, -1
    try:
        check_attention(model)
        check_model(model)
        digest = _model_digest(model)
    except (TypeError, ValueError) as exc:
        error = exc
    agree(resolve_group(group), {"the model (class, conversion)": digest}, error,
          describe=lambda name, value: f"model digest {value:#010x}",
          what="prepare_batch's model check")


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
