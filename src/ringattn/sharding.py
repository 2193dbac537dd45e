"""Shard global tensors onto the ranks of a group, and gather them back.

Legend: S global seq, S_pad padded seq, L local seq (S_pad / W), W world size.

Both directions are differentiable, with the semantics of a replicated tensor (every rank
holds the same value, and a loss computed from it counts once):

* ``shard`` (replicated -> sharded): backward all-gathers the shards' gradients, so the
  gradient of the replicated input is the full gradient, on every rank.
* ``unshard`` (sharded -> replicated): backward keeps this rank's slice of the gradient.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .comm import agree, collective, group_members, resolve_group
from .layouts import (DEFAULT_LAYOUT, LAYOUT_NAMES, SHARD_TAG, check_origin, check_tag, get_layout,
                      local_positions, restore_index, tag_shard)
from .masks import check_cu_seqlens

__all__ = ["shard", "unshard", "positions"]

_LAYOUT_NAMES = LAYOUT_NAMES


def _take_local(x, layout, rank, world, seqlen, dim):
    """This rank's slots of the global tensor ``x`` (length seqlen on ``dim``), zero padded."""
    pos = local_positions(layout, rank, world, seqlen).to(x.device)
    valid = pos < seqlen
    picked = x.index_select(dim, pos.clamp(max=seqlen - 1))
    if bool(valid.all()):
        return picked
    shape = [1] * x.dim()
    shape[dim] = pos.numel()
    return torch.where(valid.view(shape), picked, torch.zeros((), dtype=x.dtype, device=x.device))


def _gather_global(x, layout, group, world, seqlen, dim):
    """All shards gathered and put in global order, cut to ``seqlen`` on ``dim``."""
    parts = [torch.empty_like(x) for _ in range(world)]
    collective("unshard's all-gather", group,
               lambda: dist.all_gather(parts, x.contiguous(), group=group, async_op=True))
    full = torch.cat(parts, dim=dim)
    idx = restore_index(layout, world, seqlen).to(x.device)
    return full.index_select(dim, idx[:seqlen])


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layout, group, seqlen, dim):
        ctx.args = (layout, group, seqlen, dim)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        return _take_local(x, layout, rank, world, seqlen, dim)

    @staticmethod
    def backward(ctx, grad):  # differentiable again: unshard's backward is shard's forward
        return _Unshard.apply(grad, *ctx.args), None, None, None, None


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layout, group, seqlen, dim):
        ctx.args = (layout, group, seqlen, dim)
        return _gather_global(x, layout, group, dist.get_world_size(group), seqlen, dim)

    @staticmethod
    def backward(ctx, grad):
        return _Shard.apply(grad, *ctx.args), None, None, None, None


def _normalize_dim(x, dim, what):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim!r} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def _layout(layout, seqlen, cu_seqlens):
    """(layout object, seqlen, digest of cu_seqlens or -2) for these arguments."""
    if cu_seqlens is None:
        return get_layout(layout), seqlen, -2
    cu = check_cu_seqlens(cu_seqlens, seqlen)
    return get_layout(layout, cu), cu[-1], zlib.crc32(repr(cu).encode()) & 0x7FFFFFFF


def _check(x, dim, layout, seqlen, group, what, local, cu_seqlens):
    """Shared checks of shard/unshard, agreed on by all ranks before any gather."""
    pg = resolve_group(group)
    world = dist.get_world_size(pg)
    error = None
    fields = {"dim": -1, "ndim": -1, "layout": -1, "seqlen": -1, "cu_seqlens": -1}
    lay = None
    try:
        dim = _normalize_dim(x, dim, what)
        if x.device.type == "meta":
            raise ValueError(f"{what} takes a tensor with data, got one on the meta device "
                             f"(shape {tuple(x.shape)}): materialise it first (e.g. "
                             f"torch.empty_like(x, device='cpu'))")
        tag = getattr(x, SHARD_TAG, None) if local else None
        if tag is not None:
            check_origin(f"{what}: the tensor", x, group_members(pg), "gathered", dim, x.dim())
            if seqlen is None and cu_seqlens is None:
                seqlen = tag.seqlen  # the shard's own S: right even when S was padded
        lay, seqlen, cu_digest = _layout(layout, seqlen, cu_seqlens)
        if seqlen is None:
            seqlen = x.shape[dim] * world if local else x.shape[dim]
        if not isinstance(seqlen, int) or isinstance(seqlen, bool) or seqlen < 1:
            raise ValueError(f"seqlen must be an int >= 1, got {seqlen!r}")
        if tag is not None:  # before the length: the tag says why it differs
            check_tag("the tensor", x, lay, seqlen, cu_digest, dist.get_rank(pg), world,
                      f"gathered by {what}")
        n = x.shape[dim]
        if local and n != lay.local_len(seqlen, world):
            raise ValueError(
                f"seqlen={seqlen} with layout {lay.name!r} on {world} ranks gives shards of "
                f"{lay.local_len(seqlen, world)} along dim {dim}, but the tensor has {n}"
            )
        if not local and n != seqlen:
            raise ValueError(f"tensor has {n} entries along dim {dim}, but seqlen={seqlen}")
        fields = {"dim": dim, "ndim": x.dim(), "layout": _LAYOUT_NAMES.index(lay.name),
                  "seqlen": seqlen, "cu_seqlens": cu_digest}
    except (TypeError, ValueError) as exc:  # reported on every rank by agree()
        error = exc
    agree(pg, fields, error, what=what)
    return pg, lay, seqlen, dim, fields["cu_seqlens"]


def shard(x: torch.Tensor, *, group=None, layout: str = DEFAULT_LAYOUT, dim: int = 1,
          seqlen: int | None = None, cu_seqlens=None) -> torch.Tensor:
    """This rank's shard of a global tensor, padded when S does not divide the layout.

    Arguments:
        x: the global tensor (the same on every rank), sequence along ``dim``.
        group: a ProcessGroup, a 1-D DeviceMesh, or None for the default group.
        layout: "contiguous", "zigzag" or "striped".
        dim: the sequence dimension (1 for [B, S, H, D]; 2 for an lse [B, H, S]).
        seqlen: the global S; defaults to ``x.shape[dim]`` (which must equal it).
        cu_seqlens: packed documents (flash-attn's [0, ..., S]); with ``layout="zigzag"``
            every document is zigzagged over the ranks (``layouts.DocumentZigzag``). Pass
            the same value to ``ring_attention``.

    Returns:
        The local shard, ``layout.local_len(S, W)`` long on ``dim``; padding slots are zero.
        It remembers its layout, S, documents, dim and group: ``ring_attention`` refuses it
        if called with others, over another group, or when it was not sharded along the
        sequence dim of [B, S_local, H, D] (tensors computed from it, e.g. by a projection,
        do not carry this).

    Raises:
        TypeError, ValueError: bad input or ranks that disagree, on every rank.
    """
    pg, lay, seqlen, dim, cu_digest = _check(x, dim, layout, seqlen, group, "shard", False,
                                             cu_seqlens)
    out = _Shard.apply(x, lay, pg, seqlen, dim)
    return tag_shard(out, lay, seqlen, cu_digest, dim, group_members(pg), dist.get_rank(pg))


def unshard(x: torch.Tensor, *, group=None, layout: str = DEFAULT_LAYOUT, dim: int = 1,
            seqlen: int | None = None, cu_seqlens=None) -> torch.Tensor:
    """Gather all ranks' shards into the global tensor, in global order, padding dropped.

    Arguments:
        x: this rank's shard, ``layout.local_len(S, W)`` long on ``dim``.
        group, layout, dim, cu_seqlens: as for ``shard``.
        seqlen: the global S; defaults to cu_seqlens[-1], else the S a tensor made by
            ``shard`` remembers, else W * x.shape[dim] (only right when S was not padded).

    Returns:
        The global tensor, ``seqlen`` long on ``dim``, on every rank.

    Raises:
        TypeError, ValueError: bad input or ranks that disagree, on every rank; a tensor
            made by ``shard`` with another layout (placement), S, documents, dim or group.
    """
    pg, lay, seqlen, dim, _ = _check(x, dim, layout, seqlen, group, "unshard", True, cu_seqlens)
    return _Unshard.apply(x, lay, pg, seqlen, dim)


def positions(seqlen: int, *, group=None, layout: str = DEFAULT_LAYOUT, cu_seqlens=None,
              device=None):
    """Global position of each of this rank's local slots (for RoPE and position embeddings).

    Arguments:
        seqlen: the global S.
        group, layout, cu_seqlens: as for ``shard``.
        device: where to put the result.

    Returns:
        [L] int64 global positions (entries >= seqlen are padding slots). With
        ``cu_seqlens``, a pair (global positions, positions inside each token's document),
        the second being what RoPE wants for packed documents (0 on padding slots).

    Raises:
        TypeError, ValueError: bad seqlen, layout or cu_seqlens.
    """
    pg = resolve_group(group)
    if not isinstance(seqlen, int) or isinstance(seqlen, bool) or seqlen < 1:
        raise ValueError(f"seqlen must be an int >= 1, got {seqlen!r}")
    lay, seqlen, _ = _layout(layout, seqlen, cu_seqlens)
    pos = local_positions(lay, dist.get_rank(pg), dist.get_world_size(pg), seqlen)
    if cu_seqlens is None:
        return pos.to(device) if device is not None else pos
    starts = torch.tensor(check_cu_seqlens(cu_seqlens, seqlen)[:-1])
    real = pos < seqlen
    doc = torch.searchsorted(starts, pos.clamp(max=seqlen - 1), right=True) - 1
    in_doc = torch.where(real, pos - starts[doc], torch.zeros_like(pos))
    return (pos, in_doc) if device is None else (pos.to(device), in_doc.to(device))


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
