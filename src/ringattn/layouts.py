"""Layouts: where each global token lives, as an index permutation.

Legend: S global sequence length, S_pad padded length, L local length (S_pad / W),
W world size, c chunk length.

A layout pads S up to a multiple of what it needs (W, or 2W for zigzag) and gives every rank
L = S_pad / W token slots. Positions >= S are padding: they are masked as keys and produce
nothing as queries. Inside a rank, the local buffer is a few *segments*, each a run of
global positions with a fixed stride, which is what lets the plan describe the mask between
two blocks as a band instead of a dense matrix.

Restoring global order from the concatenation of all ranks' shards is an argsort of the
permutation (see ``restore_index``).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

import torch

__all__ = [
    "Segment",
    "Layout",
    "Contiguous",
    "Zigzag",
    "Striped",
    "DocumentZigzag",
    "DocumentContiguous",
    "Grouped",
    "grouped",
    "LAYOUTS",
    "LAYOUT_NAMES",
    "SHARD_TAG",
    "ShardTag",
    "check_tag",
    "placement_digest",
    "same_tag",
    "tag_shard",
    "get_layout",
    "local_positions",
    "restore_index",
]


@dataclass(frozen=True)
class Segment:
    """A run of global positions stored contiguously in a rank's local buffer.

    Local slot ``local_start + i`` holds global position ``global_start + i * stride``,
    for ``0 <= i < length``.
    """

    local_start: int
    length: int
    global_start: int
    stride: int

    def valid_length(self, seqlen: int) -> int:
        """How many leading slots of this segment hold real (non-padding) tokens."""
        if self.global_start >= seqlen:
            return 0
        return min(self.length, -(-(seqlen - self.global_start) // self.stride))


@dataclass(frozen=True)
class Layout:
    """Base class: a layout is a rule placing S_pad global positions on W ranks."""

    name: str = ""

    increasing = True
    """Every rank's local slots hold increasing global positions (true of all layouts here;
    the plan relies on it to treat a rank's own causal block as one triangle)."""

    unit_stride = True
    """Every segment is a run of consecutive positions (stride 1)."""

    def multiple(self, world: int) -> int:
        """S_pad is the smallest multiple of this that is >= S."""
        return world

    def padded_len(self, seqlen: int, world: int) -> int:
        m = self.multiple(world)
        return -(-seqlen // m) * m

    def local_len(self, seqlen: int, world: int) -> int:
        return self.padded_len(seqlen, world) // world

    def segments(self, rank: int, world: int, padded: int) -> tuple[Segment, ...]:
        raise NotImplementedError


@dataclass(frozen=True)
class Contiguous(Layout):
    """Rank r holds positions [r*L, (r+1)*L). Causal work grows with r (unbalanced)."""

    name: str = "contiguous"

    def segments(self, rank: int, world: int, padded: int) -> tuple[Segment, ...]:
        n = padded // world
        return (Segment(0, n, rank * n, 1),)


@dataclass(frozen=True)
class Zigzag(Layout):
    """2W chunks; rank r holds chunk r then chunk 2W-1-r (balanced causal work)."""

    name: str = "zigzag"

    def multiple(self, world: int) -> int:
        return 2 * world

    def segments(self, rank: int, world: int, padded: int) -> tuple[Segment, ...]:
        c = padded // (2 * world)
        return (Segment(0, c, rank * c, 1), Segment(c, c, (2 * world - 1 - rank) * c, 1))


@dataclass(frozen=True)
class Striped(Layout):
    """Token t lives on rank t mod W at local slot t // W (balanced causal work)."""

    name: str = "striped"
    unit_stride = False

    def segments(self, rank: int, world: int, padded: int) -> tuple[Segment, ...]:
        return (Segment(0, padded // world, rank, world),)


@dataclass(frozen=True)
class DocumentZigzag(Layout):
    """Zigzag applied to every packed document: each document is cut into 2W chunks and
    rank r holds chunks r and 2W-1-r of EVERY document, so each document's causal work is
    spread evenly over the ranks (plain zigzag balances only the whole sequence).

    Chunks of one document differ by at most one token; the tokens left over when a length
    does not divide 2W go to ranks in round-robin order carried across documents, so ranks
    hold S/W tokens give or take one (documents shorter than W, even of length 1, are fine).
    Each rank's buffer is padded to ceil(S / W) slots at its end.

    ``cu_seqlens`` is flash-attn's [0, end_0, ..., S]; build this layout with
    ``get_layout("zigzag", cu_seqlens=...)``.
    """

    cu_seqlens: tuple[int, ...] = field(default=(0, 1), kw_only=True)
    name: str = "zigzag"

    def multiple(self, world: int) -> int:
        return world

    def segments(self, rank: int, world: int, padded: int) -> tuple[Segment, ...]:
        return _per_document_segments(self.cu_seqlens, world, padded, _zigzag_chunks)[rank]


def _zigzag_chunks(length: int, world: int, turn: int):
    """One document's 2W zigzag chunks in document order, as (rank, size), and the next
    ``turn`` (the rank that gets the next left-over token)."""
    base, extra = divmod(length, 2 * world)
    gets = [0] * world
    for i in range(extra):
        gets[(turn + i) % world] += 1
    early = [(r, base + (gets[r] >= 1)) for r in range(world)]  # chunks r, rank order
    late = [(r, base + (gets[r] == 2)) for r in reversed(range(world))]  # chunks 2W-1-r
    return early + late, (turn + extra) % world


def _contiguous_chunks(length: int, world: int, turn: int):
    """One document's W contiguous chunks in document order, as (rank, size), and the
    next ``turn``."""
    base, extra = divmod(length, world)
    return [(r, base + ((r - turn) % world < extra)) for r in range(world)], (turn + extra) % world


@lru_cache(maxsize=64)
def _per_document_segments(cu: tuple[int, ...], world: int, padded: int, chunks):
    """Every rank's segments when each document is cut by ``chunks`` (``_zigzag_chunks``
    or ``_contiguous_chunks``), left-over tokens dealt round-robin across documents, and
    each rank's buffer padded at its end."""
    per_rank: list[list[Segment]] = [[] for _ in range(world)]
    used = [0] * world
    turn = 0
    for start, stop in zip(cu[:-1], cu[1:]):
        pieces, turn = chunks(stop - start, world, turn)
        offset = start
        for r, size in pieces:
            if size:
                per_rank[r].append(Segment(used[r], size, offset, 1))
                used[r] += size
            offset += size
    local, pad_start = padded // world, cu[-1]
    for r in range(world):  # padding slots get unique positions >= S, rank by rank
        if used[r] < local:
            per_rank[r].append(Segment(used[r], local - used[r], pad_start, 1))
            pad_start += local - used[r]
    return tuple(tuple(segs) for segs in per_rank)


@dataclass(frozen=True)
class DocumentContiguous(Layout):
    """Every packed document cut into W contiguous chunks; rank r holds chunk r of EVERY
    document, documents in order (ring-flash-attn's varlen split: with every length a
    multiple of W, rank r's slots are ``doc[r * n / W : (r + 1) * n / W]`` for each document
    of length n). Tokens left over when a length does not divide W go to ranks in
    round-robin order carried across documents; each rank's buffer is padded to
    ceil(S / W) slots at its end. Build it with ``get_layout("doc_contiguous",
    cu_seqlens=...)``: it needs documents.
    """

    cu_seqlens: tuple[int, ...] = field(default=(0, 1), kw_only=True)
    name: str = "doc_contiguous"

    def multiple(self, world: int) -> int:
        return world

    def segments(self, rank: int, world: int, padded: int) -> tuple[Segment, ...]:
        return _per_document_segments(self.cu_seqlens, world, padded, _contiguous_chunks)[rank]


@dataclass(frozen=True)
class Grouped(Layout):
    """``base`` over ``world * size`` ranks, seen as a ring of ``world`` ranks: ring rank r
    holds the slots of base ranks r*size .. r*size + size-1 (what Ulysses' all-to-all over
    those ``size`` ranks gathers on each of them; the 2-D hybrid's ring layout). Build it
    with ``grouped``.

    Slot order: with ``sorted_slots``, the gathered positions in increasing order, as few
    segments as possible (zigzag over W grouped by ``size`` is then zigzag over W / size,
    so causal work stays balanced over the ring; a one-rank ring is global order).
    Otherwise (striped bases on a ring of several ranks, whose sorted slots would be
    thousands of short runs) the base ranks' slots one after another, not increasing.
    """

    base: Layout = field(default_factory=Contiguous, kw_only=True)
    size: int = field(default=1, kw_only=True)
    sorted_slots: bool = field(default=True, kw_only=True)
    name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "name", self.base.name)

    @property
    def increasing(self) -> bool:  # type: ignore[override]
        return self.sorted_slots

    def multiple(self, world: int) -> int:
        return self.base.multiple(world * self.size)

    def segments(self, rank: int, world: int, padded: int) -> tuple[Segment, ...]:
        return _grouped_segments(self, rank, world, padded)

    def member_slots(self, rank: int, world: int, seqlen: int) -> torch.Tensor:
        """For each local slot of ``rank``: its index in the base ranks' shards laid one
        after another (base rank r*size + u's slot i is u * L_base + i) ([L] int64)."""
        return _member_slots(self, rank, world, seqlen)


def grouped(base: Layout, size: int, world: int) -> Layout:
    """``base`` over ``world * size`` ranks as a ring of ``world`` ranks (``Grouped``)."""
    if size == 1:
        return base
    return Grouped(base=base, size=size, sorted_slots=base.unit_stride or world == 1)


@lru_cache(maxsize=256)
def _grouped_segments(layout: Grouped, rank: int, world: int, padded: int):
    size, n = layout.size, padded // (world * layout.size)
    parts = [Segment(s.local_start + u * n, s.length, s.global_start, s.stride)
             for u in range(size)
             for s in layout.base.segments(rank * size + u, world * size, padded)]
    if not layout.sorted_slots:
        return tuple(parts)
    pos = torch.cat([torch.arange(s.length) * s.stride + s.global_start for s in parts]).sort().values
    breaks = [0, *((torch.nonzero(pos[1:] - pos[:-1] != 1).flatten() + 1).tolist()), pos.numel()]
    return tuple(Segment(a, b - a, int(pos[a]), 1) for a, b in zip(breaks[:-1], breaks[1:]))


@lru_cache(maxsize=64)
def _member_slots(layout: Grouped, rank: int, world: int, seqlen: int) -> torch.Tensor:
    size = layout.size
    members = torch.cat([_positions(layout.base, rank * size + u, world * size, seqlen)
                         for u in range(size)])
    where = torch.empty(int(members.max()) + 1, dtype=torch.long)
    where[members] = torch.arange(members.numel())
    return where[_positions(layout, rank, world, seqlen)]


LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in (Contiguous(), Zigzag(), Striped())}
"""The layouts of a whole sequence, by name (each also takes documents: zigzag then
zigzags every document)."""

DOCUMENT_LAYOUTS = ("doc_contiguous",)
"""Layouts that exist only for packed documents (``cu_seqlens`` required)."""

LAYOUT_NAMES = tuple(sorted(LAYOUTS)) + DOCUMENT_LAYOUTS
"""Every layout name, in the order the ranks' agreement numbers them."""

SHARD_TAG = "_ringattn_shard"
"""Attribute ``ringattn.shard`` (and the compat splits) set on their result: a ``ShardTag``,
which every function that takes a shard compares with its own arguments, so a shard attended
or gathered with another placement (or S, or documents, or over another group, or sharded
along another dim) is refused instead of computed wrong."""


class ShardTag(NamedTuple):
    """What a shard remembers of how it was made."""

    layout: str
    """The layout's name (for messages; placements are compared, not names)."""
    seqlen: int
    cu_seqlens: int
    """A digest of the documents' offsets, or -2 for none."""
    dim: int
    ndim: int
    members: tuple[int, ...]
    """The group's global ranks in group order."""
    placement: int
    """``placement_digest`` of the real tokens this rank's shard holds."""


@lru_cache(maxsize=512)
def placement_digest(layout: "Layout", rank: int, world: int, seqlen: int) -> int:
    """A digest of the global positions of the real (non-padding) tokens that ``rank``'s
    shard holds under ``layout``, in slot order: equal digests mean the same tokens in the
    same places, whatever the layouts are called."""
    pos = _positions(layout, rank, world, seqlen)
    return zlib.crc32(pos[pos < seqlen].numpy().tobytes()) & 0x7FFFFFFF


def tag_shard(t: torch.Tensor, layout: "Layout", seqlen: int, cu_digest: int, dim: int,
              members: tuple[int, ...], rank: int) -> torch.Tensor:
    """Set ``t``'s ``ShardTag``: it is group rank ``rank``'s shard of a tensor of S=``seqlen``
    along ``dim``, placed by ``layout`` over ``members``; returns ``t``."""
    setattr(t, SHARD_TAG, ShardTag(layout.name, seqlen, cu_digest, dim, t.dim(), tuple(members),
                                   placement_digest(layout, rank, len(members), seqlen)))
    return t


def same_tag(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` with ``like``'s shard tag (``t`` holds the same slots: an elementwise op of it);
    returns ``t``."""
    tag = getattr(like, SHARD_TAG, None)
    if tag is not None:
        setattr(t, SHARD_TAG, tag._replace(ndim=t.dim()))
    return t


def check_origin(name: str, t, members: tuple[int, ...], used_by: str, dim: int | None = None,
                 ndim: int | None = None, hint: str = "") -> None:
    """Refuse a shard made over another group of ranks than ``members``, or (``dim`` given)
    along another dim (of a tensor of another rank than ``ndim``, when given) than
    ``used_by`` (e.g. "attended", "gathered") takes; ``hint`` ends the dim message.

    Raises:
        ValueError: naming the ranks or the dims.
    """
    tag = getattr(t, SHARD_TAG, None)
    if tag is None:
        return
    if tag.members != tuple(members):
        raise ValueError(
            f"{name} was sharded by ringattn.shard over the ranks {list(tag.members)} but is "
            f"{used_by} over the group of ranks {list(members)}: pass the group it was "
            f"sharded over")
    if dim is not None and (tag.dim != dim or (ndim is not None and tag.ndim != ndim)):
        this = f"this {ndim}-D one" if ndim is not None else "the tensor"
        raise ValueError(
            f"{name} was sharded by ringattn.shard along dim {tag.dim} of a {tag.ndim}-D "
            f"tensor, not dim {dim} of {this} as {used_by}{hint}")


def check_tag(name: str, t, layout: "Layout", seqlen: int, cu_digest: int, rank: int,
              world: int, used_by: str) -> None:
    """Refuse a shard made with another placement, S or documents than ``used_by`` (e.g.
    "attended", "gathered") uses: ``layout`` over ``world`` ranks, this being ``rank``.

    Raises:
        ValueError: naming what differs.
    """
    tag = getattr(t, SHARD_TAG, None)
    if tag is None:
        return
    if tag.seqlen != seqlen:
        raise ValueError(f"{name} was sharded with seqlen={tag.seqlen} but is {used_by} with "
                         f"seqlen={seqlen}: pass the same seqlen (the global S) to both")
    if tag.cu_seqlens != cu_digest:
        def said(digest):
            return "no cu_seqlens" if digest == -2 else f"cu_seqlens (digest {digest})"
        raise ValueError(f"{name} was sharded with {said(tag.cu_seqlens)} but is {used_by} with "
                         f"{said(cu_digest)}: pass the same cu_seqlens (packed documents) to both")
    if tag.placement != placement_digest(layout, rank, world, seqlen):
        same = " (the same name, another placement of tokens)" if tag.layout == layout.name else ""
        raise ValueError(
            f"{name} was sharded with layout {tag.layout!r} but is {used_by} with layout "
            f"{layout.name!r}{same}: rank {rank}'s shard holds other tokens under it; pass the "
            f"layout it was made with")


DEFAULT_LAYOUT = "zigzag"
"""The one default of ``shard``, ``unshard``, ``positions``, ``ring_attention`` and
``shard_batch``: shards made and attended with defaults always agree, and zigzag balances
causal work (the common case)."""


def get_layout(layout: str | Layout, cu_seqlens: tuple[int, ...] | None = None) -> Layout:
    """Return the layout object for a name (or the object itself).

    With ``cu_seqlens`` (validated flash-attn offsets), "zigzag" is ``DocumentZigzag``:
    zigzag per packed document. Other layouts do not depend on documents.
    """
    if isinstance(layout, Layout):
        return layout
    if layout in DOCUMENT_LAYOUTS:
        if cu_seqlens is None:
            raise ValueError(f"layout {layout!r} places packed documents: pass cu_seqlens")
        return DocumentContiguous(cu_seqlens=tuple(cu_seqlens))
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {list(LAYOUT_NAMES)}")
    if cu_seqlens is not None and layout == "zigzag":
        return DocumentZigzag(cu_seqlens=tuple(cu_seqlens))
    return LAYOUTS[layout]


@lru_cache(maxsize=256)
def _positions(layout: Layout, rank: int, world: int, seqlen: int) -> torch.Tensor:
    padded = layout.padded_len(seqlen, world)
    parts = [
        torch.arange(s.length, dtype=torch.long) * s.stride + s.global_start
        for s in layout.segments(rank, world, padded)
    ]
    return torch.cat(parts)


def local_positions(layout: str | Layout, rank: int, world: int, seqlen: int) -> torch.Tensor:
    """Global position of each local slot of ``rank`` ([L] int64; values >= seqlen are padding)."""
    return _positions(get_layout(layout), rank, world, seqlen).clone()


@lru_cache(maxsize=64)
def _restore(layout: Layout, world: int, seqlen: int) -> torch.Tensor:
    perm = torch.cat([_positions(layout, r, world, seqlen) for r in range(world)])
    return torch.argsort(perm)


def restore_index(layout: str | Layout, world: int, seqlen: int) -> torch.Tensor:
    """Index into the rank-major concatenation of all shards that yields global order.

    ``torch.cat(shards, dim).index_select(dim, restore_index(...))`` is the padded global
    tensor (length S_pad); its first ``seqlen`` entries are the real tokens.
    """
    return _restore(get_layout(layout), world, seqlen).clone()


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
