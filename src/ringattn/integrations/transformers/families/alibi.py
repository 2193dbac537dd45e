"""BLOOM and MPT: ALiBi computed in their own attention modules, replaced by ring attention
with their slopes as ``alibi_slopes``.

``convert`` swaps those module instances' class for a subclass that keeps their
projections and calls ring attention with flash-attn's ``-slope * |i - j|`` in global
positions (under the causal mask it differs from the models' key-position bias by a
constant per query, which softmax ignores). Their blocks drop keyword arguments, so the
modules get the context of the forward that runs them (``state.bind_context``).
"""

from __future__ import annotations

import torch

from ....strategies.auto import attention
from ....validate import caller_error
from ..attention import ModelMask, _ring_arguments
from ..checks import register_attention
from ..state import SwapMixin, bind_context, require_context, swap_class

__all__ = ["convert_alibi"]

FAMILIES = ("bloom", "mpt")
register_attention("alibi", FAMILIES)


def _alibi_attention(module, q, k, v, attention_mask, scale, slopes, dropout):
    """Ring attention of [B, L, H, D] q, k, v with ALiBi ``slopes`` (flash-attn's
    ``-slope * |i - j|`` in global positions: under the causal mask it differs from the
    models' key-position bias by a constant per query, which softmax ignores)."""
    ctx = require_context(module)
    error = None
    try:  # this rank's refusals travel in the attention's agreement (every rank raises)
        if dropout and module.training:
            raise ValueError(f"ring attention has no attention dropout, got {dropout}")
        if attention_mask is not None and not isinstance(attention_mask, ModelMask):
            raise TypeError(f"{type(module).__name__} got a dense attention mask; padding "
                            f"goes through ringattn.shard_batch")
        causal, window, mask = _ring_arguments(module, attention_mask, None, True, ctx)
        if not causal or window != (-1, -1) or mask is not None:
            raise ValueError(f"{type(module).__name__} asked for a {attention_mask.kind} mask; "
                             f"ALiBi attention runs causal")
    except (TypeError, ValueError) as exc:
        error = exc
    with caller_error(error):
        out = attention(q, k, v, strategy=ctx.strategy, causal=True, softmax_scale=scale,
                        alibi_slopes=slopes, **ctx.attention_kwargs())
    ctx.record_call()
    return out


def _bloom_slopes(num_heads: int) -> list[float]:
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    bias = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)  # [H, 1, 2]
    return [float(x) for x in bias[:, 0, 1] - bias[:, 0, 0]]


def _mpt_slopes(num_heads: int) -> list[float]:
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    bias = build_mpt_alibi_tensor(num_heads, 2)  # [H, 1, 2]: the bias of keys 0 and 1
    return [float(x) for x in bias[:, 0, 1] - bias[:, 0, 0]]


class _BloomAttention(SwapMixin):
    """BLOOM's attention over the ring: its own fused projection, ALiBi slopes and
    output projection, ring attention in between."""

    def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None,
                use_cache=False, output_attentions=False, **kwargs):
        from transformers.models.bloom.modeling_bloom import dropout_add

        if output_attentions:
            raise TypeError("ring attention returns no attention weights")
        b, length, _ = hidden_states.shape
        q, k, v = self._reshape(self.query_key_value(hidden_states))  # [B, H, L, D]
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_idx)
        out = _alibi_attention(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               attention_mask, self.inv_norm_factor, self._ring_slopes,
                               self.attention_dropout.p)
        out = self.dense(out.reshape(b, length, -1))
        return dropout_add(out, residual, self.hidden_dropout, self.training), None



class _MptAttention(SwapMixin):
    """MPT's attention over the ring: its own projections, ``clip_qkv``, scale and
    ALiBi slopes, ring attention in between."""

    def forward(self, hidden_states, position_bias=None, cache=None, attention_mask=None,
                **kwargs):
        b, length = hidden_states.shape[:2]
        qkv = self.Wqkv(hidden_states)
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = (t.reshape(b, length, self.n_heads, self.head_dim) for t in qkv.chunk(3, 2))
        if cache is not None:
            k, v = (t.transpose(1, 2) for t in cache.update(
                k.transpose(1, 2), v.transpose(1, 2), self.layer_idx))
        out = _alibi_attention(self, q, k, v, attention_mask, self.softmax_scale,
                               self._ring_slopes, self.attn_dropout_p)
        return self.out_proj(out.reshape(b, length, -1)), None



def convert_alibi(model) -> None:
    """Replace BLOOM's / MPT's attention modules by ring attention with their ALiBi."""
    family = model.config.model_type
    if family == "bloom":
        from transformers.models.bloom.modeling_bloom import BloomAttention as base

        mixin, slopes = _BloomAttention, _bloom_slopes(model.config.n_head)
    else:
        from transformers.models.mpt.modeling_mpt import MptAttention as base

        mixin, slopes = _MptAttention, _mpt_slopes(model.config.n_heads)
    cls = swap_class(mixin, base)
    found = []
    for module in model.modules():
        if type(module) is base:
            module.__class__ = cls
            module._ring_slopes = slopes
            found.append(module)
    if not found:
        raise ValueError(f"{type(model).__name__} has no {base.__name__} to convert")
    bind_context(model, found)

if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
