"""``ra.attention``: one entry point for every strategy, and ``strategy="auto"``'s cost model.

Legend: B batch, S global seq, L local seq, H heads, Hkv kv heads, D / Dv head dims,
W ranks, R x U the hybrid mesh (ring across, Ulysses within), e bytes per element.

The cost model estimates one call (forward, plus backward when a gradient is wanted) of
each strategy from three kinds of numbers:

* **work**: the visible (query, key) pairs of the causal / window / document mask, counted
  exactly per (query rank, key rank) for the call's layout (``work``); a custom ``mask=``
  is not evaluated (its work is taken as that of the rest of the mask: an upper bound).
  A pair costs 2(D + Dv) FLOP per head forward and 2.5x that backward.
* **machine**: attention FLOP/s of one rank, and per mesh dimension a ``Link``: bandwidth
  (bytes/s one rank sends) and latency (s per collective or hop). ``CostModel`` holds
  them; ``measure`` times them once per group (a hop, an all-to-all, a kernel call; the
  slowest rank's times, so every rank holds the same numbers), or the user passes them.
* **schedule**, per strategy:
  - ring: W steps; step t takes max(the slowest rank's blocks at t, one K/V hop); the
    backward's hop carries K/V and the fp32 dK/dV accumulator.
  - Ulysses: 4 all-to-alls forward (q, k, v with only the kv heads each rank needs, out),
    4 backward, none overlapped, each lat + bytes (U-1)/U / bandwidth; compute: the rank
    with the most heads, over the whole sequence.
  - all-gather: K/V all-gathered (lat + (W-1) K/V shards / bandwidth), backward again plus
    the fp32 reduce-scatter, not overlapped; compute: the slowest rank's pairs.
  - hybrid: Ulysses over U on the inner link, then the ring over R on the outer link with
    H/U heads of S/R tokens.
  On a 2-D mesh the one-dimensional strategies run over all W ranks: their hops and
  all-gathers go at the outer (slower) link's speed, their all-to-alls send (U-1)/W of
  the data over the inner link and (W-U)/W over the outer one at the same time.

``choose`` picks the cheapest (ties: ring, Ulysses, all-gather, hybrid), logs each new
choice once (logger "ringattn"), and is the same on every rank: it depends only on the
call's shapes and options and on numbers every rank shares. The strategy is part of every
call's agreement, so ranks that still chose differently get an error, not a hang.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.distributed as dist

from ..validate import STRATEGY_NAMES, check_strategy
from .allgather import allgather_attention
from .hybrid import hybrid_attention
from .ring import ring_attention
from ..comm import (RingComm, collective, is_hybrid_mesh, mesh_groups, metadata_device,
                    resolve_group)
from ..layouts import DEFAULT_LAYOUT, Layout, get_layout, grouped, local_positions
from ..masks import check_cu_seqlens
from .ulysses import head_split, ulysses_attention

__all__ = ["CostModel", "Link", "Estimate", "attention", "choose", "estimate", "measure", "work"]

log = logging.getLogger("ringattn")

BACKWARD_FLOP_RATIO = 2.5
"""Backward FLOP / forward FLOP of attention (recompute of the scores, dP, dS, dQ, dK, dV)."""


@dataclass(frozen=True)
class Link:
    """One mesh dimension's interconnect as one rank sees it."""

    bandwidth: float
    """Bytes per second one rank sends (each direction)."""
    latency: float
    """Seconds of fixed cost per collective or hop."""

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class CostModel:
    """A machine for ``estimate``: one rank's attention FLOP/s and its links."""

    flops: float
    """Attention FLOP/s one rank sustains (forward and backward alike)."""
    inner: Link
    """The link of a 1-D group, or of the hybrid mesh's "ulysses" (inner) dimension."""
    outer: Link | None = None
    """The hybrid mesh's "ring" (outer) dimension; None: as ``inner``."""
    overlap: float = 1.0
    """How much of a ring hop hides behind the kernels beside it: 1 (GPUs: NCCL's copies
    run beside the kernels), 0 (the time of both is the sum: CPU ranks, whose gloo copies
    take the cores the kernels use; docs/platform.md). Measured by ``measure``."""

    @property
    def across(self) -> Link:
        return self.inner if self.outer is None else self.outer


@dataclass(frozen=True)
class Estimate:
    """Seconds of one call of a strategy: compute, exposed communication, total."""

    strategy: str
    compute: float
    comm: float
    total: float


@dataclass(frozen=True)
class CallShape:
    """What the cost of a call depends on (hashable: choices are cached and logged by it)."""

    batch: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    itemsize: int
    backward: bool
    layout: Layout
    causal: bool
    window: tuple[int, int]
    cu_seqlens: tuple[int, ...] | None = None
    mesh: tuple[int, int] | None = None
    """(R, U) of a hybrid mesh; None: a 1-D group of ``world`` ranks."""
    world: int = field(default=1)


def work(layout: Layout, world: int, seqlen: int, causal: bool, window=(-1, -1),
         cu_seqlens=None) -> torch.Tensor:
    """Visible (query, key) pairs between the queries of rank r and the keys of rank s,
    [W, W] float64, for the causal / window / document mask (exact counts)."""
    return _work(layout, world, seqlen, bool(causal), tuple(window),
                 None if cu_seqlens is None else tuple(cu_seqlens)).clone()


@lru_cache(maxsize=64)
def _work(layout, world, seqlen, causal, window, cu):
    left, right = window
    pos = torch.arange(seqlen)
    lo, hi = torch.zeros(seqlen, dtype=torch.long), torch.full((seqlen,), seqlen - 1)
    if cu is not None:
        bounds = torch.tensor(cu)
        doc = torch.bucketize(pos, bounds, right=True) - 1
        lo, hi = bounds[doc], bounds[doc + 1] - 1
    if left >= 0:
        lo = torch.maximum(lo, pos - left)
    if causal:
        hi = torch.minimum(hi, pos)
    elif right >= 0:
        hi = torch.minimum(hi, pos + right)
    owner = torch.empty(layout.padded_len(seqlen, world), dtype=torch.long)
    for r in range(world):
        owner[local_positions(layout, r, world, seqlen)] = r
    owner = owner[:seqlen]
    out = torch.zeros(world, world, dtype=torch.float64)
    for s in range(world):  # keys of rank s visible to each query: a difference of prefix counts
        mine = torch.nn.functional.pad(torch.cumsum(owner == s, 0), (1, 0))
        seen = (mine[(hi + 1).clamp(min=0)] - mine[lo.clamp(max=seqlen)]).clamp(min=0)
        out[:, s] = torch.zeros(world, dtype=torch.float64).index_add_(0, owner, seen.double())
    return out


def _ring_time(pairs: torch.Tensor, per_pair: float, flops: float, hop_f: float,
               hop_b: float, backward: bool, overlap: float = 1.0) -> tuple[float, float]:
    """(compute, total) seconds of the ring over ``pairs`` [W, W]: step t takes the slowest
    rank's blocks at t and the hop beside them, of which ``overlap`` of the shorter one is
    hidden (1: the slower of the two)."""

    def both(c, h):
        return c + h - overlap * min(c, h)

    w = pairs.shape[0]
    idx = torch.arange(w)
    per_step = torch.stack([pairs[idx, (idx - t) % w].max() for t in range(w)])
    busy = torch.nonzero(per_step > 0)
    steps = int(busy[-1]) + 1 if busy.numel() else 1
    fwd = per_step[:steps] * per_pair / flops
    compute = float(fwd.sum())
    total = sum(both(float(c), hop_f if t + 1 < steps else 0.0) for t, c in enumerate(fwd))
    if backward:
        bwd = fwd * BACKWARD_FLOP_RATIO
        compute += float(bwd.sum())
        total += sum(both(float(c), hop_b if t + 1 < steps else 0.0) for t, c in enumerate(bwd))
    return compute, total


def _a2a(link_in: Link, link_out: Link | None, nbytes: float, members: int, world: int) -> float:
    """One all-to-all of ``nbytes`` per rank over ``world`` ranks, of which ``members`` (this
    rank included) share the inner link and the rest are reached over ``link_out``."""
    if world == 1:
        return 0.0
    near = nbytes * (members - 1) / world
    far = nbytes * (world - members) / world
    t = near / link_in.bandwidth
    if far:
        t = max(t, far / link_out.bandwidth)
    return (link_in.latency if link_out is None else max(link_in.latency, link_out.latency)) + t


def estimate(shape: CallShape, cost: CostModel) -> dict[str, Estimate]:
    """Seconds of one call of every strategy that can run on ``shape``'s group."""
    b, s, h, hkv, d, dv, e = (shape.batch, shape.seqlen, shape.heads, shape.kv_heads,
                              shape.head_dim, shape.value_dim, shape.itemsize)
    r_dim, u_dim = shape.mesh if shape.mesh else (1, shape.world)
    w = r_dim * u_dim
    per_pair = 2.0 * (d + dv) * b  # per head
    lay = shape.layout
    pairs = _work(lay, w, s, shape.causal, shape.window, shape.cu_seqlens)
    padded = lay.padded_len(s, w)
    n = padded // w
    kv_shard = b * n * hkv * (d + dv) * e
    q_shard, out_shard = b * n * h * d * e, b * n * h * dv * e
    bwd = shape.backward
    # one-dimensional strategies over all W ranks (on a 2-D mesh: across the outer link)
    mesh = shape.mesh is not None
    flat = cost.across if mesh else cost.inner
    res = {}
    hop_f = flat.time(kv_shard)
    hop_b = flat.time(kv_shard + b * n * hkv * (d + dv) * 4)
    comp, tot = _ring_time(pairs, per_pair * h, cost.flops, hop_f, hop_b, bwd, cost.overlap)
    res["ring"] = Estimate("ring", comp, max(tot - comp, 0.0), tot)
    split = head_split(h, hkv, w)
    kv_sent = sum(len(x) for x in split.kv_heads) / hkv  # kv heads sent, in shards
    members = u_dim if mesh else w
    a2a = lambda nbytes: _a2a(cost.inner, cost.outer if mesh else None, nbytes, members, w)  # noqa: E731
    most = max(len(x) for x in split.q_heads)
    comp = float(pairs.sum()) * per_pair * most / cost.flops * (1 + BACKWARD_FLOP_RATIO * bwd)
    comm = a2a(q_shard) + 2 * a2a(kv_shard / 2 * kv_sent) + a2a(out_shard)
    comm *= 2 if bwd else 1
    res["ulysses"] = Estimate("ulysses", comp, comm, comp + comm)
    comp = float(pairs.sum(1).max()) * per_pair * h / cost.flops * (1 + BACKWARD_FLOP_RATIO * bwd)
    gather = flat.latency + (w - 1) * kv_shard / flat.bandwidth
    comm = gather + (gather + (w - 1) * b * n * hkv * (d + dv) * 4 / flat.bandwidth if bwd else 0)
    res["allgather"] = Estimate("allgather", comp, comm, comp + comm)
    if mesh and u_dim > 1 and r_dim > 1:
        split = head_split(h, hkv, u_dim)
        most = max(len(x) for x in split.q_heads)
        kv_sent = sum(len(x) for x in split.kv_heads) / hkv
        a2a_in = lambda nbytes: _a2a(cost.inner, None, nbytes, u_dim, u_dim)  # noqa: E731
        comm = a2a_in(q_shard) + 2 * a2a_in(kv_shard / 2 * kv_sent) + a2a_in(out_shard)
        comm *= 2 if bwd else 1
        glay = grouped(lay, u_dim, r_dim)
        gpairs = _work(glay, r_dim, s, shape.causal, shape.window, shape.cu_seqlens)
        kv_ring = b * (n * u_dim) * max(len(x) for x in split.kv_heads) * (d + dv)
        hop_f = cost.across.time(kv_ring * e)
        hop_b = cost.across.time(kv_ring * (e + 4))
        comp, tot = _ring_time(gpairs, per_pair * most, cost.flops, hop_f, hop_b, bwd,
                               cost.overlap)
        res["hybrid"] = Estimate("hybrid", comp, max(tot - comp, 0.0) + comm, tot + comm)
    return res


_LOGGED: set = set()


def choose(shape: CallShape, cost: CostModel) -> str:
    """The cheapest strategy for ``shape`` (ties in ``STRATEGY_NAMES`` order); each new
    (shape, choice) is logged once at INFO."""
    est = estimate(shape, cost)
    best = min(est.values(), key=lambda x: (x.total, STRATEGY_NAMES.index(x.strategy)))
    key = (shape, best.strategy)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("strategy='auto' chose %r for %s: %s", best.strategy, shape,
                 ", ".join(f"{x.strategy} {x.total * 1e3:.3g} ms" for x in est.values()))
    return best.strategy


_MEASURED: dict = {}


def measure(group=None, *, nbytes: int = 4 << 20, reps: int = 3) -> CostModel:
    """Time this group's links and one rank's attention FLOP/s (every rank calls it; the
    slowest rank's times are used, so every rank returns the same model). Cached per group
    (per mesh dimension for the hybrid's 2-D mesh)."""
    if is_hybrid_mesh(group):
        flat, ring, uly = mesh_groups(group)
        key = ("mesh", flat.group_name, ring.group_name, uly.group_name)
        dims = (uly, ring)
    else:
        flat = resolve_group(group)
        key, dims = flat.group_name, (flat,)
    if key in _MEASURED:
        return _MEASURED[key]
    dev = metadata_device(flat)
    times = [t for pg in dims for t in _link_times(pg, dev, nbytes, reps)]
    probe = _PROBE.to(dev)

    def kernel():
        torch.nn.functional.scaled_dot_product_attention(probe, probe, probe, is_causal=True)

    comm = RingComm(dims[-1])  # the ring's dimension
    send = torch.zeros(nbytes // 4, device=dev)
    recv = torch.empty_like(send)

    def beside():  # a big hop posted, the kernel run, the hop awaited: what a ring step does
        hop = comm.hop(send, recv, RingComm.KV_TAG) if comm.world > 1 else None
        kernel()
        if hop is not None:
            hop.wait()

    times += [_best_of(reps, dev, beside), _best_of(reps, dev, kernel)]
    row = torch.tensor(times, dtype=torch.float64, device=dev)
    if dist.get_world_size(flat) > 1:
        collective("auto's link measurement", flat, lambda: dist.all_reduce(
            row, op=dist.ReduceOp.MAX, group=flat, async_op=True))
    t = row.tolist()
    links = [Link(bandwidth=nbytes / max(big - lat, 1e-9), latency=lat)
             for lat, big in zip(t[0:-2:2], t[1:-2:2])]
    b, h, n, d = _PROBE.shape
    flop = b * h * n * (n + 1) / 2 * 2 * (d + d)  # causal pairs x 2(D + Dv)
    together, alone, hop = t[-2], t[-1], t[-3]  # (the ring dimension's big hop)
    overlap = 1.0 if comm.world == 1 else (alone + hop - together) / min(alone, hop)
    model = CostModel(flops=flop / alone, inner=links[0],
                      outer=links[1] if len(links) > 1 else None,
                      overlap=min(max(overlap, 0.0), 1.0))
    _MEASURED[key] = model
    return model


_PROBE = torch.zeros(1, 4, 1024, 64)


def _best_of(reps: int, dev, fn) -> float:
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def _link_times(pg, dev, nbytes: int, reps: int) -> list[float]:
    """(seconds of a hop of a few bytes, of ``nbytes``) to the next rank of ``pg``."""
    comm = RingComm(pg)
    out = []
    for size in (8, nbytes // 4):
        send = torch.zeros(size, device=dev)
        recv = torch.empty_like(send)
        out.append(_best_of(reps, dev, lambda: comm.world > 1 and comm.hop(
            send, recv, RingComm.KV_TAG).wait()))
    return out


def call_shape(q, k, v, group, *, causal=False, window_size=(-1, -1), layout=DEFAULT_LAYOUT,
               seqlen=None, cu_seqlens=None) -> CallShape:
    """``CallShape`` of a call (its inputs are validated by the chosen strategy)."""
    mesh = None
    if is_hybrid_mesh(group):
        _, ring, uly = mesh_groups(group)
        mesh = (dist.get_world_size(ring), dist.get_world_size(uly))
    world = dist.get_world_size(resolve_group(group))
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, seqlen)
    s = seqlen if seqlen is not None else (cu[-1] if cu else q.shape[1] * world)
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return CallShape(q.shape[0], int(s), q.shape[2], k.shape[2], q.shape[3], v.shape[3],
                     q.element_size(), backward, get_layout(layout, cu), bool(causal),
                     tuple(int(x) for x in window_size), cu, mesh, world)


STRATEGIES = {"ring": ring_attention, "ulysses": ulysses_attention,
              "allgather": allgather_attention, "hybrid": hybrid_attention}
"""Strategy name -> its attention function (the same arguments; ``backward_overlap`` is the
ring's own, ``heads_k_stride`` all-gather's)."""



def attention(q, k, v, *, group=None, strategy: str = "auto", cost: CostModel | None = None,
              **kwargs):
    """Attention over a sequence sharded across ``group`` by ``strategy``: one of
    "ring", "ulysses", "allgather", "hybrid" (``group`` a 2-D ("ring", "ulysses")
    DeviceMesh) or "auto" (the cheapest by the cost model of ``ringattn.auto``, with
    ``cost`` or the group's measured ``CostModel``; hybrid is a candidate on a 2-D mesh).

    ``kwargs`` are ``ring_attention``'s (and ``heads_k_stride`` for all-gather,
    ``backward_overlap`` for the ring and the hybrid). The same shards, results and errors
    whatever the strategy.

    Raises:
        ValueError: an unknown strategy, "hybrid" without a 2-D mesh, and everything the
            chosen strategy raises (the same error on every rank).
    """
    check_strategy(strategy, group)
    if strategy == "auto":
        # compiled code has custom ops for the ring only (and measures nothing)
        strategy = "ring" if torch.compiler.is_compiling() else _auto(q, k, v, group, cost, kwargs)
    if strategy != "allgather":
        kwargs.pop("heads_k_stride", None)
    if strategy in ("ulysses", "allgather"):
        kwargs.pop("backward_overlap", None)
    return STRATEGIES[strategy](q, k, v, group=group, **kwargs)


def _auto(q, k, v, group, cost, kwargs) -> str:
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "ring"  # its validation reports the inputs
    try:
        shape = call_shape(q, k, v, group, causal=kwargs.get("causal", False),
                           window_size=kwargs.get("window_size", (-1, -1)),
                           layout=kwargs.get("layout", DEFAULT_LAYOUT),
                           seqlen=kwargs.get("seqlen"), cu_seqlens=kwargs.get("cu_seqlens"))
    except (TypeError, ValueError):
        return "ring"  # the ring's validation reports the same problem on every rank
    return choose(shape, cost if cost is not None else measure(group))


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
