"""torch's fused attention ops that return the LSE, as block kernels.

Legend: B batch, Sq query rows, Sk key rows, H heads, Hkv kv heads, D head dim.

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``): tiled, never
  materialises Sq x Sk, handles GQA natively, accepts ``is_causal`` (top-left aligned) and an
  additive float mask.
* CUDA: ``aten._scaled_dot_product_efficient_attention`` (+ ``_backward``): fp32/fp16/bf16,
  additive bias, LSE. K/V heads are expanded for GQA inside the call only.

A block is FULL (no mask), causal (``Band(0, None)``, run with ``is_causal``) or a general
band. A general band is run in row tiles, each with an additive mask over just the columns
its rows can see, so the mask is at most ``TILE_ROWS x Sk`` and never grows with the global
sequence. The ring only hands over rows that see at least one key, which matters: these ops
report lse = 0 (not -inf) for a row that sees nothing, and crash on empty inputs.
"""

from __future__ import annotations

import torch

from ..masks import Band

TILE_ROWS = 256
"""Rows per kernel call for banded blocks (bounds the additive mask to TILE_ROWS x Sk)."""

_aten = torch.ops.aten


def _additive_mask(band: Band, rows: range, cols: range, dtype, device) -> torch.Tensor:
    ok = band.dense(rows, cols, device=device)
    return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))


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


# The CUDA efficient-attention op pads its LSE to a multiple of this many rows.
_LSE_ALIGN = 32


def _cuda_fwd(q, k, v, causal, mask, scale):
    h = q.shape[1]
    bias = None if mask is None else mask.expand(q.shape[0], h, *mask.shape[-2:])
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
        q, _expand_heads(k, h), _expand_heads(v, h), bias, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]]


def _cuda_bwd(dout, q, k, v, out, lse, causal, mask, scale):
    b, h, sq, _ = q.shape
    hkv = k.shape[1]
    bias = None if mask is None else mask.expand(b, h, *mask.shape[-2:])
    pad = -sq % _LSE_ALIGN
    lse_padded = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
    empty = torch.empty(0, device=q.device, dtype=torch.int64)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, _expand_heads(k, h), _expand_heads(v, h), bias, out, lse_padded.contiguous(),
        empty, empty, 0.0, [True, True, True, False], causal, scale=scale,
    )
    if hkv != h:
        dk = dk.reshape(b, hkv, h // hkv, *dk.shape[2:]).sum(2)
        dv = dv.reshape(b, hkv, h // hkv, *dv.shape[2:]).sum(2)
    return dq, dk, dv


class SdpaKernel:
    """One fused-op kernel; ``device_type`` picks torch's CPU or CUDA op."""

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

    def _tiles(self, band: Band, nq: int, nk: int):
        for a in range(0, nq, TILE_ROWS):
            b = min(nq, a + TILE_ROWS)
            c0, c1 = band.cols_for_rows(a, b, nk)
            yield a, b, c0, c1

    def forward(self, q, k, v, scale: float, band: Band | None):
        q_, k_, v_ = (x.transpose(1, 2) for x in (q, k, v))
        if band is None or band.is_causal:
            out, lse = self._fwd(q_, k_, v_, band is not None, None, scale)
            return out.transpose(1, 2), lse
        b, sq, h, d = q.shape
        out_BSHD = torch.empty_like(q)
        lse_BHS = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
        for a, e, c0, c1 in self._tiles(band, sq, k.shape[1]):
            mask = _additive_mask(band, range(a, e), range(c0, c1), q.dtype, q.device)
            o, l = self._fwd(q_[:, :, a:e], k_[:, :, c0:c1], v_[:, :, c0:c1], False, mask, scale)
            out_BSHD[:, a:e] = o.transpose(1, 2)
            lse_BHS[:, :, a:e] = l
        return out_BSHD, lse_BHS

    def backward(self, dout, q, k, v, out, lse, scale: float, band: Band | None):
        q_, k_, v_, do_, o_ = (x.transpose(1, 2) for x in (q, k, v, dout, out))
        lse = lse.to(torch.float32) if q.dtype != torch.float64 else lse
        if band is None or band.is_causal:
            dq, dk, dv = self._bwd(do_, q_, k_, v_, o_, lse, band is not None, None, scale)
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        dq_BSHD = torch.empty_like(q)
        dk_BSHD = torch.zeros(k.shape, dtype=torch.float32 if k.dtype != torch.float64 else k.dtype, device=k.device)
        dv_BSHD = torch.zeros_like(dk_BSHD)
        for a, e, c0, c1 in self._tiles(band, q.shape[1], k.shape[1]):
            mask = _additive_mask(band, range(a, e), range(c0, c1), q.dtype, q.device)
            dq, dk, dv = self._bwd(
                do_[:, :, a:e], q_[:, :, a:e], k_[:, :, c0:c1], v_[:, :, c0:c1],
                o_[:, :, a:e], lse[:, :, a:e], False, mask, scale,
            )
            dq_BSHD[:, a:e] = dq.transpose(1, 2)
            dk_BSHD[:, c0:c1] += dk.transpose(1, 2)
            dv_BSHD[:, c0:c1] += dv.transpose(1, 2)
        return dq_BSHD, dk_BSHD, dv_BSHD
