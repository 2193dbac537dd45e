"""All-gather KV (Llama 3's context parallelism): every rank gathers the K/V of the whole
sequence, a few kv heads at a time, and attends its own queries to them; dK/dV go home by
reduce-scatter.

Legend: B batch, L local seq (S_pad / W), H heads, Hkv kv heads, G = H / Hkv, D head dim,
Dv value head dim, W world size, E = D + Dv.

The keys of the gathered buffer are in rank-major slot order (rank 0's shard, rank 1's,
...), so the ring's plan applies unchanged: its step t pairs this rank's queries with rank
(r - t) mod W's keys, which sit at columns (r - t) mod W * L of the buffer. ``merged_plan``
shifts every step's blocks there and makes them ONE step of a one-rank ring, which the
ring's forward and backward run as they are (same kernels, merge and empty-tile skipping).

Memory contract: K/V (and in the backward dK/dV) of the WHOLE sequence for the kv heads in
flight: ``heads_k_stride`` kv heads at a time (all by default). Nothing is kept between
forward and backward but this rank's shards: the backward gathers K/V again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .comm import LocalComm, all_gather_single, reduce_scatter_single
from .plan import Plan, kv_source
from .ring import Ring, attention_backward, attention_forward

__all__ = ["GatherGroup", "merged_plan", "allgather_attention_apply"]


def merged_plan(plan: Plan, world: int, rank: int, local_len: int) -> Plan:
    """The ring plan's blocks of every step as one step over the gathered keys."""
    blocks = []
    for t, step in enumerate(plan.steps):
        off = kv_source(rank, t, world) * local_len
        blocks.extend(replace(b, k_start=b.k_start + off, k_stop=b.k_stop + off) for b in step)
    return Plan((tuple(blocks),))


@dataclass(frozen=True)
class GatherGroup:
    """kv heads [kv_lo, kv_hi) (query heads [kv_lo * G, kv_hi * G)) and their ring."""

    kv_lo: int
    kv_hi: int
    q_lo: int
    q_hi: int
    ring: Ring


def _gather(k_BLHD, v_BLHD, group, world):
    """[B, L, n, D], [B, L, n, Dv] of every rank -> (k, v) [B, W*L, n, D|Dv], rank-major."""
    b, n, h, d = k_BLHD.shape
    kv = torch.cat((k_BLHD, v_BLHD), dim=3).contiguous()
    out = kv.new_empty(world * kv.numel())
    all_gather_single(out, kv.reshape(-1), group, what="all-gather of K/V")
    full = out.view(world, b, n, h, kv.shape[3]).transpose(0, 1).reshape(b, world * n, h, -1)
    return full[..., :d], full[..., d:]


def _scatter_home(dk_BSHD, dv_BSHD, group, world):
    """Sum every rank's [B, W*L, n, D|Dv] gradients and keep this rank's [B, L, n, D|Dv]."""
    b, s, h, d = dk_BSHD.shape
    n = s // world
    dkv = torch.cat((dk_BSHD, dv_BSHD), dim=3).view(b, world, n, h, -1).transpose(0, 1)
    dkv = dkv.contiguous()
    out = dkv.new_empty(dkv.numel() // world)
    reduce_scatter_single(out, dkv.reshape(-1), group, what="reduce-scatter of dK/dV")
    mine = out.view(b, n, h, -1)
    return mine[..., :d], mine[..., d:]


class _AllGatherAttention(torch.autograd.Function):
    """One forward and one backward for the strategy, per kv-head group."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, groups, pg, world, lse_grad):
        b, n, h, _ = q.shape
        out = q.new_empty(b, n, h, v.shape[3])
        lse = None
        for g in groups:
            k_all, v_all = _gather(k[:, :, g.kv_lo:g.kv_hi], v[:, :, g.kv_lo:g.kv_hi], pg, world)
            o, l = attention_forward(q[:, :, g.q_lo:g.q_hi], k_all, v_all,
                                     None if sinks is None else sinks[g.q_lo:g.q_hi], g.ring)
            del k_all, v_all
            if lse is None:
                lse = l.new_empty(b, h, n)
            out[:, :, g.q_lo:g.q_hi] = o
            lse[:, g.q_lo:g.q_hi] = l
        if any(ctx.needs_input_grad[:4]):
            ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.groups, ctx.pg, ctx.world, ctx.lse_grad = groups, pg, world, lse_grad
        if not lse_grad:
            ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dsinks = None if sinks is None else torch.zeros_like(sinks)
        if dout is None:
            dout = torch.zeros_like(out)
        with torch.autocast(q.device.type, enabled=False):
            for g in ctx.groups:  # every rank runs every gather and reduce-scatter
                qs, ks = slice(g.q_lo, g.q_hi), slice(g.kv_lo, g.kv_hi)
                k_all, v_all = _gather(k[:, :, ks], v[:, :, ks], ctx.pg, ctx.world)
                dq_g, dk_all, dv_all, ds = attention_backward(
                    g.ring, ctx.lse_grad, q[:, :, qs], k_all, v_all, out[:, :, qs],
                    lse[:, qs], None if sinks is None else sinks[qs], dout[:, :, qs],
                    None if dlse is None else dlse[:, qs], ctx.needs_input_grad[3])
                del k_all, v_all
                dq[:, :, qs] = dq_g
                dk[:, :, ks], dv[:, :, ks] = _scatter_home(dk_all, dv_all, ctx.pg, ctx.world)
                if ds is not None:
                    dsinks[qs] = ds
        return dq, dk, dv, dsinks, None, None, None, None


def allgather_attention_apply(q, k, v, sinks, groups, pg, world, lse_grad):
    """(out, lse) through the all-gather strategy's autograd Function."""
    return _AllGatherAttention.apply(q, k, v, sinks, tuple(groups), pg, world, lse_grad)


def local_ring(spec, plan, kernel, layout, world, rank, local_len, q_pos, kv_pos) -> Ring:
    """The one-rank ring over the gathered keys for one head group."""
    positions = None if q_pos is None else (q_pos, kv_pos)
    return Ring(LocalComm(), spec, merged_plan(plan, world, rank, local_len), kernel, 1, "all",
                layout, positions, query_shard=(rank, world))
