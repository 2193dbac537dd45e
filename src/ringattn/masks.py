"""Masks as functions of GLOBAL positions, and their classification on blocks.

A mask says whether query position q may see key position kv. The ring never builds a
global mask: for each pair of local segments (see ``layouts.Segment``) it asks the mask to
classify the block they form as EMPTY (skip it), FULL (unmasked kernel) or PARTIAL (a band
the kernel applies), trimmed to the rows and columns that see anything.

A band ``Band(lo, hi)`` over a block's local row i and column j means: visible iff
``lo <= i - j <= hi`` (``None`` for an unbounded side). ``Band(0, None)`` is the top-left
aligned causal triangle that fused kernels run natively.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .layouts import Segment

__all__ = ["BlockKind", "Band", "Block", "WindowMask"]


class BlockKind(enum.Enum):
    EMPTY = "empty"
    FULL = "full"
    PARTIAL = "partial"


@dataclass(frozen=True)
class Band:
    """Visible iff lo <= i - j <= hi on block-local row i and column j (None: unbounded)."""

    lo: int | None
    hi: int | None

    @property
    def is_causal(self) -> bool:
        """True for the top-left aligned causal triangle (j <= i)."""
        return self.lo == 0 and self.hi is None

    def dense(self, rows: range, cols: range, device=None) -> torch.Tensor:
        """Boolean [len(rows), len(cols)] visibility for the given block-local rows and cols."""
        i = torch.arange(rows.start, rows.stop, device=device)[:, None]
        j = torch.arange(cols.start, cols.stop, device=device)[None, :]
        d = i - j
        ok = torch.ones(d.shape, dtype=torch.bool, device=device)
        if self.lo is not None:
            ok &= d >= self.lo
        if self.hi is not None:
            ok &= d <= self.hi
        return ok

    def cols_for_rows(self, row_start: int, row_stop: int, ncols: int) -> tuple[int, int]:
        """Smallest column range [start, stop) holding every visible column of these rows."""
        start = 0 if self.hi is None else max(0, row_start - self.hi)
        stop = ncols if self.lo is None else min(ncols, row_stop - 1 - self.lo + 1)
        return start, max(start, stop)


@dataclass(frozen=True)
class Block:
    """What one (q-segment, kv-segment) pair needs, in local buffer coordinates.

    Rows [q_start, q_stop) of the local queries against columns [k_start, k_stop) of the
    visiting keys; ``band`` is None for FULL blocks.
    """

    kind: BlockKind
    q_start: int = 0
    q_stop: int = 0
    k_start: int = 0
    k_stop: int = 0
    band: Band | None = None


EMPTY_BLOCK = Block(BlockKind.EMPTY)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class WindowMask:
    """Causal / sliding-window / padding mask in global positions.

    q sees kv iff both are < seqlen and q - left <= kv <= q + right (None: unbounded).
    Causal is right = 0.
    """

    seqlen: int
    left: int | None = None
    right: int | None = None

    def __call__(self, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
        """Elementwise visibility of broadcastable global position tensors."""
        ok = (q_pos < self.seqlen) & (kv_pos < self.seqlen)
        if self.left is not None:
            ok = ok & (kv_pos >= q_pos - self.left)
        if self.right is not None:
            ok = ok & (kv_pos <= q_pos + self.right)
        return ok

    def classify(self, qseg: Segment, kseg: Segment) -> Block:
        """Classify the block of two segments and trim it to its visible rows and columns."""
        if qseg.stride != kseg.stride:
            raise ValueError(
                f"segments with strides {qseg.stride} and {kseg.stride} cannot form a band"
            )
        st = qseg.stride
        nq = qseg.valid_length(self.seqlen)
        nk = kseg.valid_length(self.seqlen)
        if nq == 0 or nk == 0:
            return EMPTY_BLOCK
        # global q - kv = delta + st * (i - j); the window bounds q - kv to [-right, left].
        delta = qseg.global_start - kseg.global_start
        lo = None if self.right is None else _ceil_div(-self.right - delta, st)
        hi = None if self.left is None else (self.left - delta) // st
        # rows with at least one visible column, and columns with at least one visible row
        i0 = 0 if lo is None else max(0, lo)
        i1 = nq if hi is None else min(nq, hi + nk)
        j0 = 0 if hi is None else max(0, -hi)
        j1 = nk if lo is None else min(nk, nq - lo)
        if (lo is not None and hi is not None and lo > hi) or i0 >= i1 or j0 >= j1:
            return EMPTY_BLOCK
        shift = i0 - j0  # i - j = (i' - j') + shift in trimmed coordinates
        lo_t = None if lo is None or lo - shift <= -(j1 - j0 - 1) else lo - shift
        hi_t = None if hi is None or hi - shift >= i1 - i0 - 1 else hi - shift
        band = None if lo_t is None and hi_t is None else Band(lo_t, hi_t)
        return Block(
            BlockKind.FULL if band is None else BlockKind.PARTIAL,
            qseg.local_start + i0,
            qseg.local_start + i1,
            kseg.local_start + j0,
            kseg.local_start + j1,
            band,
        )
