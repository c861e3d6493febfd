"""The GPT lineage: LayerNorm decoders before Llama, with learned positions (GPT-2), relative
positions and a segment memory (Transformer-XL), ALiBi (BLOOM, MPT), partial rotary and a parallel
residual (GPT-NeoX, Falcon)."""

from __future__ import annotations

from ..config import (
    ALiBi,
    AttentionConfig,
    DenseFFN,
    LayerNormConfig,
    LearnedPositions,
    ModelConfig,
    RoPE,
    XLAttentionConfig,
    XLRelative,
)
from .base import PRESETS


@PRESETS.register("gpt2-small")
def gpt2_small() -> ModelConfig:
    """Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"; huggingface.co/openai-community/gpt2."""
    return ModelConfig(
        arch="decoder",
        vocab_size=50257,
        d_model=768,
        n_layers=12,
        n_heads=12,
        positional=LearnedPositions(max_len=1024),
        attention=AttentionConfig(qkv_bias=True, o_bias=True, dropout=0.1),
        norm=LayerNormConfig(eps=1e-5),
        ffn=DenseFFN(activation="gelu-tanh"),
        dropout=0.1,
        init="gpt2",
    )


@PRESETS.register("transformer-xl-enwik8-12l")
def transformer_xl_enwik8_12l() -> ModelConfig:
    """Dai et al. 2019, "Transformer-XL", arXiv:1901.02860, Table 2 (enwik8, 12 layers, 41M)."""
    # The original code's pytorch/run_enwik8_base.sh: 12 layers of d_model 512, 8 heads of 64,
    # d_inner 2048, dropout 0.1, dropatt 0.0, tgt_len 512, mem_len 512; post-norm
    # (pre_lnorm False: LayerNorm(x + sublayer(x)), no final norm); relative attention with
    # bias-free q/k/v/o and r_net, u and v shared by all layers (the paper; the PyTorch code's
    # model-level r_w_bias / r_r_bias); ReLU FFN with biases; 204 byte symbols, embeddings
    # scaled by sqrt(d_model) (AdaptiveEmbedding, div_val 1) and tied to the output layer. The
    # output layer's bias (ProjectedAdaptiveLogSoftmax without clusters is nn.Linear with one,
    # 204 parameters) is not modelled: tied logits here are hidden · Eᵀ.
    return ModelConfig(
        arch="decoder",
        vocab_size=204,
        d_model=512,
        n_layers=12,
        n_heads=8,
        head_dim=64,
        d_ff=2048,
        positional=XLRelative(),
        attention=XLAttentionConfig(mem_len=512, segment_len=512, dropout=0.0),
        norm=LayerNormConfig(eps=1e-5),
        ffn=DenseFFN(activation="relu"),
        norm_placement="post",
        final_norm=False,
        scale_embeddings=True,
        dropout=0.1,
        init="normal",
    )


@PRESETS.register("bloom-560m")
def bloom_560m() -> ModelConfig:
    """BigScience 2022, "BLOOM", arXiv:2211.05100 (ALiBi, embedding LayerNorm); huggingface.co/bigscience/bloom-560m."""
    return ModelConfig(
        arch="decoder",
        vocab_size=250880,
        d_model=1024,
        n_layers=24,
        n_heads=16,
        positional=ALiBi(),
        attention=AttentionConfig(qkv_bias=True, o_bias=True),
        norm=LayerNormConfig(eps=1e-5),
        ffn=DenseFFN(activation="gelu-tanh"),
        embedding_norm=True,
        pad_token_id=3,
        init="normal",
    )


@PRESETS.register("mpt-7b")
def mpt_7b() -> ModelConfig:
    """MosaicML 2023, "Introducing MPT-7B" (ALiBi, no biases, LayerNorm without bias); huggingface.co/mosaicml/mpt-7b."""
    return ModelConfig(
        arch="decoder",
        vocab_size=50432,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        positional=ALiBi(),
        norm=LayerNormConfig(eps=1e-5, bias=False),
        ffn=DenseFFN(activation="gelu", bias=False),
        init="normal",
    )


@PRESETS.register("gpt-neox-20b")
def gpt_neox_20b() -> ModelConfig:
    """Black et al. 2022, "GPT-NeoX-20B", arXiv:2204.06745 (rotary on 25 % of each head, parallel residual); huggingface.co/EleutherAI/gpt-neox-20b."""
    return ModelConfig(
        arch="decoder",
        vocab_size=50432,
        d_model=6144,
        n_layers=44,
        n_heads=64,
        positional=RoPE(base=10000.0, fraction=0.25),
        attention=AttentionConfig(qkv_bias=True, o_bias=True),
        norm=LayerNormConfig(eps=1e-5),
        ffn=DenseFFN(activation="gelu-tanh"),
        residual="parallel",
        tie_embeddings=False,
        init="normal",
    )


@PRESETS.register("falcon-7b")
def falcon_7b() -> ModelConfig:
    """Almazrouei et al. 2023, "The Falcon Series", arXiv:2311.16867 (MQA, parallel block, one norm); huggingface.co/tiiuae/falcon-7b."""
    return ModelConfig(
        arch="decoder",
        vocab_size=65024,
        d_model=4544,
        n_layers=32,
        n_heads=71,
        n_kv_heads=1,
        head_dim=64,
        positional=RoPE(base=10000.0),
        norm=LayerNormConfig(eps=1e-5),
        ffn=DenseFFN(activation="gelu", bias=False),
        residual="parallel-shared-norm",
        init="normal",
    )
