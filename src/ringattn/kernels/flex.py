"""torch's flex_attention as a block kernel: arbitrary masks at fused-kernel speed on CUDA.

Legend: B batch, Sq query rows, Sk key rows, H heads, Hkv kv heads, D head dim.

The plan hands this kernel one block per ring step (``tile = None``): the local queries
against the visiting keys, with the mask as a flex ``mask_mod`` that maps block rows and
columns to GLOBAL positions and calls the user's mask on them. flex's own block mask then
skips empty tiles and runs full ones without the mask; it is built once per plan block and
cached on it. Shapes are the same at every step, so the compiled kernel is reused.

Backward against the FINAL lse of the rows: flex has no such entry point, so the block is
recomputed with autograd and differentiated through the surrogate

    f = sum_rows c * (dout . (out_b - out)),   c = exp(lse_b - lse),

with ``out`` and ``lse`` (the merged results) held constant: df/d(out_b) = c * dout and
df/d(lse_b) = c * dout . (out_b - out), exactly the block's share of the gradient of the
merged output (out = sum_b exp(lse_b - lse) out_b). This costs one extra block forward.

flex has no backward on CPU and cannot return the LSE there when compiled (FACTS.md), so
this kernel supports CUDA only.
"""

from __future__ import annotations

import torch

from ..masks import Band, BlockMask

try:  # torch >= 2.9 asks for the LSE through AuxRequest; older releases take return_lse
    from torch.nn.attention.flex_attention import AuxRequest as _AuxRequest
except ImportError:  # pragma: no cover - depends on the torch release
    _AuxRequest = None

_compiled = None


def _flex(q, k, v, block_mask, scale):
    """flex_attention (compiled once) on [B, H, S, D] tensors -> (out, lse)."""
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    gqa = q.shape[1] != k.shape[1]
    if _AuxRequest is not None:
        out, aux = _compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                             return_aux=_AuxRequest(lse=True))
        return out, aux.lse
    return _compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                     return_lse=True)


def _mask_mod(mask, nq: int, nk: int, device):
    """A flex mask_mod for a Band or a BlockMask over block-local rows and columns."""
    if isinstance(mask, Band):
        lo, hi = mask.lo, mask.hi

        def band_mod(b, h, i, j):
            d = i - j
            ok = d == d
            if lo is not None:
                ok = ok & (d >= lo)
            if hi is not None:
                ok = ok & (d <= hi)
            return ok

        return band_mod
    s = mask.seqlen
    q_pos, kv_pos = mask.q_pos.to(device), mask.kv_pos.to(device)
    user = mask.mask

    def global_mod(b, h, i, j):
        qp, kp = q_pos[i], kv_pos[j]
        ok = user(b, h, torch.clamp(qp, max=s - 1), torch.clamp(kp, max=s - 1))
        return ok & (qp < s) & (kp < s)

    return global_mod


def _block_mask(mask, b: int, h: int, nq: int, nk: int, device):
    if mask is None:
        return None
    from torch.nn.attention.flex_attention import create_block_mask

    cache = mask.cache if isinstance(mask, BlockMask) else None
    key = ("flex", b, h, nq, nk, str(device))
    if cache is not None and key in cache:
        return cache[key]
    bm = create_block_mask(_mask_mod(mask, nq, nk, device), b, h, nq, nk, device=device)
    if cache is not None:
        cache[key] = bm
    return bm


class FlexKernel:
    """flex_attention with a block mask built from the ring's mask (CUDA)."""

    name = "flex"
    tile = None

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16)

    def forward(self, q, k, v, scale: float, mask):
        b, sq, h, _ = q.shape
        bm = _block_mask(mask, b, h, sq, k.shape[1], q.device)
        out, lse = _flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bm, scale)
        return out.transpose(1, 2), lse.float()

    def backward(self, dout, q, k, v, out, lse, scale: float, mask):
        b, sq, h, _ = q.shape
        bm = _block_mask(mask, b, h, sq, k.shape[1], q.device)
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
            out_b, lse_b = _flex(q_, k_, v_, bm, scale)
            final = torch.where(torch.isfinite(lse), lse, 0.0).float()  # [B, H, Sq]
            c = torch.exp(lse_b.float() - final)
            do_BHSD = dout.transpose(1, 2).float()
            gap = (do_BHSD * (out_b.float() - out.transpose(1, 2).float())).sum(-1)
            dq, dk, dv = torch.autograd.grad((c * gap).sum(), (q_, k_, v_))
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
