"""The positional schemes, `ModelConfig.positional`: added to the embeddings (sinusoidal, learned),
rotating q and k (RoPE, its scalings in scaling.py) or biasing the scores (ALiBi, T5, XL), each
with what other kinds' rules ask of it (`biases_scores`, `per_layer`, `supplies_xl_terms`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Union

from pydantic import Field

from .base import Kind, TinySize
from .scaling import RopeScaling

if TYPE_CHECKING:
    from .model import ModelConfig


class PositionalBase(Kind):
    """Base of the positional schemes; what a scheme is, for the rules of other kinds to ask."""

    biases_scores: ClassVar[bool] = False  # adds a bias to the attention scores (ALiBi, T5)
    # acts inside attention, so a LayerSpec may give its layers this scheme of their own
    per_layer: ClassVar[bool] = False
    # supplies R, u and v of Transformer-XL's relative term, for an attention that takes it
    supplies_xl_terms: ClassVar[bool] = False

    def rotary_dim(self, head_dim: int) -> int:
        """Channels of a head of `head_dim` channels that the scheme rotates (0: none)."""
        return 0

    @property
    def summary(self) -> str:
        """The components table's words for it (docs/components.md)."""
        return self.kind

    @property
    def layer_label(self) -> str:
        """describe()'s words for it as a layer's own scheme."""
        return self.kind


class Sinusoidal(PositionalBase):
    """Fixed sin/cos table added to the embeddings (Vaswani et al. 2017, section 3.5).

    layout "interleaved" is the paper's (sin on even channels, cos on odd); "split" puts all sines
    first then all cosines, same frequencies (Marian).
    """

    kind: Literal["sinusoidal"] = "sinusoidal"
    base: float = Field(10000.0, gt=1)
    layout: Literal["interleaved", "split"] = "interleaved"

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        p = []
        if model.d_model % 2:
            p.append(
                f"d_model ({model.d_model}) must be even for sinusoidal positions (sin/cos pairs): change d_model"
            )
        return p


class LearnedPositions(PositionalBase):
    """A learned table of absolute positions added to the embeddings (BERT, GPT-2, BART).

    `offset` shifts every position id into the table (BART and RoBERTa reserve the first 2 rows),
    so the usable length is `max_len - offset`.
    """

    kind: Literal["learned"] = "learned"
    max_len: int = Field(gt=0)
    offset: int = Field(0, ge=0)

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        p = []
        if self.offset >= self.max_len:
            p.append(
                f"{where}.offset ({self.offset}) must be smaller than {where}.max_len "
                f"({self.max_len}): raise max_len"
            )
        return p

    def tiny(self, size: TinySize) -> LearnedPositions:
        """128 positions after the offset."""
        return self.merged(max_len=128 + self.offset)


class RoPE(PositionalBase):
    """Rotary position embedding (Su et al. 2021, arXiv:2104.09864): rotate q and k.

    `layout` "half" rotates channel i with i + d/2 (GPT-NeoX, Llama in HF); "interleaved" rotates
    pairs (2i, 2i+1) (the paper, Meta's Llama code, GPT-J). `fraction` < 1 rotates only the first
    channels of each head (GPT-NeoX rotary_pct).
    """

    kind: Literal["rope"] = "rope"
    per_layer: ClassVar[bool] = True
    base: float = Field(10000.0, gt=1)
    layout: Literal["half", "interleaved"] = "half"
    fraction: float = Field(1.0, gt=0, le=1)
    scaling: RopeScaling | None = None

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.fraction)

    @property
    def summary(self) -> str:
        return self.kind if self.fraction == 1 else f"rope ({self.fraction:.0%} of dims)"

    @property
    def layer_label(self) -> str:  # a layer's own RoPE differs by its base
        return f"rope {self.base:g}"

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        rot, p = self.rotary_dim(model.attention.rope_head_dim(model.attn_head_dim)), []
        if rot < 2 or rot % 2:
            p.append(
                f"{where}.fraction ({self.fraction}) of head_dim ({model.attn_head_dim}) "
                f"gives {rot} rotary channels; RoPE rotates pairs, so it must be an even "
                f"number >= 2: adjust fraction or head_dim"
            )
        elif self.scaling is not None and rot < self.scaling.min_rotary_dim:
            p.append(
                f"{where}.scaling ({self.scaling.kind!r}) needs at least "
                f"{self.scaling.min_rotary_dim} rotary channels, got {rot}: raise "
                f"{where}.fraction or head_dim"
            )
        elif self.scaling is not None:
            p += self.scaling.rotary_problems(rot, f"{where}.scaling")
        return p

    def tiny(self, size: TinySize) -> RoPE:
        if self.scaling is None:
            return self
        scaling = self.scaling.tiny(size).fitted(self.rotary_dim(size.head_dim))
        return self.merged(scaling=scaling)


class ALiBi(PositionalBase):
    """Attention with linear biases (Press et al. 2022, arXiv:2108.12409): -slope·distance."""

    kind: Literal["alibi"] = "alibi"
    biases_scores: ClassVar[bool] = True
    per_layer: ClassVar[bool] = True


class T5RelativeBias(PositionalBase):
    """T5's learned relative-position bias (Raffel et al. 2020, section 2.1), log-spaced buckets,
    one table per stack shared by all its layers."""

    kind: Literal["t5-relative"] = "t5-relative"
    biases_scores: ClassVar[bool] = True
    per_layer: ClassVar[bool] = True
    num_buckets: int = Field(32, ge=4)
    max_distance: int = Field(128, gt=1)

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        p = []
        if self.max_distance <= self.num_buckets // 2:
            p.append(
                f"{where}.max_distance ({self.max_distance}) must exceed num_buckets // 2 "
                f"({self.num_buckets // 2}), where the log-spaced buckets start: raise max_distance"
            )
        return p


class NoPositions(PositionalBase):
    """No positional information (NoPE; a causal mask alone still orders tokens)."""

    kind: Literal["none"] = "none"
    per_layer: ClassVar[bool] = True


class XLRelative(PositionalBase):
    """Transformer-XL's relative positions (Dai et al. 2019, arXiv:1901.02860, section 3.3):
    scores (q + u)·k + (q + v)·W_R R_{i−j}, R a [sin, cos] sinusoid of the offset with wavelength
    `base`, u and v learned (n_heads, head_dim) biases shared by every layer (the paper), or one
    pair per layer with `per_layer_uv` (transformers' untie_r). Needs attention.kind 'xl', which
    holds W_R (src/attnlab/nn/positional/xl_relative.py)."""

    kind: Literal["xl-relative"] = "xl-relative"
    supplies_xl_terms: ClassVar[bool] = True
    base: float = Field(10000.0, gt=1)
    per_layer_uv: bool = False

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        p = []
        if not model.attention.takes_xl_terms:
            p.append(
                f"{where} 'xl-relative' needs attention.kind 'xl' (got "
                f"{model.attention.kind!r}): its term (q + v)·W_R R uses each layer's query and "
                f"W_R; set attention {{'kind': 'xl', 'mem_len': N}}"
            )
        if model.d_model % 2:
            p.append(
                f"d_model ({model.d_model}) must be even for {where} 'xl-relative' (R's sin/cos "
                f"pairs): change d_model"
            )
        return p


Positional = Annotated[
    Union[Sinusoidal, LearnedPositions, RoPE, ALiBi, T5RelativeBias, NoPositions, XLRelative],
    Field(discriminator="kind"),
]
