"""The encoder-decoders: the 2017 original (Vaswani et al.) and its descendants T5 and BART."""

from __future__ import annotations

from ..config import (
    AttentionConfig,
    DenseFFN,
    LayerNormConfig,
    LearnedPositions,
    ModelConfig,
    RMSNormConfig,
    Sinusoidal,
    T5RelativeBias,
)
from .base import PRESETS


def _vaswani(d_model: int, n_heads: int, d_ff: int, dropout: float) -> ModelConfig:
    # Shared source/target BPE vocabulary of 37,000 tokens (WMT14 en-de, section 5.1); shared
    # embeddings and pre-softmax projection scaled by sqrt(d_model) (3.4); attention projections
    # are plain matrices W^Q, W^K, W^V, W^O (3.2.2); the FFN has biases (eq. 2); post-norm with
    # LayerNorm(x + Sublayer(x)) and no final norm (3.1).
    return ModelConfig(
        arch="encoder-decoder",
        vocab_size=37000,
        d_model=d_model,
        n_layers=6,
        n_heads=n_heads,
        d_ff=d_ff,
        positional=Sinusoidal(),
        attention=AttentionConfig(dropout=0.0),
        norm=LayerNormConfig(eps=1e-6),
        ffn=DenseFFN(activation="relu"),
        norm_placement="post",
        final_norm=False,
        scale_embeddings=True,
        dropout=dropout,
        init="xavier",
    )


@PRESETS.register("transformer-base-2017")
def transformer_base_2017() -> ModelConfig:
    """Vaswani et al. 2017, "Attention Is All You Need", arXiv:1706.03762, Table 3 (base)."""
    return _vaswani(512, 8, 2048, 0.1)


@PRESETS.register("transformer-big-2017")
def transformer_big_2017() -> ModelConfig:
    """Vaswani et al. 2017, arXiv:1706.03762, Table 3 (big; dropout 0.3 for en-de)."""
    return _vaswani(1024, 16, 4096, 0.3)


@PRESETS.register("t5-small")
def t5_small() -> ModelConfig:
    """Raffel et al. 2020, "Exploring the Limits of Transfer Learning", arXiv:1910.10683 (v1.0); huggingface.co/google-t5/t5-small."""
    return ModelConfig(
        arch="encoder-decoder",
        vocab_size=32128,
        d_model=512,
        n_layers=6,
        n_heads=8,
        d_ff=2048,
        positional=T5RelativeBias(num_buckets=32, max_distance=128),
        attention=AttentionConfig(scale=1.0, dropout=0.1),
        norm=RMSNormConfig(eps=1e-6),
        ffn=DenseFFN(activation="relu", bias=False),
        dropout=0.1,
        activation_dropout=0.1,
        scale_tied_logits=True,
        pad_token_id=0,
        init="t5",
    )


@PRESETS.register("bart-base")
def bart_base() -> ModelConfig:
    """Lewis et al. 2020, "BART", arXiv:1910.13461; huggingface.co/facebook/bart-base."""
    return ModelConfig(
        arch="encoder-decoder",
        vocab_size=50265,
        d_model=768,
        n_layers=6,
        n_heads=12,
        d_ff=3072,
        positional=LearnedPositions(max_len=1026, offset=2),
        attention=AttentionConfig(qkv_bias=True, o_bias=True, dropout=0.1),
        norm=LayerNormConfig(eps=1e-5),
        ffn=DenseFFN(activation="gelu"),
        norm_placement="post",
        final_norm=False,
        embedding_norm=True,
        dropout=0.1,
        activation_dropout=0.1,
        pad_token_id=1,
        init="normal",
    )
