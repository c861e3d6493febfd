"""The config tree: every architectural choice as data.

A `ModelConfig` is a tree of small frozen pydantic models, one sub-config per component kind.
Kinds that grow (positional schemes, attention, FFNs, norms, RoPE scaling, frontends) are tagged
unions keyed by `kind`, so a RoPE-only field can never sit on an ALiBi model. Every difference in
behaviour is a named field; nothing is inferred from a model's name. Derived sizes (`head_dim`,
`kv_heads`, `ffn_dim`, ...) are read in one place: the properties at the bottom of `ModelConfig`.

Each member of a union is a `Kind` (under its union's base: `PositionalBase`, `AttentionBase`,
`FFNBase`, `NormBase`, `ScalingBase`, `FrontendBase`) and carries what is particular to it: its
cross-field rules (`problems(model, where)`), its test size (`tiny(size)`, for presets.tiny), the
sizes it derives (`rotary_dim`, `rope_head_dim`, `hidden_dim`) and its words for the preset
tables. What other kinds' rules need to know about it is a declared class variable
(`biases_scores`, `per_layer`, ...), never a test of its class; so `ModelConfig` only collects,
and adding a kind is its class and its name in the union.

Invalid configs fail at construction with *every* problem at once, each naming the field, the
value, the rule and the fix; the exception is `ConfigError` (a `ValueError`). This module does not
import torch.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import did_you_mean, problem_list

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "GLUFFN",
    "ALiBi",
    "AttentionBase",
    "AttentionConfig",
    "AudioFrontend",
    "BlockSparseAttentionConfig",
    "ConfigError",
    "DenseFFN",
    "DynamicNTKScaling",
    "FFNBase",
    "FrontendBase",
    "Kind",
    "LayerNormConfig",
    "LayerSpec",
    "LearnedPositions",
    "LinearAttentionConfig",
    "LinearScaling",
    "LongformerAttentionConfig",
    "MLAConfig",
    "MoEFFN",
    "ModelConfig",
    "NTKScaling",
    "NoPositions",
    "NormBase",
    "PatchFrontend",
    "PositionalBase",
    "RMSNormConfig",
    "RoPE",
    "ScalingBase",
    "Sinusoidal",
    "T5RelativeBias",
    "TinySize",
    "UnitOffsetRMSNormConfig",
    "XLAttentionConfig",
    "XLRelative",
    "YaRNScaling",
]


class ConfigError(ValueError):
    """An invalid config; `problems` lists each one (field, value, rule, fix)."""

    def __init__(self, title: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(problem_list(title, problems))


def _fields_at(model: Any, loc: tuple) -> list[str]:
    """The field names of the node at `loc` below pydantic model `model` (union members are
    picked by the tag pydantic puts in the path); [] when the path cannot be followed."""
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
        if part in model.model_fields:
            model = model.model_fields[part].annotation
            continue
        members = [m for m in get_args(model) if isinstance(m, type)]  # Optional / Union
        for arg in get_args(model):
            members += [m for m in get_args(arg) if isinstance(m, type)]  # Annotated[Union]
        match = [m for m in members if issubclass(m, BaseModel) and m.model_fields.get("kind")]
        match = [m for m in match if m.model_fields["kind"].default == part]
        if not match:
            return []
        model = match[0]
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def validation_problems(
    err: ValidationError,
    what: str = "field",
    sep: str = ".",
    root: str = "config",
    model: Any = None,
) -> list[str]:
    """pydantic's errors as problem lines (field, value, rule, fix); a closed set of values gets a
    did-you-mean. Used for configs and, with what="key" and sep=": ", for recipes."""
    out = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        ctx = e.get("ctx", {})
        inner = ctx.get("error")
        if isinstance(inner, ConfigError):  # a nested node's own report: keep its lines, add path
            out += [f"{where}{sep}{line}" if where else line for line in inner.problems]
        elif e["type"] == "value_error":  # our rule messages already name field, value and fix
            msg = str(inner) if inner is not None else e["msg"]
            out += [f"{where}{sep}{m}" if where and sep != "." else m for m in msg.splitlines()]
        elif e["type"] == "missing":
            out.append(f"{where}: required {what} is missing (set it)")
        elif e["type"] == "extra_forbidden":
            known = _fields_at(model, e["loc"][:-1]) if model is not None else []
            hint = did_you_mean(e["loc"][-1], known)
            out.append(f"{where}: unknown {what} (remove it or check its spelling).{hint}")
        else:
            allowed = re.findall(r"'([^']*)'", ctx.get("expected", ctx.get("expected_tags", "")))
            value = ctx.get("tag", e.get("input"))
            hint = did_you_mean(value, allowed) if allowed else ""
            out.append(f"{where or root} = {e.get('input')!r}: {e['msg']}.{hint}".rstrip("."))
    return out


class Frozen(BaseModel):
    """Base of every config node: immutable, no unknown keys, errors raised as ConfigError."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            problems = validation_problems(err, model=type(self))
            raise ConfigError(type(self).__name__, problems) from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(cls.__name__, validation_problems(err, model=cls)) from None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def replace(self, **changes: Any):
        """A validated copy with some top-level fields changed (sub-configs as objects or dicts)."""
        data = self.model_dump(mode="json")
        for key, value in changes.items():
            data[key] = value.to_dict() if isinstance(value, Frozen) else value
        return type(self).from_dict(data)

    def merged(self, **changes: Any):
        """A validated copy with `changes` deep-merged: `attention={"dropout": 0.0}` changes that
        field only (replace() would swap in a whole new sub-config with defaults elsewhere)."""
        over = {k: v.to_dict() if isinstance(v, Frozen) else v for k, v in changes.items()}
        return type(self).from_dict(merge_dicts(self.to_dict(), over))


def merge_dicts(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep merge of config data; a sub-config whose `kind` changes is replaced, not merged."""
    out = dict(base)
    for k, v in over.items():
        b = out.get(k)
        if (
            isinstance(b, dict)
            and isinstance(v, dict)
            and v.get("kind", b.get("kind")) == b.get("kind")
        ):
            out[k] = merge_dicts(b, v)
        else:
            out[k] = v
    return out


# --- kinds: the members of the tagged unions ----------------------------------------------------


@dataclass(frozen=True)
class TinySize:
    """The test size `presets.tiny` shrinks a model to, handed to every kind's `tiny`."""

    d_model: int  # the test model's width
    head_dim: int  # the test model's head width
    full_d_model: int  # the width of the model being shrunk

    def width(self, n: int) -> int:
        """A hidden width `n` of the full model at test size: its ratio to d_model kept, rounded
        to a multiple of 8 (at least 8)."""
        return 8 * max(1, round(n / self.full_d_model * self.d_model / 8))


class Kind(Frozen):
    """A member of a tagged union (a positional scheme, an attention, an FFN, ...). It holds what
    is particular to it: the cross-field rules it sets on the model it sits in and its test size.
    `ModelConfig` and `presets.tiny` only ask each kind, so adding one edits neither; a rule that
    concerns two kinds sits with one of them and asks the other a declared property (a class
    variable of its union's base), never its class."""

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        """This kind's rules on `model` (its own fields' rules are validators), each message
        opening with `where`, the node's place in the config ("positional", "layer_pattern.0.
        positional", ...). A kind without such rules has none ([])."""
        return []

    def tiny(self, size: TinySize) -> Self:
        """This node at test size (`presets.tiny`); unchanged unless the kind has sizes of its own."""
        return self


def _union_kinds(union: Any) -> list[Any]:
    """The member classes of an Annotated[Union[...], discriminator] config union."""
    return list(get_args(get_args(union)[0]))


# --- positional schemes -------------------------------------------------------------------------


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


class ScalingBase(Kind):
    """Base of RoPE's scalings."""

    # rotary channels the scaling needs: NTK's exponent d/(d-2) is undefined at d = 2
    min_rotary_dim: ClassVar[int] = 2


class _OriginalLength(ScalingBase):
    """A scaling with `original_max_len`, the length the model was trained at: at most 32 at
    test size. (Each subclass declares the field itself, so serialised configs keep its place.)"""

    def tiny(self, size: TinySize) -> Self:
        return self.merged(original_max_len=min(self.original_max_len, 32))


class LinearScaling(ScalingBase):
    """Position interpolation (Chen et al. 2023, arXiv:2306.15595): positions divided by factor."""

    kind: Literal["linear"] = "linear"
    factor: float = Field(gt=0)


class NTKScaling(ScalingBase):
    """NTK-aware scaling (bloc97, 2023): base multiplied by factor^(d/(d-2))."""

    kind: Literal["ntk"] = "ntk"
    min_rotary_dim: ClassVar[int] = 4
    factor: float = Field(gt=0)


class DynamicNTKScaling(_OriginalLength):
    """Dynamic NTK: the NTK base grows with the current length once it exceeds the original."""

    kind: Literal["dynamic-ntk"] = "dynamic-ntk"
    min_rotary_dim: ClassVar[int] = 4
    factor: float = Field(gt=0)
    original_max_len: int = Field(gt=0)


class YaRNScaling(_OriginalLength):
    """YaRN (Peng et al. 2023, arXiv:2309.00071): per-frequency ramp between interpolation and
    extrapolation plus an attention temperature 0.1·ln(factor)+1 folded into cos/sin."""

    kind: Literal["yarn"] = "yarn"
    factor: float = Field(gt=1)
    original_max_len: int = Field(gt=0)
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)
    # multiplies cos and sin; None: the paper's 0.1·ln(factor)+1. DeepSeek-V2 sets it from its
    # mscale / mscale_all_dim (their ratio of 0.1·m·ln(factor)+1 terms: 1.0 when they are equal)
    attention_factor: float | None = Field(None, gt=0)


RopeScaling = Annotated[
    Union[LinearScaling, NTKScaling, DynamicNTKScaling, YaRNScaling], Field(discriminator="kind")
]


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
        return p

    def tiny(self, size: TinySize) -> RoPE:
        return self if self.scaling is None else self.merged(scaling=self.scaling.tiny(size))


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

# --- attention, norm, FFN -----------------------------------------------------------------------


class AttentionBase(Kind):
    """Base of the attention kinds; what a kind is, for the rules of other kinds to ask."""

    per_layer: ClassVar[bool] = False  # layer_pattern may vary its window and positions per layer
    # computes Transformer-XL's relative term with its own W_R, from 'xl-relative' positions
    takes_xl_terms: ClassVar[bool] = False

    def rope_head_dim(self, head_dim: int) -> int:
        """Channels of each head that RoPE acts on, given the model's head_dim: all of them."""
        return head_dim

    # --- in words: presets.describe and presets.components_table (docs/components.md) ---

    def label(self, heads: str) -> str:
        """describe()'s name for it, given the head layout ("MHA", "GQA(8)"): "linear MHA"."""
        return f"{self.kind} {heads}"

    def summary(self, heads: str, n_heads: int) -> str:
        """The components table's cell, given the head layout ("GQA 32/8") and the head count."""
        return f"{heads}{', qk-norm' if self.qk_norm else ''}{self._table_note()}"

    def _table_note(self) -> str:
        w = self.sliding_window
        return f", window {w}" if w else ""


class AttentionConfig(AttentionBase):
    """Multi-head softmax attention (Vaswani et al. 2017, 3.2); MQA/GQA come from
    ModelConfig.n_kv_heads. The default `attention`; a dict without `kind` means this one.

    scale None means 1/sqrt(head_dim); T5 folds it into its init and uses 1.0.
    sliding_window: each query sees itself and the window-1 tokens before it (Mistral); for a
    bidirectional stack, tokens within window-1 on either side (Longformer's local attention).
    """

    kind: Literal["softmax"] = "softmax"
    per_layer: ClassVar[bool] = True
    qkv_bias: bool = False
    # with qkv_bias, False drops the key projection's bias only (Whisper): it adds q·b_k, the
    # same for every key of a query, which softmax cancels, so it is a parameter that does nothing
    k_bias: bool = True
    o_bias: bool = False
    qk_norm: bool = False
    scale: float | None = Field(None, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    sliding_window: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _k_bias_needs_qkv_bias(self) -> AttentionConfig:
        if not self.k_bias and not self.qkv_bias:
            raise ValueError(
                "k_bias (False) drops the key bias of qkv_bias, which is False: there is no "
                "bias to drop; remove k_bias"
            )
        return self

    def label(self, heads: str) -> str:
        return heads  # the default attention goes by its heads alone

    def tiny(self, size: TinySize) -> AttentionConfig:
        """A window of at most 8 tokens, so tests see it."""
        w = self.sliding_window
        return self if w is None else self.merged(sliding_window=min(w, 8))


FeatureMap = Literal["elu+1", "relu"]

# softmax-only fields, with why linear attention has no use for them
_NOT_LINEAR = {
    "scale": "the feature map replaces exp(q·k·scale); there is no score to scale",
    "dropout": "no attention weights are formed, so none can be dropped (ModelConfig.dropout "
    "still applies to the residual branches)",
    "sliding_window": "its running state summarises the whole prefix; it has no window",
}


class LinearAttentionConfig(AttentionBase):
    """Linear attention (Katharopoulos et al. 2020, arXiv:2006.16236, "Transformers are RNNs"):
    softmax(q·k) replaced by φ(q)·φ(k), so a causal decoder keeps a (D, D) running state instead
    of a growing KV cache. `feature_map` φ: "elu+1" (the paper's, 3.2.1) or "relu". Same
    projections as softmax attention (qkv_bias, o_bias, qk_norm); positions: RoPE rotates q and k
    before φ, sinusoidal / learned add to the embeddings; score biases (ALiBi, T5) are refused.
    """

    kind: Literal["linear"] = "linear"
    feature_map: FeatureMap = "elu+1"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    @model_validator(mode="before")
    @classmethod
    def _softmax_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            wrong = [
                f"{k} ({data[k]!r}) is for softmax attention only: {why}: remove it"
                for k, why in _NOT_LINEAR.items()
                if k in data
            ]
            if wrong:
                raise ConfigError(cls.__name__, wrong)
        return data

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        pos, p = model.positional, []
        if pos.biases_scores:
            p.append(
                f"positional ({pos.kind!r}) adds a bias to the attention scores, which "
                f"{where}.kind 'linear' never forms: use positional 'rope', 'sinusoidal', "
                f"'learned' or 'none', or {where}.kind 'softmax'"
            )
        return p

    @property
    def sliding_window(self) -> None:
        """Always None: the stack asks every attention config for its window."""
        return None


class LongformerAttentionConfig(AttentionBase):
    """Longformer attention (Beltagy et al. 2020, arXiv:2004.05150, section 3.1): a sliding
    window plus global tokens, chosen at run time (`global_attention_mask` of the encoder's
    forward). A global token sees every token and every token sees it; global rows use their own
    q/k/v projections (section 3.1, "Linear Projections for Global Attention").

    attention_window: transformers' even window width W, |q - k| <= W / 2; the mask's window is
    the derived `sliding_window` = W / 2 + 1 (MaskSpec counts |q - k| < window). One width for
    the whole stack: transformers allows one per layer, which is not modelled.
    """

    kind: Literal["longformer"] = "longformer"
    attention_window: int = Field(gt=0)
    qkv_bias: bool = True
    o_bias: bool = True
    qk_norm: bool = False
    scale: float | None = Field(None, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _even(self) -> LongformerAttentionConfig:
        if self.attention_window % 2:
            w = self.attention_window
            raise ValueError(
                f"attention_window ({w}) must be even: it spans W / 2 tokens on each side "
                f"(transformers' rule); use {w - 1} or {w + 1}"
            )
        return self

    @property
    def sliding_window(self) -> int:
        """The mask's window: |q - k| <= attention_window / 2 is |q - k| < W / 2 + 1."""
        return self.attention_window // 2 + 1

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        pos, p = model.positional, []
        if pos.biases_scores:
            p.append(
                f"positional ({pos.kind!r}) biases the scores of every row, and "
                f"{where}.kind 'longformer' computes its global rows apart, where no bias "
                f"is evaluated: use positional 'learned', 'sinusoidal', 'rope' or 'none'"
            )
        if model.arch != "encoder":
            p.append(
                f"{where}.kind 'longformer' needs arch 'encoder' (got {model.arch!r}): its "
                f"global tokens see the whole sequence, which a causal stack cannot; use "
                f"{where}.kind 'softmax' with sliding_window for a windowed decoder"
            )
        return p

    def _table_note(self) -> str:  # transformers' width W
        return f", longformer window {self.attention_window} + global tokens"

    def tiny(self, size: TinySize) -> LongformerAttentionConfig:
        """A width W of at most 12: a window W / 2 + 1 of at most 7."""
        return self.merged(attention_window=min(self.attention_window, 12))


class BlockSparseAttentionConfig(AttentionBase):
    """BigBird's block-sparse attention (Zaheer et al. 2020, arXiv:2007.14062, section 2, "ITC"),
    as transformers computes it: blocks of `block_size` tokens; each query block sees a 3-block
    window, the first and last blocks and `num_random_blocks` random blocks per head, and the
    first and last query blocks see everything (src/attnlab/nn/attention/block_sparse.py lists
    every way transformers differs from the paper). Sequences of at most
    (5 + 2·num_random_blocks)·block_size tokens use full attention, as transformers does.

    dropout: on the weights of that full-attention fallback only (transformers' block-sparse path
    has none). seed: added to each layer's index, which seeds transformers' training-mode plan.
    legacy_plan_len: transformers' max_position_embeddings, the length of the plan it draws from
    for sequences of 1024, 3072 and 4096 tokens in training mode.
    """

    kind: Literal["block-sparse"] = "block-sparse"
    block_size: int = Field(64, gt=0)
    num_random_blocks: int = Field(3, ge=0)
    seed: int = Field(0, ge=0)
    legacy_plan_len: int = Field(4096, gt=0)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    scale: float | None = Field(None, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)

    @property
    def sliding_window(self) -> None:
        """Always None: the window is the pattern's, not the stack's mask."""
        return None

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        p = []
        if model.arch != "encoder":
            p.append(
                f"{where}.kind 'block-sparse' needs arch 'encoder' (got {model.arch!r}): its "
                f"global and random blocks look both ways and it keeps no cache (transformers' "
                f"BigBird decoder falls back to full attention); use {where}.kind 'softmax'"
            )
        return p

    def _table_note(self) -> str:
        return f", block-sparse: blocks of {self.block_size}, {self.num_random_blocks} random"


class _NoWindowNoQKNorm:
    """For attention kinds without a window or qk-norm fields: the stack, tiny() and the preset
    tables ask every attention config for both. (MLA normalises its latents inside the layer,
    Transformer-XL no heads; the memory, not a window, bounds what an XL query sees.)"""

    @property
    def sliding_window(self) -> None:
        return None

    @property
    def qk_norm(self) -> bool:
        return False


class MLAConfig(_NoWindowNoQKNorm, AttentionBase):
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, section 2.1): keys and values
    are decompressed from one shared latent of `kv_lora_rank` channels per token, and a small
    decoupled key of `qk_rope_head_dim` channels, shared by all heads, carries RoPE. A decoder
    caches only those two (src/attnlab/cache/latent.py), not per-head K/V.

    Each head's query/key is [nope (qk_nope_head_dim); rope (qk_rope_head_dim)] and its value
    has v_head_dim channels; q_lora_rank None projects q directly (V2-Lite), else through its own
    low-rank latent (V2). bias: on the down projections and o_proj (attention_bias). scale None:
    1/sqrt(qk_nope_head_dim + qk_rope_head_dim). latent_norm_eps: the RMSNorms on the latents.
    ModelConfig.n_kv_heads and head_dim do not apply (src/attnlab/nn/attention/mla.py).
    """

    kind: Literal["mla"] = "mla"
    kv_lora_rank: int = Field(gt=0)
    q_lora_rank: int | None = Field(None, gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    bias: bool = False
    scale: float | None = Field(None, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    latent_norm_eps: float = Field(1e-6, gt=0)

    def rope_head_dim(self, head_dim: int) -> int:
        """Only the decoupled rope part of each head rotates."""
        return self.qk_rope_head_dim

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        """MLA sizes its heads itself and has no per-head K/V to share or cross-attend with."""
        p = []
        if model.n_kv_heads not in (None, model.n_heads):
            p.append(
                f"n_kv_heads ({model.n_kv_heads}) must be unset with {where}.kind 'mla': every "
                f"head decompresses its own K/V from the shared latent; remove n_kv_heads"
            )
        if model.head_dim is not None:
            p.append(
                f"head_dim ({model.head_dim}) does not apply to {where}.kind 'mla': set "
                f"{where}.qk_nope_head_dim, qk_rope_head_dim and v_head_dim; remove head_dim"
            )
        if model.arch == "encoder-decoder":
            p.append(
                f"{where}.kind 'mla' has no cross-attention form: use arch 'decoder' (DeepSeek) "
                f"or 'encoder'"
            )
        return p

    def label(self, heads: str) -> str:
        return "MLA"  # no K/V heads to count: one shared latent

    def summary(self, heads: str, n_heads: int) -> str:  # no per-head K/V cached
        return f"MLA {n_heads} heads, latent {self.kv_lora_rank}"

    def tiny(self, size: TinySize) -> MLAConfig:
        """Latents of 32, heads of the test head_dim (its rope part half of it)."""
        d = size.head_dim
        # an explicit scale keeps its YaRN factor: rescaled from the full qk width to 1.5·d
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.merged(
            scale=None if self.scale is None else self.scale * (qk / (d * 1.5)) ** 0.5,
            kv_lora_rank=32,
            q_lora_rank=None if self.q_lora_rank is None else 32,
            qk_nope_head_dim=d,
            qk_rope_head_dim=d // 2,
            v_head_dim=d,
        )


class XLAttentionConfig(_NoWindowNoQKNorm, AttentionBase):
    """Transformer-XL attention (Dai et al. 2019, arXiv:1901.02860, sections 3.2-3.3): softmax
    attention with the 'xl-relative' position term (this layer's W_R, no projection biases),
    over a memory of earlier segments: the `memory` cache kind keeps the K/V of the last
    `mem_len` positions, detached (src/attnlab/cache/memory.py), and a segment ends after
    `segment_len` tokens (the paper's tgt_len; None: after every forward call). Both are the
    defaults of `model.new_cache`, which a caller may override; no parameter depends on them.
    dropout: on the attention weights (the original code's dropatt)."""

    kind: Literal["xl"] = "xl"
    takes_xl_terms: ClassVar[bool] = True
    mem_len: int = Field(ge=0)
    segment_len: int | None = Field(None, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        p = []
        if not model.positional.supplies_xl_terms:
            p.append(
                f"{where}.kind 'xl' needs positional 'xl-relative' (got "
                f"{model.positional.kind!r}), which supplies R, u and v: set positional "
                f"{{'kind': 'xl-relative'}}"
            )
        if model.arch != "decoder":  # the scheme alone is refused above: this is the pair's rule
            p.append(
                f"Transformer-XL ({where}.kind 'xl') needs arch 'decoder' (got {model.arch!r}): "
                f"its memory holds earlier segments of one causal stream, and it has no "
                f"cross-attention form"
            )
        return p

    def _table_note(self) -> str:  # relative scores over a memory
        return f", XL relative, memory {self.mem_len}, segment {self.segment_len}"

    def tiny(self, size: TinySize) -> XLAttentionConfig:
        """Memory and segment of at most 16 positions."""
        seg = self.segment_len
        return self.merged(
            mem_len=min(self.mem_len, 16), segment_len=None if seg is None else min(seg, 16)
        )


AttentionKind = Annotated[
    Union[
        AttentionConfig,
        LinearAttentionConfig,
        LongformerAttentionConfig,
        BlockSparseAttentionConfig,
        MLAConfig,
        XLAttentionConfig,
    ],
    Field(discriminator="kind"),
]


class NormBase(Kind):
    """Base of the norm kinds."""


class LayerNormConfig(NormBase):
    """LayerNorm (Ba et al. 2016, arXiv:1607.06450); `bias` False drops the shift (MPT, OLMo)."""

    kind: Literal["layernorm"] = "layernorm"
    eps: float = Field(1e-5, gt=0)
    bias: bool = True


class RMSNormConfig(NormBase):
    """RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467): scale only, no mean, no bias."""

    kind: Literal["rmsnorm"] = "rmsnorm"
    eps: float = Field(1e-6, gt=0)


class UnitOffsetRMSNormConfig(NormBase):
    """RMSNorm with its gain stored as an offset from 1, x / rms(x) · (1 + w), the weight applied
    in fp32 before the cast back (Gemma, arXiv:2403.08295; src/attnlab/nn/norms_offset.py)."""

    kind: Literal["rmsnorm-unit-offset"] = "rmsnorm-unit-offset"
    eps: float = Field(1e-6, gt=0)


NormConfig = Annotated[
    Union[LayerNormConfig, RMSNormConfig, UnitOffsetRMSNormConfig], Field(discriminator="kind")
]


Activation = Literal["relu", "gelu", "gelu-tanh", "silu"]


class FFNBase(Kind):
    """Base of the FFN kinds."""

    @property
    def dense(self) -> DenseFFN | GLUFFN:
        """The FFN each token goes through: this one (an MoE: its expert)."""
        return self  # type: ignore[return-value]  # DenseFFN and GLUFFN; MoEFFN overrides it

    def hidden_dim(self, d_model: int) -> int:
        """The hidden width when ModelConfig.d_ff is None (of each expert for MoE): 4·d_model,
        the paper's."""
        return 4 * d_model

    @property
    def label(self) -> str:
        """describe()'s name for it."""
        return self.kind

    @property
    def summary(self) -> str:
        """The components table's words for it (docs/components.md)."""
        return f"{self.kind} {self.dense.activation}"


class DenseFFN(FFNBase):
    """Two linear maps with an activation between (Vaswani et al. 2017, 3.3)."""

    kind: Literal["dense"] = "dense"
    activation: Activation = "relu"
    bias: bool = True


class GLUFFN(FFNBase):
    """Gated linear unit FFN (Shazeer 2020, arXiv:2002.05202): down(act(gate(x)) * up(x)).
    activation "silu" is SwiGLU, "gelu"/"gelu-tanh" is GeGLU. With ModelConfig.d_ff None the
    hidden size is 2/3·4·d_model rounded up to a multiple of `multiple_of` (Llama)."""

    kind: Literal["glu"] = "glu"
    activation: Activation = "silu"
    bias: bool = False
    multiple_of: int = Field(256, gt=0)

    def hidden_dim(self, d_model: int) -> int:
        """Llama's: 2/3 of 4·d keeps the parameter count of a dense FFN."""
        return self.multiple_of * math.ceil(8 * d_model / 3 / self.multiple_of)

    def tiny(self, size: TinySize) -> GLUFFN:
        """Rounded to multiples of 16."""
        return self.merged(multiple_of=16)


class MoEFFN(FFNBase):
    """Sparse mixture of experts (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral).

    routing "topk-softmax": softmax over the k selected logits (Mixtral; equal to HF's
    softmax -> top-k -> renormalise). "softmax-topk": softmax over all experts, keep the top k
    probabilities unnormalised (Switch, Qwen-MoE with norm_topk_prob=False, DeepSeekMoE).
    The load-balancing loss (`balance_loss`) times `aux_loss_coef` is returned in
    ModelOutput.aux_loss: "switch" over the whole batch (Switch eq. 4), "sequence" per sequence
    and divided by top_k, DeepSeek-V2's expert-level loss (arXiv:2405.04434, eq. 23-25).

    DeepSeek's routing (src/attnlab/nn/ffn/moe.py): `routed_scale` multiplies the routed
    experts' weights (routed_scaling_factor); n_groups > 1 limits each token to the experts of
    its `top_k_groups` best groups, a group scored by its best expert (group_limited_greedy);
    the first `dense_layers` blocks of a stack get one dense FFN of width `dense_d_ff` (None:
    the experts' d_ff) instead of experts (first_k_dense_replace).
    """

    kind: Literal["moe"] = "moe"
    expert: Annotated[Union[DenseFFN, GLUFFN], Field(discriminator="kind")] = GLUFFN()
    n_experts: int = Field(gt=0)
    top_k: int = Field(2, gt=0)
    routing: Literal["topk-softmax", "softmax-topk"] = "topk-softmax"
    n_shared_experts: int = Field(0, ge=0)
    aux_loss_coef: float = Field(0.01, ge=0)
    balance_loss: Literal["switch", "sequence"] = "switch"
    routed_scale: float = Field(1.0, gt=0)
    n_groups: int = Field(1, gt=0)
    top_k_groups: int = Field(1, gt=0)
    dense_layers: int = Field(0, ge=0)
    dense_d_ff: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _groups(self) -> MoEFFN:
        p, e, g = [], self.n_experts, self.n_groups
        if e % g:
            p.append(
                f"n_groups ({g}) must divide n_experts ({e}): choose n_groups in {_divisors(e)}"
            )
        elif self.top_k_groups > g:
            p.append(f"top_k_groups ({self.top_k_groups}) must be <= n_groups ({g})")
        elif g > 1 and self.top_k > self.top_k_groups * (e // g):  # g = 1: problems() below
            p.append(
                f"top_k ({self.top_k}) must be <= top_k_groups ({self.top_k_groups}) x experts "
                f"per group ({e // g}): the chosen groups hold no more; raise top_k_groups"
            )
        if p:
            raise ValueError("\n".join(p))
        return self

    @property
    def dense(self) -> DenseFFN | GLUFFN:
        return self.expert

    def hidden_dim(self, d_model: int) -> int:
        return self.expert.hidden_dim(d_model)

    @property
    def label(self) -> str:
        return f"moe({self.n_experts}x, top-{self.top_k})"

    @property
    def summary(self) -> str:
        e = self.expert
        out = f"MoE {self.n_experts}x{e.kind} {e.activation}, top-{self.top_k}"
        out += f" + {self.n_shared_experts} shared" if self.n_shared_experts else ""
        return out + (f", first {self.dense_layers} dense" if self.dense_layers else "")

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        p = []
        if self.top_k > self.n_experts:  # with groups: _groups, which sees the groups' size
            p.append(
                f"{where}.top_k ({self.top_k}) must be <= {where}.n_experts ({self.n_experts}): "
                f"lower top_k or add experts"
            )
        return p

    def tiny(self, size: TinySize) -> MoEFFN:
        """At most max(4, 2·top_k) experts, so routing stays sparse; DeepSeek's dense first
        layers keep their width ratio; two groups, the top-k still inside the groups kept."""
        ch: dict[str, Any] = dict(
            expert=self.expert.tiny(size),
            n_experts=min(self.n_experts, max(4, 2 * self.top_k)),
        )
        if self.dense_d_ff:
            ch["dense_d_ff"] = size.width(self.dense_d_ff)
        if self.n_groups > 1:
            ch.update(n_groups=2, top_k_groups=min(self.top_k_groups, 2))
        return self.merged(**ch)


FFN = Annotated[Union[DenseFFN, GLUFFN, MoEFFN], Field(discriminator="kind")]

# --- frontends: inputs other than token ids -----------------------------------------------------


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


# --- per-layer variation ------------------------------------------------------------------------


class LayerSpec(Frozen):
    """How the layers at one place of `ModelConfig.layer_pattern` attend: their window and,
    optionally, a positional scheme of their own (src/attnlab/nn/stack.py, `LayerVariant`).

    sliding_window: as `AttentionConfig.sliding_window` (causal: the window-1 tokens before;
    bidirectional: |q - k| < window); None is full attention. positional: replaces the model's
    rotation or score bias in these layers (a RoPE base of their own: ModernBERT's and Gemma 3's
    local layers; "none": NoPE layers), None keeps the model's. Embedding-side schemes act once,
    before any layer, so a layer cannot have one of its own.
    """

    sliding_window: int | None = Field(None, gt=0)
    positional: Positional | None = None

    @model_validator(mode="after")
    def _inside_attention(self) -> LayerSpec:
        pos = self.positional
        if pos is not None and not pos.per_layer:  # only a scheme acting inside attention
            ok = [c.model_fields["kind"].default for c in _union_kinds(Positional) if c.per_layer]
            raise ValueError(
                f"positional ({pos.kind!r}) adds to the embeddings once, before any layer, so "
                f"one layer cannot have its own: use one of {', '.join(ok)} "
                f"here, or set it as ModelConfig.positional"
            )
        return self


# --- the model ----------------------------------------------------------------------------------


def _divisors(n: int) -> str:
    return "{" + ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) + "}"


class ModelConfig(Frozen):
    """A whole model. Sizes follow the papers' names; `None` means "derive" (see properties)."""

    arch: Literal["encoder", "decoder", "encoder-decoder"]
    vocab_size: int = Field(ge=0)  # 0: no token table (a model with a frontend)
    d_model: int = Field(gt=0)
    n_layers: int = Field(gt=0)
    n_decoder_layers: int | None = Field(None, gt=0)  # encoder-decoder only; None = n_layers
    n_heads: int = Field(gt=0)
    n_kv_heads: int | None = Field(None, gt=0)  # None = n_heads (MHA); 1 = MQA; else GQA
    head_dim: int | None = Field(None, gt=0)  # None = d_model // n_heads
    d_ff: int | None = Field(None, gt=0)  # None = 4·d_model (dense) or the GLU rule

    positional: Positional = Sinusoidal()
    attention: AttentionKind = AttentionConfig()
    norm: NormConfig = LayerNormConfig()
    ffn: FFN = DenseFFN()
    norm_placement: Literal["pre", "post"] = "pre"
    # "parallel": x + attn(norm1(x)) + ffn(norm2(x)) (GPT-NeoX); "parallel-shared-norm": one norm
    # feeds both branches (GPT-J, Falcon-7B, PaLM).
    residual: Literal["sequential", "parallel", "parallel-shared-norm"] = "sequential"
    final_norm: bool = True
    embedding_norm: bool = False  # LayerNorm right after the embeddings (BERT, BLOOM, BART)
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(d_model) (2017, Marian)
    # round that sqrt(d_model) to the embeddings' dtype before multiplying (Gemma: bf16 45.25, not
    # 45.2548...); without it the factor stays a Python float, as in BART and Marian
    round_embed_scale: bool = False
    dropout: float = Field(0.0, ge=0, lt=1)  # on embeddings and every residual branch
    activation_dropout: float = Field(0.0, ge=0, lt=1)  # on the FFN hidden activation (T5, fairseq)
    type_vocab_size: int = Field(0, ge=0)  # token-type (segment) embeddings; encoder only
    pad_token_id: int | None = Field(None, ge=0)

    tie_embeddings: bool = True  # output projection shares the token embedding matrix
    share_encoder_decoder_embeddings: bool = True  # encoder-decoder only
    scale_tied_logits: bool = False  # multiply the last hidden by d_model^-0.5 first (T5)
    mlm_head: bool = False  # encoder only: dense + act + norm + tied decoder (BERT)
    num_labels: int = Field(0, ge=0)  # encoder only: sequence-classification head when > 0
    # the classification head's dense + tanh on the first token before the linear map (BERT's
    # pooler); False: the first token's (final-normed) state straight to it (ViT). Without
    # num_labels it says which head adding labels builds (load_pretrained(..., num_labels=...))
    classifier_pooler: bool = True
    # encoder only: turns non-token inputs (pixel_values) into the sequence; None = token ids
    frontend: Frontend | None = None
    # per-layer attention: layer i of each stack attends as layer_pattern[i % len(layer_pattern)]
    # (window, own positional scheme); None: every layer as `attention` and `positional` say.
    # ModernBERT: one global layer, then two local ones with a 128-token window and their own RoPE
    layer_pattern: tuple[LayerSpec, ...] | None = None
    # False: the first block has no norm before its attention, whose input the embedding norm has
    # just normalised (ModernBERT); pre-norm, sequential residual only
    first_attn_norm: bool = True
    # the MLM head's dense layer has a bias (BERT); ModernBERT's has none
    mlm_dense_bias: bool = True
    # a hierarchical image encoder (Swin): stages of windowed blocks at halving resolution after a
    # patch-grid frontend; d_model, n_heads and d_ff are the first stage's, n_layers their sum; a
    # classifier (num_labels) maps the mean final token to the labels (classifier_pooler False)
    stages: StagesConfig | None = None
    init: Literal["xavier", "normal", "gpt2", "t5"] = "gpt2"

    @model_validator(mode="before")
    @classmethod
    def _softmax_by_default(cls, data: Any) -> Any:
        """`attention` given as a dict without `kind` is softmax attention, as before kinds."""
        att = data.get("attention") if isinstance(data, dict) else None
        if isinstance(att, dict) and "kind" not in att:
            data = {**data, "attention": {"kind": "softmax", **att}}
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        problems = self._problems()
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _problems(self) -> list[str]:
        p: list[str] = []
        kv = self.kv_heads
        if self.n_heads % kv:
            p.append(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({kv}): "
                f"choose n_kv_heads in {_divisors(self.n_heads)}"
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            p.append(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) when "
                f"head_dim is not set: choose n_heads in {_divisors(self.d_model)} or set head_dim"
            )
        p += self._kind_problems()
        if self.residual != "sequential" and self.norm_placement == "post":
            p.append(
                f"residual ({self.residual!r}) needs norm_placement 'pre': a post-norm parallel "
                f"block has no published form; use residual 'sequential' or placement 'pre'"
            )
        if self.residual != "sequential" and self.arch == "encoder-decoder":
            p.append(
                f"residual ({self.residual!r}) is not defined with cross-attention: "
                f"use residual 'sequential' for arch 'encoder-decoder'"
            )
        if self.arch != "encoder-decoder":
            for name in ("n_decoder_layers",):
                if getattr(self, name) is not None:
                    p.append(
                        f"{name} ({getattr(self, name)}) is only for arch 'encoder-decoder': remove it"
                    )
        if self.arch != "encoder":
            for name in ("type_vocab_size", "num_labels"):
                if getattr(self, name):
                    p.append(
                        f"{name} ({getattr(self, name)}) is only for arch 'encoder': set it to 0"
                    )
            if self.mlm_head:
                p.append("mlm_head (True) is only for arch 'encoder': set it to False")
        if self.mlm_head and self.num_labels:
            p.append(
                f"mlm_head (True) and num_labels ({self.num_labels}) exclude each other: a model has one "
                f"head; build one model per task (they can share the encoder weights)"
            )
        p += self._frontend_problems()
        p += self._layer_problems()
        p += self._stage_problems()
        if self.round_embed_scale and not self.scale_embeddings:
            p.append(
                "round_embed_scale (True) needs scale_embeddings (True): enable it or drop the rounding"
            )
        if self.scale_tied_logits and not self.tie_embeddings:
            p.append(
                "scale_tied_logits (True) needs tie_embeddings (True): enable it or drop the scaling"
            )
        if (
            self.pad_token_id is not None
            and self.pad_token_id >= self.vocab_size
            # an encoder with a frontend refuses a padding id outright; Whisper's is the decoder's
            and (self.frontend is None or self.arch == "encoder-decoder")
        ):
            p.append(
                f"pad_token_id ({self.pad_token_id}) must be < vocab_size ({self.vocab_size}): "
                f"fix the id or enlarge the vocabulary"
            )
        return p

    def _kind_problems(self) -> list[str]:
        """Each kind's own rules (`Kind.problems`): the model asks every node, never its class."""
        nodes = dict(positional=self.positional, attention=self.attention, ffn=self.ffn)
        nodes.update(norm=self.norm, frontend=self.frontend)
        return [m for where, n in nodes.items() if n is not None for m in n.problems(self, where)]

    def _layer_problems(self) -> list[str]:
        """The per-layer fields: `layer_pattern`, `first_attn_norm`, `mlm_dense_bias`."""
        p: list[str] = []
        if not self.first_attn_norm and (
            self.norm_placement != "pre" or self.residual != "sequential"
        ):
            p.append(
                f"first_attn_norm (False) needs norm_placement 'pre' and residual 'sequential' "
                f"(got {self.norm_placement!r}, {self.residual!r}): it drops the norm in front "
                f"of the first attention; set first_attn_norm True"
            )
        if not self.mlm_dense_bias and not self.mlm_head:
            p.append("mlm_dense_bias (False) describes the MLM head: set mlm_head True or drop it")
        pattern = self.layer_pattern
        if pattern is None:
            return p
        if not pattern:
            p.append("layer_pattern (()) is empty: give at least one LayerSpec, or None")
        if not self.attention.per_layer:
            p.append(
                f"layer_pattern needs attention.kind 'softmax' (got {self.attention.kind!r}): "
                f"per-layer windows and positions are defined for softmax attention; drop it"
            )
        if self.attention.sliding_window is not None:
            p.append(
                f"attention.sliding_window ({self.attention.sliding_window}) and layer_pattern "
                f"exclude each other: the pattern gives every layer its window; move the window "
                f"into the pattern's entries"
            )
        for i, spec in enumerate(pattern):  # a layer's own scheme, by its own rules
            if spec.positional is not None:
                p += spec.positional.problems(self, f"layer_pattern.{i}.positional")
        return p

    def _stage_problems(self) -> list[str]:
        """`stages`: Swin's network, so the settings its blocks have (one problem per field)."""
        st = self.stages
        if st is None:
            return []
        p: list[str] = []
        if self.n_layers != sum(st.depths) or self.n_heads != st.heads[0]:
            p.append(
                f"n_layers ({self.n_layers}) and n_heads ({self.n_heads}) must be the stages' "
                f"total depth ({sum(st.depths)}) and first heads ({st.heads[0]}): set them so"
            )
        for s, h in enumerate(st.heads):
            if (self.d_model << s) % h:
                p.append(
                    f"stages.heads.{s} ({h}) must divide stage {s}'s width d_model·2^{s} "
                    f"({self.d_model << s}): choose another head count"
                )
        needs = dict(
            frontend=("patch-grid", self.frontend.kind if self.frontend else None),
            attention=("softmax", self.attention.kind),
            sliding_window=(None, self.attention.sliding_window),  # the stages' windows
            qk_norm=(False, self.attention.qk_norm),
            k_bias=(True, getattr(self.attention, "k_bias", True)),  # q, k, v alike in Swin
            scale=(None, self.attention.scale),
            n_kv_heads=(None, self.n_kv_heads),
            head_dim=(None, self.head_dim),
            norm=("layernorm", self.norm.kind),
            ffn=("dense", self.ffn.kind),
            norm_placement=("pre", self.norm_placement),
            residual=("sequential", self.residual),
            final_norm=(True, self.final_norm),
            embedding_norm=(False, self.embedding_norm),
            classifier_pooler=(False, self.classifier_pooler),  # Swin's head: mean, then linear
            layer_pattern=(None, self.layer_pattern),
        )
        for name, (want, got) in needs.items():
            if got != want:
                p.append(
                    f"{name} ({got!r}) must be {want!r} with stages (Swin's blocks, "
                    f"src/attnlab/nn/swin.py): set {name} to {want!r} or drop stages"
                )
        return p

    def _frontend_problems(self) -> list[str]:
        """Token ids and frontends: a model without a frontend needs a vocabulary; an encoder
        with a frontend (ViT) has no token embeddings, and its frontend adds the positions; an
        encoder-decoder's frontend (Whisper) feeds the encoder, whose positions it adds, and the
        one token table, `vocab_size` and `positional` are the decoder's."""
        p: list[str] = []
        f = self.frontend
        if f is None and self.vocab_size == 0:
            p.append(
                "vocab_size (0) must be > 0: a model reads token ids unless it has a frontend; "
                "set vocab_size, or a frontend (e.g. {'kind': 'patches', ...} for images)"
            )
        if f is None:
            return p
        if self.arch != f.arch:
            p.append(
                f"frontend ({f.kind!r}) is only for arch {f.arch!r} (got {self.arch!r}): use arch "
                f"{f.arch!r} or drop the frontend"
            )
            return p
        if self.arch == "encoder-decoder":
            if self.vocab_size == 0:
                p.append(
                    f"vocab_size (0) must be > 0 with frontend {f.kind!r}: the decoder reads and "
                    f"predicts token ids; set vocab_size"
                )
            if not self.share_encoder_decoder_embeddings:
                p.append(
                    f"share_encoder_decoder_embeddings (False) needs two token tables; with "
                    f"frontend {f.kind!r} the encoder has none and the decoder's is the only one: "
                    f"set it to True"
                )
            return p
        if self.vocab_size:
            p.append(
                f"vocab_size ({self.vocab_size}) must be 0 with frontend {f.kind!r}, whose inputs "
                f"are not token ids: set vocab_size to 0 (no token table is built)"
            )
        if self.positional.kind != "none":
            p.append(
                f"positional ({self.positional.kind!r}) must be 'none' with frontend {f.kind!r}, "
                f"which adds its own learned positions (class token included): set positional "
                f"to {{'kind': 'none'}}"
            )
        token_fields = dict(
            type_vocab_size=self.type_vocab_size,
            mlm_head=self.mlm_head,
            pad_token_id=self.pad_token_id is not None,  # 0 is an id too
            scale_embeddings=self.scale_embeddings,
        )
        for name in [k for k, v in token_fields.items() if v]:
            p.append(
                f"{name} ({getattr(self, name)!r}) describes token embeddings, which a model "
                f"with frontend {f.kind!r} has none of: remove it"
            )
        return p

    # --- derived values: the only place they are computed ---------------------------------------

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (0 without RoPE)."""
        return self.positional.rotary_dim(self.attention.rope_head_dim(self.attn_head_dim))

    @property
    def ffn_dim(self) -> int:
        """Hidden size of the FFN (of each expert for MoE)."""
        return self.d_ff if self.d_ff is not None else self.ffn.hidden_dim(self.d_model)

    @property
    def decoder_layers(self) -> int:
        return self.n_decoder_layers if self.n_decoder_layers is not None else self.n_layers

    @property
    def is_causal(self) -> bool:
        """Whether the (main) stack is causal: decoder-only models are."""
        return self.arch == "decoder"

    # --- serialisation ------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        return cls.from_dict(json.loads(text))

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> ModelConfig:
        import yaml

        return cls.from_dict(yaml.safe_load(text))

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        text = path.read_text()
        return cls.from_yaml(text) if path.suffix in (".yaml", ".yml") else cls.from_json(text)
