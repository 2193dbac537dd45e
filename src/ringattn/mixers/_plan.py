"""Where a sequence mixer's state crosses ranks: the plan every rank computes alike.

Legend: S global seq, L local seq (S_pad / W), W world size, k conv kernel size.

A layout whose segments are runs of consecutive positions (contiguous, zigzag and their
per-document forms) cuts the global sequence into *chunks*: the real (non-padding) part of
every segment of every rank. Sorted by global start, the chunks tile [0, S). A chunk
*continues* the one before it in global order unless it starts a packed document; a
document start inside a chunk cuts it into *pieces*, each of which enters with a zero state.

Every rank computes the same plan from (layout, W, S, cu_seqlens): which chunk hands its
state (or its last k-1 inputs, for a convolution) to which, so the one exchange of the
small per-chunk data needs no further metadata.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..layouts import Layout

__all__ = ["Chunk", "Plan", "make_plan", "conv_sources"]


@dataclass(frozen=True)
class Chunk:
    """The real tokens of one segment of one rank."""

    rank: int
    index: int
    """Its place among its rank's chunks (slot order): its row in the exchanged table."""
    local_start: int
    length: int
    global_start: int
    starts_doc: bool
    """Its first token starts a document (or the sequence): it enters with a zero state."""
    cuts: tuple[int, ...]
    """Offsets 0 < c < length inside it where a document starts (the state resets there)."""

    def pieces(self) -> list[tuple[int, int]]:
        """(offset, length) of its runs inside one document, in order."""
        edges = [0, *self.cuts, self.length]
        return [(a, b - a) for a, b in zip(edges[:-1], edges[1:])]


@dataclass(frozen=True, eq=False)
class Plan:
    """(Compared and hashed by identity: ``make_plan`` returns one object per call shape.)"""

    world: int
    rank: int
    chunks: tuple[tuple[Chunk, ...], ...]
    """Every rank's chunks, in its slot order."""
    rows: int
    """Rows of the exchanged table per rank: the most chunks any rank holds (at least 1)."""
    chains: dict
    """For each of this rank's chunks that continues another (by index): the chunks whose
    maps compose into its entering state, (rank, index) in global order; the first of them
    starts from a zero state (it starts a document or resets inside)."""
    sends_state: tuple[tuple[bool, ...], ...]
    """[rank][index]: some chunk's chain holds it (its final state from zero is needed)."""
    sends_map: tuple[tuple[bool, ...], ...]
    """[rank][index]: it is inside some chain, not first (its transition map is needed)."""
    real: torch.Tensor
    """[L] bool: this rank's slots that hold real tokens."""
    doc_starts: tuple[int, ...]
    """Sorted global positions where a document starts (0 at least)."""


@lru_cache(maxsize=128)
def make_plan(layout: Layout, world: int, rank: int, seqlen: int,
              cu: tuple[int, ...] | None) -> Plan:
    """The plan of ``layout`` over ``world`` ranks for S=``seqlen`` (documents ``cu``).

    Raises:
        ValueError: the layout puts consecutive tokens in one rank's buffer out of order or
            with a stride (striped): a recurrence cannot be served by it.
    """
    padded = layout.padded_len(seqlen, world)
    starts = set(cu[:-1]) if cu is not None else {0}
    sorted_starts = sorted(starts)
    per_rank: list[list[Chunk]] = []
    for r in range(world):
        mine = []
        for seg in layout.segments(r, world, padded):
            n = seg.valid_length(seqlen)
            if n == 0:
                continue
            if seg.stride != 1 and n > 1:
                raise ValueError(
                    f"layout {layout.name!r} puts token t on rank t mod W (stride {seg.stride}): "
                    f"consecutive tokens live on different ranks, so a recurrence or a causal "
                    f"convolution would exchange its state at every token; shard with "
                    f"'zigzag' or 'contiguous' (every layout's attention is exact with them)")
            g = seg.global_start
            cuts = tuple(s - g for s in sorted_starts if g < s < g + n)
            mine.append(Chunk(r, len(mine), seg.local_start, n, g, g in starts, cuts))
        per_rank.append(mine)
    order = sorted((c for mine in per_rank for c in mine), key=lambda c: c.global_start)
    at = 0
    for c in order:  # the chunks tile [0, S): anything else is a layout this cannot serve
        if c.global_start != at:
            raise ValueError(f"layout {layout.name!r} does not place every token of S={seqlen} "
                             f"exactly once in runs of consecutive positions")
        at += c.length
    if at != seqlen:
        raise ValueError(f"layout {layout.name!r} places {at} real tokens, not S={seqlen}")
    before = {(c.rank, c.index): order[i - 1] for i, c in enumerate(order) if i > 0}
    sends_state = [[False] * len(m) for m in per_rank]
    sends_map = [[False] * len(m) for m in per_rank]
    chains_of: dict = {}
    for c in order:
        if c.starts_doc:
            continue
        chain = [before[c.rank, c.index]]
        while not (chain[0].starts_doc or chain[0].cuts):
            chain.insert(0, before[chain[0].rank, chain[0].index])
        for i, link in enumerate(chain):
            sends_state[link.rank][link.index] = True
            sends_map[link.rank][link.index] |= i > 0
        if c.rank == rank:
            chains_of[c.index] = tuple((link.rank, link.index) for link in chain)
    real = torch.zeros(padded // world, dtype=torch.bool)
    for c in per_rank[rank]:
        real[c.local_start:c.local_start + c.length] = True
    return Plan(world, rank, tuple(tuple(m) for m in per_rank),
                max(1, max(len(m) for m in per_rank)), chains_of,
                tuple(map(tuple, sends_state)), tuple(map(tuple, sends_map)), real,
                tuple(sorted_starts))


@lru_cache(maxsize=128)
def conv_sources(plan: Plan, width: int) -> torch.Tensor:
    """For a causal convolution of kernel ``width + 1``: [width, L] int64, entry [s - 1, t]
    the index of the input at global position pos(t) - s in the concatenation
    [this rank's L slots | the table of every chunk's last ``width`` inputs (rank-major,
    ``plan.rows`` chunks per rank, left-padded) | one zero slot], or the zero slot where that
    position is before the sequence, in another document than pos(t), or t is padding."""
    local = int(plan.real.numel())
    zero = local + plan.world * plan.rows * width
    idx = torch.full((width, local), zero, dtype=torch.long)
    order = sorted((c for mine in plan.chunks for c in mine), key=lambda c: c.global_start)
    for c in plan.chunks[plan.rank]:
        first_of_doc = [0, *c.cuts]  # offset of the document start each piece begins at
        for (off, n), doc_start in zip(c.pieces(), first_of_doc):
            base = c.local_start + off
            for s in range(1, width + 1):  # inside the piece: the slot s before
                if s < n:
                    idx[s - 1, base + s:base + n] = torch.arange(base, base + n - s)
            if doc_start != 0 or c.starts_doc:
                continue  # the piece starts a document: nothing before it
            for i in range(min(width, n)):  # its first slots read the chunks before it
                for s in range(i + 1, width + 1):
                    p = c.global_start + i - s
                    if p < 0 or bisect_right(plan.doc_starts, p) != bisect_right(
                            plan.doc_starts, c.global_start):
                        continue  # before the sequence, or in another document
                    src = _holder(order, p)
                    back = src.global_start + src.length - p  # 1 .. width from its end
                    idx[s - 1, c.local_start + i] = (
                        local + (src.rank * plan.rows + src.index) * width + width - back)
    return idx


def _holder(order, p: int) -> Chunk:
    lo, hi = 0, len(order) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if order[mid].global_start <= p:
            lo = mid
        else:
            hi = mid - 1
    return order[lo]


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
