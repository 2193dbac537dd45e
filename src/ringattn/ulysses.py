"""Ulysses: all-to-all from sequence shards to head shards, attention over the whole
sequence for a slice of the heads, all-to-all back.

Legend: B batch, L local seq (S_pad / W), S global seq, H heads, Hkv kv heads, D head dim,
W world size; H_r the query heads of rank r.

Rank r attends with query heads [h_r, h_r+1), h_r = floor(r * H / W): any H and W (a rank
may hold no head when H < W). Its K/V heads are the ones its query heads read: when its
query heads start and end on kv-group boundaries (the usual case) it receives just those
kv heads, once each; otherwise (W > Hkv, or H not divisible by W) it receives one kv head
per query head, replicated as far as needed (DeepSpeed's rule, generalised), never more.

The received slots (every rank's shard in turn) are put in the order of a
``layouts.Grouped`` layout: for pure Ulysses that is global order, so the local attention
is plain attention over positions 0..S_pad-1 (padding slots last) through the ring's plan,
kernels and merge with one rank. In the 2-D hybrid each Ulysses group gathers the union of
its members' shards, and those unions are the slots of a ring over the other mesh
dimension (zigzag over W grouped by U is zigzag over W / U: balanced). The output goes back
the same way. Each all-to-all is an autograd Function whose backward is the reverse
all-to-all (kv gradients from duplicated heads are summed at home).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from .comm import all_to_all_single
from .layouts import Grouped

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


def _all_to_all(send, in_splits, out_splits, group, what):
    """One all-to-all of a contiguous buffer: its first ``in_splits[r]`` elements after the
    earlier ones go to rank r; returns the received buffer (``out_splits[r]`` from rank r).
    Waits at most ringattn's timeout (``PeerError`` naming ``what``)."""
    recv = send.new_empty(sum(out_splits))
    all_to_all_single(recv, send.reshape(-1), out_splits, in_splits, group,
                      what=f"Ulysses all-to-all ({what})")
    return recv


@dataclass(frozen=True)
class Exchange:
    """One Ulysses all-to-all of a [B, L, heads, E] tensor over ``group`` (``world`` ranks):
    ``send_heads[r]`` (global head indices) go to rank r, which receives them from every
    rank and puts the slots in the order of ``slots`` (a ``layouts.Grouped``: ring rank
    ``ring_rank`` of ``ring_world``; one rank for pure Ulysses, where that is global order)."""

    group: dist.ProcessGroup
    rank: int
    world: int
    send_heads: tuple[tuple[int, ...], ...]
    slots: Grouped
    ring_rank: int
    ring_world: int
    seqlen: int

    def order(self, device):
        return _order_on(self.slots, self.ring_rank, self.ring_world, self.seqlen, str(device))


@lru_cache(maxsize=64)
def _order_on(slots: Grouped, ring_rank: int, ring_world: int, seqlen: int, device: str):
    """(source rank, slot) of every local slot of the gathered layout, and the local slot of
    every received (rank-major) slot, on ``device``."""
    member = slots.member_slots(ring_rank, ring_world, seqlen)
    n = member.numel() // slots.size
    return tuple(t.to(device) for t in (member // n, member % n, torch.argsort(member)))


def _scatter(x_BLHE, ex: Exchange):
    """[B, L, heads, E] sequence shard -> [B, W*L, len(send_heads[me]), E] in the gathered
    layout's slot order (the received buffer, reordered by one copy)."""
    b, n, _, e = x_BLHE.shape
    me = len(ex.send_heads[ex.rank])
    heads = [h for hs in ex.send_heads for h in hs]
    send = x_BLHE.permute(2, 0, 1, 3)[heads]  # [sum of send heads, B, L, E]: one copy
    chunk = b * n * e
    recv = _all_to_all(send, [len(hs) * chunk for hs in ex.send_heads],
                       [me * chunk] * ex.world, ex.group, "sequence to heads")
    src, slot, _ = ex.order(x_BLHE.device)
    # [W, me, B, L, E] -> slot order [W*L, me, B, E] (one copy) -> [B, W*L, me, E]
    return recv.view(ex.world, me, b, n, e)[src, :, :, slot].permute(2, 0, 1, 3)


def _gather(y_BSHE, ex: Exchange, heads: int):
    """Inverse of ``_scatter``: [B, W*L, me, E] in slot order -> [B, L, heads, E], the
    chunks of each rank's heads summed into their global head (kv heads sent twice get
    both gradients)."""
    b, s_pad, me, e = y_BSHE.shape
    n = s_pad // ex.world
    _, _, to_slots = ex.order(y_BSHE.device)
    send = y_BSHE.permute(1, 2, 0, 3)[to_slots]  # rank-major [W*L, me, B, E]: one copy
    chunk = n * b * e
    recv = _all_to_all(send, [me * chunk] * ex.world,
                       [len(hs) * chunk for hs in ex.send_heads], ex.group, "heads to sequence")
    out = y_BSHE.new_zeros(b, n, heads, e)
    start = 0
    for hs in ex.send_heads:  # from rank r: [L, its heads, B, E]
        if hs:
            c = recv[start:start + len(hs) * chunk].view(n, len(hs), b, e)
            out.index_add_(2, torch.tensor(hs, device=out.device), c.permute(2, 0, 1, 3))
        start += len(hs) * chunk
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
    """Differentiable: each tensor (this rank's sequence shard of all its heads) -> the
    shards of every rank of the group (in the exchange's slot order: global order, S_pad
    long, for pure Ulysses) for the heads its exchange sends here. Every rank
    must call it with the same exchanges; the backward runs every reverse all-to-all."""
    return _SeqToHeads.apply(tuple(exchanges), *xs_BLHE)


def heads_to_seq(exchange, heads: int, *ys_BSHE):
    """Differentiable inverse of ``seq_to_heads`` for tensors of this rank's query heads
    (out, and lse as [B, W*L, H_r, 1])."""
    return _HeadsToSeq.apply(exchange, heads, *ys_BSHE)
