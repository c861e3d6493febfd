"""Llama-shaped decoders that rewire the block: Phi-3 and Phi-4-mini (fused projections,
LongRoPE), OLMo 2 (norms after each sublayer, qk-norm over the whole projection), Granite
(multipliers on embeddings, residual, attention and logits) and Command R (a parallel block with one
LayerNorm, scaled logits)."""

from __future__ import annotations

from ..config import (
    GLUFFN,
    AttentionConfig,
    LayerNormConfig,
    ModelConfig,
    RMSNormConfig,
    RoPE,
)
from ..config.scaling import LongRoPEScaling
from .base import PRESETS
from .llama import llama_family


@PRESETS.register("phi3-mini-4k")
def phi3_mini_4k() -> ModelConfig:
    """Abdin et al. 2024, "Phi-3 Technical Report", arXiv:2404.14219; huggingface.co/microsoft/Phi-3-mini-4k-instruct."""
    # config.json: Llama's layout (section 2: "a similar block structure as Llama-2") at 32
    # layers of 3072, 32 heads of 96, SwiGLU of 8192, the Llama-2 vocabulary plus 64 chat and
    # padding entries (32,064); a 2,047-token sliding window in every layer (sliding_window
    # 2047, as transformers' Phi3 mask reads it); 4,096 positions, no RoPE scaling; untied. The
    # checkpoint stores q/k/v and gate/up fused (qkv_proj, gate_up_proj): same parameters.
    return llama_family(
        vocab_size=32064,
        d_model=3072,
        n_layers=32,
        n_heads=32,
        d_ff=8192,
        attention=AttentionConfig(sliding_window=2047),
        pad_token_id=32000,
    )


# Phi-4-mini's long_factor (config.json's rope_scaling): one divisor per rotated pair (48 of the
# 96 rotary channels), searched by LongRoPE for 131,072 positions; short_factor is all 1
_PHI4_MINI_LONG = (
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
    2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023,
    4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372,
    10.4687158, 11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807,
    22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66,
    32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
)  # fmt: skip


@PRESETS.register("phi4-mini")
def phi4_mini() -> ModelConfig:
    """Microsoft 2025, "Phi-4-Mini Technical Report", arXiv:2503.01743; huggingface.co/microsoft/Phi-4-mini-instruct."""
    # config.json: Phi-3's network (Phi3ForCausalLM) at 32 layers of 3072, 24 query and 8 K/V
    # heads of 128, RoPE on 75 % of each head (partial_rotary_factor 0.75) with LongRoPE from
    # 4,096 to 131,072 positions (factor 32 = their ratio, which sets the attention factor
    # sqrt(1 + ln 32 / ln 4096)); the o200k vocabulary (200,064), tied, pad 199999.
    # sliding_window 262,144 exceeds the 131,072 positions: it excludes no key, so none here.
    scaling = LongRoPEScaling(
        short_factor=(1.0,) * 48, long_factor=_PHI4_MINI_LONG, original_max_len=4096, factor=32.0
    )
    return llama_family(
        vocab_size=200064,
        d_model=3072,
        n_layers=32,
        n_heads=24,
        n_kv_heads=8,
        d_ff=8192,
        positional=RoPE(base=10000.0, fraction=0.75, scaling=scaling),
        tie_embeddings=True,
        pad_token_id=199999,
    )


@PRESETS.register("olmo2-1b")
def olmo2_1b() -> ModelConfig:
    """OLMo et al. 2024, "2 OLMo 2 Furious", arXiv:2501.00656 (norms after the sublayers, qk-norm over the whole projection); huggingface.co/allenai/OLMo-2-0425-1B."""
    # config.json: 16 layers of 2048, 16 heads of 128, SwiGLU of 8192, RoPE base 500,000 for
    # 4,096 positions, untied, the dolma2 vocabulary padded to 100,352 (pad 100277). Section
    # 3.2: h = x + RMSNorm(Attention(x)), then h + RMSNorm(MLP(h)) (the post-sublayer placement,
    # with a final norm) and an RMSNorm over all of q and all of k before RoPE (eps 1e-6)
    return llama_family(
        vocab_size=100352,
        d_model=2048,
        n_layers=16,
        n_heads=16,
        d_ff=8192,
        positional=RoPE(base=500000.0),
        norm=RMSNormConfig(eps=1e-6),
        attention=AttentionConfig(qk_norm=True, qk_norm_scope="projection"),
        norm_placement="post-sublayer",
        pad_token_id=100277,
    )


@PRESETS.register("granite-3.1-2b")
def granite_3_1_2b() -> ModelConfig:
    """IBM 2024, "Granite 3.0 Language Models" (µP multipliers); huggingface.co/ibm-granite/granite-3.1-2b-instruct."""
    # config.json: Llama's layout at 40 layers of 2048, 32 query and 8 K/V heads of 64, SwiGLU
    # of 8192, RoPE base 5e6 for 131,072 positions, 49,155 entries, tied, pad 0; the multipliers
    # of transformers' GraniteModel: embeddings x 12, x + 0.22 · sublayer(x), the softmax scale
    # attention_multiplier 1/64 (not 1/sqrt(64)), logits / logits_scaling 8 (x 0.125, exact);
    # attention_dropout 0.1 (the card's, inert at inference)
    return llama_family(
        vocab_size=49155,
        d_model=2048,
        n_layers=40,
        n_heads=32,
        n_kv_heads=8,
        d_ff=8192,
        positional=RoPE(base=5e6),
        attention=AttentionConfig(scale=0.015625, dropout=0.1),
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        logit_multiplier=1 / 8,
        tie_embeddings=True,
        pad_token_id=0,
    )


@PRESETS.register("command-r")
def command_r() -> ModelConfig:
    """Cohere 2024, "Command R" (parallel block, one bias-free LayerNorm, logit scale); huggingface.co/CohereForAI/c4ai-command-r-v01."""
    # config.json (CohereConfig's defaults but rope_theta): 40 layers of 8192, 64 heads of 128
    # (MHA), SwiGLU of 22528, 256,000 entries, tied; each block x + attn(LN(x)) + mlp(LN(x)) with
    # one LayerNorm without bias, computed in fp32 (CohereLayerNorm); RoPE base 8e6 on
    # interleaved pairs (modeling_cohere.py's rotate_half / repeat_interleave); logits x
    # logit_scale 0.0625
    return ModelConfig(
        arch="decoder",
        vocab_size=256000,
        d_model=8192,
        n_layers=40,
        n_heads=64,
        d_ff=22528,
        positional=RoPE(base=8e6, layout="interleaved"),
        norm=LayerNormConfig(eps=1e-5, bias=False, upcast=True),
        ffn=GLUFFN(activation="silu"),
        residual="parallel-shared-norm",
        logit_multiplier=0.0625,
        pad_token_id=0,
        init="normal",
    )
