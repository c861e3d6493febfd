"""Named presets: one function each, citing the paper or model card it follows.

Every preset reproduces its reference architecture exactly; tests/test_presets.py checks each
parameter count against the reference implementation in `transformers` built on the meta device
(no weights). `tiny(cfg)` keeps an architecture and shrinks its sizes for tests.

    import attnlab as al
    al.presets.names()               # every preset
    cfg = al.presets.get("mistral-7b")
    small = al.presets.tiny(cfg)     # d_model 64, 2 layers, same GQA ratio, window, MoE, ...
"""

from __future__ import annotations

import math
from collections.abc import Callable

from .config import (
    GLUFFN,
    ALiBi,
    AttentionConfig,
    AudioFrontend,
    BlockSparseAttentionConfig,
    DenseFFN,
    LayerNormConfig,
    LayerSpec,
    LearnedPositions,
    LongformerAttentionConfig,
    MLAConfig,
    ModelConfig,
    MoEFFN,
    NoPositions,
    PatchFrontend,
    PatchGridFrontend,
    RMSNormConfig,
    RoPE,
    Sinusoidal,
    StagesConfig,
    T5RelativeBias,
    TinySize,
    UnitOffsetRMSNormConfig,
    XLAttentionConfig,
    XLRelative,
    YaRNScaling,
)
from .config.scaling import Llama3Scaling, LongRoPEScaling
from .registry import Registry

PRESETS: Registry[Callable[[], ModelConfig]] = Registry("preset")


def get(name: str) -> ModelConfig:
    return PRESETS.get(name)()


def names() -> list[str]:
    return PRESETS.names()


def source(name: str) -> str:
    """The paper or model card a preset follows (first line of its docstring)."""
    return (PRESETS.get(name).__doc__ or "").strip().splitlines()[0]


# --- 2017: the original encoder-decoder ---------------------------------------------------------


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


# --- encoders -----------------------------------------------------------------------------------


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


@PRESETS.register("vit-base-patch16-224")
def vit_base_patch16_224() -> ModelConfig:
    """Dosovitskiy et al. 2021, arXiv:2010.11929; huggingface.co/google/vit-base-patch16-224 (1000-label classifier)."""
    # ViT-B/16 (Table 1: 12 layers, d 768, MLP 3072, 12 heads), 224x224 RGB images in 196 patches
    # of 16x16 plus a class token; pre-norm with a final LayerNorm (eq. 2-4), no dropout on this
    # card; the ImageNet-1k fine-tuned classifier: one linear map on the class token, no pooler
    # (transformers' ViTForImageClassification, interop/vit.py)
    return ModelConfig(
        arch="encoder",
        vocab_size=0,
        d_model=768,
        n_layers=12,
        n_heads=12,
        d_ff=3072,
        positional=NoPositions(),  # the frontend's learned table
        attention=AttentionConfig(qkv_bias=True, o_bias=True),
        norm=LayerNormConfig(eps=1e-12),
        ffn=DenseFFN(activation="gelu"),
        norm_placement="pre",
        num_labels=1000,
        classifier_pooler=False,
        frontend=PatchFrontend(image_size=224, patch_size=16, num_channels=3),
        init="normal",
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


@PRESETS.register("swin-tiny")
def swin_tiny() -> ModelConfig:
    """Liu et al. 2021, "Swin Transformer", arXiv:2103.14030; huggingface.co/microsoft/swin-tiny-patch4-window7-224 (the backbone, SwinModel)."""
    # Swin-T (section 3.3): C = 96, layer numbers {2, 2, 6, 2}, heads 3·2^s (head dim 32), 7x7
    # windows, MLP ratio 4; 224x224 RGB images in 4x4 patches (a 56x56 grid); q/k/v with
    # biases, pre-norm, a final LayerNorm over the last stage; no absolute positions (the
    # relative bias in each window). The card's classifier is not part of the preset.
    return ModelConfig(
        arch="encoder",
        vocab_size=0,
        d_model=96,
        n_layers=12,
        n_heads=3,
        d_ff=384,
        positional=NoPositions(),
        attention=AttentionConfig(qkv_bias=True, o_bias=True),
        norm=LayerNormConfig(eps=1e-5),
        ffn=DenseFFN(activation="gelu"),
        norm_placement="pre",
        classifier_pooler=False,  # with num_labels: the mean token to one linear map
        frontend=PatchGridFrontend(image_size=224, patch_size=4, num_channels=3),
        stages=StagesConfig(depths=(2, 2, 6, 2), heads=(3, 6, 12, 24), window_size=7),
        init="normal",
    )


# --- decoders -----------------------------------------------------------------------------------


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


def _llama(**sizes) -> ModelConfig:
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
    return _llama(d_model=4096, n_layers=32, n_heads=32)


@PRESETS.register("llama2-70b")
def llama2_70b() -> ModelConfig:
    """Touvron et al. 2023, arXiv:2307.09288 (GQA, 8 KV heads); huggingface.co/meta-llama/Llama-2-70b-hf."""
    return _llama(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672)


@PRESETS.register("qwen2-7b")
def qwen2_7b() -> ModelConfig:
    """Yang et al. 2024, "Qwen2 Technical Report", arXiv:2407.10671; huggingface.co/Qwen/Qwen2-7B."""
    return _llama(
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
    return _llama(
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
    return _llama(
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        attention=AttentionConfig(sliding_window=4096),
    )


@PRESETS.register("mixtral-8x7b")
def mixtral_8x7b() -> ModelConfig:
    """Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088; huggingface.co/mistralai/Mixtral-8x7B-v0.1."""
    return _llama(
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
    return _llama(
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


@PRESETS.register("gemma-2b")
def gemma_2b() -> ModelConfig:
    """Gemma Team 2024, "Gemma", arXiv:2403.08295 (MQA, GeGLU, (1 + w) RMSNorm, embeddings × sqrt(d)); huggingface.co/google/gemma-2b."""
    # Table 1: d_model 2048, 18 layers, 8 query heads and 1 K/V head of 256, feed-forward 32768 =
    # 2 · 16384 (gate and up; config.json's intermediate_size 16384), 256,128 vocabulary entries
    # (config.json's vocab_size 256000, the tokens in use), tied embeddings. Section 2: approximate
    # GeGLU, RMSNorm; the embeddings scaled by sqrt(d_model) in the model dtype and the norm's
    # stored weight w used as 1 + w are transformers' GemmaModel / GemmaRMSNorm.
    return _llama(
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


# --- the decoders of 2024-2025 ------------------------------------------------------------------


def _llama3(**sizes) -> ModelConfig:
    # Llama 3's vocabulary (128,256 tiktoken entries), RoPE base 500,000, and Llama 3.1's
    # scaling to 131,072 positions: low/high frequency factors 1 and 4 around the 8,192 trained
    # (rope_scaling of the cards' config.json; arXiv:2407.21783, section 3.3.1)
    factor = sizes.pop("factor")
    scaling = Llama3Scaling(
        factor=factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=8192
    )
    return _llama(vocab_size=128256, positional=RoPE(base=500000.0, scaling=scaling), **sizes)


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


@PRESETS.register("phi3-mini-4k")
def phi3_mini_4k() -> ModelConfig:
    """Abdin et al. 2024, "Phi-3 Technical Report", arXiv:2404.14219; huggingface.co/microsoft/Phi-3-mini-4k-instruct."""
    # config.json: Llama's layout (section 2: "a similar block structure as Llama-2") at 32
    # layers of 3072, 32 heads of 96, SwiGLU of 8192, the Llama-2 vocabulary plus 64 chat and
    # padding entries (32,064); a 2,047-token sliding window in every layer (sliding_window
    # 2047, as transformers' Phi3 mask reads it); 4,096 positions, no RoPE scaling; untied. The
    # checkpoint stores q/k/v and gate/up fused (qkv_proj, gate_up_proj): same parameters.
    return _llama(
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
    return _llama(
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


@PRESETS.register("qwen3-30b-a3b")
def qwen3_30b_a3b() -> ModelConfig:
    """Yang et al. 2025, "Qwen3 Technical Report", arXiv:2505.09388 (MoE: 128 fine-grained experts, top-8, no shared expert); huggingface.co/Qwen/Qwen3-30B-A3B."""
    # config.json: 48 layers of 2048, 32 query and 4 K/V heads of 128 with qk-norm (as
    # Qwen3-0.6B); every layer sparse (decoder_sparse_step 1, mlp_only_layers []): 128 SwiGLU
    # experts of 768 (moe_intermediate_size; intermediate_size 6144 builds nothing), top-8
    # renormalised (norm_topk_prob true: softmax over the 8 chosen logits, "topk-softmax"),
    # the switch balance loss with router_aux_loss_coef 0.001; RoPE base 1e6, untied.
    return _llama(
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


@PRESETS.register("smollm3-3b")
def smollm3_3b() -> ModelConfig:
    """Hugging Face 2025, "SmolLM3: smol, multilingual, long-context reasoner" (NoPE every 4th layer, Yang et al. 2025, arXiv:2501.18795); huggingface.co/HuggingFaceTB/SmolLM3-3B."""
    # config.json: Llama's layout, 36 layers of 2048, 16 query and 4 K/V heads of 128, SwiGLU of
    # 11008, RoPE base 5e6 for 65,536 positions; no_rope_layer_interval 4: layers 3, 7, 11, ...
    # have no positions at all (no_rope_layers [1, 1, 1, 0] x 9); tied embeddings, the Llama-3
    # vocabulary (128,256), pad 128004.
    nope = LayerSpec(positional=NoPositions())
    return _llama(
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
    return _llama(**{**base, **sizes})


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


@PRESETS.register("olmo2-1b")
def olmo2_1b() -> ModelConfig:
    """OLMo et al. 2024, "2 OLMo 2 Furious", arXiv:2501.00656 (norms after the sublayers, qk-norm over the whole projection); huggingface.co/allenai/OLMo-2-0425-1B."""
    # config.json: 16 layers of 2048, 16 heads of 128, SwiGLU of 8192, RoPE base 500,000 for
    # 4,096 positions, untied, the dolma2 vocabulary padded to 100,352 (pad 100277). Section
    # 3.2: h = x + RMSNorm(Attention(x)), then h + RMSNorm(MLP(h)) (the post-sublayer placement,
    # with a final norm) and an RMSNorm over all of q and all of k before RoPE (eps 1e-6)
    return _llama(
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
    return _llama(
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
    return _llama(
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
    return _llama(
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


# --- encoder-decoders ---------------------------------------------------------------------------


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


def _whisper(d_model: int, n_layers: int, n_heads: int) -> ModelConfig:
    # Radford et al. 2022, section 2.2 and table 1: log-mel 80 x 3000 through two Conv1d + GELU
    # and sinusoids (the audio frontend) into a pre-norm encoder; a decoder with learned
    # positions (448) and the token table tied to its output; GELU MLPs of 4·d_model; biases on
    # q, v and the output projection, none on k (as openai/whisper's model.py)
    return ModelConfig(
        arch="encoder-decoder",
        vocab_size=51865,  # multilingual byte-level BPE
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        d_ff=4 * d_model,
        positional=LearnedPositions(max_len=448),  # the decoder's; the encoder's: the frontend
        attention=AttentionConfig(qkv_bias=True, k_bias=False, o_bias=True),
        norm=LayerNormConfig(eps=1e-5),
        ffn=DenseFFN(activation="gelu"),
        norm_placement="pre",
        pad_token_id=50257,  # <|endoftext|>, as the model card's config.json
        frontend=AudioFrontend(num_mel_bins=80, max_source_positions=1500),
        init="normal",
    )


@PRESETS.register("whisper-tiny")
def whisper_tiny() -> ModelConfig:
    """Radford et al. 2022, "Robust Speech Recognition via Large-Scale Weak Supervision", arXiv:2212.04356; huggingface.co/openai/whisper-tiny."""
    return _whisper(d_model=384, n_layers=4, n_heads=6)


@PRESETS.register("whisper-base")
def whisper_base() -> ModelConfig:
    """Radford et al. 2022, "Robust Speech Recognition via Large-Scale Weak Supervision", arXiv:2212.04356; huggingface.co/openai/whisper-base."""
    return _whisper(d_model=512, n_layers=6, n_heads=8)


# --- test size ----------------------------------------------------------------------------------


def tiny(
    cfg: ModelConfig, d_model: int = 64, n_layers: int = 2, vocab_size: int = 256
) -> ModelConfig:
    """The same architecture at test size: d_model 64, 2 layers, head_dim d_model/4, vocab 256.

    Keeps MHA / MQA / GQA and the GQA group size, the positional scheme (learned tables hold 128
    positions, YaRN/dynamic-NTK original lengths shrink to 32), the FFN kind and its d_ff/d_model
    ratio, MoE top-k with max(4, 2·top_k) experts at most, the sliding window (at most 8, so tests
    see it, in each layer_pattern entry too; Longformer's width at most 12, window 7), norm,
    placement, residual topology, heads and tying; Transformer-XL's memory and segment at most 16
    positions. A layer pattern keeps as many layers as its first layer of each kind needs (a
    NoPE layer 4th in the pattern: 4 layers), and a MoE one sparse layer after its dense ones
    (DeepSeek-V3: 4 layers). A frontend keeps its kind and channels at its own
    test size (`frontend.tiny(size)`: 8x8 patches of 32x32 images, no vocabulary; 32 frames of
    audio for the encoder).
    Staged encoders (Swin) keep two stages of two blocks (n_layers 4), windows of at most 4.
    Each kind shrinks itself (`tiny(size)` of its config class): this function sets the shared
    sizes only.
    """
    head_dim = d_model // 4
    kv = cfg.kv_heads
    if kv == cfg.n_heads:
        heads, kv_heads = 4, 4
    elif kv == 1:
        heads, kv_heads = 4, 1
    else:  # GQA: keep the group size
        heads, kv_heads = 2 * (cfg.n_heads // kv), 2
    ch: dict = dict(
        vocab_size=vocab_size if cfg.vocab_size else 0,  # an image encoder has no token table
        d_model=d_model,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=None if kv_heads == heads else kv_heads,
        head_dim=None if heads * head_dim == d_model else head_dim,
    )
    if cfg.n_decoder_layers is not None:
        ch["n_decoder_layers"] = n_layers
    size = TinySize(d_model=d_model, head_dim=head_dim, full_d_model=cfg.d_model)
    if cfg.d_ff is not None:
        ch["d_ff"] = size.width(cfg.d_ff)
    # each kind knows its test size (Kind.tiny in config/base.py)
    for name in ("positional", "attention", "ffn", "norm"):
        ch[name] = getattr(cfg, name).tiny(size)
    # as many blocks as every kind of FFN block needs (a MoE: a sparse block after its dense
    # ones, DeepSeek-V3: 4)
    ch["n_layers"] = max(ch["n_layers"], cfg.ffn.tiny_layers())
    if cfg.layer_pattern is not None:  # each layer's window at most 8, as the model's
        ch["layer_pattern"] = pattern = [
            s.merged(sliding_window=min(s.sliding_window, 8)) if s.sliding_window else s
            for s in cfg.layer_pattern
        ]
        # enough layers that each kind of layer occurs: SmolLM3's NoPE layer is the 4th,
        # Gemma 3's global layer the 6th
        ch["n_layers"] = max(ch["n_layers"], 1 + max(pattern.index(s) for s in pattern))
    if cfg.n_decoder_layers is not None:  # as deep as the encoder
        ch["n_decoder_layers"] = ch["n_layers"]
    if cfg.pad_token_id is not None and cfg.pad_token_id >= vocab_size:
        ch["pad_token_id"] = 0
    if cfg.frontend is not None:
        ch["frontend"] = cfg.frontend.tiny(size)
    if cfg.stages is not None:  # two stages of two blocks: windows, shifted windows, one merge
        w = min(cfg.stages.window_size, 4)
        ch["stages"] = StagesConfig(depths=(2, 2), heads=(heads, 2 * heads), window_size=w)
        ch["n_layers"] = 4
    return cfg.replace(**ch)


def describe(cfg: ModelConfig) -> str:
    """One line: the components a config uses (each kind's `label`)."""
    kv = cfg.kv_heads
    heads = "MHA" if kv == cfg.n_heads else ("MQA" if kv == 1 else f"GQA({kv})")
    attn = cfg.attention.label(heads)  # "MHA", "longformer MHA", "MLA"
    fields = cfg.attention.to_dict()
    if cfg.attention.qk_norm:  # per head, or over the whole projection (OLMo 2)
        attn += " qk-norm" + (
            " (projection)" if fields.get("qk_norm_scope") == "projection" else ""
        )
    if fields.get("softcap") is not None:  # Gemma 2
        attn += f" softcap {fields['softcap']:g}"
    if fields.get("sinks"):  # GPT-OSS
        attn += " sinks"
    if cfg.layer_pattern is not None:  # "MHA layers [global, window 65 + rope 10000, ...]"
        attn += f" layers {_pattern(cfg)}"
    if cfg.stages is not None:  # "MHA in 7x7 shifted windows, stages [2, 2, 6, 2]"
        w = cfg.stages.window_size
        attn += f" in {w}x{w} shifted windows, stages {list(cfg.stages.depths)}"
    pos = cfg.positional.kind if cfg.frontend is None else cfg.frontend.summary
    if cfg.frontend is not None and cfg.arch == "encoder-decoder":  # the frontend feeds the encoder
        pos += f"; decoder {cfg.positional.kind}"
    pos += _scaling(cfg, "+{}")  # "rope+llama3"
    return (
        f"{cfg.arch}, {pos}, {attn}, {cfg.norm.kind}, {cfg.norm_placement}-norm, "
        f"{cfg.ffn.label}, {', '.join([cfg.residual, *_scales(cfg)])}"
    )


def _scaling(cfg: ModelConfig, words: str) -> str:
    """The RoPE scaling's kind in `words` ("+{}" -> "+llama3"), or "" without one."""
    scaling = cfg.positional.to_dict().get("scaling")
    return words.format(scaling["kind"]) if scaling else ""


def _scales(cfg: ModelConfig) -> list[str]:
    """The model's multipliers and logit cap where set (Granite, Cohere, Gemma 2):
    ["embeddings x12", "residual x0.22", "logits x0.125", "logits capped at 30"]."""
    out = []
    for name, what in (
        ("embedding_multiplier", "embeddings"),
        ("residual_multiplier", "residual"),
        ("logit_multiplier", "logits"),
    ):
        if getattr(cfg, name) != 1.0:
            out.append(f"{what} x{getattr(cfg, name):g}")
    if cfg.final_logit_softcap is not None:
        out.append(f"logits capped at {cfg.final_logit_softcap:g}")
    return out


def _pattern(cfg: ModelConfig) -> str:
    """A layer pattern in a few words: [global, window 65 + rope 10000, ...]; a run of three
    or more equal layers as one entry (Gemma 3: [5 x window 512 + rope 10000, global])."""
    parts: list[list] = []  # [words, run length]
    for spec in cfg.layer_pattern or ():
        part = f"window {spec.sliding_window}" if spec.sliding_window else "global"
        if spec.positional is not None:
            part += f" + {spec.positional.layer_label}"
        if parts and parts[-1][0] == part:
            parts[-1][1] += 1
        else:
            parts.append([part, 1])
    words = [f"{n} x {w}" if n >= 3 else ", ".join([w] * n) for w, n in parts]
    return "[" + ", ".join(words) + "]"


def components_table() -> str:
    """Markdown table, preset x components, generated from the presets (docs/components.md);
    each kind says its own words (`summary`)."""
    head = "| preset | arch | positional | attention | norm | placement | FFN | residual |"
    rows = [head, "|" + "---|" * 8]
    for name in names():
        cfg = get(name)
        pos = cfg.positional.summary
        if cfg.frontend is not None:  # the frontend's positions, not the stack's
            pos = cfg.frontend.summary
            if cfg.arch == "encoder-decoder":  # Whisper: the frontend's are the encoder's
                pos = f"encoder: {pos}; decoder: {cfg.positional.kind}"
        kv = cfg.kv_heads
        heads = "MHA" if kv == cfg.n_heads else ("MQA" if kv == 1 else f"GQA {cfg.n_heads}/{kv}")
        attn = cfg.attention.summary(heads, cfg.n_heads)
        if cfg.layer_pattern is not None:
            attn += f", layers cycle {_pattern(cfg)}"
        if cfg.stages is not None:  # Swin: softmax attention without a window of its own
            st = cfg.stages
            depths = "-".join(map(str, st.depths))
            attn += f", {st.window_size}x{st.window_size} shifted windows, stages {depths}"
        pos += _scaling(cfg, ", {} scaling")
        residual = ", ".join([cfg.residual, *_scales(cfg)])
        rows.append(
            f"| {name} | {cfg.arch} | {pos} | {attn} | {cfg.norm.kind} | {cfg.norm_placement} | {cfg.ffn.summary} | {residual} |"
        )
    return "\n".join(rows)


__all__ = ["PRESETS", "components_table", "describe", "get", "names", "source", "tiny"]
