"""Pure-torch block attention: any device, any float dtype, any mask, any score modification.
The oracle, the fallback, and the exact path for what fused kernels cannot do (soft-capping).

Legend: B batch, Sq query rows, Sk key rows, H heads, Hkv kv heads, G = H / Hkv, D head dim
(Dv the value head dim, which may differ: MLA).

It materialises the scores of ROW_TILE query rows at a time ([B, H, ROW_TILE, Sk], in
float32, float64 for float64 inputs), never of the global sequence nor of a whole block.

Soft-capping (Gemma 2, Grok): the score of a pair is ``cap * tanh(scale * q.k / cap)``;
its derivative by the raw score is ``1 - tanh^2 = 1 - (s / cap)^2``, applied in backward.
ALiBi then adds ``-slope_h * |q_pos - kv_pos|`` (global positions; flash-attn's order and
sign), a constant for the gradients.
"""

from __future__ import annotations

import torch

from ..masks import Band, BlockMask
from ..spec import accumulator_dtype

ROW_TILE = 256
"""Query rows per step: bounds the materialised scores to ROW_TILE x Sk per head."""


def _expand_kv(x_BSHD: torch.Tensor, groups: int, acc: torch.dtype) -> torch.Tensor:
    """[B, Sk, Hkv, D] -> [B, H, Sk, D] in acc dtype (kv head h // G serves query head h)."""
    return x_BSHD.to(acc).transpose(1, 2).repeat_interleave(groups, dim=1)


def _row_tile(mask, rows: slice, nk: int, device):
    """(columns, visibility) for block rows ``rows``: the column range their keys can lie in
    (a band's rows see a bounded range, so a causal block costs half a square) and the bool
    visibility over it, or None when everything in it is visible."""
    if mask is None:
        return slice(0, nk), None
    if isinstance(mask, BlockMask):
        return slice(0, nk), mask.dense().to(device)[..., rows, :]
    c0, c1 = mask.cols_for_rows(rows.start, rows.stop, nk)
    return slice(c0, c1), mask.dense(range(rows.start, rows.stop), range(c0, c1), device=device)


def _distances(rel_bias, rows: slice, cols: slice):
    """(index [Sr, Sc] into the bias rows, in range [Sr, Sc]) of a relative bias: the global
    distance q_pos - kv_pos of each pair, and whether it lies in [0, extent)."""
    table, q_pos, kv_pos, _ = rel_bias
    dist = q_pos[rows, None] - kv_pos[None, cols]
    extent = table.shape[-1]
    return dist.clamp(0, extent - 1), (dist >= 0) & (dist < extent)


def _relative(rel_bias, rows: slice, cols: slice, dtype):
    """[B, H, Sr, Sc] the per-query relative bias of a row tile: ``table[b, q, h, q_pos -
    kv_pos]`` where that distance is in [0, extent), else 0."""
    table = rel_bias[0][:, rows].to(dtype).permute(0, 2, 1, 3)  # [B, H, Sr, E]
    index, inside = _distances(rel_bias, rows, cols)
    shape = (*table.shape[:2], *index.shape)
    return table.gather(-1, index.expand(shape)).masked_fill(~inside, 0.0)


def _scores(q_BHSD, k_BHSD, scale, softcap, ok, alibi, rows: slice, cols: slice,
            rel_bias=None):
    """(masked scores of one row tile, their soft-capped part before the ALiBi bias or
    None without soft-capping): scaled, soft-capped, biased."""
    s = (q_BHSD @ k_BHSD.transpose(-1, -2)) * scale
    capped = None
    if softcap:
        s = capped = torch.tanh(s / softcap) * softcap
    if alibi is not None:
        slopes_H, q_pos, kv_pos = alibi
        dist = (q_pos[rows, None] - kv_pos[None, cols]).abs().to(s.dtype)
        s = s - slopes_H.to(s.dtype).view(1, -1, 1, 1) * dist
    if rel_bias is not None:
        s = s + _relative(rel_bias, rows, cols, s.dtype)
    return (s if ok is None else s.masked_fill(~ok, float("-inf"))), capped


def _add_relative_grad(rel_bias, ds_BHSC, rows: slice, cols: slice) -> None:
    """Add the score gradient of a row tile to the gradient of its bias rows (each pair's
    score gradient goes to the table entry its distance picked)."""
    grad = rel_bias[3]
    if grad is None:
        return
    index, inside = _distances(rel_bias, rows, cols)
    extent = grad.shape[-1]
    b, h = ds_BHSC.shape[:2]
    sums = torch.zeros(b, h, ds_BHSC.shape[2], extent, dtype=ds_BHSC.dtype, device=ds_BHSC.device)
    sums.scatter_add_(-1, index.expand(ds_BHSC.shape), ds_BHSC.masked_fill(~inside, 0.0))
    grad[:, rows] += sums.permute(0, 2, 1, 3).to(grad.dtype)


class ReferenceKernel:
    """Dense per-row-tile attention in plain torch ops."""

    tile = (256, 128)
    """General masks are classified in tiles of (rows, cols) for this kernel."""

    name = "reference"
    features = frozenset({"softcap", "alibi", "value_dim", "rel_bias"})
    """Everything: soft-capping, ALiBi, a per-query relative bias, and a value head dim
    different from the query's."""

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def forward(self, q, k, v, scale: float, mask: Band | BlockMask | None, softcap: float = 0.0,
                alibi=None, rel_bias=None):
        acc = accumulator_dtype(q.dtype)
        b, sq, h, _ = q.shape
        groups = h // k.shape[2]
        k_BHSD, v_BHSD = _expand_kv(k, groups, acc), _expand_kv(v, groups, acc)
        out_BSHD = torch.empty(b, sq, h, v.shape[3], dtype=q.dtype, device=q.device)
        lse_BHS = torch.empty(b, h, sq, dtype=acc, device=q.device)
        for a in range(0, sq, ROW_TILE):
            rows = slice(a, min(sq, a + ROW_TILE))
            q_BHSD = q[:, rows].to(acc).transpose(1, 2)
            cols, ok = _row_tile(mask, rows, k.shape[1], q.device)
            s, _ = _scores(q_BHSD, k_BHSD[:, :, cols], scale, softcap, ok, alibi, rows, cols,
                           rel_bias)
            lse = torch.logsumexp(s, dim=-1)
            # rows with no visible key: lse = -inf; subtracting 0 there keeps exp(-inf) = 0
            p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
            out_BSHD[:, rows] = (p @ v_BHSD[:, :, cols]).transpose(1, 2).to(q.dtype)
            lse_BHS[:, :, rows] = lse
        return out_BSHD, lse_BHS

    def backward(self, dout, q, k, v, out, lse, scale: float, mask: Band | BlockMask | None,
                 softcap: float = 0.0, alibi=None, rel_bias=None):
        acc = accumulator_dtype(q.dtype)
        b, sk, hkv, d = k.shape
        sq, h = q.shape[1], q.shape[2]
        groups = h // hkv
        k_BHSD, v_BHSD = _expand_kv(k, groups, acc), _expand_kv(v, groups, acc)
        dq_BSHD = torch.empty(q.shape, dtype=acc, device=q.device)
        dk_BHSD = torch.zeros(b, h, sk, d, dtype=acc, device=q.device)
        dv_BHSD = torch.zeros(b, h, sk, v.shape[3], dtype=acc, device=q.device)
        lse = lse.to(acc)
        for a in range(0, sq, ROW_TILE):
            rows = slice(a, min(sq, a + ROW_TILE))
            q_BHSD = q[:, rows].to(acc).transpose(1, 2)
            cols, ok = _row_tile(mask, rows, sk, q.device)
            k_t, v_t = k_BHSD[:, :, cols], v_BHSD[:, :, cols]
            s, capped = _scores(q_BHSD, k_t, scale, softcap, ok, alibi, rows, cols, rel_bias)
            final = lse[:, :, rows]
            p = torch.exp(s - torch.where(torch.isfinite(final), final, 0.0).unsqueeze(-1))
            do_BHSD = dout[:, rows].to(acc).transpose(1, 2)
            o_BHSD = out[:, rows].to(acc).transpose(1, 2)
            dv_BHSD[:, :, cols] += p.transpose(-1, -2) @ do_BHSD
            dp = do_BHSD @ v_t.transpose(-1, -2)
            delta = (do_BHSD * o_BHSD).sum(-1, keepdim=True)
            ds = p * (dp - delta)
            if rel_bias is not None:  # added after soft-capping: its gradient is ds itself
                _add_relative_grad(rel_bias, ds, rows, cols)
            if softcap:  # d cap*tanh(x/cap) / dx = 1 - tanh^2 (of the capped score)
                ds = ds * (1 - (capped / softcap) ** 2)
            dq_BSHD[:, rows] = ((ds @ k_t) * scale).transpose(1, 2)
            dk_BHSD[:, :, cols] += (ds.transpose(-1, -2) @ q_BHSD) * scale

        def fold(x_BHSD):  # sum the G query heads that share a kv head
            return x_BHSD.reshape(b, hkv, groups, sk, x_BHSD.shape[-1]).sum(2).transpose(1, 2)

        return dq_BSHD, fold(dk_BHSD), fold(dv_BHSD)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
