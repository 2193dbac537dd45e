"""Ring attention with a per-query relative position bias and per-query sink logits.

Legend: B batch, L local seq (S_pad / W), H heads, Hkv kv heads, D head dim, E extent of
the relative bias.

Some models add to the score of query i and key j a bias that depends on the query's own
hidden state and on the distance i - j (Inkling's "relative logits": each query mixes a bank
of bias-vs-distance profiles into one row ``table[i, :]`` of E values, and the score of
(i, j) gets ``table[i, i - j]`` when 0 <= i - j < E, else nothing). The table row of a query
lives on the query's rank and never travels; the distance of a pair is known from the
layout's global positions of the block's rows and columns. So the bias is a score
modification the ring's kernel computes per block from data (``RelativeBias.options``), as
it does ALiBi; its gradient (the score gradient of each pair, summed per query and
distance) accumulates on the query's rank like dQ.

Per-query sinks ([B, H, L]: one extra logit per query row with value 0) fold into the
finished result as gpt-oss's per-head sinks do (``strategies.ring``'s sink merge).

The score modification runs on the reference kernel (exact for any dtype; row tiles bound
its memory). Only the ring strategy carries it.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .kernels import get_kernel
from .spec import accumulator_dtype
from .strategies.ring import attention_backward, attention_forward, build_ring
from .validate import autocast_inputs, caller_error, no_autocast, unit_stride

__all__ = ["RelativeBias", "ring_attention_with_bias"]


@dataclasses.dataclass(frozen=True, eq=False)
class RelativeBias:
    """The data of a per-query relative bias on one rank: ``table`` [B, L, H, E] (each local
    query's bias for distances 0 .. E-1) and, in the backward, ``grad`` (its accumulator)."""

    table: torch.Tensor
    grad: torch.Tensor | None = None

    def options(self, blk, q_pos, kv_pos):
        """The kernel's ``rel_bias`` of one block: (table rows, global positions of the
        block's rows and columns, gradient rows or None)."""
        rows = slice(blk.q_start, blk.q_stop)
        return (self.table[:, rows], q_pos[rows], kv_pos[blk.k_start:blk.k_stop],
                None if self.grad is None else self.grad[:, rows])


class _BiasedRingAttention(torch.autograd.Function):
    """out = ring attention of this rank's queries with the relative bias ``table`` and
    per-query ``sinks`` (or None); gradients for q, k, v, table and sinks."""

    @staticmethod
    def forward(ctx, q, k, v, table, sinks, ring):
        biased = dataclasses.replace(ring, score_bias=RelativeBias(table.detach()))
        out, lse = attention_forward(q, k, v, None if sinks is None else sinks.detach(), biased)
        ctx.save_for_backward(q, k, v, table, sinks, out, lse)
        ctx.ring = ring
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, table, sinks, out, lse = ctx.saved_tensors
        if dout is None:
            return None, None, None, None, None, None
        grad = torch.zeros(table.shape, dtype=accumulator_dtype(q.dtype), device=table.device)
        biased = dataclasses.replace(ctx.ring, score_bias=RelativeBias(table.detach(), grad))
        with no_autocast(q.device.type):
            dq, dk, dv, dsinks = attention_backward(
                biased, False, q, k, v, out, lse, sinks, dout, None,
                sinks is not None and ctx.needs_input_grad[4])
        return dq, dk, dv, grad.to(table.dtype), dsinks, None


def _check_bias(q, table, sinks, extent: int):
    """The shapes of the bias inputs against q [B, L, H, D] (TypeError/ValueError)."""
    b, n, h, _ = q.shape
    if not isinstance(table, torch.Tensor) or table.dim() != 4 or tuple(table.shape[:3]) != (b, n, h):
        raise ValueError(f"rel_bias must be a [B={b}, L={n}, H={h}, E] tensor (each query's bias "
                         f"for distances 0 .. E-1), got "
                         f"{tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__}")
    if table.shape[3] != extent or extent < 1:
        raise ValueError(f"rel_bias has extent {table.shape[3]}, expected rel_extent={extent} >= 1")
    if not table.dtype.is_floating_point or table.device != q.device:
        raise TypeError(f"rel_bias must be a float tensor on {q.device}, got {table.dtype} on "
                        f"{table.device}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor)
                              or tuple(sinks.shape) != (b, h, n)
                              or not sinks.dtype.is_floating_point or sinks.device != q.device):
        raise ValueError(f"query_sinks must be a float [B={b}, H={h}, L={n}] tensor on {q.device}, "
                         f"got {tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else sinks!r}")


def ring_attention_with_bias(q, k, v, rel_bias, *, rel_extent: int, query_sinks=None,
                             group=None, causal: bool = True, window_size=(-1, -1),
                             softmax_scale: float | None = None, layout: str = "zigzag",
                             seqlen: int | None = None, mask=None, cu_seqlens=None,
                             backward_overlap: str = "all"):
    """``ring_attention`` with a per-query relative position bias and per-query sinks.

    Arguments:
        q, k, v: as ``ring_attention`` ([B, L, H, D], [B, L, Hkv, D], [B, L, Hkv, Dv]).
        rel_bias: [B, L, H, E] float, differentiable: the score of query i and key j (GLOBAL
            positions) gets ``rel_bias[b, i, h, i - j]`` when 0 <= i - j < E, nothing
            otherwise (after scaling). E must equal ``rel_extent`` (the model's, the same
            on every rank: it is not compared across ranks).
        query_sinks: None or [B, H, L] float, differentiable: one extra logit per query row
            with value 0 (padding rows get none).
        Every other argument is ``ring_attention``'s (return_lse is not offered).

    Returns:
        out [B, L, H, Dv] in q's dtype (under ``torch.autocast``: q, k, v are cast to its
        dtype first, as ``ring_attention`` casts them, and so is out).

    Raises:
        TypeError, ValueError: the same error on every rank, before any ring message.
    """
    if torch.compiler.is_compiling():
        raise TypeError("ring_attention_with_bias does not run under torch.compile")
    if not isinstance(rel_extent, int) or isinstance(rel_extent, bool):
        raise TypeError(f"rel_extent must be an int, got {type(rel_extent).__name__}")
    scale = (1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale))
    q, k, v = autocast_inputs(q, k, v)  # under autocast, its dtype (as ring_attention)
    try:  # this rank's refusal travels in the agreement: every rank raises it
        _check_bias(q, rel_bias, query_sinks, rel_extent)
        error = None
    except (TypeError, ValueError, AttributeError, IndexError) as exc:
        error = exc if isinstance(exc, (TypeError, ValueError)) else TypeError(str(exc))
    with caller_error(error):
        ring = build_ring(
            q, k, v, group=group, causal=causal, window_size=tuple(window_size),
            softmax_scale=scale, layout=layout, seqlen=seqlen, mask=mask,
            cu_seqlens=cu_seqlens, return_lse=False, kernel="reference",
            backward_overlap=backward_overlap)
    if ring.kernel is not get_kernel("reference", q.device, q.dtype):  # the same on every rank
        raise TypeError(f"a per-query score bias needs the reference kernel (the one that adds "
                        f"it per block), but the ring got {ring.kernel.name!r} for "
                        f"{q.device.type} {q.dtype}")
    q, k, v = unit_stride(q, k, v)
    table = rel_bias.contiguous()
    with no_autocast(q.device.type):
        return _BiasedRingAttention.apply(q, k, v, table, query_sinks, ring)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
