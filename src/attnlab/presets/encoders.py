"""The encoders of the BERT lineage: BERT and RoBERTa, their long-context variants (Longformer's
sliding window with global tokens, BigBird's block-sparse attention) and ModernBERT."""

from __future__ import annotations

from ..config import (
    GLUFFN,
    AttentionConfig,
    BlockSparseAttentionConfig,
    DenseFFN,
    LayerNormConfig,
    LayerSpec,
    LearnedPositions,
    LongformerAttentionConfig,
    ModelConfig,
    RoPE,
)
from .base import PRESETS


@PRESETS.register("bert-base")
def bert_base() -> ModelConfig:
    """Devlin et al. 2019, arXiv:1810.04805; huggingface.co/google-bert/bert-base-uncased (with MLM head)."""
    return ModelConfig(
        arch="encoder",
        vocab_size=30522,
        d_model=768,
        n_layers=12,
        n_heads=12,
        d_ff=3072,
        positional=LearnedPositions(max_len=512),
        attention=AttentionConfig(qkv_bias=True, o_bias=True, dropout=0.1),
        norm=LayerNormConfig(eps=1e-12),
        ffn=DenseFFN(activation="gelu"),
        norm_placement="post",
        final_norm=False,
        embedding_norm=True,
        dropout=0.1,
        type_vocab_size=2,
        pad_token_id=0,
        mlm_head=True,
        init="normal",
    )


@PRESETS.register("roberta-base")
def roberta_base() -> ModelConfig:
    """Liu et al. 2019, arXiv:1907.11692; huggingface.co/FacebookAI/roberta-base (with MLM head)."""
    return bert_base().replace(
        vocab_size=50265,
        positional=LearnedPositions(max_len=514, offset=2),
        norm=LayerNormConfig(eps=1e-5),
        type_vocab_size=1,
        pad_token_id=1,
    )


@PRESETS.register("longformer-base-4096")
def longformer_base_4096() -> ModelConfig:
    """Beltagy et al. 2020, arXiv:2004.05150; huggingface.co/allenai/longformer-base-4096 (with MLM head)."""
    # RoBERTa-base with Longformer attention: window 512 in every layer (|q - k| <= 256), global
    # q/k/v projections, 4,096 positions (+2 for RoBERTa's offset), MLM-pretrained from RoBERTa
    return roberta_base().replace(
        positional=LearnedPositions(max_len=4098, offset=2),
        attention=LongformerAttentionConfig(attention_window=512, dropout=0.1),
    )


@PRESETS.register("bigbird-roberta-base")
def bigbird_roberta_base() -> ModelConfig:
    """Zaheer et al. 2020, arXiv:2007.14062; huggingface.co/google/bigbird-roberta-base (with MLM head)."""
    # BERT's encoder with block-sparse attention (blocks of 64, 3 random blocks per head), 4,096
    # positions from 0 (no RoBERTa offset), gelu_new, a 50,358-token vocabulary, warm-started
    # from RoBERTa's weights (section 4); transformers' BigBirdModel (interop/big_bird.py)
    return bert_base().replace(
        vocab_size=50358,
        positional=LearnedPositions(max_len=4096),
        attention=BlockSparseAttentionConfig(
            block_size=64, num_random_blocks=3, qkv_bias=True, o_bias=True, dropout=0.1
        ),
        ffn=DenseFFN(activation="gelu-tanh"),
    )


@PRESETS.register("modernbert-base")
def modernbert_base() -> ModelConfig:
    """Warner et al. 2024, "Smarter, Better, Faster, Longer" (ModernBERT), arXiv:2412.13663; huggingface.co/answerdotai/ModernBERT-base (with MLM head)."""
    # Section 2.1.1: no biases (LayerNorm without bias too), GeGLU, RoPE, pre-norm with a norm
    # after the embeddings (so the first layer has none of its own before attention) and a final
    # norm; attention alternates: every third layer global (RoPE base 160,000), the others local,
    # |q - k| <= 64 (a 128-token window, RoPE base 10,000). The card's MLM head: dense without
    # bias + GELU + LayerNorm, the tied embedding as decoder with a bias (transformers'
    # ModernBertForMaskedLM). 22 layers, d 768, GLU width 1152, 12 heads (card's config.json).
    local = LayerSpec(sliding_window=65, positional=RoPE(base=10000.0))
    return ModelConfig(
        arch="encoder",
        vocab_size=50368,
        d_model=768,
        n_layers=22,
        n_heads=12,
        d_ff=1152,
        positional=RoPE(base=160000.0),
        norm=LayerNormConfig(eps=1e-5, bias=False),
        ffn=GLUFFN(activation="gelu", bias=False),
        norm_placement="pre",
        embedding_norm=True,
        layer_pattern=(LayerSpec(), local, local),
        first_attn_norm=False,
        pad_token_id=50283,
        mlm_head=True,
        mlm_dense_bias=False,
        init="normal",
    )
