"""Mixture-of-experts decoders: Mixtral, DeepSeek-V2-Lite and DeepSeek-V3 (latent attention,
shared experts), Qwen3-30B-A3B and GPT-OSS (attention sinks)."""

from __future__ import annotations

import math

from ..config import (
    GLUFFN,
    AttentionConfig,
    LayerSpec,
    MLAConfig,
    ModelConfig,
    MoEFFN,
    RMSNormConfig,
    RoPE,
    YaRNScaling,
)
from .base import PRESETS
from .llama import llama_family


@PRESETS.register("mixtral-8x7b")
def mixtral_8x7b() -> ModelConfig:
    """Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088; huggingface.co/mistralai/Mixtral-8x7B-v0.1."""
    return llama_family(
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        positional=RoPE(base=1e6),
        ffn=MoEFFN(
            expert=GLUFFN(activation="silu"),
            n_experts=8,
            top_k=2,
            routing="topk-softmax",
            aux_loss_coef=0.02,
        ),
    )


@PRESETS.register("deepseek-v2-lite")
def deepseek_v2_lite() -> ModelConfig:
    """DeepSeek-AI 2024, "DeepSeek-V2", arXiv:2405.04434 (MLA, fine-grained + shared experts); huggingface.co/deepseek-ai/DeepSeek-V2-Lite."""
    # config.json: 27 layers of d_model 2048, 16 heads; MLA with a 512-channel KV latent, no
    # query latent (q_lora_rank null), heads of 128 + 64 rotary channels, values of 128; YaRN
    # x40 from 4096 positions with mscale = mscale_all_dim = 0.707 (cos/sin factor 1, softmax
    # scale 192^-0.5 · (0.1·0.707·ln 40 + 1)², as transformers' DeepseekV2Attention); layer 0
    # dense (first_k_dense_replace 1, intermediate_size 10944), then 64 routed experts of 1408,
    # top-6, softmax scores unnormalised (norm_topk_prob false), 2 shared experts; the
    # sequence-wise balance loss with aux_loss_alpha 0.001 (seq_aux); untied, 102,400 tokens.
    mscale = 0.1 * 0.707 * math.log(40) + 1
    return llama_family(
        vocab_size=102400,
        d_model=2048,
        n_layers=27,
        n_heads=16,
        d_ff=1408,
        positional=RoPE(
            base=10000.0,
            layout="interleaved",
            scaling=YaRNScaling(factor=40, original_max_len=4096, attention_factor=1.0),
        ),
        attention=MLAConfig(
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            scale=192**-0.5 * mscale * mscale,  # transformers' order of products
        ),
        norm=RMSNormConfig(eps=1e-6),
        ffn=MoEFFN(
            expert=GLUFFN(activation="silu"),
            n_experts=64,
            top_k=6,
            routing="softmax-topk",
            n_shared_experts=2,
            aux_loss_coef=0.001,
            balance_loss="sequence",
            dense_layers=1,
            dense_d_ff=10944,
        ),
    )


@PRESETS.register("qwen3-30b-a3b")
def qwen3_30b_a3b() -> ModelConfig:
    """Yang et al. 2025, "Qwen3 Technical Report", arXiv:2505.09388 (MoE: 128 fine-grained experts, top-8, no shared expert); huggingface.co/Qwen/Qwen3-30B-A3B."""
    # config.json: 48 layers of 2048, 32 query and 4 K/V heads of 128 with qk-norm (as
    # Qwen3-0.6B); every layer sparse (decoder_sparse_step 1, mlp_only_layers []): 128 SwiGLU
    # experts of 768 (moe_intermediate_size; intermediate_size 6144 builds nothing), top-8
    # renormalised (norm_topk_prob true: softmax over the 8 chosen logits, "topk-softmax"),
    # the switch balance loss with router_aux_loss_coef 0.001; RoPE base 1e6, untied.
    return llama_family(
        vocab_size=151936,
        d_model=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        d_ff=768,
        positional=RoPE(base=1e6),
        norm=RMSNormConfig(eps=1e-6),
        attention=AttentionConfig(qk_norm=True),
        ffn=MoEFFN(
            expert=GLUFFN(activation="silu"),
            n_experts=128,
            top_k=8,
            routing="topk-softmax",
            aux_loss_coef=0.001,
        ),
    )


@PRESETS.register("deepseek-v3")
def deepseek_v3() -> ModelConfig:
    """DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv:2412.19437 (MLA with a query latent, sigmoid routing with aux-loss-free bias, grouped top-k); huggingface.co/deepseek-ai/DeepSeek-V3."""
    # config.json (DeepseekV3Config's defaults are this model's sizes): 61 layers of 7168, 128
    # heads; MLA with a 1536-channel query latent and a 512-channel KV latent, heads of 128 + 64
    # rotary channels (interleaved pairs), values of 128; YaRN x40 from 4,096 positions with
    # mscale = mscale_all_dim = 1 (cos/sin factor 1, softmax scale 192^-0.5 · (0.1 ln 40 + 1)²);
    # the first 3 layers dense (18432), then 256 routed experts of 2048 and 1 shared: sigmoid
    # scores, a per-expert bias that chooses but does not weigh (e_score_correction_bias, a
    # buffer), 8 groups scored by their two best experts, the best 4 kept, top-8 renormalised
    # and x 2.5 (noaux_tc); 129,280 entries, untied. The multi-token-prediction module
    # (num_nextn_predict_layers 1, 14B) is not part of the causal LM (transformers builds
    # none). Balance: the complementary sequence-wise loss with α = 0.0001 (section 4.2).
    mscale = 0.1 * 1.0 * math.log(40) + 1
    return llama_family(
        vocab_size=129280,
        d_model=7168,
        n_layers=61,
        n_heads=128,
        d_ff=2048,
        positional=RoPE(
            base=10000.0,
            layout="interleaved",
            scaling=YaRNScaling(factor=40, original_max_len=4096, attention_factor=1.0),
        ),
        attention=MLAConfig(
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            scale=192**-0.5 * mscale * mscale,  # transformers' order of products
        ),
        norm=RMSNormConfig(eps=1e-6),
        ffn=MoEFFN(
            expert=GLUFFN(activation="silu"),
            n_experts=256,
            top_k=8,
            routing="sigmoid-topk-norm",
            n_shared_experts=1,
            routed_scale=2.5,
            n_groups=8,
            top_k_groups=4,
            group_score="top2-sum",
            selection_bias=True,
            aux_loss_coef=0.0001,
            balance_loss="sequence",
            dense_layers=3,
            dense_d_ff=18432,
        ),
    )


@PRESETS.register("gpt-oss-20b")
def gpt_oss_20b() -> ModelConfig:
    """OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card", arXiv:2508.10925 (attention sinks, alternating 128-token window, clamped SwiGLU experts); huggingface.co/openai/gpt-oss-20b."""
    # config.json: 24 layers of 2880, 64 query and 8 K/V heads of 64 with biases on q/k/v/o and
    # a learned sink logit per head; layer_types alternate a 128-token sliding window (layer 0)
    # and full attention; YaRN x32 from 4,096 positions (RoPE base 150,000, beta 32 / 1, the
    # unrounded ramp: truncate false); 32 experts of 2880 with biases, top-4 by the router's
    # logits (a bias too), softmax over the 4 (GptOssTopKRouter); each expert
    # down((up.clamp(±7) + 1) · g·σ(1.702·g)), g = gate.clamp(max=7) (swiglu_limit 7); the
    # switch balance loss with router_aux_loss_coef 0.9; o200k_harmony vocabulary (201,088),
    # untied, pad 199999
    return llama_family(
        vocab_size=201088,
        d_model=2880,
        n_layers=24,
        n_heads=64,
        n_kv_heads=8,
        head_dim=64,
        d_ff=2880,
        positional=RoPE(
            base=150000.0,
            scaling=YaRNScaling(factor=32, original_max_len=4096, truncate=False),
        ),
        attention=AttentionConfig(qkv_bias=True, o_bias=True, sinks=True),
        layer_pattern=(LayerSpec(sliding_window=128), LayerSpec()),
        ffn=MoEFFN(
            expert=GLUFFN(activation="gelu-sigmoid", bias=True, limit=7.0, up_shift=1.0),
            n_experts=32,
            top_k=4,
            routing="topk-softmax",
            router_bias=True,
            aux_loss_coef=0.9,
        ),
        pad_token_id=199999,
    )
