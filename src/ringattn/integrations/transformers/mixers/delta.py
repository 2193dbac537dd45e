"""Gated delta rule layers: Qwen3-Next / Qwen3.5 GatedDeltaNet (a short causal convolution,
then the gated delta rule), Kimi Linear's and Bailing-hybrid's Kimi Delta Attention (a
per-key-channel decay g [B, L, H, dk]), OLMo-Hybrid's and LaRa-mini's Gated DeltaNets:
``ringattn.mixers.causal_conv1d`` then ``gated_delta_rule`` across ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ....mixers import causal_conv1d, gated_delta_rule
from ..checks import register_mixers
from .base import _RingMixer, _keep, _conv, _masked, _ring_args


class _GatedDeltaNet(_RingMixer):
    """Qwen3-Next / Qwen3.5 GatedDeltaNet: conv(q, k, v) then the gated delta rule."""

    def _project(self, hidden):
        """(mixed_qkv [B, L, 2 key_dim + value_dim], z [B, L, Hv, dv], b, a [B, L, Hv])."""
        if hasattr(self, "in_proj_qkvz"):  # Qwen3-Next: grouped by key head
            q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden),
                                                                 self.in_proj_ba(hidden))
            q, k, v = (t.reshape(t.shape[0], t.shape[1], -1) for t in (q, k, v))
            return torch.cat((q, k, v), dim=-1), z, b, a
        batch, length, _ = hidden.shape  # Qwen3.5: one projection each
        z = self.in_proj_z(hidden).reshape(batch, length, -1, self.head_v_dim)
        return self.in_proj_qkv(hidden), z, self.in_proj_b(hidden), self.in_proj_a(hidden)

    def _ring_forward(self, hidden, ctx, **_):
        ring = _ring_args(ctx)
        batch, length, _ = hidden.shape
        hidden = _masked(hidden, _keep(ctx, batch, hidden.device, hidden.dtype))
        mixed, z, b, a = self._project(hidden)
        mixed = causal_conv1d(mixed, *_conv(self.conv1d),
                              activation=self.activation, **ring)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(batch, length, -1, self.head_k_dim)
        k = k.reshape(batch, length, -1, self.head_k_dim)
        v = v.reshape(batch, length, -1, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True,
                               kernel=getattr(self._family, "torch_chunk_gated_delta_rule", None),
                               **ring)
        # transformers' kernel returns float32 for float32 q; ours returns v's dtype
        out = self.norm(out.reshape(-1, out.shape[-1]), z.reshape(-1, z.shape[-1]))
        return self.out_proj(out.reshape(batch, length, -1))


def _conv_qkv(layer, mixed, ring):
    """The layer's depthwise causal convolution of [q | k | v] across the ranks."""
    return causal_conv1d(mixed, *_conv(layer.conv1d),
                         activation=layer.activation, **ring)


class _KimiDeltaAttention(_GatedDeltaNet):
    """Kimi Linear's KimiLinearDeltaAttention: conv(q, k, v) (SiLU), then the gated delta
    rule with a per-channel decay g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias)
    [B, L, H, dk] and beta = sigmoid(b_proj(x)), q and k l2-normalised; then
    o_norm(out, g_b(g_a(x))) (sigmoid gate) and o_proj."""

    def _ring_forward(self, hidden, ctx, **_):
        ring = _ring_args(ctx)
        batch, length, _ = hidden.shape
        hidden = _masked(hidden, _keep(ctx, batch, hidden.device, hidden.dtype))
        mixed = torch.cat((self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)),
                          dim=-1)
        mixed = _conv_qkv(self, mixed, ring)
        shape = (batch, length, -1, self.head_dim)
        q, k, v = (t.reshape(shape) for t in torch.split(mixed, [self.qkv_dim] * 3, dim=-1))
        g = self.forget_gate(hidden)  # [B, L, H, dk], float32
        beta = torch.sigmoid(self.b_proj(hidden))
        out = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True,
                               kernel=getattr(self._family, "chunk_kimi_delta_attention", None),
                               **ring)
        gate = self.g_b_proj(self.g_a_proj(hidden)).reshape(shape)
        return self.o_proj(self.o_norm(out, gate).reshape(batch, length, -1))


class _OlmoGatedDeltaNet(_GatedDeltaNet):
    """OLMo Hybrid's Gated DeltaNet: Qwen3.5's, with separate q/k/v projections, beta
    doubled where ``allow_neg_eigval``, and ``o_norm(out, g_proj(x))`` (SiLU gate), then
    ``o_proj``."""

    def _project(self, hidden):
        batch, length, _ = hidden.shape
        mixed = torch.cat((self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)),
                          dim=-1)
        z = self.g_proj(hidden).reshape(batch, length, -1, self.head_v_dim)
        return mixed, z, self.b_proj(hidden), self.a_proj(hidden)

    def _ring_forward(self, hidden, ctx, **_):
        ring = _ring_args(ctx)
        batch, length, _ = hidden.shape
        hidden = _masked(hidden, _keep(ctx, batch, hidden.device, hidden.dtype))
        mixed, z, b, a = self._project(hidden)
        mixed = _conv_qkv(self, mixed, ring)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(batch, length, -1, self.head_k_dim)
        k = k.reshape(batch, length, -1, self.head_k_dim)
        v = v.reshape(batch, length, -1, self.head_v_dim)
        beta = b.sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2.0
        g = -self.A_log.float().exp() * torch.nn.functional.softplus(a.float() + self.dt_bias)
        out = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True,
                               kernel=getattr(self._family, "torch_chunk_gated_delta_rule", None),
                               **ring)
        out = self.o_norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.o_proj(out.reshape(batch, length, -1))


class _KimiDelta(_RingMixer):
    """Bailing-hybrid's linear attention (``BailingHybridDeltaAttention``): Kimi Delta
    Attention, conv(q, k, v) (SiLU) then the gated delta rule with one decay per key channel
    (its forget gate), q and k l2-normalised, then the gated RMSNorm and the output
    projection; each chunk scanned by the family's ``chunk_kimi_delta_attention``."""

    def _ring_forward(self, hidden, ctx, **_):
        ring = _ring_args(ctx)
        batch, length, _ = hidden.shape
        hidden = _masked(hidden, _keep(ctx, batch, hidden.device, hidden.dtype))
        mixed = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        mixed = causal_conv1d(mixed, *_conv(self.conv1d),
                              activation=self.activation, **ring)
        q, k, v = (t.reshape(batch, length, -1, self.head_dim)
                   for t in mixed.split([self.qkv_dim] * 3, dim=-1))
        out = gated_delta_rule(q, k, v, self.forget_gate(hidden),
                               torch.sigmoid(self.b_proj(hidden)), use_qk_l2norm=True,
                               kernel=getattr(self._family, "chunk_kimi_delta_attention", None),
                               **ring)
        gate = self.g_proj(hidden).reshape(batch, length, -1, self.head_dim)
        return self.o_proj(self.o_norm(out, gate).reshape(batch, length, -1))


register_mixers("delta", {
    "Qwen3NextGatedDeltaNet": _GatedDeltaNet,
    "Qwen3_5GatedDeltaNet": _GatedDeltaNet,
    "Qwen3_5MoeGatedDeltaNet": _GatedDeltaNet,
    "KimiLinearDeltaAttention": _KimiDeltaAttention,
    "OlmoHybridGatedDeltaNet": _OlmoGatedDeltaNet,
    "LaraMiniGatedDeltaNet": _GatedDeltaNet,
    "BailingHybridDeltaAttention": _KimiDelta,
    "Qwen4ExpTextGatedDeltaNet": _GatedDeltaNet,
}, families=("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "kimi_linear", "olmo_hybrid",
             "lara_mini", "bailing_hybrid", "qwen4_exp_text"))


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
