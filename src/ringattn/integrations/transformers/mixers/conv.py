"""Short causal convolutions: LFM2's and LFM3's short convolution (B * x convolved, times C)
and ZAYA's compressed convolutional attention projections (CCA): ``causal_conv1d`` across
ranks, each chunk with the halo of the k-1 inputs before it. ZAYA's attention calls its
projection with positional arguments only, so its layers get the context of their model's
forward.
"""

from __future__ import annotations

import torch

from ....mixers import causal_conv1d
from ..checks import register_mixers
from .base import _RingMixer, _context, _keep, _conv, _masked, _ring_args


class _ShortConv(_RingMixer):
    """LFM2's short convolution: (B * x) convolved, times C."""

    def _ring_forward(self, hidden, ctx, **_):
        hidden = _masked(hidden, _keep(ctx, hidden.shape[0], hidden.device, hidden.dtype))
        bm, cm, x = self.in_proj(hidden).chunk(3, dim=-1)
        y = causal_conv1d(bm * x, *_conv(self.conv), **_ring_args(ctx))
        return self.out_proj((cm * y).contiguous())


def _shifted(x: torch.Tensor, shifts: int, ring: dict) -> list[torch.Tensor]:
    """[x_{t-1}, ..., x_{t-shifts}] of x [B, L, D] on this rank's slots (zero before the
    sequence or the packed document), from one ``causal_conv1d`` with one-hot taps."""
    d = x.shape[-1]
    taps = torch.zeros(shifts * d, shifts + 1, dtype=x.dtype, device=x.device)
    for s in range(1, shifts + 1):  # tap j multiplies x_{t - shifts + j}
        taps[(s - 1) * d:s * d, shifts - s] = 1
    out = causal_conv1d(x.repeat(1, 1, shifts), taps, **ring)
    return list(out.split(d, dim=-1))


class _CompressedConvAttention(_RingMixer):
    """ZAYA's CCA projection (``ZayaCCAProjection``): (query, key, value) [B, L, heads, D]."""

    def forward(self, hidden_states, cache=None, conv_mask=None):
        ctx = _context(self, {"cache": cache})
        if ctx is None:
            return super(_RingMixer, self).forward(hidden_states, cache, conv_mask)
        return self._ring_forward(hidden_states, ctx)

    def _ring_forward(self, hidden, ctx, **_):
        ring = _ring_args(ctx)
        batch, length, _ = hidden.shape
        hidden = _masked(hidden, _keep(ctx, batch, hidden.device, hidden.dtype))
        heads, kv_heads, dim = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        q, k = self.q_proj(hidden), self.k_proj(hidden)
        qk = torch.cat([q, k], dim=-1)
        width = self.conv_kernel_size  # tokens before t that q_t and k_t read
        before = _shifted(torch.cat([qk, hidden], dim=-1), width, ring)
        # windows [B * L, C, width + 1]: qk_{t-width}, ..., qk_t
        window = torch.stack([b[..., :qk.shape[-1]] for b in reversed(before)] + [qk], dim=-1)
        mixed = self.conv_qk_grouped(self.conv_qk_depthwise(
            window.reshape(batch * length, qk.shape[-1], width + 1)))
        mixed = mixed.reshape(batch, length, -1)
        # residual paths: the mean of q and its group's k per query head; k its group's mean
        q_res = (q.view(batch, length, heads, dim)
                 + k.view(batch, length, kv_heads, dim).repeat_interleave(heads // kv_heads, 2)) * 0.5
        k_res = q_res.view(batch, length, kv_heads, heads // kv_heads, dim).mean(dim=-2)
        query = mixed[..., :heads * dim].view(batch, length, heads, dim) + q_res
        key = mixed[..., heads * dim:].view(batch, length, kv_heads, dim) + k_res
        previous = before[0][..., qk.shape[-1]:]  # hidden_{t-1}, zero before the start
        value = torch.cat([self.v_proj_current(hidden), self.v_proj_delayed(previous)], dim=-1)
        return query, key, value.view(batch, length, kv_heads, dim)


register_mixers("conv", {
    "Lfm2ShortConv": _ShortConv,
    "Lfm2MoeShortConv": _ShortConv,
    "Lfm3ShortConv": _ShortConv,
    "ZayaCCAProjection": _CompressedConvAttention,
}, families=("lfm2", "lfm2_moe", "lfm3", "zaya"), kwargs_stop=("zaya",))


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
