"""Pure-torch block attention: any device, any float dtype, any mask. The oracle and fallback.

Legend: B batch, Sq query rows, Sk key rows, H heads, Hkv kv heads, G = H / Hkv, D head dim.

It materialises the [B, H, Sq, Sk] scores of one block (never of the global sequence), in
float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

from ..masks import Band, BlockMask
from ..spec import accumulator_dtype


def _expand_kv(x_BSHD: torch.Tensor, groups: int, acc: torch.dtype) -> torch.Tensor:
    """[B, Sk, Hkv, D] -> [B, H, Sk, D] in acc dtype (kv head h // G serves query head h)."""
    return x_BSHD.to(acc).transpose(1, 2).repeat_interleave(groups, dim=1)


def _probs(q, k, scale, mask, lse_BHS=None):
    """Masked scaled scores and, given an lse, the probabilities exp(s - lse)."""
    acc = accumulator_dtype(q.dtype)
    groups = q.shape[2] // k.shape[2]
    q_BHSD = q.to(acc).transpose(1, 2)
    k_BHSD = _expand_kv(k, groups, acc)
    s = (q_BHSD @ k_BHSD.transpose(-1, -2)) * scale
    if isinstance(mask, BlockMask):
        s = s.masked_fill(~mask.dense().to(q.device), float("-inf"))
    elif mask is not None:
        ok = mask.dense(range(q.shape[1]), range(k.shape[1]), device=q.device)
        s = s.masked_fill(~ok, float("-inf"))
    if lse_BHS is None:
        lse_BHS = torch.logsumexp(s, dim=-1)
    # rows with no visible key: lse = -inf; subtracting 0 there keeps exp(-inf) = 0, not NaN
    safe = torch.where(torch.isfinite(lse_BHS), lse_BHS, 0.0).to(acc)
    return q_BHSD, k_BHSD, torch.exp(s - safe.unsqueeze(-1)), lse_BHS


class ReferenceKernel:
    """Dense per-block attention in plain torch ops."""

    tile = (256, 128)
    """General masks are classified in tiles of (rows, cols) for this kernel."""

    name = "reference"

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def forward(self, q, k, v, scale: float, mask: Band | BlockMask | None):
        acc = accumulator_dtype(q.dtype)
        _, _, p, lse_BHS = _probs(q, k, scale, mask)
        v_BHSD = _expand_kv(v, q.shape[2] // k.shape[2], acc)
        out_BSHD = (p @ v_BHSD).transpose(1, 2)
        return out_BSHD.to(q.dtype), lse_BHS.to(acc)

    def backward(self, dout, q, k, v, out, lse, scale: float, mask: Band | BlockMask | None):
        acc = accumulator_dtype(q.dtype)
        b, sk, hkv, d = k.shape
        groups = q.shape[2] // hkv
        q_BHSD, k_BHSD, p, _ = _probs(q, k, scale, mask, lse.to(acc))
        v_BHSD = _expand_kv(v, groups, acc)
        do_BHSD = dout.to(acc).transpose(1, 2)
        o_BHSD = out.to(acc).transpose(1, 2)
        dv = p.transpose(-1, -2) @ do_BHSD
        dp = do_BHSD @ v_BHSD.transpose(-1, -2)
        delta = (do_BHSD * o_BHSD).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = (ds @ k_BHSD) * scale
        dk = (ds.transpose(-1, -2) @ q_BHSD) * scale

        def fold(x_BHSD):  # sum the G query heads that share a kv head
            return x_BHSD.reshape(b, hkv, groups, sk, d).sum(2).transpose(1, 2)

        return dq.transpose(1, 2), fold(dk), fold(dv)
