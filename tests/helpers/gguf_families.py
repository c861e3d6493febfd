"""The test-size model of each GGUF family: a tiny random-weight transformers model per
llama.cpp architecture attnlab reads (tests/interop/gguf/test_gguf_families.py loads each against
its model, tests/interop/gguf/test_gguf_write.py writes each, benchmarks/check_llamacpp.py runs
each in llama.cpp). Needs transformers (`tiny` imports it)."""

from __future__ import annotations

import torch

from helpers.gguf_writing import vocab_size

SMALL = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
LLAMA3 = dict(
    rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
    high_freq_factor=4.0, original_max_position_embeddings=32,
)  # fmt: skip

FALCON = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
    bias=False, alibi=False, parallel_attn=True, bos_token_id=1, eos_token_id=2,
)  # fmt: skip

# name -> (general.architecture, transformers class stem, config, tokenizer, test length)
# Lengths: past each sliding window (16) and past the original context where RoPE is scaled.
FAMILIES = {
    "llama3": (
        "llama", "Llama",
        # llama.cpp reads original_max_position_embeddings from config.json's top level
        # (LlamaModel.generate_extra_tensors), so the tiny model states it there too
        dict(SMALL, head_dim=32, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=256, rope_parameters=LLAMA3,
             original_max_position_embeddings=32, tie_word_embeddings=False),
        "gpt2", 256,
    ),
    "smollm3": (
        "smollm3", "SmolLM3", dict(SMALL, num_hidden_layers=4, max_position_embeddings=64),
        "gpt2", 48,
    ),
    "granite": (
        "granite", "Granite",
        dict(SMALL, max_position_embeddings=64, embedding_multiplier=3.0, residual_multiplier=0.5,
             attention_multiplier=0.2, logits_scaling=4.0, tie_word_embeddings=True),
        "gpt2", 48,
    ),
    "phi3": (
        "phi3", "Phi3",
        dict(SMALL, max_position_embeddings=128, original_max_position_embeddings=32,
             sliding_window=16,
             rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                  short_factor=[1.0, 1.1, 1.2, 1.5, 1.8, 2.0, 2.5, 3.0],
                                  long_factor=[1.0, 1.3, 1.9, 2.7, 3.5, 4.0, 4.0, 4.0])),
        "spm", 128,
    ),
    "gemma2": (
        "gemma2", "Gemma2",
        dict(SMALL, head_dim=16, max_position_embeddings=64, sliding_window=16,
             query_pre_attn_scalar=16, attn_logit_softcapping=20.0, final_logit_softcapping=10.0),
        "spm", 48,
    ),
    "gemma3": (
        "gemma3", "Gemma3TextConfig/Gemma3",
        dict(SMALL, head_dim=16, num_hidden_layers=6, max_position_embeddings=128,
             sliding_window=16, query_pre_attn_scalar=16,
             rope_parameters={
                 "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=100000.0),
                 "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}),
        "spm", 48,
    ),
    "qwen3moe": (
        "qwen3moe", "Qwen3Moe",
        dict(SMALL, head_dim=24, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, norm_topk_prob=True),
        "gpt2", 48,
    ),
    "olmo2": ("olmo2", "Olmo2", dict(SMALL, max_position_embeddings=64), "gpt2", 48),
    "command-r": (
        "command-r", "Cohere",
        dict(SMALL, max_position_embeddings=64, logit_scale=0.5, layer_norm_eps=1e-5),
        "gpt2", 48,
    ),
    "gpt-oss": (
        "gpt-oss", "GptOss",
        dict(SMALL, head_dim=16, intermediate_size=32, max_position_embeddings=128,
             num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                  original_max_position_embeddings=32, beta_fast=32.0,
                                  beta_slow=1.0, truncate=False)),
        "gpt2", 128,
    ),
    "deepseek-v3": (
        "deepseek2", "DeepseekV3",
        dict(SMALL, num_key_value_heads=4, max_position_embeddings=128, q_lora_rank=24,
             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
             n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
             moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
             routed_scaling_factor=2.5, norm_topk_prob=True,
             scoring_func="sigmoid",  # as DeepSeek-V3's config.json states it
             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                  original_max_position_embeddings=32, beta_fast=32.0,
                                  beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
        "gpt2", 128,
    ),
    "deepseek-v2": (  # softmax routing: llama.cpp writes no expert_gating_func for it
        "deepseek2", "DeepseekV2",
        dict(SMALL, num_key_value_heads=4, max_position_embeddings=128, q_lora_rank=24,
             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
             n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
             topk_method="group_limited_greedy", moe_intermediate_size=32, n_shared_experts=1,
             first_k_dense_replace=1, routed_scaling_factor=2.5,
             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                  original_max_position_embeddings=32, beta_fast=32.0,
                                  beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)),
        "gpt2", 128,
    ),
    "gpt2": (  # LayerNorm, learned positions (the table is the context), Conv1D weights
        "gpt2", "GPT2Config/GPT2LMHeadModel",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2),
        "gpt2", 48,
    ),
    "gptneox": (  # partial rotary (a quarter of each head), parallel residual
        "gptneox", "GPTNeoX",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
             max_position_embeddings=64, rotary_pct=0.25, bos_token_id=1, eos_token_id=2),
        "gpt2", 48,
    ),
    "mpt": (  # ALiBi, no biases (LayerNorm without shift), fused [q; k; v]
        "mpt", "Mpt",
        dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=64, bos_token_id=1, eos_token_id=2),
        "gpt2", 48,
    ),
    "bloom": (  # ALiBi, an embedding norm, the head tied
        "bloom", "Bloom",
        dict(hidden_size=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2),
        "gpt2", 48,
    ),
    "falcon": (  # the 7B layout: multi-query, one norm for the parallel block, the head tied
        "falcon", "Falcon",
        dict(FALCON, multi_query=True, new_decoder_architecture=False),
        "gpt2", 48,
    ),
    "falcon-40b": (  # the new decoder architecture: GQA, two norms (ln_attn, ln_mlp), untied
        "falcon", "Falcon",
        dict(FALCON, new_decoder_architecture=True, num_kv_heads=2, tie_word_embeddings=False),
        "gpt2", 48,
    ),
    "falcon2-11b": (  # the new decoder architecture with one norm, a RoPE base, a wider FFN
        "falcon", "Falcon",
        dict(FALCON, new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1,
             ffn_hidden_size=160, rope_theta=500000.0),
        "gpt2", 48,
    ),
}  # fmt: skip
# the attnlab converter each family needs (landing in src/attnlab/interop/)
MODEL_TYPES = {
    "llama3": "llama", "smollm3": "smollm3", "granite": "granite", "phi3": "phi3",
    "gemma2": "gemma2", "gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "olmo2": "olmo2",
    "command-r": "cohere", "gpt-oss": "gpt_oss", "deepseek-v3": "deepseek_v3",
    "deepseek-v2": "deepseek_v2", "gpt2": "gpt2",
    "gptneox": "gpt_neox", "bloom": "bloom", "mpt": "mpt", "falcon": "falcon",
    "falcon-40b": "falcon", "falcon2-11b": "falcon",
}  # fmt: skip


def tiny(family: str):
    """The family's tiny transformers model, norms away from their init (a norm loaded in the
    wrong place or without llama.cpp's +1 undone shows), biases, sinks and the routing bias
    random."""
    import transformers

    arch, stem, config, tokenizer, _ = FAMILIES[family]
    cfg_name, _, model_stem = stem.partition("/")
    cfg_cls = getattr(transformers, cfg_name if model_stem else f"{stem}Config")
    model_stem = model_stem or stem
    model_cls = getattr(
        transformers, model_stem if model_stem.endswith("Model") else f"{model_stem}ForCausalLM"
    )
    cfg = cfg_cls(vocab_size=vocab_size(tokenizer, arch), **config)
    torch.manual_seed(0)
    hf = model_cls(cfg).eval()
    gemma = arch.startswith("gemma")
    with torch.no_grad():
        for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
            if "norm" in name or "layernorm" in name:
                p.uniform_(-0.5, 0.5) if gemma else p.uniform_(0.5, 1.5)
            elif name.endswith(("bias", "sinks", "e_score_correction_bias")):
                p.normal_(0, 0.1)
    return hf
