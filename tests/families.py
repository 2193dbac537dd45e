"""Tiny decoder models of many transformers families, for the model-family survey.

``FAMILIES[name]()`` returns ``(config, CausalLM class)``: a tiny fp32 config (vocab
<= 128, hidden 64, 4 heads, 2 kv heads where the family has GQA, small head dims, >= 128
positions, no dropout) with enough layers to hold every layer type the family has (sliding,
chunked, NoPE, linear/recurrent/conv mixers, dense and MoE), and each feature that could
break context parallelism switched on and made to matter at S = 37: windows of 7, chunks of
8, soft-capping, attention sinks, router aux losses, MLA's value head dim, learned positions.
``FEATURES[name]`` says what the config exercises. ``build(name, attn)`` makes the model
with the same weights on every call and every process.

Built from configs with random weights: no hub downloads.
"""

from __future__ import annotations

import torch

VOCAB = 97
WINDOW = 7
"""Sliding windows: W keys (q-W < kv <= q), well inside S = 37 and every shard."""
CHUNK = 8
"""Llama 4 chunked attention: queries see keys of their own 8-token chunk."""

# width, depth and heads shared by the families whose configs use the Llama names; token 0
# is the padding token, as in real checkpoints (its embedding row is zero; shard_batch
# fills the slots that pad S up to the shards with each row's first token, not with it)
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
_AUX = dict(output_router_logits=True, router_aux_loss_coef=0.1)
"""Router aux loss on, with a coefficient large enough that an error in it shows (Mixtral,
Qwen3-MoE, OLMoE, GraniteMoE, FlexOlmo: ``ra_hf.convert`` makes it global). Other MoE families leave it
off so that their table row shows their own feature."""


def _tf():
    import transformers

    return transformers


def _llama():
    tf = _tf()
    return tf.LlamaConfig(**_COMMON), tf.LlamaForCausalLM


def _mistral():
    tf = _tf()
    return tf.MistralConfig(**_COMMON, head_dim=16, sliding_window=WINDOW), tf.MistralForCausalLM


def _qwen2():
    tf = _tf()
    return tf.Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=WINDOW,
                          max_window_layers=2,
                          layer_types=["sliding_attention", "full_attention"]), tf.Qwen2ForCausalLM


def _qwen3():
    tf = _tf()
    return tf.Qwen3Config(**_COMMON, head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
                          max_window_layers=2,
                          layer_types=["sliding_attention", "full_attention"]), tf.Qwen3ForCausalLM


def _gemma():
    tf = _tf()
    return tf.GemmaConfig(**_COMMON, head_dim=16), tf.GemmaForCausalLM


def _gemma2():
    tf = _tf()
    return tf.Gemma2Config(**_COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                           layer_types=["sliding_attention", "full_attention"],
                           attn_logit_softcapping=5.0, final_logit_softcapping=3.0), tf.Gemma2ForCausalLM


def _gemma3():
    tf = _tf()
    return tf.Gemma3TextConfig(**_COMMON, head_dim=16, query_pre_attn_scalar=16,
                               sliding_window=WINDOW,
                               layer_types=["sliding_attention", "full_attention"]), tf.Gemma3ForCausalLM


def _phi3():
    tf = _tf()
    return tf.Phi3Config(**_COMMON, sliding_window=WINDOW, resid_pdrop=0.0, embd_pdrop=0.0
                         ), tf.Phi3ForCausalLM


def _olmo2():
    tf = _tf()
    return tf.Olmo2Config(**_COMMON), tf.Olmo2ForCausalLM


def _gpt_oss():
    tf = _tf()
    return tf.GptOssConfig(**{**_COMMON, "intermediate_size": 32}, head_dim=16, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=WINDOW,
                           layer_types=["sliding_attention", "full_attention"]), tf.GptOssForCausalLM


def _qwen2_moe():
    tf = _tf()
    return tf.Qwen2MoeConfig(**_COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                             num_experts=4, num_experts_per_tok=2, use_sliding_window=True,
                             sliding_window=WINDOW, max_window_layers=2,
                             layer_types=["sliding_attention", "full_attention"]), tf.Qwen2MoeForCausalLM


def _phimoe():
    tf = _tf()
    return tf.PhimoeConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2,
                           sliding_window=WINDOW), tf.PhimoeForCausalLM


def _mixtral():
    tf = _tf()
    return tf.MixtralConfig(**_COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                            **_AUX), tf.MixtralForCausalLM


_MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
            first_k_dense_replace=1)
"""Multi-head latent attention: q/k head dim 16 + 8 = 24, v head dim 12; layer 1 is MoE."""


def _deepseek_v3():
    tf = _tf()
    cfg = tf.DeepseekV3Config(**{**_COMMON, "num_key_value_heads": 4}, **_MLA, n_group=1,
                              topk_group=1)
    return cfg, tf.DeepseekV3ForCausalLM


def _deepseek_v2():
    tf = _tf()
    return tf.DeepseekV2Config(**{**_COMMON, "num_key_value_heads": 4}, **_MLA), tf.DeepseekV2ForCausalLM


def _opt():
    tf = _tf()
    return tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=256, dropout=0.0,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2), tf.OPTForCausalLM


def _llama4():
    tf = _tf()
    return tf.Llama4TextConfig(
        **{**_COMMON, "num_hidden_layers": 3}, intermediate_size_mlp=96, head_dim=16,
        num_local_experts=2, interleave_moe_layer_step=2, attention_chunk_size=CHUNK,
        layer_types=["chunked_attention", "chunked_attention", "full_attention"],
        no_rope_layers=[1, 1, 0], attn_temperature_tuning=True, floor_scale=4,
    ), tf.Llama4ForCausalLM


def _llama4_chunked():
    """Llama 4 with chunked layers and a NoPE layer, without the temperature tuning."""
    cfg, cls = _llama4()
    cfg.attn_temperature_tuning = False
    return cfg, cls


def _doge():
    tf = _tf()
    return tf.DogeConfig(**_COMMON, keep_window_size=16), tf.DogeForCausalLM


def _bloom():
    tf = _tf()
    return tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4), tf.BloomForCausalLM


def _codegen():
    tf = _tf()
    return tf.CodeGenConfig(vocab_size=VOCAB, n_positions=256, n_ctx=256, n_embd=64, n_layer=2,
                            n_head=4, rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=1, eos_token_id=2), tf.CodeGenForCausalLM


def _xglm():
    tf = _tf()
    return tf.XGLMConfig(vocab_size=VOCAB, max_position_embeddings=256, d_model=64, ffn_dim=96,
                         num_layers=2, attention_heads=4, dropout=0.0, attention_dropout=0.0,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2), tf.XGLMForCausalLM


def _stablelm():
    tf = _tf()
    return tf.StableLmConfig(**_COMMON, qk_layernorm=True, use_parallel_residual=True,
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                  partial_rotary_factor=0.25)), tf.StableLmForCausalLM


def _nemotron():
    tf = _tf()
    return tf.NemotronConfig(**_COMMON), tf.NemotronForCausalLM


def _falcon():
    tf = _tf()
    return tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_kv_heads=2, new_decoder_architecture=True, max_position_embeddings=256,
                           bos_token_id=1, eos_token_id=2), tf.FalconForCausalLM


def _gptj():
    tf = _tf()
    return tf.GPTJConfig(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                         bos_token_id=1, eos_token_id=2), tf.GPTJForCausalLM


def _gpt_neo():
    tf = _tf()
    return tf.GPTNeoConfig(vocab_size=VOCAB, max_position_embeddings=256, hidden_size=64, num_layers=2,
                           num_heads=4, attention_types=[[["global", "local"], 1]], window_size=WINDOW,
                           bos_token_id=1, eos_token_id=2), tf.GPTNeoForCausalLM


def _mpt():
    tf = _tf()
    return tf.MptConfig(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, max_seq_len=256,
                        expansion_ratio=2), tf.MptForCausalLM


def _qwen3_next():
    tf = _tf()
    return tf.Qwen3NextConfig(
        **_COMMON, head_dim=16, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"],
    ), tf.Qwen3NextForCausalLM


def _lfm2():
    tf = _tf()
    return tf.Lfm2Config(**{k: v for k, v in _COMMON.items() if k != "intermediate_size"},
                         intermediate_size=96, block_auto_adjust_ff_dim=False, conv_L_cache=3,
                         layer_types=["conv", "full_attention"]), tf.Lfm2ForCausalLM


def _jamba():
    tf = _tf()
    return tf.JambaConfig(**_COMMON, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                          attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                          mamba_d_state=8, mamba_expand=2), tf.JambaForCausalLM


def _falcon_h1():
    tf = _tf()
    return tf.FalconH1Config(**_COMMON, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                             mamba_d_state=8, mamba_chunk_size=8, head_dim=16), tf.FalconH1ForCausalLM


def _granitemoehybrid():
    tf = _tf()
    return tf.GraniteMoeHybridConfig(
        **_COMMON, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
        layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8,
        mamba_chunk_size=8, position_embedding_type="rope",
    ), tf.GraniteMoeHybridForCausalLM


def _recurrent_gemma():
    tf = _tf()
    return tf.RecurrentGemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   lru_width=64, attention_window_size=WINDOW,
                                   block_types=["recurrent", "attention"]), tf.RecurrentGemmaForCausalLM


def _gemma3n():
    tf = _tf()
    return tf.Gemma3nTextConfig(
        **{**_COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, altup_num_inputs=2,
        num_kv_shared_layers=2, laurel_rank=8, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
        final_logit_softcapping=3.0,
    ), tf.Gemma3nForCausalLM


# -- more common families (cheap: each is one config line) -------------------------------

def _cohere():
    tf = _tf()
    return tf.CohereConfig(**_COMMON, use_qk_norm=False, logit_scale=0.5), tf.CohereForCausalLM


def _cohere2():
    tf = _tf()
    return tf.Cohere2Config(**_COMMON, sliding_window=WINDOW,
                            layer_types=["sliding_attention", "full_attention"]), tf.Cohere2ForCausalLM


def _starcoder2():
    tf = _tf()
    return tf.Starcoder2Config(**_COMMON, sliding_window=WINDOW, residual_dropout=0.0,
                               embedding_dropout=0.0), tf.Starcoder2ForCausalLM


def _granite():
    tf = _tf()
    return tf.GraniteConfig(**_COMMON, embedding_multiplier=2.0, residual_multiplier=0.5,
                            attention_multiplier=0.2, logits_scaling=2.0), tf.GraniteForCausalLM


def _glm4():
    tf = _tf()
    return tf.Glm4Config(**_COMMON, head_dim=16), tf.Glm4ForCausalLM


def _smollm3():
    tf = _tf()
    return tf.SmolLM3Config(**_COMMON, no_rope_layers=[1, 0]), tf.SmolLM3ForCausalLM


def _exaone4():
    tf = _tf()
    return tf.Exaone4Config(**_COMMON, sliding_window=WINDOW, sliding_window_pattern="LG",
                            layer_types=["sliding_attention", "full_attention"]), tf.Exaone4ForCausalLM


def _olmo3():
    tf = _tf()
    return tf.Olmo3Config(**_COMMON, sliding_window=WINDOW,
                          layer_types=["sliding_attention", "full_attention"]), tf.Olmo3ForCausalLM


def _qwen3_moe():
    tf = _tf()
    return tf.Qwen3MoeConfig(**_COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4,
                             num_experts_per_tok=2, **_AUX), tf.Qwen3MoeForCausalLM


def _phi():
    tf = _tf()
    return tf.PhiConfig(**_COMMON, resid_pdrop=0.0, embd_pdrop=0.0, qk_layernorm=True,
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                             partial_rotary_factor=0.5)), tf.PhiForCausalLM


def _gpt_neox():
    tf = _tf()
    return tf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=256, hidden_dropout=0.0,
                            attention_dropout=0.0, bos_token_id=1, eos_token_id=2), tf.GPTNeoXForCausalLM


def _gpt2():
    tf = _tf()
    return tf.GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                         eos_token_id=2, scale_attn_by_inverse_layer_idx=True), tf.GPT2LMHeadModel


def _helium():
    tf = _tf()
    return tf.HeliumConfig(**_COMMON, head_dim=16), tf.HeliumForCausalLM


def _ministral():
    tf = _tf()
    cfg = tf.MinistralConfig(**_COMMON, head_dim=16, sliding_window=WINDOW,
                             layer_types=["sliding_attention", "full_attention"])
    return cfg, tf.MinistralForCausalLM


def _seed_oss():
    tf = _tf()
    return tf.SeedOssConfig(**_COMMON, head_dim=16, attention_dropout=0.0,
                            residual_dropout=0.0), tf.SeedOssForCausalLM


def _minimax():
    tf = _tf()
    return tf.MiniMaxConfig(**_COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                            block_size=8,
                            layer_types=["linear_attention", "full_attention"]), tf.MiniMaxForCausalLM


def _olmo():
    tf = _tf()
    return tf.OlmoConfig(**_COMMON, clip_qkv=0.5), tf.OlmoForCausalLM


def _glm():
    tf = _tf()
    return tf.GlmConfig(**_COMMON, head_dim=16), tf.GlmForCausalLM


def _apertus():
    tf = _tf()
    return tf.ApertusConfig(**_COMMON), tf.ApertusForCausalLM


def _persimmon():
    tf = _tf()
    return tf.PersimmonConfig(**{k: v for k, v in _COMMON.items() if k != "num_key_value_heads"},
                              qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
                              rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                   partial_rotary_factor=0.5)), tf.PersimmonForCausalLM


def _flex_olmo():
    tf = _tf()
    return tf.FlexOlmoConfig(**{**_COMMON, "intermediate_size": 32}, num_experts=4,
                             num_experts_per_tok=2, **_AUX), tf.FlexOlmoForCausalLM


def _biogpt():
    tf = _tf()
    return tf.BioGptConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                           layerdrop=0.0, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2), tf.BioGptForCausalLM


def _olmoe():
    tf = _tf()
    return tf.OlmoeConfig(**{**_COMMON, "intermediate_size": 32}, num_experts=4,
                          num_experts_per_tok=2, **_AUX), tf.OlmoeForCausalLM


def _granitemoe():
    tf = _tf()
    return tf.GraniteMoeConfig(**{**_COMMON, "intermediate_size": 32}, num_local_experts=4,
                               num_experts_per_tok=2, embedding_multiplier=2.0,
                               attention_multiplier=0.2, **_AUX), tf.GraniteMoeForCausalLM


FAMILIES = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "olmo2": _olmo2,
    "gpt_oss": _gpt_oss,
    "qwen2_moe": _qwen2_moe,
    "phimoe": _phimoe,
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
    "deepseek_v2": _deepseek_v2,
    "opt": _opt,
    "llama4": _llama4,
    "llama4_chunked": _llama4_chunked,
    "doge": _doge,
    "bloom": _bloom,
    "codegen": _codegen,
    "xglm": _xglm,
    "stablelm": _stablelm,
    "nemotron": _nemotron,
    "falcon": _falcon,
    "gptj": _gptj,
    "gpt_neo": _gpt_neo,
    "mpt": _mpt,
    "qwen3_next": _qwen3_next,
    "lfm2": _lfm2,
    "jamba": _jamba,
    "falcon_h1": _falcon_h1,
    "granitemoehybrid": _granitemoehybrid,
    "recurrent_gemma": _recurrent_gemma,
    "gemma3n": _gemma3n,
    "cohere": _cohere,
    "cohere2": _cohere2,
    "starcoder2": _starcoder2,
    "granite": _granite,
    "glm4": _glm4,
    "smollm3": _smollm3,
    "exaone4": _exaone4,
    "olmo3": _olmo3,
    "qwen3_moe": _qwen3_moe,
    "phi": _phi,
    "gpt_neox": _gpt_neox,
    "gpt2": _gpt2,
    "helium": _helium,
    "ministral": _ministral,
    "seed_oss": _seed_oss,
    "minimax": _minimax,
    "olmoe": _olmoe,
    "granitemoe": _granitemoe,
    "flex_olmo": _flex_olmo,
    "olmo": _olmo,
    "glm": _glm,
    "apertus": _apertus,
    "persimmon": _persimmon,
    "biogpt": _biogpt,
}


FEATURES = {
    "llama": "GQA, RoPE",
    "mistral": "sliding_window=7 on every layer (kwarg + mask)",
    "qwen2": "sliding layer + full layer (kwarg + mask)",
    "qwen3": "q/k norm, sliding layer + full layer",
    "gemma": "head_dim 16, scaled embeddings",
    "gemma2": "attn_logit_softcapping=5 (softcap kwarg), final_logit_softcapping=3, sliding + full",
    "gemma3": "q/k norm, sliding (local RoPE) + full layer",
    "phi3": "fused qkv, sliding_window=7 (kwarg + mask)",
    "olmo2": "q/k norm over all heads",
    "gpt_oss": "attention sinks (s_aux kwarg, random), sliding + full, MoE",
    "qwen2_moe": "sliding window in the mask only, MoE + shared expert",
    "phimoe": "sliding window in the mask only, sparsemixer MoE (eval mode)",
    "mixtral": "MoE + router aux loss",
    "deepseek_v3": "MLA (qk head dim 24, v head dim 12), dense + MoE layer",
    "deepseek_v2": "MLA (qk head dim 24, v head dim 12), dense + MoE layer",
    "opt": "learned positions from the attention mask, scaling=1.0 (pre-scaled q)",
    "llama4": "chunked attention (chunk 8, mask only), NoPE layer with temperature tuning "
              "(floor_scale 4), MoE",
    "llama4_chunked": "chunked attention (chunk 8, mask only), NoPE layer without temperature "
                      "tuning, MoE",
    "doge": "dynamic mask (keep_window_size 16) passed as attention_mask",
    "bloom": "ALiBi, no AttentionInterface",
    "codegen": "partial rotary (rotary_dim 8 of head dim 16)",
    "xglm": "sinusoidal positions, no AttentionInterface",
    "stablelm": "partial rotary 0.25, q/k layernorm, parallel residual",
    "nemotron": "partial rotary, relu2",
    "falcon": "new decoder architecture (GQA), no AttentionInterface",
    "gptj": "rotary_dim 8, parallel residual",
    "gpt_neo": "global + local (window 7) layers, no AttentionInterface",
    "mpt": "ALiBi, no AttentionInterface",
    "qwen3_next": "gated DeltaNet layer + gated full attention, MoE",
    "lfm2": "short-conv layer + attention layer",
    "jamba": "Mamba layer + attention layer, MoE",
    "falcon_h1": "Mamba2 in parallel with attention in every layer",
    "granitemoehybrid": "Mamba2 layer + attention layer, MoE",
    "recurrent_gemma": "RG-LRU recurrent block + local attention (window 7)",
    "gemma3n": "AltUp, LAuReL, per-layer inputs, KV sharing, sliding + full, activation sparsity",
    "cohere": "parallel block, LayerNorm, logit_scale",
    "cohere2": "sliding (RoPE) + full (NoPE) layers",
    "starcoder2": "sliding_window=7 on every layer, biases, LayerNorm",
    "granite": "embedding/residual/attention multipliers, logits scaling",
    "glm4": "partial rotary (interleaved), post norms",
    "smollm3": "NoPE layer + RoPE layer",
    "exaone4": "sliding + full layer (NoPE global), q/k norm",
    "olmo3": "sliding + full layer, q/k norm",
    "qwen3_moe": "MoE + router aux loss",
    "phi": "partial rotary 0.5, q/k layernorm, parallel block",
    "gpt_neox": "partial rotary, parallel residual",
    "gpt2": "learned positions, scale_attn_by_inverse_layer_idx",
    "helium": "GQA, RoPE",
    "ministral": "sliding + full layer",
    "seed_oss": "GQA, q/k/v bias",
    "minimax": "lightning (linear) attention layer + full layer, MoE",
    "olmoe": "q/k norm, MoE + router aux loss",
    "granitemoe": "multipliers, MoE + router aux loss",
    "flex_olmo": "q/k norm, MoE + router aux loss",
    "olmo": "clip_qkv 0.5, non-parametric LayerNorm",
    "glm": "partial rotary (interleaved)",
    "apertus": "xIELU activation, q/k norm, llama3 RoPE",
    "persimmon": "partial rotary 0.5, q/k layernorm, fused qkv",
    "biogpt": "learned positions, scaled embeddings, class not declared backend compatible",
}
"""What each family's config exercises (for the survey's table)."""

_EVAL = {"phimoe"}
"""Families whose training mode is random per token (PhiMoE samples its experts with Gumbel
noise): no two runs agree, so they are compared in eval mode (deterministic top-2)."""


def _randomize_sinks(model) -> None:
    """GPT-OSS initialises its attention sinks near zero (std 0.02); make them matter."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 2.0)


def build(name: str, attn_implementation: str):
    """Family ``name`` with ``attn_implementation`` ("eager", "ringattn", ...): fp32, train
    mode (eval for ``_EVAL``), the same weights on every call."""
    cfg, cls = FAMILIES[name]()
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model = cls(cfg).float()
    _randomize_sinks(model)
    return model.eval() if name in _EVAL else model
