"""transformers integration: ring attention as a registered attention implementation.

``register()`` adds "ringattn" to transformers' ``AttentionInterface`` (and a mask function
that builds no dense mask to ``AttentionMaskInterface``), so any model that calls its
attention through that interface runs context-parallel with
``config._attn_implementation = "ringattn"`` (or ``from_pretrained(...,
attn_implementation="ringattn")``) and a batch from ``ringattn.shard_batch``:

    from ringattn.integrations import transformers as ra_hf
    ra_hf.register()
    model = LlamaForCausalLM(config)            # config._attn_implementation = "ringattn"
    out = model(**ra.shard_batch(batch, group=cp_group, layout="zigzag"))

Nothing is patched: the batch's ``RingContext`` travels through the model's own kwargs.
A model's sliding window (Mistral, Qwen2: ``sliding_window`` W means keys q-W < kv <= q)
reaches the ring as ``window_size=(W - 1, -1)``; it is never dropped.
"""

from __future__ import annotations

from ..api import ring_attention

NAME = "ringattn"


def ring_attention_forward(module, query, key, value, attention_mask=None, dropout=0.0,
                           scaling=None, sliding_window=None, ring_context=None, **kwargs):
    """transformers attention function: query [B, H, L, D], key/value [B, Hkv, L, D] ->
    ([B, L, H, D], None)."""
    if ring_context is None:
        raise ValueError(
            "attn_implementation='ringattn' needs the batch's ring_context: call the model "
            "with the dict from ringattn.shard_batch(batch, group=...)"
        )
    if dropout:
        raise ValueError(f"ring attention has no attention dropout, got dropout={dropout}")
    window = (-1, -1) if not sliding_window else (int(sliding_window) - 1, -1)
    out = ring_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        causal=bool(getattr(module, "is_causal", True)), window_size=window,
        softmax_scale=scaling, **ring_context.attention_kwargs(),
    )
    return out, None


def _no_dense_mask(*args, **kwargs):
    """The ring builds its masks from the RingContext; the model needs no [B, 1, S, S] mask."""
    return None


def register(name: str = NAME) -> str:
    """Register ring attention with transformers under ``name``; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, ring_attention_forward)
    AttentionMaskInterface.register(name, _no_dense_mask)
    return name
