"""The Llama lineage: pre-norm RMSNorm, RoPE, SwiGLU, no biases (Llama 2 and 3), and the decoders
that keep that frame and change a piece or two: Qwen2's qkv biases, Qwen3's qk-norm, Mistral's
sliding window, SmolLM3's NoPE layers. `llama_family` is the frame the other lineage modules
(llama_variants.py, gemma.py, moe.py) change too."""

from __future__ import annotations

from ..config import (
    GLUFFN,
    AttentionConfig,
    LayerSpec,
    ModelConfig,
    NoPositions,
    RMSNormConfig,
    RoPE,
)
from ..config.scaling import Llama3Scaling
from .base import PRESETS


def llama_family(**sizes) -> ModelConfig:
    """Llama 2's frame (vocabulary 32,000, RoPE base 10,000, RMSNorm eps 1e-5, SwiGLU, untied,
    normal init) with `sizes` and any field changed."""
    base = dict(
        arch="decoder",
        vocab_size=32000,
        positional=RoPE(base=10000.0),
        norm=RMSNormConfig(eps=1e-5),
        ffn=GLUFFN(activation="silu"),
        tie_embeddings=False,
        init="normal",
    )
    return ModelConfig(**{**base, **sizes})


@PRESETS.register("llama2-7b")
def llama2_7b() -> ModelConfig:
    """Touvron et al. 2023, "Llama 2", arXiv:2307.09288; huggingface.co/meta-llama/Llama-2-7b-hf."""
    return llama_family(d_model=4096, n_layers=32, n_heads=32)


@PRESETS.register("llama2-70b")
def llama2_70b() -> ModelConfig:
    """Touvron et al. 2023, arXiv:2307.09288 (GQA, 8 KV heads); huggingface.co/meta-llama/Llama-2-70b-hf."""
    return llama_family(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672)


def _llama3(**sizes) -> ModelConfig:
    # Llama 3's vocabulary (128,256 tiktoken entries), RoPE base 500,000, and Llama 3.1's
    # scaling to 131,072 positions: low/high frequency factors 1 and 4 around the 8,192 trained
    # (rope_scaling of the cards' config.json; arXiv:2407.21783, section 3.3.1)
    factor = sizes.pop("factor")
    scaling = Llama3Scaling(
        factor=factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=8192
    )
    return llama_family(vocab_size=128256, positional=RoPE(base=500000.0, scaling=scaling), **sizes)


@PRESETS.register("llama3.2-1b")
def llama3_2_1b() -> ModelConfig:
    """Meta 2024, "Llama 3.2" (Llama 3 herd, arXiv:2407.21783, pruned and distilled from 3.1-8B); huggingface.co/meta-llama/Llama-3.2-1B."""
    # config.json: 16 layers of 2048, 32 query and 8 K/V heads of 64, SwiGLU of 8192, tied
    # embeddings, the llama3 scaling with factor 32
    return _llama3(
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        d_ff=8192,
        factor=32.0,
        tie_embeddings=True,
    )


@PRESETS.register("llama3.1-8b")
def llama3_1_8b() -> ModelConfig:
    """Grattafiori et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, Table 3 (8B); huggingface.co/meta-llama/Llama-3.1-8B."""
    # config.json: 32 layers of 4096, 32 query and 8 K/V heads of 128, SwiGLU of 14336, untied,
    # the llama3 scaling with factor 8
    return _llama3(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336, factor=8.0)


@PRESETS.register("qwen2-7b")
def qwen2_7b() -> ModelConfig:
    """Yang et al. 2024, "Qwen2 Technical Report", arXiv:2407.10671; huggingface.co/Qwen/Qwen2-7B."""
    return llama_family(
        vocab_size=152064,
        d_model=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        d_ff=18944,
        positional=RoPE(base=1e6),
        norm=RMSNormConfig(eps=1e-6),
        attention=AttentionConfig(qkv_bias=True),
    )


@PRESETS.register("qwen3-0.6b")
def qwen3_0_6b() -> ModelConfig:
    """Yang et al. 2025, "Qwen3 Technical Report", arXiv:2505.09388 (qk-norm, head_dim 128 = 2 · d_model / n_heads, tied); huggingface.co/Qwen/Qwen3-0.6B."""
    # Qwen2's layout without the q/k/v biases and with an RMSNorm on each query and key head
    # before the rotation (section 2, "QK-Norm"); 40,960 positions (config.json), no window
    return llama_family(
        vocab_size=151936,
        d_model=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        d_ff=3072,
        positional=RoPE(base=1e6),
        norm=RMSNormConfig(eps=1e-6),
        attention=AttentionConfig(qk_norm=True),
        tie_embeddings=True,
    )


@PRESETS.register("mistral-7b")
def mistral_7b() -> ModelConfig:
    """Jiang et al. 2023, "Mistral 7B", arXiv:2310.06825 (sliding window 4096); huggingface.co/mistralai/Mistral-7B-v0.1."""
    return llama_family(
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        attention=AttentionConfig(sliding_window=4096),
    )


@PRESETS.register("smollm3-3b")
def smollm3_3b() -> ModelConfig:
    """Hugging Face 2025, "SmolLM3: smol, multilingual, long-context reasoner" (NoPE every 4th layer, Yang et al. 2025, arXiv:2501.18795); huggingface.co/HuggingFaceTB/SmolLM3-3B."""
    # config.json: Llama's layout, 36 layers of 2048, 16 query and 4 K/V heads of 128, SwiGLU of
    # 11008, RoPE base 5e6 for 65,536 positions; no_rope_layer_interval 4: layers 3, 7, 11, ...
    # have no positions at all (no_rope_layers [1, 1, 1, 0] x 9); tied embeddings, the Llama-3
    # vocabulary (128,256), pad 128004.
    nope = LayerSpec(positional=NoPositions())
    return llama_family(
        vocab_size=128256,
        d_model=2048,
        n_layers=36,
        n_heads=16,
        n_kv_heads=4,
        d_ff=11008,
        positional=RoPE(base=5e6),
        norm=RMSNormConfig(eps=1e-6),
        layer_pattern=(LayerSpec(), LayerSpec(), LayerSpec(), nope),
        tie_embeddings=True,
        pad_token_id=128004,
    )
