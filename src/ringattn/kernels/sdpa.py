"""torch's fused attention ops that return the LSE, as block kernels.

Legend: B batch, Sq query rows, Sk key rows, H heads, Hkv kv heads, D head dim.

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``): tiled, never
  materialises Sq x Sk, handles GQA natively, accepts ``is_causal`` (top-left aligned) and an
  additive float mask.
* CUDA: ``aten._scaled_dot_product_flash_attention`` (+ ``_backward``) for unmasked bf16/fp16
  blocks, else ``aten._scaled_dot_product_efficient_attention`` (+ ``_backward``):
  fp32/fp16/bf16, additive bias, LSE. K/V heads are expanded for GQA inside the call only.

A block is FULL (no mask), causal (``Band(0, None)``, run with ``is_causal``), a general
band, or a ``BlockMask`` (a tile of a general mask, with its dense visibility). A general
band is run in row tiles, each with an additive mask over just the columns its rows can
see, so the mask is at most ``TILE_ROWS x Sk`` and never grows with the global sequence;
a BlockMask is already a tile. These ops report lse = 0 (not -inf) for a row that sees
nothing, so such rows are set to lse = -inf and out = 0 here; they crash on empty inputs,
which the plan never hands over.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..masks import Band, BlockMask

TILE_ROWS = 256
"""Rows per kernel call for banded blocks (bounds the additive mask to TILE_ROWS x Sk)."""

_aten = torch.ops.aten
_BIAS_ALIGN = 16
"""The CUDA op wants the bias's row stride to be a multiple of 16 bytes (seen on H100:
"attn_bias is not correctly aligned"); rows are allocated this many elements wide."""


def _additive(ok: torch.Tensor, dtype) -> torch.Tensor:
    """0 where ``ok``, -inf elsewhere, with rows padded in memory to an aligned stride."""
    n = ok.shape[-1]
    wide = -(-n // _BIAS_ALIGN) * _BIAS_ALIGN
    bias = torch.zeros(*ok.shape[:-1], wide, dtype=dtype, device=ok.device)[..., :n]
    return bias.masked_fill_(~ok, float("-inf"))


def _cpu_fwd(q, k, v, causal, mask, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )


def _cpu_bwd(dout, q, k, v, out, lse, causal, mask, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
    )


def _expand_heads(x_BHSD: torch.Tensor, heads: int) -> torch.Tensor:
    groups = heads // x_BHSD.shape[1]
    return x_BHSD if groups == 1 else x_BHSD.repeat_interleave(groups, dim=1)


def _fold_heads(x_BHSD: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the gradients of the query heads that share a kv head (undoes _expand_heads)."""
    b, h = x_BHSD.shape[:2]
    return x_BHSD if h == kv_heads else x_BHSD.reshape(b, kv_heads, h // kv_heads, *x_BHSD.shape[2:]).sum(2)


# The CUDA efficient-attention op pads its LSE to a multiple of this many rows.
_LSE_ALIGN = 32


def _use_flash(q, k, causal, mask) -> bool:
    """The CUDA flash op (much faster than the efficient one on Hopper) for unmasked bf16/fp16
    blocks; causal only when square, where top-left and bottom-right alignment agree."""
    return (mask is None and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256
            and (not causal or q.shape[2] == k.shape[2]))


@lru_cache(maxsize=None)
def _flash_aux(device, dtype):
    """The (cum_seq_q, cum_seq_k, philox_seed, philox_offset) the flash forward returns
    without dropout, which its backward takes back. The ring's backward has only the final
    out and lse, so they are taken once from a tiny forward on the device."""
    x = torch.zeros(1, 1, 16, 64, device=device, dtype=dtype)
    res = _aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
    return res[2], res[3], res[6], res[7]


def _cuda_fwd(q, k, v, causal, mask, scale):
    h = q.shape[1]
    if _use_flash(q, k, causal, mask):
        out, lse = _aten._scaled_dot_product_flash_attention(
            q, _expand_heads(k, h), _expand_heads(v, h), 0.0, causal, False, scale=scale)[:2]
        return out, lse
    bias = None if mask is None else mask.expand(q.shape[0], h, *mask.shape[-2:])
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
        q, _expand_heads(k, h), _expand_heads(v, h), bias, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]]


def _cuda_bwd(dout, q, k, v, out, lse, causal, mask, scale):
    b, h, sq, _ = q.shape
    hkv = k.shape[1]
    if _use_flash(q, k, causal, mask):
        cum_q, cum_k, seed, offset = _flash_aux(q.device, q.dtype)
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            dout, q, _expand_heads(k, h), _expand_heads(v, h), out, lse.contiguous(), cum_q,
            cum_k, sq, k.shape[2], 0.0, causal, seed, offset, scale=scale)
        return dq, _fold_heads(dk, hkv), _fold_heads(dv, hkv)
    bias = None if mask is None else mask.expand(b, h, *mask.shape[-2:])
    pad = -sq % _LSE_ALIGN
    lse_padded = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
    empty = torch.empty(0, device=q.device, dtype=torch.int64)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, _expand_heads(k, h), _expand_heads(v, h), bias, out, lse_padded.contiguous(),
        empty, empty, 0.0, [True, True, True, False], causal, scale=scale,
    )
    return dq, _fold_heads(dk, hkv), _fold_heads(dv, hkv)


def _same_head_dim(q, k, v):
    """The fused ops want one head dim for q, k and v: zero columns make them equal without
    changing any score (q, k padded) or any output column that is kept (v padded)."""
    d, dv = q.shape[-1], v.shape[-1]
    if d < dv:
        q, k = (torch.nn.functional.pad(t, (0, dv - d)) for t in (q, k))
    elif dv < d:
        v = torch.nn.functional.pad(v, (0, d - dv))
    return q, k, v


class SdpaKernel:
    """One fused-op kernel; ``device_type`` picks torch's CPU or CUDA op."""

    tile = (256, 128)
    """General masks are classified in tiles of (rows, cols) for this kernel."""

    features = frozenset({"value_dim"})
    """A value head dim different from the query's runs padded (MLA); no soft-capping."""

    def __init__(self, device_type: str):
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"SdpaKernel supports 'cpu' and 'cuda', not {device_type!r}")
        self.device_type = device_type
        self.name = f"sdpa-{device_type}"
        self._fwd, self._bwd = (_cpu_fwd, _cpu_bwd) if device_type == "cpu" else (_cuda_fwd, _cuda_bwd)

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        if device.type != self.device_type:
            return False
        if self.device_type == "cpu":
            return dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        return dtype in (torch.float32, torch.bfloat16, torch.float16)

    def _calls(self, mask, nq: int, nk: int, device):
        """(rows, cols, causal, visibility or None) for each op call a block needs."""
        if mask is None or (isinstance(mask, Band) and mask.is_causal):
            yield slice(0, nq), slice(0, nk), mask is not None, None
        elif isinstance(mask, Band):
            for a in range(0, nq, TILE_ROWS):
                b = min(nq, a + TILE_ROWS)
                c0, c1 = mask.cols_for_rows(a, b, nk)
                ok = mask.dense(range(a, b), range(c0, c1), device=device)
                yield slice(a, b), slice(c0, c1), False, ok[None, None]
        elif isinstance(mask, BlockMask):
            yield slice(0, nq), slice(0, nk), False, mask.dense().to(device)
        else:
            raise TypeError(f"{self.name} cannot apply a mask of type {type(mask).__name__}")

    def forward(self, q, k, v, scale: float, mask, softcap: float = 0.0):
        if softcap:
            raise ValueError(f"{self.name} cannot soft-cap scores (the registry picks another kernel)")
        d, dv = q.shape[-1], v.shape[-1]
        if d != dv:
            out, lse = self.forward(*_same_head_dim(q, k, v), scale, mask)
            return out[..., :dv], lse
        q_, k_, v_ = (x.transpose(1, 2) for x in (q, k, v))
        b, sq, h, _ = q.shape
        calls = list(self._calls(mask, sq, k.shape[1], q.device))
        if len(calls) == 1 and calls[0][3] is None:
            out, lse = self._fwd(q_, k_, v_, calls[0][2], None, scale)
            return out.transpose(1, 2), lse
        out_BSHD = torch.empty_like(q)
        lse_BHS = torch.empty(b, h, sq, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype, device=q.device)
        for rows, cols, causal, ok in calls:
            o, l = self._fwd(q_[:, :, rows], k_[:, :, cols], v_[:, :, cols], causal,
                             _additive(ok, q.dtype), scale)
            # rows that see no key: the ops say lse = 0, out = 0 or NaN (no host sync here)
            dead = ~ok.any(-1)
            l = l.masked_fill(dead, float("-inf"))
            o = o.masked_fill(dead[..., None], 0.0)
            out_BSHD[:, rows] = o.transpose(1, 2)
            lse_BHS[:, :, rows] = l
        return out_BSHD, lse_BHS

    def backward(self, dout, q, k, v, out, lse, scale: float, mask, softcap: float = 0.0):
        if softcap:
            raise ValueError(f"{self.name} cannot soft-cap scores (the registry picks another kernel)")
        d, dv = q.shape[-1], v.shape[-1]
        if d != dv:
            wide = max(d, dv)
            do_w, o_w = (torch.nn.functional.pad(t, (0, wide - dv)) for t in (dout, out))
            dq, dk, dv_ = self.backward(do_w, *_same_head_dim(q, k, v), o_w, lse, scale, mask)
            return dq[..., :d], dk[..., :d], dv_[..., :dv]
        q_, k_, v_, do_, o_ = (x.transpose(1, 2) for x in (q, k, v, dout, out))
        lse = lse.to(torch.float32) if q.dtype != torch.float64 else lse
        calls = list(self._calls(mask, q.shape[1], k.shape[1], q.device))
        if len(calls) == 1 and calls[0][3] is None:
            dq, dk, dv = self._bwd(do_, q_, k_, v_, o_, lse, calls[0][2], None, scale)
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        # rows that see no key anywhere have lse = -inf; any finite value gives them p = 0
        lse = torch.where(torch.isfinite(lse), lse, 0.0)
        dq_BSHD = torch.empty_like(q)
        acc = torch.float32 if k.dtype != torch.float64 else k.dtype
        dk_BSHD = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv_BSHD = torch.zeros_like(dk_BSHD)
        for rows, cols, causal, ok in calls:
            dq, dk, dv = self._bwd(
                do_[:, :, rows], q_[:, :, rows], k_[:, :, cols], v_[:, :, cols],
                o_[:, :, rows], lse[:, :, rows], causal, _additive(ok, q.dtype), scale,
            )
            dq_BSHD[:, rows] = dq.transpose(1, 2)
            dk_BSHD[:, cols] += dk.transpose(1, 2)
            dv_BSHD[:, cols] += dv.transpose(1, 2)
        return dq_BSHD, dk_BSHD, dv_BSHD


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
