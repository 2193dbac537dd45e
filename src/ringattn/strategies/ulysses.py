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

This file owns the head-splitting machinery that Ulysses and the hybrid share (the
exchanges, ``Topology`` of one group or of the hybrid's mesh, ``heads_setup``,
``split_heads_attention``, the op pair ``ringattn::heads_attention`` /
``ringattn::heads_attention_backward`` for torch.compile, whose forward also returns the
head-sharded q, k, v, out and lse it attended with and whose backward runs the all-to-alls
and the loop's backward on them) and the public ``ulysses_attention``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import torch.distributed as dist

from ..comm import (HYBRID_DIMS, LocalComm, RingComm, all_to_all_single, group_from_key,
                    group_key, is_hybrid_mesh, mesh_groups, resolve_group)
from ..layouts import DEFAULT_LAYOUT, Grouped, Layout, grouped
from ..masks import Mask, head_offset, mask_key
from ..plan import Plan
from ..spec import AttnSpec, accumulator_dtype
from ..validate import (Checked, agreed, autocast_inputs, caller_error, check_local,
                        differentiable_once, heads_plan, no_autocast, op_call_args, op_tensors,
                        optional_tensor, tag_result, unit_stride)
from .ring import Ring, RingAttention, attention_backward, attention_forward, dropout_error

__all__ = ["Exchange", "HeadSplit", "Topology", "compiled_heads_attention", "head_split",
           "heads_to_seq", "seq_to_heads", "split_heads_attention", "split_heads_entry",
           "ulysses_attention"]

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
    @differentiable_once
    def backward(ctx, *grads):
        return (None, *(_gather(g.contiguous(), ex, h)
                        for g, ex, h in zip(grads, ctx.exchanges, ctx.heads)))


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, exchange, heads, *ys):
        ctx.exchange = exchange
        return tuple(_gather(y, exchange, heads) for y in ys)

    @staticmethod
    @differentiable_once
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


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    dropout_p: float = 0.0,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    layout: str = DEFAULT_LAYOUT,
    seqlen: int | None = None,
    mask: Mask | None = None,
    cu_seqlens=None,
    return_lse: bool = False,
    kernel=None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes=None,
):
    """``ring_attention``'s computation by Ulysses' all-to-all: the same arguments, shards,
    semantics and guarantees (exact; the same error on every rank before any collective).

    Each rank sends every other rank the heads it will attend with, for its own tokens (one
    all-to-all each for q, k, v), attends over the WHOLE sequence for its share of the
    heads, and sends the outputs back (one all-to-all; one more for lse). Any H, Hkv and
    W: heads split as evenly as possible (a rank may get none when H < W); kv heads are
    sent only to the ranks whose query heads read them, replicated only where a rank's
    query heads do not cover whole kv groups (see this module's docstring). Head-dependent
    masks see global head indices.

    Memory contract: a rank holds q, k, v and out of the whole sequence for its ~H/W heads
    (S x H/W, the same size as its shards of all heads), no tensor of all heads x S.

    Arguments, Returns, Raises: as ``ring_attention`` (no ``backward_overlap``: nothing is
    overlapped). sinks' gradient on each rank covers its own heads; sum it over the group.
    """
    return split_heads_entry(
        "ulysses", q, k, v, group=group, dropout_p=dropout_p, causal=causal, window_size=window_size,
        softmax_scale=softmax_scale, layout=layout, seqlen=seqlen, mask=mask,
        cu_seqlens=cu_seqlens, kernel=kernel, return_lse=return_lse, softcap=softcap,
        sinks=sinks, alibi_slopes=alibi_slopes, backward_overlap="all")




def split_heads_entry(strategy: str, q, k, v, *, dropout_p=0.0, **kwargs):
    """``ulysses_attention`` and ``hybrid_attention``: under torch.compile their custom op
    pair (end of this file), else ``split_heads_attention``; ``dropout_p`` other than 0
    refused (``dropout_error``)."""
    refused = dropout_error(dropout_p)
    if torch.compiler.is_compiling():
        if refused is not None:
            raise refused
        return compiled_heads_attention(strategy, *autocast_inputs(q, k, v), **kwargs)
    with caller_error(refused):  # raised by the agreement, on every rank, before any send
        result = split_heads_attention(q, k, v, strategy=strategy, **kwargs)
    if kwargs.get("return_lse"):
        return tag_result(q, *result, True)
    return tag_result(q, result, None, False)


@dataclass(frozen=True)
class Topology:
    """Where a head-splitting strategy runs: ``flat`` (every rank, shard order) is the
    Ulysses dimension (``uly``, U ranks, this rank u) x the ring dimension (``ring``, R
    ranks, this rank r), with flat rank r * U + u. Pure Ulysses has R = 1."""

    flat: dist.ProcessGroup
    uly: dist.ProcessGroup | None
    u: int
    U: int
    ring: dist.ProcessGroup | None
    r: int
    R: int
    mesh: bool = False
    """Made from the hybrid's 2-D mesh (else pure Ulysses over one group)."""
    error: Exception | None = None
    """Why this rank cannot run on this mesh (raised by every rank in the agreement)."""

    @staticmethod
    def ulysses(pg):
        w = dist.get_world_size(pg)
        return Topology(pg, pg, dist.get_rank(pg), w, None, 0, 1)

    @staticmethod
    def hybrid(mesh):
        flat, ring, uly = mesh_groups(mesh)
        t = Topology(flat, uly, dist.get_rank(uly), dist.get_world_size(uly), ring,
                      dist.get_rank(ring), dist.get_world_size(ring), mesh=True)
        # Every process group orders its members by global rank, while shards and the
        # hybrid's places go by mesh coordinate (ring r, Ulysses u at r * U + u): the two
        # agree on every rank exactly when the mesh lists its ranks in increasing order row
        # by row. A rank that sees a difference reports it in the agreement, so every rank
        # raises it (the others cannot see it from their own coordinates).
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(f"rank {dist.get_rank()} is not in the hybrid's mesh "
                             f"{mesh.mesh.tolist()}: call it only on the mesh's ranks")
        r, u = coordinate
        if (dist.get_rank(flat), t.r, t.u) != (r * t.U + u, r, u):
            return replace(t, error=ValueError(
                f"the hybrid's mesh places global rank {dist.get_rank()} at ring {r}, Ulysses "
                f"{u} (shard {r * t.U + u}), but torch orders the mesh's process groups by "
                f"global rank, which puts it at shard {dist.get_rank(flat)}: list the mesh's "
                f"ranks in increasing order row by row (make it with ra.hybrid_mesh(group, "
                f"ulysses=U) or init_device_mesh(..., mesh_dim_names={HYBRID_DIMS}))"))
        return t


@dataclass(frozen=True)
class _Heads:
    """One head-splitting call, agreed: this rank's query heads [lo, hi) of ``split``, the
    exchanges that move them (None when U = 1) and the ring over the unions."""

    topo: Topology
    checked: Checked
    split: object
    lo: int
    hi: int
    layout: Layout
    spec: AttnSpec
    steps: int
    ex_q: Exchange | None
    ex_kv: Exchange | None

    def ring(self, backward_overlap: str) -> Ring:
        comm = LocalComm() if self.topo.R == 1 else RingComm(self.topo.ring)
        return Ring(comm, self.spec, self.checked.plan, self.checked.kernel, self.steps,
                    backward_overlap, self.layout)


def _heads_setup(q, k, v, topo: Topology, *, return_lse, sinks, backward_overlap, steps=None,
                 extra_fields=(), extra_check=None, **args) -> _Heads:
    """Validate, agree and plan a head-splitting call (``steps`` None), or rebuild one that
    was agreed in its forward from the cached plan and the ``steps`` it agreed on."""

    def check():  # which inputs need a gradient decides which reverse all-to-alls run
        if topo.error is not None:
            raise topo.error
        wants = [bool(getattr(t, "requires_grad", False)) for t in (q, k, v, sinks)]
        own = () if extra_check is None else tuple(extra_check())
        return (sum(int(w) << i for i, w in enumerate(wants)), *own)

    mine = {}  # this rank's heads and the ring's spec and plan for them

    def planner(c: Checked) -> Plan:
        split = head_split(c.fields["heads"], c.fields["kv_heads"], topo.U)
        lo, hi = split.q_range(topo.u)
        lay = grouped(c.layout, topo.U, topo.R)
        spec, plan = heads_plan(c, lo, hi, lay, topo.R, topo.r, c.fields["batch"], q.device) \
            if hi > lo else (c.spec, Plan(((),) * topo.R))
        mine.update(split=split, lo=lo, hi=hi, layout=lay, spec=spec, mask=c.mask)
        return plan

    def region(j):  # what flat rank j's plan evaluates: its ring rank's rows, its heads
        lo_j, hi_j = mine["split"].q_range(j % topo.U)
        return mine["layout"], head_offset(mine["mask"], lo_j), topo.R, j // topo.U, hi_j - lo_j

    if steps is None:
        _, _, checked, last = agreed(
            q, k, v, topo.flat, ("grads", *extra_fields), check, planner=planner, region=region,
            return_lse=return_lse, strategy="hybrid" if topo.mesh else "ulysses",
            sinks=sinks, backward_overlap=backward_overlap, **args)
        steps = last + 1 if topo.R > 1 else 1
    else:  # agreed in the forward: validation again, no exchange
        checked = check_local(
            q, k, v, RingComm(topo.flat), args["causal"], args["window_size"],
            args["softmax_scale"], args["layout"], args["seqlen"], args["mask"],
            args["cu_seqlens"], args["kernel"], backward_overlap, return_lse, topo.flat,
            args["softcap"], sinks, args["alibi_slopes"], plan_ring=False)
        checked = replace(checked, plan=planner(checked))
    split, lay, s = mine["split"], mine["layout"], checked.spec.seqlen
    ex_q = ex_kv = None
    if topo.U > 1:
        ex_q, ex_kv = (Exchange(topo.uly, topo.u, topo.U, heads, lay, topo.r, topo.R, s)
                       for heads in (split.q_heads, split.kv_heads))
    return _Heads(topo, checked, split, mine["lo"], mine["hi"], lay, mine["spec"], steps,
                  ex_q, ex_kv)


def _split_heads_attention(q, k, v, topo: Topology, *, return_lse, sinks, backward_overlap,
                           extra_kv=(), core=None, extra_fields=(), extra_check=None, **args):
    """Ulysses over ``topo.uly`` (~H/U heads of the U members' shards on each rank), the ring
    over ``topo.ring`` on those unions, and back (see ``ulysses_attention`` and
    ``hybrid_attention``).

    ``extra_kv`` are more [B, L, Hkv, E] tensors sent with K/V (Eagle3's cached keys), and
    ``core(ring, q, k, v, extra_kv, sinks)`` -> (out, lse or None) replaces the attention
    on the gathered heads (default: ``RingAttention``); ``extra_fields``/``extra_check``
    as ``build_ring``'s."""
    q, k, v = autocast_inputs(q, k, v)
    hd = _heads_setup(q, k, v, topo, return_lse=return_lse, sinks=sinks,
                      backward_overlap=backward_overlap, extra_fields=extra_fields,
                      extra_check=extra_check, **args)
    b, h = q.shape[0], q.shape[2]
    lo, hi, ex_q = hd.lo, hd.hi, hd.ex_q
    if topo.U > 1:  # [B, U*L, heads_u, D] each
        q_f, k_f, v_f, *extra_f = seq_to_heads((ex_q, *[hd.ex_kv] * (2 + len(extra_kv))),
                                               q, k, v, *extra_kv)
    else:
        q_f, k_f, v_f, extra_f = q, k, v, list(extra_kv)
    with no_autocast(q.device.type):
        if hi > lo:
            ring = hd.ring(backward_overlap)
            heads_sinks = None if sinks is None else sinks[lo:hi]
            q_f, k_f, v_f, *extra_f = unit_stride(q_f, k_f, v_f, *extra_f)
            if core is None:
                out_f, lse_f = RingAttention.apply(q_f, k_f, v_f, heads_sinks, ring,
                                                    bool(return_lse))
            else:
                out_f, lse_f = core(ring, q_f, k_f, v_f, extra_f, heads_sinks)
        else:  # no head here; still part of the autograd graph, so backward's collectives run
            # a 0 that depends on every differentiable input (the only one needing a
            # gradient may be the sinks); empty slices, so an infinite sink stays out of it
            zero = sum(t.reshape(-1)[:0].sum().to(q_f.dtype)
                       for t in (q_f, k_f, v_f, *extra_f, *([] if sinks is None else [sinks])))
            out_f = q_f.new_zeros(b, q_f.shape[1], 0, v.shape[3]) + zero.to(q.dtype)
            lse_f = zero.new_zeros(b, 0, q_f.shape[1], dtype=accumulator_dtype(q.dtype)) + zero
    if topo.U == 1:
        return (out_f, lse_f) if return_lse else out_f
    if not return_lse:
        return heads_to_seq(ex_q, h, out_f)[0]
    out, lse_BLH1 = heads_to_seq(ex_q, h, out_f, lse_f.transpose(1, 2).unsqueeze(-1))
    return out, lse_BLH1.squeeze(-1).transpose(1, 2)


def split_heads_attention(q, k, v, *, group, strategy: str, **kwargs):
    """Ulysses (``strategy="ulysses"``, ``group`` a group) or the hybrid (``"hybrid"``,
    ``group`` its 2-D mesh) with ``_split_heads_attention``'s hooks, for attention
    variants built on them (Eagle3's TTT)."""
    if strategy == "hybrid":
        if not is_hybrid_mesh(group):
            what = (f"a {group.ndim}-D DeviceMesh" if hasattr(group, "ndim")
                    else type(group).__name__)
            raise TypeError(f"strategy='hybrid' takes group= a 2-D DeviceMesh with "
                            f"mesh_dim_names={HYBRID_DIMS}, got {what}")
        topo = Topology.hybrid(group)
    else:
        topo = Topology.ulysses(resolve_group(group))
    return _split_heads_attention(q, k, v, topo, **kwargs)




# -- the compile op pair ------------------------------------------------------------------

def _heads_call(q, k, v, sinks, cu_seqlens, alibi_slopes, strategy, group_key_, causal,
                window_left, window_right, softmax_scale, layout, seqlen, mask_key, softcap,
                kernel, backward_overlap, return_lse, steps=None):
    """``api._heads_setup`` for the op's values: agreed (forward) or rebuilt (``steps``)."""
    
    group = group_from_key(group_key_)
    topo = (Topology.hybrid(group) if strategy == "hybrid"
            else Topology.ulysses(resolve_group(group)))
    args = op_call_args(cu_seqlens, "", causal, window_left, window_right, softmax_scale,
                      layout, seqlen, mask_key, resolve=False)
    return _heads_setup(
        q, k, v, topo, return_lse=return_lse, sinks=optional_tensor(sinks),
        backward_overlap=backward_overlap, steps=steps, kernel=kernel, softcap=softcap,
        alibi_slopes=None if alibi_slopes.numel() == 0 else alibi_slopes.tolist(), **args)


def _lse_to_seq(lse_BHL, ex, heads):
    return _gather(lse_BHL.transpose(1, 2).unsqueeze(-1).contiguous(), ex, heads).squeeze(-1).transpose(1, 2)


def _lse_to_heads(lse_BHL, ex):
    return _scatter(lse_BHL.transpose(1, 2).unsqueeze(-1).contiguous(), ex).squeeze(-1).transpose(1, 2)


@torch.library.custom_op("ringattn::heads_attention", mutates_args=())
def _heads_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
    cu_seqlens: torch.Tensor, alibi_slopes: torch.Tensor, strategy: str, group_key_: str,
    causal: bool, window_left: int, window_right: int, softmax_scale: float, layout: str,
    seqlen: int, mask_key: int, softcap: float, kernel: str, backward_overlap: str,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    hd = _heads_call(q, k, v, sinks, cu_seqlens, alibi_slopes, strategy, group_key_, causal,
                     window_left, window_right, softmax_scale, layout, seqlen, mask_key,
                     softcap, kernel, backward_overlap, return_lse)
    b, h = q.shape[0], q.shape[2]
    split = hd.topo.U > 1
    with torch.autocast(q.device.type, enabled=False):
        q_f, k_f, v_f = ((_scatter(q, hd.ex_q), _scatter(k, hd.ex_kv), _scatter(v, hd.ex_kv))
                         if split else (q, k, v))
        q_f, k_f, v_f = unit_stride(q_f, k_f, v_f)
        if hd.hi > hd.lo:
            heads_sinks = None if sinks.numel() == 0 else sinks[hd.lo:hd.hi]
            out_f, lse_f = attention_forward(q_f, k_f, v_f, heads_sinks, hd.ring(backward_overlap))
        else:
            out_f = q_f.new_zeros(b, q_f.shape[1], 0, v.shape[3])
            lse_f = q_f.new_zeros(b, 0, q_f.shape[1], dtype=accumulator_dtype(q.dtype))
        if not split:  # nothing moved: the backward takes q, k, v, out, lse themselves
            empty = q.new_empty(0)
            return (out_f.contiguous(), lse_f.contiguous(), empty, empty.clone(), empty.clone(),
                    empty.clone(), lse_f.new_empty(0), torch.tensor(hd.steps))
        out, lse = _gather(out_f, hd.ex_q, h), _lse_to_seq(lse_f, hd.ex_q, h)
    return (out.contiguous(), lse.contiguous(), q_f.contiguous(), k_f.contiguous(),
            v_f.contiguous(), out_f.contiguous(), lse_f.contiguous(), torch.tensor(hd.steps))


@_heads_op.register_fake
def _(q, k, v, sinks, cu_seqlens, alibi_slopes, strategy, group_key_, *plain):

    group = group_from_key(group_key_)
    topo = (Topology.hybrid(group) if strategy == "hybrid"
            else Topology.ulysses(resolve_group(group)))
    b, n, h, d = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out, lse = q.new_empty(b, n, h, v.shape[-1]), q.new_empty(b, h, n, dtype=acc)
    steps = torch.empty((), dtype=torch.int64)
    if topo.U == 1:
        empty = q.new_empty(0)
        return out, lse, empty, empty.clone(), empty.clone(), empty.clone(), lse.new_empty(0), steps
    split = head_split(h, k.shape[2], topo.U)
    nq, nkv, m = len(split.q_heads[topo.u]), len(split.kv_heads[topo.u]), topo.U * n
    return (out, lse, q.new_empty(b, m, nq, d), q.new_empty(b, m, nkv, k.shape[-1]),
            q.new_empty(b, m, nkv, v.shape[-1]), q.new_empty(b, m, nq, v.shape[-1]),
            q.new_empty(b, nq, m, dtype=acc), steps)


@torch.library.custom_op("ringattn::heads_attention_backward", mutates_args=())
def _heads_backward_op(
    dout: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, sinks: torch.Tensor, cu_seqlens: torch.Tensor,
    alibi_slopes: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, q_f: torch.Tensor,
    k_f: torch.Tensor, v_f: torch.Tensor, out_f: torch.Tensor, lse_f: torch.Tensor,
    steps: torch.Tensor, strategy: str, group_key_: str, causal: bool, window_left: int,
    window_right: int, softmax_scale: float, layout: str, seqlen: int, mask_key: int,
    softcap: float, kernel: str, backward_overlap: str, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # validated and agreed in forward: the cached plan and the agreed steps, no exchange
    hd = _heads_call(q, k, v, sinks, cu_seqlens, alibi_slopes, strategy, group_key_, causal,
                     window_left, window_right, softmax_scale, layout, seqlen, mask_key,
                     softcap, kernel, backward_overlap, return_lse, steps=int(steps))
    h, hkv = q.shape[2], k.shape[2]
    split = hd.topo.U > 1
    if return_lse and dlse.numel() == 0:  # every rank moves an lse gradient (zeros here)
        dlse = torch.zeros_like(lse)
    with torch.autocast(q.device.type, enabled=False):
        if split:
            dout_f = _scatter(dout.contiguous(), hd.ex_q)
            dlse_f = _lse_to_heads(dlse, hd.ex_q) if return_lse else None
        else:
            q_f, k_f, v_f, out_f, lse_f = q, k, v, out, lse
            dout_f, dlse_f = dout.contiguous(), (dlse if return_lse else None)
        dsinks = None
        if hd.hi > hd.lo:
            heads_sinks = None if sinks.numel() == 0 else sinks[hd.lo:hd.hi]
            dq_f, dk_f, dv_f, dsinks_h = attention_backward(
                hd.ring(backward_overlap), return_lse, q_f, k_f, v_f, out_f, lse_f,
                heads_sinks, dout_f, dlse_f, heads_sinks is not None)
            if dsinks_h is not None:
                dsinks = sinks.new_zeros(h)
                dsinks[hd.lo:hd.hi] = dsinks_h
        else:
            dq_f, dk_f, dv_f = (torch.zeros_like(t) for t in (q_f, k_f, v_f))
        if split:
            dq = _gather(dq_f.contiguous(), hd.ex_q, h)
            dk, dv = (_gather(t.contiguous(), hd.ex_kv, hkv) for t in (dk_f, dv_f))
        else:
            dq, dk, dv = dq_f, dk_f, dv_f
    if dsinks is None:
        dsinks = sinks.new_zeros(h) if sinks.numel() else sinks.new_empty(0)
    return tuple(t.contiguous() for t in (dq, dk, dv, dsinks))


@_heads_backward_op.register_fake
def _(dout, dlse, q, k, v, sinks, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(sinks)


_HEADS_PLAIN = ("strategy", "group_key_", "causal", "window_left", "window_right",
                "softmax_scale", "layout", "seqlen", "mask_key", "softcap", "kernel",
                "backward_overlap", "return_lse")


def _heads_setup_context(ctx, inputs, output):
    q, k, v, sinks, cu_seqlens, alibi_slopes, *plain = inputs
    out, lse, q_f, k_f, v_f, out_f, lse_f, steps = output
    ctx.save_for_backward(q, k, v, sinks, cu_seqlens, alibi_slopes, out, lse, q_f, k_f, v_f,
                          out_f, lse_f, steps)
    ctx.plain = dict(zip(_HEADS_PLAIN, plain))


def _heads_backward(ctx, dout, dlse, *_unused):
    q, k, v, sinks, cu, slopes, out, lse, q_f, k_f, v_f, out_f, lse_f, steps = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is None or not ctx.plain["return_lse"]:
        dlse = lse.new_empty(0)
    dq, dk, dv, dsinks = torch.ops.ringattn.heads_attention_backward(
        dout, dlse, q, k, v, sinks, cu, slopes, out, lse, q_f, k_f, v_f, out_f, lse_f, steps,
        **ctx.plain)
    return (dq, dk, dv, dsinks if sinks.numel() else None, None, None,
            *([None] * len(_HEADS_PLAIN)))


_heads_op.register_autograd(_heads_backward, setup_context=_heads_setup_context)


def compiled_heads_attention(strategy: str, q, k, v, *, group, causal: bool, window_size,
                             softmax_scale, layout: str, seqlen, mask, cu_seqlens,
                             return_lse: bool, kernel, softcap: float, sinks,
                             alibi_slopes=None, backward_overlap: str = "all"):
    """``ulysses_attention`` / ``hybrid_attention`` (``strategy``) under torch.compile: the
    forward op returns the head-sharded q, k, v, out and lse it computed with, and the
    backward op runs the ring's backward on them (no forward again)."""
    cu, slopes = op_tensors(kernel, cu_seqlens, alibi_slopes)
    out, lse, *_ = torch.ops.ringattn.heads_attention(
        q, k, v, q.new_empty(0) if sinks is None else sinks, cu, slopes, strategy,
        group_key(group), bool(causal), int(window_size[0]), int(window_size[1]),
        1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale),
        layout, -1 if seqlen is None else seqlen,
        mask if isinstance(mask, int) else mask_key(mask), float(softcap), kernel or "auto",
        backward_overlap, bool(return_lse))
    return (out, lse) if return_lse else out


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
