"""The plan: what one ring step computes, as a pure function of (layout, mask, W, rank, step).

At step t, rank r holds the keys/values that started on rank (r - t) mod W. The plan pairs
every local query segment with every visiting key segment, asks the mask to classify each
pair, drops EMPTY pairs and merges FULL rectangles that touch, so the ring loop makes one
kernel call per remaining block. No process, tensor or device is involved: tests call it
directly, and results are cached, so forward and backward (and every layer of a model)
reuse one classification.
"""

from __future__ import annotations

from functools import lru_cache

from .layouts import Layout
from .masks import Band, Block, BlockKind, WindowMask

__all__ = ["kv_source", "plan_step", "plan_counts"]


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
