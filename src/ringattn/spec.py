"""AttnSpec: the options of one attention call, as one frozen value.

The spec travels from the public function through the autograd Function into the ring loop
and the plan, so forward and backward see exactly the same options, and the plan cache can
key on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["AttnSpec", "accumulator_dtype"]


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are accumulated in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, kw_only=True)
class AttnSpec:
    """Everything that decides what one attention call computes, except the tensors."""

    causal: bool = False
    """Query i sees key j only if j <= i (global positions)."""

    window_size: tuple[int, int] = (-1, -1)
    """(left, right) as in flash-attn: query i sees key j iff i-left <= j <= i+right; -1 unbounded."""

    softmax_scale: float
    """Multiplier of q.k before the softmax (1/sqrt(D) when the caller passes None)."""

    seqlen: int
    """Global sequence length S, without padding."""

    layout: str = "zigzag"
    """Name of the layout that places global tokens on ranks (see ringattn.layouts)."""

    softcap: float = 0.0
    """Soft-capping of the scaled scores, ``softcap * tanh(s / softcap)`` (Gemma 2); 0: none."""

    alibi_slopes: tuple[float, ...] | None = None
    """ALiBi: per head h, ``-alibi_slopes[h] * |q - kv|`` (GLOBAL positions) is added to the
    (soft-capped) scores, as flash-attn defines it; None: no bias."""

    def __post_init__(self) -> None:
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {self.causal!r}")
        w = self.window_size
        if (
            not isinstance(w, tuple)
            or len(w) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in w)
            or min(w) < -1
        ):
            raise ValueError(
                f"window_size must be a pair of ints (left, right), each >= 0 or -1 for "
                f"unbounded, got {w!r}"
            )
        s = self.softmax_scale
        if not isinstance(s, float) or not math.isfinite(s) or s <= 0:
            raise ValueError(f"softmax_scale must be a finite float > 0, got {s!r}")
        c = self.softcap
        if not isinstance(c, float) or not math.isfinite(c) or c < 0:
            raise ValueError(f"softcap must be a finite float >= 0 (0: no capping), got {c!r}")
        a = self.alibi_slopes
        if a is not None and not (isinstance(a, tuple) and all(
                isinstance(x, float) and math.isfinite(x) for x in a)):
            raise ValueError(f"alibi_slopes must be finite floats, got {a!r}")
        if not isinstance(self.seqlen, int) or isinstance(self.seqlen, bool) or self.seqlen < 1:
            raise ValueError(f"seqlen must be an int >= 1, got {self.seqlen!r}")

    @property
    def left(self) -> int | None:
        """Keys at most this far before the query are visible; None: unbounded."""
        return None if self.window_size[0] < 0 else self.window_size[0]

    @property
    def right(self) -> int | None:
        """Keys at most this far after the query are visible; None: unbounded."""
        right = None if self.window_size[1] < 0 else self.window_size[1]
        if self.causal:
            return 0 if right is None else min(right, 0)
        return right


BACKWARD_OVERLAP = ("all", "kv", "none")
"""How much communication the ring's backward overlaps with compute, from fastest to
leanest (``ring_attention(backward_overlap=...)``)."""


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
