"""The plan: what one ring step computes, as a pure function of (layout, mask, W, rank, step).

At step t, rank r holds the keys/values that started on rank (r - t) mod W. The plan pairs
every local query segment with every visiting key segment, asks the mask to classify each
pair, drops EMPTY pairs and merges FULL rectangles that touch, so the ring loop makes one
kernel call per remaining block. No process, tensor or device is involved: tests call it
directly, and results are cached, so forward and backward (and every layer of a model)
reuse one classification.
"""

from __future__ import annotations

import logging
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

import torch

from .layouts import Layout, local_positions
from .masks import Band, Block, BlockKind, BlockMask, Mask, WindowMask, evaluate, value_digest

__all__ = ["kv_source", "plan_step", "plan_counts", "make_plan", "Plan", "view_digest"]


def kv_source(rank: int, step: int, world: int) -> int:
    """The rank whose keys/values rank ``rank`` holds at ring step ``step``."""
    return (rank - step) % world


def _coalesce(blocks: list[Block]) -> list[Block]:
    """Merge FULL blocks that share rows and touch in columns (or the reverse)."""
    full = [b for b in blocks if b.kind is BlockKind.FULL]
    rest = [b for b in blocks if b.kind is not BlockKind.FULL]
    merged = True
    while merged:
        merged = False
        for a in range(len(full)):
            for b in range(len(full)):
                x, y = full[a], full[b]
                if a == b:
                    continue
                if (x.q_start, x.q_stop) == (y.q_start, y.q_stop) and x.k_stop == y.k_start:
                    new = Block(BlockKind.FULL, x.q_start, x.q_stop, x.k_start, y.k_stop)
                elif (x.k_start, x.k_stop) == (y.k_start, y.k_stop) and x.q_stop == y.q_start:
                    new = Block(BlockKind.FULL, x.q_start, y.q_stop, x.k_start, x.k_stop)
                else:
                    continue
                full = [f for i, f in enumerate(full) if i not in (a, b)] + [new]
                merged = True
                break
            if merged:
                break
    return sorted(full + rest, key=lambda b: (b.q_start, b.k_start))


@lru_cache(maxsize=8192)
def plan_step(
    layout: Layout, mask: WindowMask, world: int, rank: int, step: int
) -> tuple[Block, ...]:
    """Blocks rank ``rank`` computes at ring step ``step`` (never EMPTY ones).

    Arguments:
        layout: where global tokens live.
        mask: visibility in global positions; its ``seqlen`` is the unpadded S.
        world: W, the number of ranks in the ring.
        rank: the rank whose queries are computed.
        step: ring step in [0, W); the keys come from ``kv_source(rank, step, world)``.

    Returns:
        A tuple of non-empty ``Block``s in local buffer coordinates.
    """
    padded = layout.padded_len(mask.seqlen, world)
    source = kv_source(rank, step, world)
    segments = layout.segments(rank, world, padded)
    if source == rank and layout.increasing and mask.left is None and mask.right == 0:
        # Own keys under a plain causal mask: with local slots in increasing global order,
        # pos(j) <= pos(i) iff j <= i, so the whole valid prefix is ONE top-left causal
        # block (zigzag's two diagonal triangles and the full block between them in one
        # kernel call, which skips the empty quadrant itself).
        n = sum(seg.valid_length(mask.seqlen) for seg in segments)
        if n == 0:
            return ()
        return (Block(BlockKind.FULL, 0, 1, 0, 1) if n == 1
                else Block(BlockKind.PARTIAL, 0, n, 0, n, Band(0, None)),)
    blocks = [
        mask.classify(qs, ks)
        for qs in segments
        for ks in layout.segments(source, world, padded)
    ]
    return tuple(_coalesce([b for b in blocks if b.kind is not BlockKind.EMPTY]))


def plan_counts(layout: Layout, mask: WindowMask, world: int, rank: int) -> dict[BlockKind, int]:
    """Number of FULL and PARTIAL blocks a rank computes over a whole ring turn."""
    counts = {BlockKind.FULL: 0, BlockKind.PARTIAL: 0}
    for step in range(world):
        for b in plan_step(layout, mask, world, rank, step):
            counts[b.kind] += 1
    return counts


# ---------------------------------------------------------------------------------------
# General masks: classified by evaluating the mask on tiles of local slots.
# ---------------------------------------------------------------------------------------

STORED_MASK_BYTES = 32 << 20
"""Partial tiles' dense masks are kept with the plan up to this many bytes per plan; past
it they are evaluated again when a kernel needs them (masks with few partial tiles, such as
documents and causal, stay far below it)."""


@dataclass(frozen=True)
class Plan:
    """Blocks for every ring step of one rank; ``last_step`` is the last step with any."""

    steps: tuple[tuple[Block, ...], ...]

    @property
    def last_step(self) -> int:
        return max((t for t, blocks in enumerate(self.steps) if blocks), default=0)

    def counts(self) -> dict[BlockKind, int]:
        counts = {BlockKind.FULL: 0, BlockKind.PARTIAL: 0}
        for blocks in self.steps:
            for b in blocks:
                counts[b.kind] += 1
        return counts


def _valid_prefix(pos: torch.Tensor, seqlen: int) -> int:
    """Slots up to the last real token (< S): with increasing positions (every layout but a
    grouped striped one) exactly the real tokens; padding slots inside are masked."""
    real = torch.nonzero(pos < seqlen)
    return int(real[-1]) + 1 if real.numel() else 0


def _tile_runs(kinds: list[BlockKind]):
    """Maximal runs of equal, non-EMPTY tile kinds: (first tile, stop tile, kind)."""
    runs, start = [], None
    for i, k in enumerate([*kinds, BlockKind.EMPTY]):
        if start is not None and k is not kinds[start]:
            runs.append((start, i, kinds[start]))
            start = None
        if start is None and k is not BlockKind.EMPTY:
            start = i
    return runs


FLEX_TILE = 128
"""Tile edge of the one-block-per-step plans (``tile=None``): flex_attention's block size."""


def _tile_kinds(vis, rows: int, cols_per: int, ncols: int):
    """EMPTY/FULL/PARTIAL of each column tile of one row tile's visibility [Bm,Hm,rows,ncols]
    (over every batch row and head); columns past ``ncols`` count as invisible padding for
    EMPTY and as visible for FULL (they are cut off, not computed)."""
    ntc = -(-ncols // cols_per)
    pad = ntc * cols_per - ncols
    seen, every = vis.any(1).any(0), vis.all(1).all(0)  # [rows, ncols]
    t_any = torch.nn.functional.pad(seen, (0, pad)).view(rows, ntc, cols_per).any(2).any(0)
    t_all = torch.nn.functional.pad(every, (0, pad), value=True).view(rows, ntc, cols_per).all(2).all(0)
    return [BlockKind.EMPTY if not x else BlockKind.FULL if y else BlockKind.PARTIAL
            for x, y in zip(t_any.tolist(), t_all.tolist())]


MIN_PIECE = 32
"""Segment boundaries closer than this are not cut at (many tiny documents stay in shared
tiles rather than becoming thousands of tiny kernel calls)."""


def _cuts(starts, n: int, width: int) -> list[int]:
    """Tile boundaries over [0, n): the layout's segment starts (pieces of at least
    MIN_PIECE), then every ``width`` inside each piece. Tiles aligned to segments never mix
    two chunks (two documents, for the per-document layout), so a mask that is empty, full
    or causal per chunk pair leaves few partial tiles."""
    marks = [0]
    for s in [*starts, n]:
        s = min(s, n)
        if s - marks[-1] >= MIN_PIECE:
            marks.append(s)
    if marks[-1] != n:  # a short tail joins the piece before it
        if len(marks) > 1:
            marks[-1] = n
        else:
            marks.append(n)
    out = [0]
    for a, b in zip(marks[:-1], marks[1:]):
        out.extend(range(a + width, b, width))
        out.append(b)
    return out


def _classify_step(mask, seqlen, q_pos, kv_pos, q_starts, kv_starts, batch, heads, tile,
                   budget):
    """Blocks of one (local queries, visiting keys) pair under a general mask."""
    if tile is None:
        return _classify_step_whole(mask, seqlen, q_pos, kv_pos, batch, heads, budget)
    nq, nk = _valid_prefix(q_pos, seqlen), _valid_prefix(kv_pos, seqlen)
    if nq == 0 or nk == 0:
        return []
    rows_per, cols_per = tile
    cols = _cuts(kv_starts, nk, cols_per)
    cut = torch.tensor(cols, device=kv_pos.device)
    width = cut[1:] - cut[:-1]
    blocks = []
    rows = _cuts(q_starts, nq, rows_per)
    for a, e in zip(rows[:-1], rows[1:]):
        vis = evaluate(mask, seqlen, q_pos[a:e], kv_pos[:nk], batch, heads)
        # per column tile: how many columns anyone sees, and how many everyone sees
        seen = torch.nn.functional.pad(vis.any(2).any(1).any(0).cumsum(0), (1, 0))
        every = torch.nn.functional.pad(vis.all(2).all(1).all(0).cumsum(0), (1, 0))
        n_seen, n_every = seen[cut[1:]] - seen[cut[:-1]], every[cut[1:]] - every[cut[:-1]]
        kinds = [BlockKind.EMPTY if x == 0 else BlockKind.FULL if y == w else BlockKind.PARTIAL
                 for x, y, w in zip(n_seen.tolist(), n_every.tolist(), width.tolist())]
        for t0, t1, kind in _tile_runs(kinds):
            c0, c1 = cols[t0], cols[t1]
            payload = None
            if kind is BlockKind.PARTIAL:
                dense = vis[..., c0:c1]
                keep = dense.numel() <= budget[0]
                budget[0] -= dense.numel() if keep else 0
                payload = BlockMask(mask, seqlen, q_pos[a:e], kv_pos[c0:c1], batch, heads,
                                    dense.clone() if keep else None)
            blocks.append(Block(kind, a, e, c0, c1, payload))
    return _coalesce(blocks)


def _classify_step_whole(mask, seqlen, q_pos, kv_pos, batch, heads, budget):
    """One block over the whole local buffers (padding included, as invisible slots), with
    the kinds of its FLEX_TILE x FLEX_TILE tiles and the dense masks of its partial tiles,
    for kernels that skip tiles themselves. Vectorised over tiles: this runs once per new
    mask (every batch, for packed documents)."""
    n, m, t = q_pos.numel(), kv_pos.numel(), FLEX_TILE
    if _valid_prefix(q_pos, seqlen) == 0 or _valid_prefix(kv_pos, seqlen) == 0:
        return []
    ntc = -(-m // t)
    rows, parts, bounds, intervals = [], [], [], True
    cols = torch.arange(m, device=q_pos.device)
    for a in range(0, n, t):
        vis = evaluate(mask, seqlen, q_pos[a:a + t], kv_pos, batch, heads)
        # rows whose visible columns are one run [lo, hi) (documents, causal, windows,
        # prefix-LM): kernels can test two bounds instead of reading stored bits
        cnt = vis.sum(-1)
        lo = torch.where(vis, cols, m).amin(-1)
        hi = torch.where(vis, cols + 1, 0).amax(-1)
        intervals = intervals and bool(((cnt == 0) | (hi - lo == cnt)).all())
        bounds.append(torch.stack([torch.where(cnt > 0, lo, 0), hi]).to(torch.int32))
        pad = (0, ntc * t - m, 0, t - vis.shape[2])
        hidden = torch.nn.functional.pad(vis, pad)  # slots past the buffers: not visible
        tiles = hidden.unflatten(3, (ntc, t)).movedim(3, 0)  # [ntc, Bm, Hm, t, t]
        # past the buffers' ends counts as visible for FULL: flex cuts those rows/cols off
        full = torch.nn.functional.pad(vis, pad, value=True).unflatten(3, (ntc, t)).movedim(3, 0)
        kind = torch.where(tiles.flatten(1).any(1),
                           torch.where(full.flatten(1).all(1), 1, 2), 0).to(torch.uint8)
        rows.append(kind)
        parts.append(tiles[kind == 2])
    grid = torch.stack(rows).cpu()
    if not bool((grid > 0).any()):
        return []
    if bool((grid == 1).all()):
        return [Block(BlockKind.FULL, 0, n, 0, m)]
    if intervals:
        payload = BlockMask(mask, seqlen, q_pos, kv_pos, batch, heads, tile_kinds=grid,
                            row_bounds=torch.cat(bounds, dim=-1))
        return [Block(BlockKind.PARTIAL, 0, n, 0, m, payload)]
    tiles = torch.cat(parts)
    keep = tiles.numel() <= budget[0]
    budget[0] -= tiles.numel() if keep else 0
    payload = BlockMask(mask, seqlen, q_pos, kv_pos, batch, heads, tile_kinds=grid,
                        tile_masks=tiles if keep else None)
    return [Block(BlockKind.PARTIAL, 0, n, 0, m, payload)]


PLAN_CACHE_BYTES = 256 << 20
"""General-mask plans are cached up to this many bytes of mask tensors (stored bits, tile
kinds, row bounds, and what kernels derive from them), least recently used first out."""

PLAN_CACHE_ENTRIES = 16
"""... and up to this many plans."""

log = logging.getLogger("ringattn")


def _tensor_bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (tuple, list)):
        return sum(_tensor_bytes(y) for y in x)
    if isinstance(x, dict):
        return sum(_tensor_bytes(y) for y in x.values())
    if hasattr(x, "as_tuple"):  # flex_attention's BlockMask
        return _tensor_bytes(x.as_tuple())
    return 0


def plan_bytes(plan: Plan) -> int:
    """Bytes of the mask tensors a plan holds (including kernels' derived caches)."""
    total = 0
    for blocks in plan.steps:
        for b in blocks:
            m = b.mask
            if isinstance(m, BlockMask):
                total += sum(_tensor_bytes(getattr(m, n)) for n in
                             ("stored", "tile_kinds", "tile_masks", "row_bounds"))
                total += _tensor_bytes(m.cache)
    return total


class _PlanCache:
    """LRU of general-mask plans bounded by ``PLAN_CACHE_BYTES`` and
    ``PLAN_CACHE_ENTRIES``; says once when a new mask object repeats a cached mask's
    digest (each object is planned and cached apart: build masks once, or use the
    value-keyed ones)."""

    def __init__(self):
        self.plans: OrderedDict = OrderedDict()
        self.warned = False

    def get(self, key, make):
        if key in self.plans:
            self.plans.move_to_end(key)
            return self.plans[key]
        mask, rest = key[1], key[:1] + key[2:]
        if (not self.warned and value_digest(mask) is None  # a value-keyed mask: its own plan
                and any(k[:1] + k[2:] == rest and k[1] is not mask for k in self.plans)):
            self.warned = True
            log.warning(
                "ringattn: a new mask object %r has the digest of a cached one; every new "
                "object is planned again and cached apart (up to %d MiB): build the mask "
                "once and reuse it, or use a value-keyed mask (masks.key_mask, "
                "masks.document, masks.chunked)", mask, PLAN_CACHE_BYTES >> 20)
        plan = make()
        self.plans[key] = plan
        self.trim()
        return plan

    def trim(self):
        sizes = {k: plan_bytes(p) for k, p in self.plans.items()}
        total = sum(sizes.values())
        while self.plans and (len(self.plans) > PLAN_CACHE_ENTRIES or
                              (total > PLAN_CACHE_BYTES and len(self.plans) > 1)):
            key, _ = self.plans.popitem(last=False)
            total -= sizes[key]

    def bytes(self) -> int:
        return sum(plan_bytes(p) for p in self.plans.values())

    def clear(self):
        self.plans.clear()


PLAN_CACHE = _PlanCache()


def _general_plan(layout, mask, digest, world, rank, seqlen, batch, heads, device, tile) -> Plan:
    return PLAN_CACHE.get(
        (layout, mask, digest, world, rank, seqlen, batch, heads, device, tile),
        lambda: _make_general_plan(layout, mask, world, rank, seqlen, batch, heads, device, tile))


def _make_general_plan(layout, mask, world, rank, seqlen, batch, heads, device, tile) -> Plan:
    pos = [local_positions(layout, r, world, seqlen).to(device) for r in range(world)]
    padded = layout.padded_len(seqlen, world)
    starts = [[seg.local_start for seg in layout.segments(r, world, padded)] for r in range(world)]
    budget = [STORED_MASK_BYTES]
    steps = tuple(
        tuple(_classify_step(mask, seqlen, pos[rank], pos[kv_source(rank, t, world)],
                             starts[rank], starts[kv_source(rank, t, world)],
                             batch, heads, tile, budget))
        for t in range(world)
    )
    return Plan(steps)


VIEW_CHUNK = 1 << 22
"""Mask evaluations per piece of ``view_digest`` (bounds its memory)."""


@lru_cache(maxsize=64)
def view_digest(layout: Layout, mask: Mask, world: int, rank: int, seqlen: int, batch: int,
                heads: int, device: str) -> int:
    """A 31-bit digest of the mask over every position rank ``rank``'s plan evaluates: its
    real query slots (in slot order) against every key position, all batch rows and heads.

    Ranks compare it (rank r's own view against what rank r - 1 computed for rank r) so a
    mask function that gives different answers on different ranks is reported wherever a
    rank would use it, not only on ``fingerprint``'s probe. Batch or head dimensions that
    do not change the answer are collapsed first, so equal bits give equal digests whatever
    shape the mask function returns. Cached per (mask object, region)."""
    pos = local_positions(layout, rank, world, seqlen).to(device)
    rows = pos[pos < seqlen]
    cols = torch.arange(seqlen, device=device)
    step = max(1, VIEW_CHUNK // max(1, seqlen * batch * heads))
    crc = 0
    for a in range(0, rows.numel(), step):
        vis = evaluate(mask, seqlen, rows[a:a + step], cols, batch, heads)
        for dim in (0, 1):
            if vis.shape[dim] > 1 and bool((vis == vis.narrow(dim, 0, 1)).all()):
                vis = vis.narrow(dim, 0, 1)
        crc = zlib.crc32(repr(tuple(vis.shape)).encode(), crc)
        crc = zlib.crc32(vis.contiguous().cpu().numpy().tobytes(), crc)
    return crc & 0x7FFFFFFF


def make_plan(layout: Layout, mask: Mask, world: int, rank: int, seqlen: int, *,
              batch: int = 1, heads: int = 1, device="cpu",
              tile: tuple[int, int] | None = (256, 128), digest: int = 0) -> Plan:
    """The blocks rank ``rank`` computes at every ring step, for any mask and layout.

    Masks that are a band (causal, sliding windows, their intersections) are classified
    analytically per segment pair (``plan_step``). Any other mask is evaluated on tiles of
    local slots (``tile`` = (rows, cols)): each tile is EMPTY, FULL or PARTIAL over all
    batch rows and heads, and runs of equal tiles along a row tile become blocks; PARTIAL
    blocks carry their dense mask. ``tile=None`` makes one block per step for kernels that
    skip tiles themselves (flex_attention), carrying the kinds of its FLEX_TILE-square tiles
    and the dense masks of the partial ones.

    Plans are cached per (layout, mask, digest, W, rank, S, B, H, device, tile): forward
    and backward, and every layer of a model, share one classification.

    Raises:
        ValueError: the mask failed or returned something that is not a bool tensor.
    """
    if mask.band is not None:
        left, right = mask.band
        window = WindowMask(seqlen, left, right)
        return Plan(tuple(plan_step(layout, window, world, rank, t) for t in range(world)))
    return _general_plan(layout, mask, digest, world, rank, seqlen, batch, heads,
                         torch.device(device), tile)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
