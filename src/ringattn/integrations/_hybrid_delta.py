"""Hybrid families' layers converted by ``convert_mixers`` (see ``hybrid``): delta rules.

* Kimi Linear (``kimi_linear``): Kimi Delta Attention, the gated delta rule with one decay
  per key channel (g [B, L, H, dk] from its forget gate), after a SiLU causal convolution of
  q, k and v; then a sigmoid-gated RMSNorm. Each chunk is scanned by transformers'
  ``chunk_kimi_delta_attention``.
* OLMo Hybrid (``olmo_hybrid``): a Gated DeltaNet with separate q/k/v/a/b projections, beta
  doubled where ``linear_allow_neg_eigval`` (beta in [0, 2]), and a SiLU-gated RMSNorm of
  its own ``g_proj``; each chunk scanned by its ``torch_chunk_gated_delta_rule``.
* LaraMini (``lara_mini``): Qwen3.5's Gated DeltaNet (``hybrid._GatedDeltaNet`` as is),
  beside sliding-window (RoPE) and full (NoPE) attention layers.

Refused: Qwen4-Exp (``qwen4_exp_text``), whose Gated DeltaNet is Qwen3.5's but whose
attention layers pick, for each query, the blocks of keys it may see from the content of
all the earlier keys (its QSA indexer builds that mask from the dense 4-D mask and every
key of the sequence), which ring attention does not compute; ``REFUSED`` gives the reason
``convert_mixers`` states.

Padding is zeroed before the projections (transformers' ``apply_mask_to_padding_states``
with the 2-D mask), so the forget gate, beta and the output gate see what they see in one
process. A packed row (``cu_seq_lens_q`` or position ids restarting at 0) starts each
document with a zero state and an empty convolution window.
"""

from __future__ import annotations

import torch

from .hybrid import _GatedDeltaNet, _keep, _masked, _ring_args


def _conv_qkv(layer, mixed, ring):
    """The layer's depthwise causal convolution of [q | k | v] across the ranks."""
    from ..mixers import causal_conv1d

    return causal_conv1d(mixed, layer.conv1d.weight, layer.conv1d.bias,
                         activation=layer.activation, **ring)


class _KimiDeltaAttention(_GatedDeltaNet):
    """Kimi Linear's KimiLinearDeltaAttention: conv(q, k, v) (SiLU), then the gated delta
    rule with a per-channel decay g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias)
    [B, L, H, dk] and beta = sigmoid(b_proj(x)), q and k l2-normalised; then
    o_norm(out, g_b(g_a(x))) (sigmoid gate) and o_proj."""

    def _ring_forward(self, hidden, ctx, **_):
        from ..mixers import gated_delta_rule

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
        from ..mixers import gated_delta_rule

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


LAYERS: dict = {
    "KimiLinearDeltaAttention": _KimiDeltaAttention,
    "OlmoHybridGatedDeltaNet": _OlmoGatedDeltaNet,
    "LaraMiniGatedDeltaNet": _GatedDeltaNet,
}
"""transformers' layer class name -> the mixin of its converted class."""
FAMILIES: frozenset = frozenset({"kimi_linear", "olmo_hybrid", "lara_mini"})
"""model_type of the families these layers complete."""
KWARGS_STOP: frozenset = frozenset()
"""The families among FAMILIES whose model does not pass ring_context on to its layers."""
REFUSED: dict = {
    "qwen4_exp_text": (
        "its indexed attention layers choose, for each query, the blocks of keys it attends "
        "to from the content of every earlier key (the QSA indexer, a data-dependent sparse "
        "mask built from the dense 4-D mask), which ring attention does not compute"),
}
"""model_type -> why ``convert_mixers`` refuses the family (its Gated DeltaNet alone would
convert; the rest of the model cannot be made exact)."""

if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
