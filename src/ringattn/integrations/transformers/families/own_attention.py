"""Families that compute attention in their own modules: XGLM, Falcon and
GPT-NeoX-Japanese (rotary), OpenAI GPT (learned positions) and GPT-Neo (unscaled scores,
windowed local layers).

``convert`` swaps those module instances' class for a subclass that keeps their projections
(and rotary embedding) and calls ring attention. Falcon and GPT-Neo cannot be built with
"ringattn" (their constructors look the attention class up in a dict of their own:
KeyError), so they are built with "eager" and ``convert`` selects ring attention
(``checks.BUILT_EAGER``). Families whose blocks drop keyword arguments get the context of
the forward that runs them (``state.bind_context``).
"""

from __future__ import annotations

from ..attention import ring_attention_forward
from ..checks import BUILT_EAGER, NAME, register_attention
from ..state import SwapMixin, bind_context, require_context, swap_class

__all__ = ["convert_own_attention"]

FAMILIES = ("xglm", "gpt_neo", "falcon", "gpt_neox_japanese", "openai-gpt")
register_attention("own attention", FAMILIES)


class _XGLMAttention(SwapMixin):
    """XGLM's self-attention over the ring: its own projections (queries pre-scaled),
    ring attention through the registered attention function."""

    def forward(self, hidden_states, key_value_states=None, cache=None,
                attention_mask=None, **kwargs):
        if key_value_states is not None:
            raise TypeError("ring attention runs XGLM's self-attention, not cross-attention")
        b, length, _ = hidden_states.shape
        q, k, v = ((proj(hidden_states) * scale).view(b, length, -1, self.head_dim)
                   .transpose(1, 2) for proj, scale in
                   ((self.q_proj, self.scaling), (self.k_proj, 1.0), (self.v_proj, 1.0)))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out, _ = ring_attention_forward(
            self, q, k, v, attention_mask, dropout=self.dropout if self.training else 0.0,
            scaling=1.0, **kwargs)
        return self.out_proj(out.reshape(b, length, -1)), None



class _GPTNeoSelfAttention(SwapMixin):
    """GPT-Neo's self-attention over the ring: its own projections, no score scaling,
    its local layers' window (keys q - window_size < k <= q) as the sliding window."""

    def forward(self, hidden_states, attention_mask=None, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        b, length, _ = hidden_states.shape
        q, k, v = (self._split_heads(proj(hidden_states), self.num_heads, self.head_dim)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_id)
        window = self.config.window_size if self.attention_type == "local" else None
        out, _ = ring_attention_forward(
            self, q, k, v, attention_mask,
            dropout=self.attn_dropout.p if self.training else 0.0, scaling=1.0,
            sliding_window=window, output_attentions=output_attentions,
            ring_context=require_context(self))
        out = self.out_proj(out.reshape(b, length, -1))
        return self.resid_dropout(out), None



class _FalconAttention(SwapMixin):
    """Falcon's rotary self-attention over the ring: its own fused projection, head
    split and rotary embedding, ring attention through the registered function."""

    def forward(self, hidden_states, alibi, attention_mask, position_ids=None,
                layer_past=None, use_cache=False, output_attentions=False,
                position_embeddings=None, **kwargs):
        from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

        b, length, _ = hidden_states.shape
        kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
        q, k, v = self._split_heads(self.query_key_value(hidden_states))  # [B, L, h, D]
        q, k, v = (t.transpose(1, 2).reshape(b, heads, length, self.head_dim) for t, heads in
                   ((q, self.num_heads), (k, kv_heads), (v, kv_heads)))
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_idx)
        out, _ = ring_attention_forward(
            self, q, k, v, attention_mask, scaling=self.inv_norm_factor,
            output_attentions=output_attentions, ring_context=require_context(self))
        return self.dense(out.reshape(b, length, -1)), None



class _GPTNeoXJapaneseAttention(SwapMixin):
    """GPT-NeoX-Japanese's attention over the ring: its own fused projection, rotary
    embedding and output projection (its layer adds the bias), ring attention in between."""

    def _attn(self, query, key, value, attention_mask=None):
        out, _ = ring_attention_forward(  # [B, L, H, D]; the caller merges [B, H, L, D]
            self, query, key, value, attention_mask,
            dropout=self.attention_dropout.p if self.training else 0.0,
            scaling=1.0 / self.norm_factor, ring_context=require_context(self))
        return out.transpose(1, 2), None



class _OpenAIGPTAttention(SwapMixin):
    """OpenAI GPT's attention over the ring: its own fused projection and output
    projection, scores scaled by 1/sqrt(D) where the block says so, causal (its mask
    buffer), ring attention in between."""

    def _attn(self, q, k, v, attention_mask=None, output_attentions=False):
        if output_attentions:
            raise TypeError("ring attention returns no attention weights "
                            "(output_attentions=True)")
        out, _ = ring_attention_forward(  # k arrives [B, H, D, L]; out [B, L, H, D]
            self, q, k.transpose(-1, -2), v, attention_mask, is_causal=True,
            dropout=self.attn_dropout.p if self.training else 0.0,
            scaling=v.shape[-1] ** -0.5 if self.scale else 1.0,
            ring_context=require_context(self))
        return [out.transpose(1, 2)]



def convert_own_attention(model) -> None:
    """Replace XGLM's, GPT-Neo's, Falcon's, GPT-NeoX-Japanese's or OpenAI GPT's attention
    modules by ring attention."""
    if model.config.model_type == "falcon":
        from transformers.models.falcon.modeling_falcon import FalconAttention as base

        if model.config.alibi:
            raise ValueError("ringattn converts Falcon with rotary embeddings, not with ALiBi "
                             "(config.alibi=True: its bias is rounded to bfloat16)")
        cls = swap_class(_FalconAttention, base)
    elif model.config.model_type == "xglm":
        from transformers.models.xglm.modeling_xglm import XGLMAttention as base

        cls = swap_class(_XGLMAttention, base)
    elif model.config.model_type == "openai-gpt":
        from transformers.models.openai.modeling_openai import Attention as base

        cls = swap_class(_OpenAIGPTAttention, base)
    elif model.config.model_type == "gpt_neox_japanese":
        from transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese import (
            GPTNeoXJapaneseAttention as base)

        cls = swap_class(_GPTNeoXJapaneseAttention, base)
    else:
        from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention as base

        cls = swap_class(_GPTNeoSelfAttention, base)
    found = tuple(m for m in model.modules() if type(m) is base)
    if not found:
        raise ValueError(f"{type(model).__name__} has no {base.__name__} to convert")
    for module in found:
        module.__class__ = cls
    if model.config.model_type != "xglm":  # their blocks do not pass keyword arguments
        bind_context(model, found)
    if model.config.model_type in BUILT_EAGER:
        model.config._attn_implementation = NAME  # the mask function, check_attention

if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
