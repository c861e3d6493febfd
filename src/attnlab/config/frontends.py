"""Inputs other than token ids, `ModelConfig.frontend` (image patches, a patch grid, audio), and
`ModelConfig.stages`, the hierarchical body the patch grid feeds (Swin).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Union

from pydantic import Field, model_validator

from .base import Frozen, Kind, TinySize, _divisors

if TYPE_CHECKING:
    from .model import ModelConfig


class FrontendBase(Kind):
    """Base of the frontends. Each says the `arch` it feeds (a class variable), its `seq_len`
    and a `summary`, and shrinks itself without the model's sizes (`tiny()`)."""

    arch: ClassVar[str]  # the architecture this frontend feeds


class PatchFrontend(FrontendBase):
    """Images as token sequences (Dosovitskiy et al. 2021, arXiv:2010.11929, section 3.1, eq. 1):
    non-overlapping `patch_size` x `patch_size` patches, each linearly projected to d_model, a
    learned class token in front, learned positions added (the class token's included). The
    position table is the frontend's, so the stack's `positional` is "none"
    (src/attnlab/nn/frontends/patches.py)."""

    kind: Literal["patches"] = "patches"
    arch: ClassVar[str] = "encoder"  # the architecture this frontend feeds
    image_size: int = Field(gt=0)  # square images, image_size x image_size pixels
    patch_size: int = Field(gt=0)
    num_channels: int = Field(3, gt=0)

    @model_validator(mode="after")
    def _whole_patches(self) -> PatchFrontend:
        s, p = self.image_size, self.patch_size
        if s % p:
            raise ValueError(
                f"image_size ({s}) must be divisible by patch_size ({p}): the position table has "
                f"one row per whole patch; choose patch_size in {_divisors(s)} or image_size "
                f"{s - s % p} or {s - s % p + p}"
            )
        return self

    @property
    def seq_len(self) -> int:
        """Tokens per image of image_size: one per patch, plus the class token."""
        return (self.image_size // self.patch_size) ** 2 + 1

    @property
    def summary(self) -> str:
        s, p = self.image_size, self.patch_size
        return f"{p}x{p} patches of {s}x{s}x{self.num_channels} images, learned positions"

    def tiny(self, size: TinySize | None = None) -> PatchFrontend:
        """The test size presets.tiny() uses: 32x32 images in 8x8 patches (16 + class token)."""
        return self.merged(image_size=32, patch_size=8)


class AudioFrontend(FrontendBase):
    """Audio as token sequences (Radford et al. 2022, Whisper, arXiv:2212.04356, section 2.2):
    a log-mel spectrogram of `num_mel_bins` channels and 2·`max_source_positions` frames, two
    Conv1d (width 3, strides 1 and 2) with GELU, then Whisper's fixed sinusoids, a frozen table of
    `max_source_positions` rows (src/attnlab/nn/frontends/audio.py). It feeds the encoder of an
    encoder-decoder; the config's `positional` is the decoder's."""

    kind: Literal["audio"] = "audio"
    arch: ClassVar[str] = "encoder-decoder"  # the architecture this frontend feeds
    num_mel_bins: int = Field(80, gt=0)
    max_source_positions: int = Field(1500, gt=0)

    @property
    def seq_len(self) -> int:
        """Encoder tokens per clip: one per two frames."""
        return self.max_source_positions

    @property
    def summary(self) -> str:
        frames, m = 2 * self.max_source_positions, self.num_mel_bins
        return f"{m}-bin log-mel ({frames} frames), 2 conv1d + GELU, sinusoidal positions"

    def tiny(self, size: TinySize | None = None) -> AudioFrontend:
        """The test size presets.tiny() uses: 32 frames (16 encoder tokens), same mel bins."""
        return self.merged(max_source_positions=16)


class PatchGridFrontend(FrontendBase):
    """Images as a grid of patch tokens (Swin, Liu et al. 2021, arXiv:2103.14030, section 3.1):
    `patch_size` x `patch_size` patches, each linearly projected to d_model and normalised, kept
    row-major with their (rows, columns) for the body; no class token, no positions
    (src/attnlab/nn/frontends/patch_grid.py). Feeds `ModelConfig.stages` (Swin)."""

    kind: Literal["patch-grid"] = "patch-grid"
    arch: ClassVar[str] = "encoder"  # the architecture this frontend feeds
    image_size: int = Field(gt=0)  # the square images the model is made for
    patch_size: int = Field(gt=0)
    num_channels: int = Field(3, gt=0)

    @property
    def seq_len(self) -> int:
        """Tokens per image of image_size (the first stage's grid)."""
        return math.ceil(self.image_size / self.patch_size) ** 2

    @property
    def summary(self) -> str:
        s, p = self.image_size, self.patch_size
        return f"{p}x{p} patch grid of {s}x{s}x{self.num_channels} images"

    def tiny(self, size: TinySize | None = None) -> PatchGridFrontend:
        """The test size presets.tiny() uses: 32x32 images in 2x2 patches (a 16x16 grid)."""
        return self.merged(image_size=32, patch_size=2)


Frontend = Annotated[
    Union[PatchFrontend, AudioFrontend, PatchGridFrontend], Field(discriminator="kind")
]


class StagesConfig(Frozen):
    """A hierarchical encoder (Swin, Liu et al. 2021, arXiv:2103.14030, sections 3.1-3.2;
    src/attnlab/nn/swin.py): stage s runs `depths[s]` pre-norm blocks of width d_model·2^s with
    `heads[s]` heads and an FFN of d_ff·2^s; patch merging halves the grid between stages.
    Attention stays inside `window_size` x `window_size` windows with a learned relative
    position bias, the windows shifted by window_size // 2 in every second block of a stage."""

    depths: tuple[Annotated[int, Field(gt=0)], ...] = Field(min_length=1)
    heads: tuple[Annotated[int, Field(gt=0)], ...] = Field(min_length=1)
    window_size: int = Field(gt=0)

    @model_validator(mode="after")
    def _one_per_stage(self) -> StagesConfig:
        if len(self.depths) != len(self.heads):
            raise ValueError(
                f"depths ({list(self.depths)}) and heads ({list(self.heads)}) need one entry per "
                f"stage each: give them the same length"
            )
        return self

    def problems(self, model: ModelConfig) -> list[str]:
        """Swin's network, so the settings its blocks have (one problem per field): the rules a
        model with these stages must keep, collected by ModelConfig like a kind's."""
        st = self
        p: list[str] = []
        if model.n_layers != sum(st.depths) or model.n_heads != st.heads[0]:
            p.append(
                f"n_layers ({model.n_layers}) and n_heads ({model.n_heads}) must be the stages' "
                f"total depth ({sum(st.depths)}) and first heads ({st.heads[0]}): set them so"
            )
        for s, h in enumerate(st.heads):
            if (model.d_model << s) % h:
                p.append(
                    f"stages.heads.{s} ({h}) must divide stage {s}'s width d_model·2^{s} "
                    f"({model.d_model << s}): choose another head count"
                )
        needs = dict(
            frontend=("patch-grid", model.frontend.kind if model.frontend else None),
            attention=("softmax", model.attention.kind),
            sliding_window=(None, model.attention.sliding_window),  # the stages' windows
            qk_norm=(False, model.attention.qk_norm),
            k_bias=(True, getattr(model.attention, "k_bias", True)),  # q, k, v alike in Swin
            scale=(None, model.attention.scale),
            n_kv_heads=(None, model.n_kv_heads),
            head_dim=(None, model.head_dim),
            norm=("layernorm", model.norm.kind),
            ffn=("dense", model.ffn.kind),
            norm_placement=("pre", model.norm_placement),
            residual=("sequential", model.residual),
            final_norm=(True, model.final_norm),
            embedding_norm=(False, model.embedding_norm),
            classifier_pooler=(False, model.classifier_pooler),  # Swin's head: mean, then linear
            layer_pattern=(None, model.layer_pattern),
        )
        for name, (want, got) in needs.items():
            if got != want:
                p.append(
                    f"{name} ({got!r}) must be {want!r} with stages (Swin's blocks, "
                    f"src/attnlab/nn/swin.py): set {name} to {want!r} or drop stages"
                )
        return p
