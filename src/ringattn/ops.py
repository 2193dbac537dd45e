"""Ring attention as ``torch.library`` custom ops, so ``torch.compile`` traces through it.

Legend: B batch, L local seq, H heads, Hkv kv heads, D head dim, Dv value head dim.

Under ``torch.compile`` the ring cannot be traced: it agrees on metadata with a collective,
reads plans from Python caches and posts point-to-point sends (FACTS.md: P2P calls inside a
compiled region fail). ``ring_attention`` therefore calls, while compiling, two opaque ops
that take only tensors and plain values (the group by name, masks by a registry key) and
have fake implementations for shapes:

* ``ringattn::ring_attention(q, k, v, sinks, cu_seqlens, ...) -> (out, lse, steps)`` runs
  the same validation and agreement as eager calls (the same error on every rank, before
  any send), then the ring's forward;
* ``ringattn::ring_attention_backward(dout, dlse, q, k, v, out, lse, sinks, ..., steps)``
  runs the ring's backward. ``steps`` (the ring length all ranks agreed on in forward, as a
  0-d tensor) lets it rebuild the ring from the cached plan without a second agreement.

Both call the functions eager calls use (``ring.attention_forward`` / ``attention_backward``):
one implementation, two entry points. Tensors that carry no value are passed empty
(``sinks`` without sinks, ``cu_seqlens`` without documents), since an op's outputs and
inputs must be tensors.
"""

from __future__ import annotations

import torch

from .api import _check_local, build_ring
from .comm import RingComm, group_by_name
from .masks import registered_mask
from .ring import Ring, attention_backward, attention_forward

__all__ = ["compiled_ring_attention"]


def _optional(t: torch.Tensor):
    return None if t.numel() == 0 else t


def _call_args(cu_seqlens, group_name, causal, window_left, window_right, softmax_scale,
               layout, seqlen, mask_key):
    """The ring_attention arguments the op's plain values stand for."""
    return dict(
        group=group_by_name(group_name), causal=causal,
        window_size=(window_left, window_right), softmax_scale=softmax_scale,
        layout=layout, seqlen=None if seqlen < 0 else seqlen,
        mask=None if mask_key < 0 else registered_mask(mask_key),
        cu_seqlens=None if cu_seqlens.numel() == 0 else cu_seqlens.tolist(),
    )


@torch.library.custom_op("ringattn::ring_attention", mutates_args=())
def _ring_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
    cu_seqlens: torch.Tensor, alibi_slopes: torch.Tensor, group_name: str, causal: bool, window_left: int,
    window_right: int, softmax_scale: float, layout: str, seqlen: int, mask_key: int,
    softcap: float, kernel: str, backward_overlap: str, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = _call_args(cu_seqlens, group_name, causal, window_left, window_right,
                      softmax_scale, layout, seqlen, mask_key)
    ring = build_ring(q, k, v, **args, return_lse=return_lse, kernel=kernel,
                      backward_overlap=backward_overlap, softcap=softcap, sinks=_optional(sinks),
                      alibi_slopes=_optional(alibi_slopes))
    with torch.autocast(q.device.type, enabled=False):  # kernels pick their own dtypes
        out, lse = attention_forward(q, k, v, _optional(sinks), ring)
    return out, lse, torch.tensor(ring.steps, dtype=torch.int64)


@_ring_attention_op.register_fake
def _(q, k, v, sinks, cu_seqlens, alibi_slopes, group_name, causal, window_left, window_right,
      softmax_scale, layout, seqlen, mask_key, softcap, kernel, backward_overlap, return_lse):
    b, n, h, _ = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_empty(b, n, h, v.shape[-1])
    lse = q.new_empty(b, h, n, dtype=acc)
    return out, lse, torch.empty((), dtype=torch.int64)


@torch.library.custom_op("ringattn::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(
    dout: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
    cu_seqlens: torch.Tensor, alibi_slopes: torch.Tensor, steps: torch.Tensor, group_name: str, causal: bool,
    window_left: int, window_right: int, softmax_scale: float, layout: str, seqlen: int,
    mask_key: int, softcap: float, kernel: str, backward_overlap: str, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    args = _call_args(cu_seqlens, group_name, causal, window_left, window_right,
                      softmax_scale, layout, seqlen, mask_key)
    pg = args.pop("group")
    comm = RingComm(pg)
    # validated and agreed in forward: the cached plan, no second agreement
    checked = _check_local(
        q, k, v, comm, args["causal"], args["window_size"], args["softmax_scale"],
        args["layout"], args["seqlen"], args["mask"], args["cu_seqlens"], kernel,
        backward_overlap, return_lse, pg, softcap, _optional(sinks), _optional(alibi_slopes))
    ring = Ring(comm, checked.spec, checked.plan, checked.kernel, int(steps), backward_overlap,
                checked.layout)
    with torch.autocast(q.device.type, enabled=False):
        dq, dk, dv, dsinks = attention_backward(
            ring, return_lse, q, k, v, out, lse, _optional(sinks), dout, _optional(dlse),
            sinks.numel() > 0)
    dsinks = sinks.new_empty(0) if dsinks is None else dsinks
    return tuple(t.contiguous() for t in (dq, dk, dv, dsinks))  # strides as the fake says


@_ring_attention_backward_op.register_fake
def _(dout, dlse, q, k, v, out, lse, sinks, cu_seqlens, alibi_slopes, steps, *plain):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(sinks)


_PLAIN = ("group_name", "causal", "window_left", "window_right", "softmax_scale", "layout",
          "seqlen", "mask_key", "softcap", "kernel", "backward_overlap", "return_lse")


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, cu_seqlens, alibi_slopes, *plain = inputs
    out, lse, steps = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, cu_seqlens, alibi_slopes, steps)
    ctx.plain = dict(zip(_PLAIN, plain))


def _backward(ctx, dout, dlse, _dsteps):
    q, k, v, out, lse, sinks, cu_seqlens, alibi_slopes, steps = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is None or not ctx.plain["return_lse"]:  # lse not returned: no gradient on it
        dlse = lse.new_empty(0)
    dq, dk, dv, dsinks = torch.ops.ringattn.ring_attention_backward(
        dout, dlse, q, k, v, out, lse, sinks, cu_seqlens, alibi_slopes, steps, **ctx.plain)
    return dq, dk, dv, (dsinks if sinks.numel() else None), None, None, *([None] * len(_PLAIN))


_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_ring_attention(q, k, v, *, group_name: str, causal: bool, window_size,
                            softmax_scale: float, layout: str, seqlen: int | None, mask_key: int,
                            cu_seqlens, return_lse: bool, kernel: str, backward_overlap: str,
                            softcap: float, sinks, alibi_slopes=None):
    """``ring_attention`` through the custom ops (the caller resolved every plain value)."""
    empty = q.new_empty(0)
    cu = (torch.empty(0, dtype=torch.int64) if cu_seqlens is None
          else torch.as_tensor(cu_seqlens, dtype=torch.int64))
    slopes = (torch.empty(0, dtype=torch.float64) if alibi_slopes is None
              else torch.as_tensor(alibi_slopes, dtype=torch.float64))
    out, lse, _ = torch.ops.ringattn.ring_attention(
        q, k, v, empty if sinks is None else sinks, cu, slopes, group_name, causal,
        int(window_size[0]), int(window_size[1]), softmax_scale, layout,
        -1 if seqlen is None else seqlen, mask_key, softcap, kernel, backward_overlap,
        return_lse)
    return out, lse
