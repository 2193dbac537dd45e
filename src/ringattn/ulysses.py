"""Ulysses: all-to-all from sequence shards to head shards, attention over the whole
sequence for a slice of the heads, all-to-all back.

Legend: B batch, L local seq (S_pad / W), S global seq, H heads, Hkv kv heads, D head dim,
W world size; H_r the query heads of rank r.

Rank r attends with query heads [h_r, h_r+1), h_r = floor(r * H / W): any H and W (a rank
may hold no head when H < W). Its K/V heads are the ones its query heads read: when its
query heads start and end on kv-group boundaries (the usual case) it receives just those
kv heads, once each; otherwise (W > Hkv, or H not divisible by W) it receives one kv head
per query head, replicated as far as needed (DeepSpeed's rule, generalised), never more.

The received sequence is in rank-major slot order (every rank's shard in turn); it is put
in global order with the layout's restore index, so the local attention is plain attention
over positions 0..S-1 (the first S slots; the layout's padding slots come last) and reuses
the ring's plan, kernels and merge with one rank. The output goes back the same way. Each
all-to-all is an autograd Function whose backward is the reverse all-to-all (kv gradients
from duplicated heads are summed at home).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from .layouts import Layout, restore_index

__all__ = ["HeadSplit", "head_split", "seq_to_heads", "heads_to_seq"]


@dataclass(frozen=True)
class HeadSplit:
    """Which heads every rank attends with, for one (H, Hkv, W)."""

    q_heads: tuple[tuple[int, ...], ...]
    """Per rank: its global query heads (a contiguous range, possibly empty)."""
    kv_heads: tuple[tuple[int, ...], ...]
    """Per rank: the global kv head of each of its local kv heads (repeats possible)."""

    def q_range(self, rank: int) -> tuple[int, int]:
        heads = self.q_heads[rank]
        return (heads[0], heads[-1] + 1) if heads else (0, 0)


@lru_cache(maxsize=256)
def head_split(heads: int, kv_heads: int, world: int) -> HeadSplit:
    """Query heads split as evenly as possible over ``world`` ranks, and the kv heads each
    rank needs so that local query head j reads local kv head j // (H_r / Hkv_r)."""
    group = heads // kv_heads
    q, kv = [], []
    for r in range(world):
        lo, hi = r * heads // world, (r + 1) * heads // world
        mine = tuple(range(lo, hi))
        need = [h // group for h in mine]
        distinct = sorted(set(need))
        per = len(mine) // len(distinct) if distinct else 0
        aligned = bool(distinct) and per * len(distinct) == len(mine) and all(
            need[j] == distinct[j // per] for j in range(len(mine)))
        q.append(mine)
        kv.append(tuple(distinct) if aligned else tuple(need))
    return HeadSplit(tuple(q), tuple(kv))


def _all_to_all(send_list, recv_shapes, group, like):
    """One all-to-all of variable-size chunks along dim 0: ``send_list[r]`` goes to rank
    r; returns the chunks received from every rank (shapes ``recv_shapes``)."""
    send = torch.cat([t.reshape(-1) for t in send_list]) if send_list else like.new_empty(0)
    in_splits = [t.numel() for t in send_list]
    out_splits = [int(torch.Size(sh).numel()) for sh in recv_shapes]
    recv = like.new_empty(sum(out_splits))
    dist.all_to_all_single(recv, send.contiguous(), out_splits, in_splits, group=group)
    return [c.view(sh) for c, sh in zip(recv.split(out_splits), recv_shapes)]


@dataclass(frozen=True)
class Exchange:
    """One Ulysses all-to-all of a [B, L, heads, E] tensor: ``send_heads[r]`` (global head
    indices) go to rank r, which receives them from every rank."""

    group: dist.ProcessGroup
    rank: int
    world: int
    layout: Layout
    seqlen: int
    send_heads: tuple[tuple[int, ...], ...]

    def restore(self, device):
        return _restore_on(self.layout, self.world, self.seqlen, str(device))


@lru_cache(maxsize=64)
def _restore_on(layout: Layout, world: int, seqlen: int, device: str):
    idx = restore_index(layout, world, seqlen).to(device)
    return idx, torch.argsort(idx)


def _scatter(x_BLHE, ex: Exchange):
    """[B, L, heads, E] sequence shard -> [B, S_pad, len(send_heads[me]), E] in global order."""
    b, n, _, e = x_BLHE.shape
    me = len(ex.send_heads[ex.rank])
    send = [x_BLHE[:, :, list(hs)].permute(2, 0, 1, 3) for hs in ex.send_heads]
    chunks = _all_to_all(send, [(me, b, n, e)] * ex.world, ex.group, x_BLHE)
    # rank-major slot order [B, W*L, me, E], then global order
    full = torch.stack(chunks).permute(2, 0, 3, 1, 4).reshape(b, ex.world * n, me, e)
    to_global, _ = ex.restore(x_BLHE.device)
    return full.index_select(1, to_global)


def _gather(y_BSHE, ex: Exchange, heads: int):
    """Inverse of ``_scatter``: [B, S_pad, me, E] in global order -> [B, L, heads, E], the
    chunks of each rank's heads summed into their global head (kv heads sent twice get
    both gradients)."""
    b, s_pad, me, e = y_BSHE.shape
    n = s_pad // ex.world
    _, to_slots = ex.restore(y_BSHE.device)
    slots = y_BSHE.index_select(1, to_slots).reshape(b, ex.world, n, me, e)
    send = [slots[:, r].permute(2, 0, 1, 3) for r in range(ex.world)]
    chunks = _all_to_all(send, [(len(hs), b, n, e) for hs in ex.send_heads], ex.group, y_BSHE)
    out = y_BSHE.new_zeros(b, n, heads, e)
    for hs, c in zip(ex.send_heads, chunks):
        if hs:
            out.index_add_(2, torch.tensor(hs, device=out.device), c.permute(1, 2, 0, 3))
    return out


class _SeqToHeads(torch.autograd.Function):
    """Several tensors at once, so that the backward (all of their reverse all-to-alls) runs
    on every rank whenever any of them has a gradient: missing gradients are zeros."""

    @staticmethod
    def forward(ctx, exchanges, *xs):
        ctx.exchanges, ctx.heads = exchanges, [x.shape[2] for x in xs]
        return tuple(_scatter(x, ex) for x, ex in zip(xs, exchanges))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *(_gather(g.contiguous(), ex, h)
                        for g, ex, h in zip(grads, ctx.exchanges, ctx.heads)))


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, exchange, heads, *ys):
        ctx.exchange = exchange
        return tuple(_gather(y, exchange, heads) for y in ys)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *(_scatter(g.contiguous(), ctx.exchange) for g in grads))


def seq_to_heads(exchanges, *xs_BLHE):
    """Differentiable: each tensor (this rank's sequence shard of all its heads) -> the whole
    sequence (global order, S_pad long) of the heads its exchange sends here. Every rank
    must call it with the same exchanges; the backward runs every reverse all-to-all."""
    return _SeqToHeads.apply(tuple(exchanges), *xs_BLHE)


def heads_to_seq(exchange, heads: int, *ys_BSHE):
    """Differentiable inverse of ``seq_to_heads`` for tensors of this rank's query heads
    (out, and lse as [B, S_pad, H_r, 1])."""
    return _HeadsToSeq.apply(exchange, heads, *ys_BSHE)
