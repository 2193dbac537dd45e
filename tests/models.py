"""Tiny transformers models for the integration tests (random init, seeded, GQA)."""

import torch


def tiny_causal_lm(family: str, attn: str):
    """``family`` "llama" or "qwen2-sliding"; ``attn`` an attn_implementation name. The
    same weights on every call (seeded)."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if family == "llama":
        cfg = tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
    else:  # a sliding-window layer then a full one: the window must reach the ring
        cfg = tf.Qwen2Config(**common, sliding_window=7, use_sliding_window=True,
                             layer_types=["sliding_attention", "full_attention"])
        cls = tf.Qwen2ForCausalLM
    cfg._attn_implementation = attn
    return cls(cfg).float()
