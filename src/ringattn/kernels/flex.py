"""torch's flex_attention as a block kernel: arbitrary masks at fused-kernel speed on CUDA.

Legend: B batch, Sq query rows, Sk key rows, H heads, Hkv kv heads, D head dim.

The plan hands this kernel one block per ring step (``tile = None``): the local queries
against the visiting keys, classified by the plan in 128 x 128 tiles (empty, full,
partial) with either each row's run of visible columns (documents, causal, windows,
prefix-LM: two compares per element, as fast as a hand-written mask_mod) or the dense bits
of the partial tiles (any other mask: a lookup, about 2x slower on an H100). That
classification becomes flex's block mask directly (``BlockMask.from_kv_blocks``): flex
skips empty tiles, runs full ones without a mask, and ``mask_mod`` only reads what the
plan stored. So the
user's mask is never traced into a compiled kernel (it runs once, eagerly, in the plan,
where its errors are reported before any send), every mask compiles to the same kernel,
and the block mask is built once per plan block and cached on it.

Backward against the FINAL lse of the rows: flex has no such entry point, so the block is
recomputed with autograd and differentiated through the surrogate

    f = sum_rows c * (dout . (out_b - out)),   c = exp(lse_b - lse),

with ``out`` and ``lse`` (the merged results) held constant: df/d(out_b) = c * dout and
df/d(lse_b) = c * dout . (out_b - out), exactly the block's share of the gradient of the
merged output (out = sum_b exp(lse_b - lse) out_b). This costs one extra block forward.

flex has no backward on CPU and cannot return the LSE there when compiled (docs/platform.md), so
this kernel supports CUDA only.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..masks import Band, BlockMask

try:  # torch >= 2.9 asks for the LSE through AuxRequest; older releases take return_lse
    from torch.nn.attention.flex_attention import AuxRequest as _AuxRequest
except ImportError:  # pragma: no cover - depends on the torch release
    _AuxRequest = None

@lru_cache(maxsize=1)
def _compiled_flex():
    """flex_attention compiled once per process (compiling on first use, not at import)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, block_mask, scale):
    """Compiled flex_attention on [B, H, S, D] tensors -> (out, lse)."""
    compiled = _compiled_flex()
    gqa = q.shape[1] != k.shape[1]
    if _AuxRequest is not None:
        out, aux = compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                             return_aux=_AuxRequest(lse=True))
        return out, aux.lse
    return compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                    return_lse=True)


def _mask_mod(mask, device):
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


def _from_tiles(mask: BlockMask, nq: int, nk: int, device):
    """flex block mask from the plan's tile kinds and partial-tile bits."""
    from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

    from ..plan import FLEX_TILE as t

    grid = mask.tile_kinds.to(device)

    def lists(kind):  # per row tile: how many tiles of this kind, and their columns first
        sel = grid == kind
        order = torch.argsort((~sel).to(torch.int8), dim=1, stable=True)
        return sel.sum(1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]

    kv_num, kv_idx = lists(2)
    full_num, full_idx = lists(1)
    if mask.row_bounds is not None:  # each row sees one run of columns: two compares
        bounds = mask.row_bounds.to(device)  # [2, Bm, Hm, Sq]
        b_max = torch.tensor(bounds.shape[1] - 1, device=device)
        h_max = torch.tensor(bounds.shape[2] - 1, device=device)
        lo, hi = bounds[0], bounds[1]

        def mod(b, h, i, j):
            bb, hh = torch.minimum(b, b_max), torch.minimum(h, h_max)
            return (j >= lo[bb, hh, i]) & (j < hi[bb, hh, i])
    elif mask.tile_masks is not None:
        # partial tiles' bits, then an all-visible and an all-hidden tile, so mask_mod is
        # right on every tile (flex calls it on partial tiles only when compiled)
        part = mask.tile_masks.to(device)  # [P, Bm, Hm, t, t]
        p = part.shape[0]
        shape = (1, *part.shape[1:])
        bits = torch.cat([part, torch.ones(shape, dtype=torch.bool, device=device),
                          torch.zeros(shape, dtype=torch.bool, device=device)])
        tile_id = torch.full(grid.shape, p + 1, dtype=torch.int64, device=device)
        tile_id[grid == 1] = p
        tile_id[grid == 2] = torch.arange(p, device=device)
        b_max = torch.tensor(bits.shape[1] - 1, device=device)
        h_max = torch.tensor(bits.shape[2] - 1, device=device)

        def mod(b, h, i, j):
            return bits[tile_id[i // t, j // t], torch.minimum(b, b_max),
                        torch.minimum(h, h_max), i % t, j % t]
    else:  # partial tiles too many to keep: evaluate the user's mask inside the kernel
        mod = _mask_mod(mask, device)
    return FlexBlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=t,
                                        mask_mod=mod, seq_lengths=(nq, nk))


def _block_mask(mask, nq: int, nk: int, device):
    if mask is None:
        return None
    from torch.nn.attention.flex_attention import create_block_mask

    cache = mask.cache if isinstance(mask, BlockMask) else None
    key = ("flex", nq, nk, str(device))
    if cache is not None and key in cache:
        return cache[key]
    if isinstance(mask, BlockMask) and mask.tile_kinds is not None:
        bm = _from_tiles(mask, nq, nk, device)
    else:
        bm = create_block_mask(_mask_mod(mask, device), None, None, nq, nk, device=device)
    if cache is not None:
        cache[key] = bm
    return bm


class FlexKernel:
    """flex_attention with a block mask built from the ring's mask (CUDA)."""

    name = "flex"
    tile = None
    features = frozenset()
    """Plain scores only (score_mod soft-capping is not wired in)."""

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16)

    def forward(self, q, k, v, scale: float, mask, softcap: float = 0.0):
        if softcap or q.shape[-1] != v.shape[-1]:
            raise ValueError("flex: no soft-capping or value head dim (the registry picks another kernel)")
        bm = _block_mask(mask, q.shape[1], k.shape[1], q.device)
        out, lse = _flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bm, scale)
        return out.transpose(1, 2), lse.float()

    def backward(self, dout, q, k, v, out, lse, scale: float, mask, softcap: float = 0.0):
        bm = _block_mask(mask, q.shape[1], k.shape[1], q.device)
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
            out_b, lse_b = _flex(q_, k_, v_, bm, scale)
            final = torch.where(torch.isfinite(lse), lse, 0.0).float()  # [B, H, Sq]
            c = torch.exp(lse_b.float() - final)
            do_BHSD = dout.transpose(1, 2).float()
            gap = (do_BHSD * (out_b.float() - out.transpose(1, 2).float())).sum(-1)
            dq, dk, dv = torch.autograd.grad((c * gap).sum(), (q_, k_, v_))
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
