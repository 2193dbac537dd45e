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
Qwen3-MoE, OLMoE, GraniteMoE, FlexOlmo, Ernie 4.5 MoE, GraniteMoeShared, GraniteMoeSWA; DBRX
and JetMoe set theirs: ``ra_hf.convert`` makes it global). Other MoE families leave it
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
    # keep_window_size below S = 37: each query keeps its top 16 keys of the dynamic mask
    # (A = 0 at init: every key's bias ties), selected over the whole sequence under CP
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


# -- attention families, part 1 (afmoe .. jetmoe) and the hybrids the mixers convert ------

def _afmoe():
    tf = _tf()
    return tf.AfmoeConfig(**_COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4,
                          num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1,
                          sliding_window=WINDOW, mup_enabled=True,
                          layer_types=["sliding_attention", "full_attention"]), tf.AfmoeForCausalLM


def _arcee():
    tf = _tf()
    return tf.ArceeConfig(**_COMMON, head_dim=16), tf.ArceeForCausalLM


def _bitnet():
    tf = _tf()
    return tf.BitNetConfig(**_COMMON), tf.BitNetForCausalLM


def _cohere2_moe():
    tf = _tf()
    return tf.Cohere2MoeConfig(**_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                               num_shared_experts=1, sliding_window=WINDOW, logit_scale=0.5,
                               layer_types=["sliding_attention", "full_attention"],
                               mlp_layer_types=["sparse", "sparse"]), tf.Cohere2MoeForCausalLM


def _cwm():
    tf = _tf()
    return tf.CwmConfig(**_COMMON, head_dim=16, sliding_window=WINDOW,
                        layer_types=["full_attention", "sliding_attention"]), tf.CwmForCausalLM


def _dbrx():
    tf = _tf()
    return tf.DbrxConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=VOCAB,
                         attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=10000.0),
                         ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2,
                                         moe_loss_weight=0.1),
                         output_router_logits=True, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2), tf.DbrxForCausalLM


_DSA = dict(index_topk=8, index_head_dim=16, index_n_heads=2)
"""DeepSeek sparse attention: each query keeps the 8 keys its indexer scores highest."""


def _deepseek_v32():
    tf = _tf()
    return tf.DeepseekV32Config(**{**_COMMON, "num_key_value_heads": 4}, **_MLA, **_DSA,
                                n_group=1, topk_group=1,
                                mlp_layer_types=["dense", "sparse"]), tf.DeepseekV32ForCausalLM


def _glm_moe_dsa():
    tf = _tf()
    return tf.GlmMoeDsaConfig(**{**_COMMON, "num_key_value_heads": 4}, **_MLA, **_DSA,
                              mlp_layer_types=["dense", "sparse"],
                              indexer_types=["full", "shared"]), tf.GlmMoeDsaForCausalLM


def _diffllama():
    tf = _tf()
    return tf.DiffLlamaConfig(**_COMMON, head_dim=16, lambda_std_dev=0.5), tf.DiffLlamaForCausalLM


def _dots1():
    tf = _tf()
    return tf.Dots1Config(**_COMMON, head_dim=16, moe_intermediate_size=32, n_routed_experts=4,
                          num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                          sliding_window=WINDOW,
                          layer_types=["sliding_attention", "full_attention"]), tf.Dots1ForCausalLM


def _ernie4_5():
    tf = _tf()
    return tf.Ernie4_5Config(**_COMMON, head_dim=16, use_bias=True), tf.Ernie4_5ForCausalLM


def _ernie4_5_moe():
    tf = _tf()
    return tf.Ernie4_5_MoeConfig(**_COMMON, head_dim=16, moe_intermediate_size=32,
                                 moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
                                 moe_layer_start_index=1, **_AUX), tf.Ernie4_5_MoeForCausalLM


def _exaone_moe():
    tf = _tf()
    return tf.ExaoneMoeConfig(**_COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4,
                              num_experts_per_tok=2, num_shared_experts=1, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention"],
                              mlp_layer_types=["dense", "sparse"]), tf.ExaoneMoeForCausalLM


def _glm4_moe():
    tf = _tf()
    return tf.Glm4MoeConfig(**_COMMON, head_dim=16, moe_intermediate_size=32, n_routed_experts=4,
                            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                            use_qk_norm=True,
                            rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                 partial_rotary_factor=0.5)), tf.Glm4MoeForCausalLM


def _glm4_moe_lite():
    tf = _tf()
    return tf.Glm4MoeLiteConfig(**{**_COMMON, "num_key_value_heads": 4},
                                **{k: v for k, v in _MLA.items() if k != "first_k_dense_replace"},
                                rope_interleave=True,
                                mlp_layer_types=["dense", "sparse"]), tf.Glm4MoeLiteForCausalLM


def _gpt_bigcode():
    tf = _tf()
    return tf.GPTBigCodeConfig(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4,
                               multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               pad_token_id=0, bos_token_id=1,
                               eos_token_id=2), tf.GPTBigCodeForCausalLM


def _granitemoeshared():
    tf = _tf()
    return tf.GraniteMoeSharedConfig(**{**_COMMON, "intermediate_size": 32}, num_local_experts=4,
                                     num_experts_per_tok=2, shared_intermediate_size=32,
                                     embedding_multiplier=2.0, attention_multiplier=0.2,
                                     **_AUX), tf.GraniteMoeSharedForCausalLM


def _granite_swa():
    tf = _tf()
    return tf.GraniteSWAConfig(**_COMMON, sliding_window=WINDOW, embedding_multiplier=2.0,
                               attention_multiplier=0.2,
                               layer_types=["full_attention", "sliding_attention"],
                               layer_rope_theta=[10000.0, 500.0]), tf.GraniteSWAForCausalLM


def _granitemoe_swa():
    tf = _tf()
    return tf.GraniteMoeSWAConfig(**{**_COMMON, "intermediate_size": 32}, num_local_experts=4,
                                  num_experts_per_tok=2, shared_intermediate_size=32,
                                  sliding_window=WINDOW, attention_multiplier=0.2,
                                  layer_types=["full_attention", "sliding_attention"],
                                  layer_rope_theta=[10000.0, 500.0],
                                  **_AUX), tf.GraniteMoeSWAForCausalLM


def _hunyuan_v1_dense():
    tf = _tf()
    return tf.HunYuanDenseV1Config(**_COMMON, head_dim=16), tf.HunYuanDenseV1ForCausalLM


def _hunyuan_v1_moe():
    tf = _tf()
    return tf.HunYuanMoEV1Config(**{**_COMMON, "intermediate_size": 32}, head_dim=16, num_experts=4,
                                 moe_topk=2), tf.HunYuanMoEV1ForCausalLM


def _hyperclovax():
    tf = _tf()
    return tf.HyperCLOVAXConfig(**_COMMON, head_dim=16, embedding_multiplier=2.0,
                                residual_multiplier=0.5, attention_multiplier=0.2,
                                logits_scaling=2.0, use_post_norm=True), tf.HyperCLOVAXForCausalLM


def _jais2():
    tf = _tf()
    return tf.Jais2Config(**_COMMON, head_dim=16), tf.Jais2ForCausalLM


def _jetmoe():
    tf = _tf()
    return tf.JetMoeConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                           num_key_value_heads=2, kv_channels=16, intermediate_size=32,
                           max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
                           output_router_logits=True, aux_loss_coef=0.1, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2), tf.JetMoeForCausalLM


def _qwen3_5():
    tf = _tf()
    return tf.Qwen3_5TextConfig(
        **_COMMON, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
    ), tf.Qwen3_5ForCausalLM


def _qwen3_5_moe():
    tf = _tf()
    return tf.Qwen3_5MoeTextConfig(
        **{k: v for k, v in _COMMON.items() if k != "intermediate_size"}, head_dim=16,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"],
    ), tf.Qwen3_5MoeForCausalLM


def _lfm2_moe():
    tf = _tf()
    return tf.Lfm2MoeConfig(
        **{k: v for k, v in _COMMON.items() if k != "intermediate_size"}, intermediate_size=96,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
        conv_L_cache=3, layer_types=["conv", "full_attention"]), tf.Lfm2MoeForCausalLM


def _bamba():
    tf = _tf()
    return tf.BambaConfig(**_COMMON, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32,
                          mamba_d_state=8, mamba_n_groups=2,
                          mamba_chunk_size=8), tf.BambaForCausalLM


def _mamba2():
    tf = _tf()
    return tf.Mamba2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=4,
                           head_dim=32, expand=2, state_size=8, n_groups=2, chunk_size=8,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2), tf.Mamba2ForCausalLM


def _nemotron_h():
    tf = _tf()
    return tf.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
        layers_block_type=["linear_attention", "full_attention", "mlp"], mamba_num_heads=4,
        mamba_head_dim=32, ssm_state_size=8, n_groups=2, chunk_size=8, pad_token_id=0,
        bos_token_id=1, eos_token_id=2), tf.NemotronHForCausalLM


def _mamba():
    tf = _tf()
    return tf.MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=8,
                          expand=2, conv_kernel=4, time_step_rank=8, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2), tf.MambaForCausalLM


def _falcon_mamba():
    tf = _tf()
    return tf.FalconMambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                state_size=8, expand=2, conv_kernel=4, time_step_rank=8,
                                pad_token_id=0, bos_token_id=1,
                                eos_token_id=2), tf.FalconMambaForCausalLM


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


# -- more hybrids: lfm3 and zaya (convert_mixers), bailing_hybrid, minimax_m3_vl_text, inkling --

def _lfm3():
    tf = _tf()
    return tf.Lfm3Config(**{k: v for k, v in _COMMON.items() if k != "num_hidden_layers"},
                         num_hidden_layers=3, head_dim=16, conv_L_cache=3, conv_bias=True,
                         sliding_window=WINDOW,
                         layer_types=["conv", "sliding_attention", "full_attention"]), tf.Lfm3ForCausalLM


def _zaya():
    tf = _tf()
    return tf.ZayaConfig(**{k: v for k, v in _COMMON.items() if k != "intermediate_size"},
                         head_dim=16, sliding_window=WINDOW, layer_types=["hybrid_sliding", "hybrid"],
                         moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1,
                         router_hidden_size=16, attention_bias=True), tf.ZayaForCausalLM


def _bailing_hybrid():
    tf = _tf()
    return tf.BailingHybridConfig(
        **{**_COMMON, "num_key_value_heads": 4}, head_dim=16, short_conv_kernel_size=4,
        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        moe_intermediate_size=32, first_k_dense_replace=1,
        layer_types=["linear_attention", "full_attention"]), tf.BailingHybridForCausalLM


def _minimax_m3_vl_text():
    tf = _tf()
    return tf.MiniMaxM3VLTextConfig(
        **_COMMON, head_dim=16, rotary_dim=8, num_local_experts=4, num_experts_per_tok=2,
        dense_intermediate_size=96, shared_intermediate_size=32, mlp_layer_types=["dense", "sparse"],
        index_n_heads=2, index_head_dim=8, index_block_size=4, index_topk_blocks=2,
        index_local_blocks=1, layer_types=["minimax_m3_sparse", "full_attention"],
    ), tf.MiniMaxM3VLForCausalLM


def _inkling_text():
    tf = _tf()
    return tf.InklingTextConfig(
        **_COMMON, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2,
        swa_head_dim=16, sliding_window_size=WINDOW, d_rel=4, rel_extent=16,
        layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "sparse"],
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    ), tf.InklingForCausalLM


_INKLING2 = dict(vocab_size=VOCAB, unpadded_vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
                 sliding_window_size=WINDOW, d_rel=4, rel_extent=16, log_scaling_n_floor=8,
                 layer_types=["hybrid_sliding", "hybrid"] * 2, moe_intermediate_size=32,
                 n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=2,
                 max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _inkling2_text():
    tf = _tf()
    return tf.Inkling2TextConfig(**_INKLING2), tf.Inkling2ForCausalLM


def _inkling2_loop_text():
    tf = _tf()
    return tf.Inkling2LoopTextConfig(**_INKLING2, loop_layer_index_start=2, loop_layer_index_end=4,
                                     loop_num_passes=2, loop_gate_rank=8), tf.Inkling2LoopForCausalLM


# -- more attention families (second block) ----------------------------------------------

def _ministral3():
    tf = _tf()
    return tf.Ministral3Config(
        **_COMMON, head_dim=16, sliding_window=WINDOW,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.5),
    ), tf.Ministral3ForCausalLM


def _nanochat():
    tf = _tf()
    return tf.NanoChatConfig(**_COMMON, final_logit_softcapping=3.0), tf.NanoChatForCausalLM


def _vaultgemma():
    tf = _tf()
    return tf.VaultGemmaConfig(**_COMMON, head_dim=16, query_pre_attn_scalar=16,
                               sliding_window=WINDOW,
                               layer_types=["sliding_attention", "full_attention"],
                               attn_logit_softcapping=5.0,
                               final_logit_softcapping=3.0), tf.VaultGemmaForCausalLM


def _minicpm3():
    tf = _tf()
    return tf.MiniCPM3Config(**{**_COMMON, "num_key_value_heads": 4}, kv_lora_rank=16,
                             q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                             v_head_dim=12, scale_emb=2.0, scale_depth=1.4,
                             dim_model_base=32), tf.MiniCPM3ForCausalLM


def _youtu():
    tf = _tf()
    return tf.YoutuConfig(**{**_COMMON, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=24,
                          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                          rope_interleave=True), tf.YoutuForCausalLM


def _axk1():
    tf = _tf()
    return tf.AXK1Config(**{**_COMMON, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=24,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                         n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                         moe_intermediate_size=32, n_group=1, topk_group=1,
                         mlp_layer_types=["dense", "sparse"]), tf.AXK1ForCausalLM


def _longcat_flash():
    tf = _tf()
    c = {k: v for k, v in _COMMON.items() if k not in ("num_hidden_layers", "intermediate_size")}
    return tf.LongcatFlashConfig(**{**c, "num_key_value_heads": 4}, num_layers=1,
                                 ffn_hidden_size=96, expert_ffn_hidden_size=32, kv_lora_rank=16,
                                 q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                 v_head_dim=12, head_dim=8, n_routed_experts=4, zero_expert_num=2,
                                 moe_topk=2, routed_scaling_factor=1.0), tf.LongcatFlashForCausalLM


def _mimo_v2_flash():
    tf = _tf()
    return tf.MiMoV2FlashConfig(
        **_COMMON, head_dim=24, v_head_dim=12, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2,
        rope_parameters={t: dict(rope_type="default", rope_theta=10000.0,
                                 partial_rotary_factor=0.334)
                         for t in ("sliding_attention", "full_attention")},
    ), tf.MiMoV2FlashForCausalLM


def _minimax_m2():
    tf = _tf()
    return tf.MiniMaxM2Config(**{**_COMMON, "intermediate_size": 32}, head_dim=16,
                              num_local_experts=4, num_experts_per_tok=2,
                              **_AUX), tf.MiniMaxM2ForCausalLM


def _solar_open():
    tf = _tf()
    return tf.SolarOpenConfig(**{k: v for k, v in _COMMON.items() if k != "intermediate_size"},
                              head_dim=16, moe_intermediate_size=32, n_routed_experts=4,
                              num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                              routed_scaling_factor=2.0), tf.SolarOpenForCausalLM


def _mellum():
    tf = _tf()
    return tf.MellumConfig(**{**_COMMON, "intermediate_size": 32}, head_dim=16,
                           sliding_window=WINDOW,
                           layer_types=["sliding_attention", "full_attention"],
                           mlp_layer_types=["dense", "sparse"], moe_intermediate_size=32,
                           num_local_experts=4, num_experts_per_tok=2,
                           **_AUX), tf.MellumForCausalLM


def _kolibri1():
    tf = _tf()
    return tf.Kolibri1Config(**{k: v for k, v in _COMMON.items() if k != "intermediate_size"},
                             head_dim=16, sliding_window=WINDOW,
                             layer_types=["sliding_attention", "full_attention"],
                             moe_intermediate_size=32, shared_expert_intermediate_size=32,
                             num_experts=4, num_experts_per_tok=2), tf.Kolibri1ForCausalLM


def _laguna():
    tf = _tf()
    return tf.LagunaConfig(
        **_COMMON, head_dim=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], num_attention_heads_per_layer=[4, 2],
        mlp_layer_types=["dense", "sparse"], moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        moe_router_logit_softcapping=2.0, gating="per-head",
    ), tf.LagunaForCausalLM


def _flint():
    tf = _tf()
    return tf.FlintConfig(**_COMMON, head_dim=16, sliding_window=WINDOW,
                          layer_types=["sliding_attention", "full_attention"],
                          moe_intermediate_size=32, shared_expert_intermediate_size=32,
                          num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
                          **_AUX), tf.FlintForCausalLM


def _beam():
    tf = _tf()
    return tf.BeamConfig(**_COMMON, head_dim=16, sliding_window=WINDOW,
                         layer_types=["sliding_attention", "full_attention"],
                         mlp_layer_types=["dense", "sparse"], moe_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                         final_logit_softcapping=3.0), tf.BeamForCausalLM


def _hy_v3():
    tf = _tf()
    return tf.HYV3Config(**_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                         num_shared_experts=1, moe_intermediate_size=32,
                         mlp_layer_types=["dense", "sparse"]), tf.HYV3ForCausalLM


def _dory():
    tf = _tf()
    return tf.DoryConfig(**{**_COMMON, "num_hidden_layers": 3}, head_dim=16, sliding_window=WINDOW,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         n_input_layers=1, n_recurrent_layers=1, n_output_layers=1,
                         n_recurrent_loops=2), tf.DoryForCausalLM


def _apertus1p5_text():
    tf = _tf()
    return tf.Apertus1p5TextConfig(**_COMMON), tf.Apertus1p5TextForCausalLM


def _cohere_compass_text():
    tf = _tf()
    return tf.CohereCompassTextConfig(
        **_COMMON, head_dim=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], logit_scale=0.5,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": None},
    ), tf.CohereCompassForCausalLM


def _gemma4_text():
    tf = _tf()
    return tf.Gemma4TextConfig(
        **{**_COMMON, "num_hidden_layers": 4}, head_dim=16, global_head_dim=32,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
        attention_k_eq_v=True,
        num_global_key_value_heads=1, num_kv_shared_layers=2, vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8, final_logit_softcapping=3.0, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=32,
    ), tf.Gemma4ForCausalLM


def _hrm_text():
    tf = _tf()
    c = {k: v for k, v in _COMMON.items() if k not in ("num_key_value_heads", "num_hidden_layers")}
    return tf.HrmTextConfig(**c, head_dim=16, num_layers_per_stack=1, num_hidden_layers=6,
                            H_cycles=2, L_cycles=2, L_bp_cycles=[1],
                            embedding_scale=2.0), tf.HrmTextForCausalLM


def _modernbert_decoder():
    tf = _tf()
    c = {k: v for k, v in _COMMON.items() if k != "num_key_value_heads"}
    return tf.ModernBertDecoderConfig(**c, sliding_window=WINDOW, local_attention=2 * WINDOW,
                                      layer_types=["full_attention", "sliding_attention"],
                                      attention_bias=True), tf.ModernBertDecoderForCausalLM


def _emu3():
    tf = _tf()
    from transformers.models.emu3.configuration_emu3 import Emu3TextConfig

    return Emu3TextConfig(**_COMMON, attention_dropout=0.0), tf.Emu3ForCausalLM


def _ctrl():
    tf = _tf()
    return tf.CTRLConfig(vocab_size=VOCAB, n_positions=256, n_embd=64, dff=96, n_layer=2, n_head=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0), tf.CTRLLMHeadModel


def _openai_gpt():
    tf = _tf()
    return tf.OpenAIGPTConfig(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                              pad_token_id=0), tf.OpenAIGPTLMHeadModel


def _gpt_neox_japanese():
    tf = _tf()
    return tf.GPTNeoXJapaneseConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_multiple_size=2,
                                    max_position_embeddings=256, attention_dropout=0.0,
                                    hidden_dropout=0.0, bos_token_id=1,
                                    eos_token_id=2), tf.GPTNeoXJapaneseForCausalLM


_INDEXED_MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                    v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                    moe_intermediate_size=32, index_topk=8, index_head_dim=16, index_n_heads=2)
"""MLA with a DeepSeek-sparse-attention indexer keeping 8 keys per query (of up to 37)."""


def _axk2():
    tf = _tf()
    return tf.AXK2Config(**{**_COMMON, "num_key_value_heads": 4}, **_INDEXED_MLA,
                         mlp_layer_types=["dense", "sparse"]), tf.AXK2ForCausalLM


def _hy_v4():
    tf = _tf()
    return tf.HYV4Config(**{**_COMMON, "num_key_value_heads": 4}, **_INDEXED_MLA, head_dim=24,
                         mlp_layer_types=["dense", "sparse"]), tf.HYV4ForCausalLM


def _dots3_note_text():
    tf = _tf()
    return tf.Dots3NoteTextConfig(**{**_COMMON, "num_key_value_heads": 4}, **_INDEXED_MLA,
                                  head_dim=24, sliding_window=WINDOW,
                                  layer_types=["indexed_attention", "sliding_attention"],
                                  mlp_layer_types=["dense", "sparse"],
                                  shared_experts_intermediate_size=32,
                                  swa_num_attention_heads=4, swa_num_key_value_heads=4,
                                  swa_q_lora_rank=24, swa_kv_lora_rank=16, swa_head_dim=24,
                                  swa_qk_nope_head_dim=16,
                                  swa_v_head_dim=12), tf.Dots3NoteForCausalLM


def _deepseek_v4():
    tf = _tf()
    c = {k: v for k, v in _COMMON.items() if k != "intermediate_size"}
    return tf.DeepseekV4Config(
        **{**c, "num_key_value_heads": 1}, head_dim=32, q_lora_rank=24, moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, sliding_window=WINDOW,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe"], hc_mult=2, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=16, index_topk=4, num_nextn_predict_layers=0,
    ), tf.DeepseekV4ForCausalLM


# -- delta-rule hybrids: kimi_linear, olmo_hybrid, lara_mini (convert_mixers), qwen4_exp --


def _kimi_linear():
    tf = _tf()  # MLA expands its latent to every head: as many kv heads as heads
    return tf.KimiLinearConfig(
        **{**_COMMON, "num_key_value_heads": 4}, moe_intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, linear_head_dim=8,
        linear_num_heads=4, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
    ), tf.KimiLinearForCausalLM


def _olmo_hybrid():
    tf = _tf()
    return tf.OlmoHybridConfig(
        **_COMMON, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
        layer_types=["linear_attention", "full_attention"],
    ), tf.OlmoHybridForCausalLM


def _lara_mini():
    tf = _tf()  # (with head dims 8, transformers' float32 chunked scan alone puts the A_log
    # gradient of this init 1.1e-5 from a float64 loop: the survey's bound measures CP, not it)
    return tf.LaraMiniConfig(
        **{k: v for k, v in _COMMON.items() if k not in ("intermediate_size", "num_hidden_layers")},
        num_hidden_layers=3, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        sliding_window=WINDOW, layer_types=["linear_attention", "sliding_attention", "full_attention"],
    ), tf.LaraMiniForCausalLM


def _qwen4_exp():
    tf = _tf()
    return tf.Qwen4ExpTextConfig(
        **{k: v for k, v in _COMMON.items() if k != "intermediate_size"}, head_dim=16,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, hc_count=2, hc_lowrank=8,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
        indexer_compress_ratio=4, layer_types=["linear_attention", "indexed_attention"],
    ), tf.Qwen4ExpForCausalLM


# -- Zamba, Zamba2: Mamba layers and shared transformer blocks --------------------------------

def _zamba():
    tf = _tf()  # both hybrid layers run one (tied) attention block on [hidden, embeddings]
    return tf.ZambaConfig(**{**_COMMON, "num_hidden_layers": 3}, n_mamba_heads=2, mamba_d_state=8,
                          mamba_dt_rank=8, layers_block_type=["mamba", "hybrid", "hybrid"]
                          ), tf.ZambaForCausalLM


def _zamba2():
    tf = _tf()  # the LoRA adapters add to k and v at full width: as many kv heads as heads
    return tf.Zamba2Config(**{**_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4},
                           n_mamba_heads=4, mamba_ngroups=2, mamba_d_state=8, chunk_size=8,
                           use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
                           layers_block_type=["mamba", "hybrid", "hybrid"]), tf.Zamba2ForCausalLM


# -- RWKV, xLSTM: no attention, every sequence layer a recurrence (convert_mixers) ----------

def _rwkv():
    tf = _tf()
    return tf.RwkvConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                         attention_hidden_size=64, intermediate_size=96, context_length=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2), tf.RwkvForCausalLM


def _xlstm():
    tf = _tf()  # eps 1e-3: the stabiliser m weighs in the output (eps e^m), so a wrong m shows
    return tf.xLSTMConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=4,
                          eps=1e-3, pad_token_id=0, bos_token_id=1, eos_token_id=2
                          ), tf.xLSTMForCausalLM


def _rwkv_weights(model) -> None:
    """RWKV's keys made large (about +-30, where exp(k) is 1e13 and the WKV's running-maximum
    scale carries the state) and its bonus time_first varied per channel (initialised to 1)."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for block in model.rwkv.blocks:
            block.attention.key.weight.mul_(10.0)
            block.attention.time_first.copy_(torch.randn(64, generator=g))


def _xlstm_weights(model) -> None:
    """xLSTM's gates are initialised constant (zero weights; input gate bias -10): made to
    vary per token (std about 3), the input gate's bias -10, -6, -2, 2 by head, so that the
    stabiliser m (in the output through eps e^m) is the document start's m = 0, decayed, in
    some heads and the largest recent input gate in others."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for block in model.backbone.blocks:
            layer = block.mlstm_layer
            for gate, scale in ((layer.igate_preact, 0.4), (layer.fgate_preact, 0.25)):
                gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) * scale)
            layer.igate_preact.bias.copy_(torch.linspace(-10.0, 2.0, layer.igate_preact.bias.numel()))


_WEIGHTS = {"rwkv": _rwkv_weights, "xlstm": _xlstm_weights}
"""Families whose initialisation hides what the survey must exercise: a function setting
weights that make it matter (the same on every call)."""


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
    "afmoe": _afmoe,
    "arcee": _arcee,
    "bitnet": _bitnet,
    "cohere2_moe": _cohere2_moe,
    "cwm": _cwm,
    "dbrx": _dbrx,
    "deepseek_v32": _deepseek_v32,
    "diffllama": _diffllama,
    "dots1": _dots1,
    "ernie4_5": _ernie4_5,
    "ernie4_5_moe": _ernie4_5_moe,
    "exaone_moe": _exaone_moe,
    "glm4_moe": _glm4_moe,
    "glm4_moe_lite": _glm4_moe_lite,
    "glm_moe_dsa": _glm_moe_dsa,
    "gpt_bigcode": _gpt_bigcode,
    "granitemoeshared": _granitemoeshared,
    "granite_swa": _granite_swa,
    "granitemoe_swa": _granitemoe_swa,
    "hunyuan_v1_dense": _hunyuan_v1_dense,
    "hunyuan_v1_moe": _hunyuan_v1_moe,
    "hyperclovax": _hyperclovax,
    "jais2": _jais2,
    "jetmoe": _jetmoe,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "lfm2_moe": _lfm2_moe,
    "bamba": _bamba,
    "mamba2": _mamba2,
    "nemotron_h": _nemotron_h,
    "mamba": _mamba,
    "falcon_mamba": _falcon_mamba,
    "biogpt": _biogpt,
    # more hybrids
    "lfm3": _lfm3,
    "zaya": _zaya,
    "bailing_hybrid": _bailing_hybrid,
    "minimax_m3_vl_text": _minimax_m3_vl_text,
    "inkling_text": _inkling_text,
    "inkling2_text": _inkling2_text,
    "inkling2_loop_text": _inkling2_loop_text,
    # delta-rule hybrids
    "kimi_linear": _kimi_linear,
    "olmo_hybrid": _olmo_hybrid,
    "lara_mini": _lara_mini,
    "qwen4_exp": _qwen4_exp,
    # more attention families (second block)
    "ministral3": _ministral3,
    "nanochat": _nanochat,
    "vaultgemma": _vaultgemma,
    "minicpm3": _minicpm3,
    "youtu": _youtu,
    "axk1": _axk1,
    "longcat_flash": _longcat_flash,
    "mimo_v2_flash": _mimo_v2_flash,
    "minimax_m2": _minimax_m2,
    "solar_open": _solar_open,
    "mellum": _mellum,
    "kolibri1": _kolibri1,
    "laguna": _laguna,
    "flint": _flint,
    "beam": _beam,
    "hy_v3": _hy_v3,
    "dory": _dory,
    "apertus1p5_text": _apertus1p5_text,
    "cohere_compass_text": _cohere_compass_text,
    "gemma4_text": _gemma4_text,
    "hrm_text": _hrm_text,
    "modernbert-decoder": _modernbert_decoder,
    "emu3": _emu3,
    "ctrl": _ctrl,
    "openai-gpt": _openai_gpt,
    "gpt_neox_japanese": _gpt_neox_japanese,
    "axk2": _axk2,
    "hy_v4": _hy_v4,
    "dots3_note_text": _dots3_note_text,
    "deepseek_v4": _deepseek_v4,
    # Zamba hybrids: Mamba layers and shared transformer blocks
    "zamba": _zamba,
    "zamba2": _zamba2,
    # attention-free: RWKV-4 and xLSTM (convert_mixers, integrations/transformers/mixers/recurrent.py)
    "rwkv": _rwkv,
    "xlstm": _xlstm,
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
    "afmoe": "sliding (RoPE) + full (NoPE) layer, q/k norm, gated output, muP input scale, "
             "dense + MoE",
    "arcee": "relu2 MLP, GQA, RoPE",
    "bitnet": "relu2 MLP, attention/MLP sub-norms",
    "cohere2_moe": "sliding (RoPE) + full (NoPE) layers, parallel block, logit_scale, MoE + "
                   "shared expert",
    "cwm": "full + sliding layer (kwarg + mask), llama3 RoPE",
    "dbrx": "clip_qkv 0.5, fused qkv, MoE + router aux loss",
    "deepseek_v32": "MLA + DSA indexer (each query keeps its top 8 keys), dense + MoE layer",
    "diffllama": "differential attention (two softmaxes, learned lambda, group norm)",
    "dots1": "sliding + full layer, dense + MoE layer (shared expert)",
    "ernie4_5": "interleaved RoPE, q/k/v/o bias",
    "ernie4_5_moe": "dense + MoE layer (shared expert), router aux loss",
    "exaone_moe": "sliding + full layer, dense + MoE layer (shared expert)",
    "glm4_moe": "partial rotary 0.5, q/k norm, dense + MoE layer (shared expert)",
    "glm4_moe_lite": "MLA (qk head dim 24, v head dim 12, interleaved RoPE), dense + MoE layer",
    "glm_moe_dsa": "MLA + DSA indexer (top 8 keys per query, shared by layer 1), dense + MoE layer",
    "gpt_bigcode": "multi-query attention, learned positions",
    "granitemoeshared": "multipliers, MoE + shared expert + router aux loss",
    "granite_swa": "attention sinks (s_aux kwarg, random), full + sliding layer, per-layer "
                   "RoPE theta, multipliers",
    "granitemoe_swa": "attention sinks (s_aux kwarg, random), full + sliding layer, MoE + "
                      "shared expert + router aux loss",
    "hunyuan_v1_dense": "q/k norm after RoPE, GQA",
    "hunyuan_v1_moe": "q/k norm after RoPE, MoE + shared MLP",
    "hyperclovax": "post norms, embedding/residual/attention multipliers, logits scaling",
    "jais2": "LayerNorm, relu2 MLP, biases",
    "jetmoe": "mixture of attention heads (routed q/o experts) + MoE, router aux loss",
    "qwen3_5": "gated DeltaNet layer + gated full attention",
    "qwen3_5_moe": "gated DeltaNet layer + gated full attention, MoE + shared expert",
    "lfm2_moe": "short-conv layer + attention layer, dense + MoE layer",
    "bamba": "Mamba2 layer (2 groups) + attention layer",
    "mamba2": "Mamba2 layers only (2 groups, chunk 8)",
    "nemotron_h": "Mamba2 layer + attention layer + MLP layer",
    "mamba": "Mamba (selective scan) layers only",
    "falcon_mamba": "Mamba layers with RMS-normed B, C and dt",
    "biogpt": "learned positions, scaled embeddings, class not declared backend compatible",
    # more hybrids
    "lfm3": "short-conv layer (conv bias) + sliding + full layer (gated attention, sandwich norms)",
    "zaya": "CCA attention (q/k convolutions, delayed value half, biases) sliding + full, MoE with a skip expert",
    "bailing_hybrid": "Kimi Delta Attention layer (per-channel decay) + gated MLA layer, MoE",
    "minimax_m3_vl_text": "block-sparse layer (indexer picks key blocks per query) + full layer, MoE",
    "inkling_text": "query-conditioned relative position bias, k/v and residual short convs, MoE",
    "inkling2_text": "query-conditioned relative position bias and sinks, dynamic short convs, "
                     "block attention residuals",
    "inkling2_loop_text": "Inkling2 with its middle layers run twice (loop), message gates",
    # delta-rule hybrids
    "kimi_linear": "Kimi Delta Attention (gate per key channel) layer + MLA (NoPE) layer, dense + MoE",
    "olmo_hybrid": "gated DeltaNet layer (beta in [0, 2], own output gate) + full attention layer",
    "lara_mini": "gated DeltaNet layer + sliding (RoPE) + full (NoPE) layer, MoE",
    "qwen4_exp": "gated DeltaNet layer + indexed attention (QSA top-k key blocks), hyper-connections, MoE",
    # more attention families (second block)
    "ministral3": "sliding_window=7 on every layer, YaRN RoPE, llama_4_scaling_beta query scale from position_ids",
    "nanochat": "q/k norm, relu2, final_logit_softcapping=3",
    "vaultgemma": "attn_logit_softcapping=5 (softcap kwarg), final_logit_softcapping=3, sliding + full",
    "minicpm3": "MLA (qk head dim 24, v head dim 12), scaled embeddings and depth-scaled residuals",
    "youtu": "MLA (qk head dim 24, v head dim 12), interleaved RoPE",
    "axk1": "MLA (qk head dim 24, v head dim 12), interleaved RoPE, dense + MoE layer",
    "longcat_flash": "MLA, two attentions per layer, shortcut MoE with zero experts",
    "mimo_v2_flash": "sinks on the sliding layer (s_aux, random), v head dim 12 != qk 24, partial rotary, sliding + full, MoE",
    "minimax_m2": "q/k norm, MoE + router aux loss",
    "solar_open": "grouped MoE router (2 groups, 1 kept) + shared expert",
    "mellum": "sliding + full (RoPE per type), q/k norm, dense + MoE layer, router aux loss",
    "kolibri1": "sliding + full, q/k norm, MoE + shared expert",
    "laguna": "heads per layer (4, 2), per-head output gate, partial RoPE per type, sliding + full, router logit soft-capping",
    "flint": "attention sinks on every layer (s_aux, random), sliding + full, MoE + router aux loss",
    "beam": "sliding (RoPE) + full (NoPE) layer, gated attention with bias, grouped MoE, final_logit_softcapping=3",
    "hy_v3": "q/k norm, dense + MoE layer (shared expert)",
    "dory": "input, looped (2 loops) and output layers, nGPT L2-normalised residuals, gated attention, sliding + full",
    "apertus1p5_text": "xIELU activation, q/k norm, llama3 RoPE",
    "cohere_compass_text": "sliding (RoPE) + full (NoPE) layers, LayerNorm, logit_scale",
    "gemma4_text": "sliding + full (K = V, head dim 32, 1 kv head), KV sharing, per-layer inputs, MoE block, final_logit_softcapping=3",
    "hrm_text": "H and L stacks of 1 layer run 2 x (2 + 1) times, the first L cycle without gradients, scaled embeddings",
    "modernbert-decoder": "full + sliding (window 7) layer, biases, LayerNorm",
    "emu3": "Emu3's text decoder (Llama-style, GQA)",
    "ctrl": "sinusoidal positions, scaled embeddings",
    "openai-gpt": "learned positions, no AttentionInterface",
    "gpt_neox_japanese": "rotary, fused qkv, last layer's attention bias, no AttentionInterface",
    "axk2": "MLA + DeepSeek sparse attention indexer (top 8 keys per query)",
    "hy_v4": "MLA + sparse attention indexer (top 8 keys per query), sinks",
    "dots3_note_text": "indexed (top 8 keys) MLA layer + sliding MLA layer",
    "deepseek_v4": "compressed sparse + heavily compressed attention (indexer top 4), hash MoE",
    # Zamba hybrids
    "zamba": "multi-head Mamba layers + 2 hybrid layers sharing one attention block (no RoPE) "
             "on [hidden, embeddings]",
    "zamba2": "Mamba2 layers (2 groups, chunk 8) + 2 hybrid layers sharing one block with "
              "per-layer LoRA adapters, RoPE",
    # attention-free
    "rwkv": "RWKV-4 time mixing (token shift, WKV with keys up to about 30) + channel mixing",
    "xlstm": "mLSTM, gates varied per token (input gate bias -10 to 2 by head), eps 1e-3 "
             "(the stabiliser weighs in)",
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


def build(name: str, attn_implementation: str, edit=None):
    """Family ``name`` with ``attn_implementation`` ("eager", "ringattn", ...): fp32, train
    mode (eval for ``_EVAL``), the same weights on every call (``edit(config)``: a change
    to its config first)."""
    cfg, cls = FAMILIES[name]()
    if edit is not None:
        edit(cfg)
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model = cls(cfg).float()
    _randomize_sinks(model)
    if name in _WEIGHTS:
        _WEIGHTS[name](model)
    return model.eval() if name in _EVAL else model
