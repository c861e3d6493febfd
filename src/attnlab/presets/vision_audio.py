"""Models whose input is not tokens: the vision encoders ViT and Swin (patches, Swin's shifted
windows in stages) and Whisper's speech encoder-decoder (log-mel frames)."""

from __future__ import annotations

from ..config import (
    AttentionConfig,
    AudioFrontend,
    DenseFFN,
    LayerNormConfig,
    LearnedPositions,
    ModelConfig,
    NoPositions,
    PatchFrontend,
    PatchGridFrontend,
    StagesConfig,
)
from .base import PRESETS


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
