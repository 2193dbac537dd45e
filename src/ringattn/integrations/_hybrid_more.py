"""Hybrid families' layers converted by ``convert_mixers`` (see ``hybrid``): more.

* LFM3 (``lfm3``): LFM2's short convolution (``Lfm3ShortConv`` is ``Lfm2ShortConv``).
* ZAYA (``zaya``): every layer is attention whose q/k/v come from a Compressed
  Convolutional Attention projection: q and k (projected, concatenated) go through a
  depthwise convolution then a grouped convolution (channels mixed within each head), so
  each token's q and k read the K = (cca_time0 - 1) + (cca_time1 - 1) tokens before it;
  half of each value head is projected from the token before. Under a ring context the
  converted projection takes those earlier tokens from ``causal_conv1d`` with one-hot taps
  (a shift by s: exact, and zero before the sequence or the document as in transformers'
  left zero padding), then runs the family's own two convolutions on each token's window
  of K + 1 tokens. The projection is called without the decoder's keyword arguments, so a
  pre-hook on the model hands it the ring context (``KWARGS_STOP``).

Refused (``REFUSED``: ``convert_mixers`` raises a ValueError with the reason): the families
whose attention ring attention does not compute.
"""

from __future__ import annotations

import torch

from .hybrid import _RingMixer, _ShortConv, _context, _keep, _masked, _ring_args


def _shifted(x: torch.Tensor, shifts: int, ring: dict) -> list[torch.Tensor]:
    """[x_{t-1}, ..., x_{t-shifts}] of x [B, L, D] on this rank's slots (zero before the
    sequence or the packed document), from one ``causal_conv1d`` with one-hot taps."""
    from ..mixers import causal_conv1d

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


class _KimiDelta(_RingMixer):
    """Bailing-hybrid's linear attention (``BailingHybridDeltaAttention``): Kimi Delta
    Attention, conv(q, k, v) (SiLU) then the gated delta rule with one decay per key channel
    (its forget gate), q and k l2-normalised, then the gated RMSNorm and the output
    projection; each chunk scanned by the family's ``chunk_kimi_delta_attention``."""

    def _ring_forward(self, hidden, ctx, **_):
        from ..mixers import causal_conv1d, gated_delta_rule

        ring = _ring_args(ctx)
        batch, length, _ = hidden.shape
        hidden = _masked(hidden, _keep(ctx, batch, hidden.device, hidden.dtype))
        mixed = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        mixed = causal_conv1d(mixed, self.conv1d.weight, self.conv1d.bias,
                              activation=self.activation, **ring)
        q, k, v = (t.reshape(batch, length, -1, self.head_dim)
                   for t in mixed.split([self.qkv_dim] * 3, dim=-1))
        out = gated_delta_rule(q, k, v, self.forget_gate(hidden),
                               torch.sigmoid(self.b_proj(hidden)), use_qk_l2norm=True,
                               kernel=getattr(self._family, "chunk_kimi_delta_attention", None),
                               **ring)
        gate = self.g_proj(hidden).reshape(batch, length, -1, self.head_dim)
        return self.o_proj(self.o_norm(out, gate).reshape(batch, length, -1))


LAYERS: dict = {
    "Lfm3ShortConv": _ShortConv,
    "ZayaCCAProjection": _CompressedConvAttention,
    "BailingHybridDeltaAttention": _KimiDelta,
}
"""transformers' layer class name -> the mixin of its converted class."""
FAMILIES: frozenset = frozenset({"lfm3", "zaya", "bailing_hybrid"})
"""model_type of the families these layers complete."""
KWARGS_STOP: frozenset = frozenset({"zaya"})
"""The families among FAMILIES whose model does not pass ring_context on to its layers
(ZAYA's attention calls its projection with positional arguments only)."""

_RELATIVE_BIAS = (
    "its attention adds to the scores a relative position bias computed from each query's "
    "hidden state (a bank of bias-vs-distance profiles mixed per query and head, passed to "
    "the attention function as a dense position_bias over slot distances)")
REFUSED: dict = {
    "minimax_m3_vl_text": (
        "its minimax_m3_sparse layers attend, for each query and key/value head, only to the "
        "blocks of keys a learned indexer scores highest against every earlier key (a "
        "data-dependent block-sparse mask), which ring attention does not compute (it has no "
        "lightning-attention or other recurrent layer; a config of full_attention layers only "
        "is a plain decoder)"),
    "inkling_text": _RELATIVE_BIAS + ", which ring attention does not compute",
    "inkling2_text": _RELATIVE_BIAS + " and a sink logit computed per query, which ring "
                                      "attention does not compute",
    "inkling2_loop_text": _RELATIVE_BIAS + " and a sink logit computed per query, which ring "
                                           "attention does not compute (its loop, layers run "
                                           "again per token, would be served)",
}
"""model_type -> why ``convert_mixers`` refuses the family (their short convolutions alone
would convert; their attention cannot be made exact by ring attention as it is)."""

if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
