"""The Gemma lineage: Gemma's embedding scale and (1 + w) RMSNorm, Gemma 2's alternating
local/global layers with soft-capping and sandwich norms, Gemma 3's layer pattern with two RoPE
bases."""

from __future__ import annotations

from ..config import (
    GLUFFN,
    AttentionConfig,
    LayerSpec,
    ModelConfig,
    RoPE,
    UnitOffsetRMSNormConfig,
)
from .base import PRESETS
from .llama import llama_family


@PRESETS.register("gemma-2b")
def gemma_2b() -> ModelConfig:
    """Gemma Team 2024, "Gemma", arXiv:2403.08295 (MQA, GeGLU, (1 + w) RMSNorm, embeddings × sqrt(d)); huggingface.co/google/gemma-2b."""
    # Table 1: d_model 2048, 18 layers, 8 query heads and 1 K/V head of 256, feed-forward 32768 =
    # 2 · 16384 (gate and up; config.json's intermediate_size 16384), 256,128 vocabulary entries
    # (config.json's vocab_size 256000, the tokens in use), tied embeddings. Section 2: approximate
    # GeGLU, RMSNorm; the embeddings scaled by sqrt(d_model) in the model dtype and the norm's
    # stored weight w used as 1 + w are transformers' GemmaModel / GemmaRMSNorm.
    return llama_family(
        vocab_size=256000,
        d_model=2048,
        n_layers=18,
        n_heads=8,
        n_kv_heads=1,
        head_dim=256,
        d_ff=16384,
        norm=UnitOffsetRMSNormConfig(eps=1e-6),
        ffn=GLUFFN(activation="gelu-tanh"),
        scale_embeddings=True,
        round_embed_scale=True,
        tie_embeddings=True,
        pad_token_id=0,
    )


def _gemma2_family(**sizes) -> ModelConfig:
    # Gemma 1's conventions (gemma-2b above: (1 + w) RMSNorm, GeGLU, embeddings x sqrt(d) rounded
    # to the weights' dtype, tied, pad 0) with a norm before and after each sublayer (Gemma 2,
    # arXiv:2408.00118, section 2.2: "we use RMSNorm to normalize the input and output of each
    # transformer sub-layer", the sandwich placement); query_pre_attn_scalar 256 = head_dim,
    # so the softmax scale is the default 1/16
    base = dict(
        norm=UnitOffsetRMSNormConfig(eps=1e-6),
        ffn=GLUFFN(activation="gelu-tanh"),
        norm_placement="sandwich",
        scale_embeddings=True,
        round_embed_scale=True,
        tie_embeddings=True,
        pad_token_id=0,
        head_dim=256,
    )
    return llama_family(**{**base, **sizes})


@PRESETS.register("gemma2-2b")
def gemma2_2b() -> ModelConfig:
    """Gemma Team 2024, "Gemma 2", arXiv:2408.00118 (local/global layers, logit soft-capping, sandwich norms); huggingface.co/google/gemma-2-2b."""
    # config.json / Table 1: 26 layers of 2304, 8 query and 4 K/V heads of 256, GeGLU of 9216
    # (feedforward 18432 = 2 x 9216), the 256,000-entry vocabulary; layers alternate a 4,096-token
    # sliding window (layer 0) and global attention; scores capped at 50 and the final logits at
    # 30 (cap · tanh(x / cap), section 2.2)
    return _gemma2_family(
        vocab_size=256000,
        d_model=2304,
        n_layers=26,
        n_heads=8,
        n_kv_heads=4,
        d_ff=9216,
        attention=AttentionConfig(softcap=50.0),
        layer_pattern=(LayerSpec(sliding_window=4096), LayerSpec()),
        final_logit_softcap=30.0,
    )


@PRESETS.register("gemma3-1b")
def gemma3_1b() -> ModelConfig:
    """Gemma Team 2025, "Gemma 3 Technical Report", arXiv:2503.19786 (5 local : 1 global, qk-norm, local RoPE 10k / global 1M); huggingface.co/google/gemma-3-1b-pt (text-only Gemma3ForCausalLM)."""
    # config.json: Gemma 2's block with qk-norm replacing the soft-capping (section 2: "we replace
    # the soft-capping of Gemma 2 with QK-norm"; (1 + w) RMSNorms over each head's 256 channels),
    # 26 layers of 1152, 4 query heads and 1 K/V head of 256, GeGLU of 6912, 262,144 entries;
    # sliding_window_pattern 6: five layers with a 512-token window and RoPE base 10,000
    # (rope_local_base_freq), then one global layer with base 1,000,000 (rope_theta); 32,768
    # positions, no scaling
    local = LayerSpec(sliding_window=512, positional=RoPE(base=10000.0))
    return _gemma2_family(
        vocab_size=262144,
        d_model=1152,
        n_layers=26,
        n_heads=4,
        n_kv_heads=1,
        d_ff=6912,
        positional=RoPE(base=1e6),
        attention=AttentionConfig(qk_norm=True),
        layer_pattern=(local, local, local, local, local, LayerSpec()),
    )
