"""config.json <-> ModelConfig: the pieces every converter shares.

- `ACT_FROM_HF` / `ACT_TO_HF`: the one activation map, for every family;
- `HFConfig`: a plain config.json dict read with a family's defaults (transformers is not
  needed), collecting every feature attnlab does not model exactly so they fail together;
- `Fit`: checks that an attnlab config is one a family can express, before writing its config;
- `confirmed` / `require_same`: the last guard, reading the written config.json back;
- `common_sizes`, `special_tokens`: keys most families write alike.

Every report is one `problem_list` (src/attnlab/errors.py). RoPE settings are in
src/attnlab/interop/rope_params.py, tensor names and fused layouts in
src/attnlab/interop/layouts.py.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from ..config import ModelConfig
from ..errors import Problems
from .converter import ConversionError, Converter

# Reading: every transformers.activations.ACT2FN name whose function equals an attnlab activation
# exactly (the tanh GELUs all compute 0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))), in other
# operation orders); tests/interop/test_interop_encoders.py checks each against ACT2FN.
ACT_FROM_HF = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu-tanh",
    "gelu_pytorch_tanh": "gelu-tanh",
    "gelu_python_tanh": "gelu-tanh",
    "gelu_fast": "gelu-tanh",
    "gelu_accurate": "gelu-tanh",
    "quick_gelu": "gelu-sigmoid",  # x·σ(1.702x), bit-equal (GPT-OSS's experts use it)
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
# Writing: per attnlab activation, the name whose ACT2FN function is attnlab's own kernel
# (F.gelu, F.gelu(approximate="tanh"), F.relu, F.silu), so the model to_hf builds computes bit for
# bit what attnlab computes: "gelu_pytorch_tanh", not GPT-2's "gelu_new" (the formula in Python
# ops, a rounding away), and "silu", not Marian's "swish" (an alias). T5 alone keeps a name of its
# own, "gated-gelu" (see src/attnlab/interop/t5.py).
ACT_TO_HF = {
    "gelu": "gelu",
    "gelu-tanh": "gelu_pytorch_tanh",
    "gelu-sigmoid": "quick_gelu",
    "relu": "relu",
    "silu": "silu",
}
_MISSING = object()


# A layer count no model reaches, refused before a converter loops over the layers (a
# config.json with num_hidden_layers = 10^9 hung `attnlab inspect`, 2.7 GB in per-layer lists):
# ten times the deepest published transformer, DeepNet's 1,000 layers (arXiv:2203.00555).
MAX_LAYERS = 10_000
# every config.json key a converter reads a layer count from (Swin's per-stage `depths` aside)
LAYER_KEYS = (
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers",
    "decoder_layers", "num_decoder_layers",
)  # fmt: skip


def layer_counts(data: dict) -> list[str]:
    """The layer counts of a config.json dict beyond MAX_LAYERS, as problem lines."""
    counts = {k: data[k] for k in LAYER_KEYS if k in data}
    depths = data.get("depths")
    if isinstance(depths, list) and all(isinstance(d, int) for d in depths):
        counts["depths"] = sum(depths)
    return [
        f"{k} = {v:,}: more layers than any model has (at most {MAX_LAYERS:,} are read)"
        for k, v in counts.items()
        if isinstance(v, int) and v > MAX_LAYERS
    ]


def parameters_beyond(cfg: ModelConfig, limit: float) -> int | None:
    """The config's parameter count where it exceeds `limit` (what the file it came from can
    hold), else None. The widths' arithmetic (build._rough_parameters, within a small factor)
    decides counts far beyond, so a hostile expert or layer count is never built, not even on
    the meta device; the rest are counted at one and two layers (build.estimated_parameters)."""
    from ..build import _rough_parameters, estimated_parameters

    rough = _rough_parameters(cfg)
    n = rough if rough > 64 * limit else estimated_parameters(cfg)
    return n if n > limit else None


class HFConfig:
    """A transformers config.json dict seen through a family's defaults and key aliases."""

    def __init__(self, family: str, data: dict, defaults: dict, aliases: dict | None = None):
        self.family, self.data, self.defaults = family, dict(data), defaults
        for old, new in (aliases or {}).items():  # e.g. GPT-2's hidden_size -> n_embd
            if old in self.data and new not in self.data:
                self.data[new] = self.data[old]
        self.problems = Problems()

    def __getitem__(self, key: str) -> Any:
        value = self.data.get(key, self.defaults.get(key, _MISSING))
        if value is _MISSING:
            raise ConversionError(f"{self.family} config.json has no {key!r} and no default for it")
        return value

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, self.defaults.get(key, default))

    def architecture(self) -> str:
        """The class `architectures` names first ('' when it names none)."""
        return (self.get("architectures") or [""])[0]

    def reject(self, key: str, value: Any, why: str) -> None:
        self.problems.add(f"{key} = {value!r}: {why}")

    def require(self, key: str, allowed: tuple, why: str = "attnlab does not model it") -> Any:
        value = self[key]
        if value not in allowed:
            self.reject(key, value, f"{why} (supported: {', '.join(map(repr, allowed))})")
        return value

    def activation(self, key: str) -> str:
        name = self[key]
        if name not in ACT_FROM_HF:
            self.reject(
                key, name, f"no exact attnlab activation (supported: {', '.join(ACT_FROM_HF)})"
            )
            return "gelu"
        return ACT_FROM_HF[name]

    def vocabulary(self) -> dict[str, Any]:
        """vocab_size, tie_embeddings and pad_token_id of a decoder-only family's ModelConfig."""
        size, pad = self["vocab_size"], self.get("pad_token_id")
        return dict(
            vocab_size=size,
            tie_embeddings=self["tie_word_embeddings"],
            # only generation uses it; -1 and out-of-vocabulary ids mean none
            pad_token_id=pad if isinstance(pad, int) and 0 <= pad < size else None,
        )

    def done(self) -> None:
        self.problems.raise_as(
            ConversionError, f"{self.family} config.json for an exact conversion"
        )


# what every decoder-only family needs (a family adds its own rules with `need`)
DECODER_ONLY = (
    ("arch", "decoder"),
    ("norm_placement", "pre"),
    ("final_norm", True),
    ("scale_embeddings", False),
    ("scale_tied_logits", False),
    ("attention.qk_norm", False),
)


def qkv_bias(cfg: ModelConfig) -> bool:
    """The config's `attention.qkv_bias`; False for an attention of another kind (MLA,
    Transformer-XL's), which has none and which `Fit` reports by its kind (`attention.kind`)."""
    return getattr(cfg.attention, "qkv_bias", False)


class Fit:
    """Checks that an attnlab config can be written as a transformers `family` config: the
    `needs` pairs (field, allowed value) at once, then whatever the family adds."""

    def __init__(
        self,
        cfg: ModelConfig,
        family: str,
        needs: tuple = DECODER_ONLY,
        attention: str | tuple[str, ...] = "softmax",
    ) -> None:
        """`attention`: the attention kind(s) the family computes (Longformer's is its own;
        BigBird's block-sparse, or softmax when attention_type is "original_full")."""
        self.cfg, self.family, self.problems = cfg, family, Problems()
        for field, allowed in needs:
            self.need(field, allowed)
        why = f" (transformers' {family} computes {attention} attention only"
        self.need("attention.kind", attention, why + "; no family has linear attention)")

    def need(self, field: str, allowed: Any, why: str = "") -> Any:
        try:
            value = attrgetter(field)(self.cfg)
        except AttributeError:  # e.g. norm.bias of an RMSNorm: the kind check reports it
            return None
        allowed = allowed if isinstance(allowed, tuple) else (allowed,)
        if value not in allowed:
            self.fail(
                field,
                value,
                f"transformers' {self.family} needs {' or '.join(map(repr, allowed))}{why}",
            )
        return value

    def fail(self, field: str, value: Any, why: str) -> None:
        self.problems.add(f"{field} = {value!r}: {why}")

    def mha(self) -> None:
        self.need("kv_heads", self.cfg.n_heads, " (one K/V head per query head)")

    def plain_heads(self) -> None:
        """head_dim = d_model / n_heads and the usual 1/sqrt(head_dim) scale."""
        hd = self.cfg.d_model // self.cfg.n_heads
        self.need("attn_head_dim", hd, " (d_model / n_heads)")
        self.need("attention.scale", None, " (1/sqrt(head_dim))")

    def dense_layernorm(
        self,
        norm_bias: bool = True,
        ffn_bias: bool = True,
        activation: str | None = None,
        ffn_bias_why: str = "",
    ) -> None:
        """The GPT-2 lineage (gpt2, bloom, mpt, gpt_neox, falcon): full attention, LayerNorm
        with or without bias, a dense FFN with or without bias (and a fixed `activation`)."""
        self.need("attention.sliding_window", None)
        self.need("norm.kind", "layernorm")
        self.need("norm.bias", norm_bias)
        if self.need("ffn.kind", "dense") == "dense":  # another kind: one problem, not three
            self.need("ffn.bias", ffn_bias, ffn_bias_why)
            if activation is not None:
                self.need("ffn.activation", activation)

    def done(self) -> None:
        self.problems.raise_as(ConversionError, _misfit(self.family))


def _misfit(family: str) -> str:
    return f"ModelConfig for transformers' {family}"


def common_sizes(cfg: ModelConfig) -> dict:
    """The sizes under the names most transformers configs share (BertConfig, LlamaConfig,
    GPTNeoXConfig, FalconConfig)."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
    )


def special_tokens(cfg: ModelConfig, defaults: dict) -> dict:
    """bos/eos ids: attnlab does not record them, so keep the family's defaults where they fit
    the vocabulary and write None where they do not (transformers warns about those)."""
    out: dict[str, Any] = {"pad_token_id": cfg.pad_token_id}
    for key in ("bos_token_id", "eos_token_id"):
        value = defaults.get(key)
        if isinstance(value, int) and value >= cfg.vocab_size:
            out[key] = None
    return out


def confirmed(conv: Converter, cfg: ModelConfig, out: dict, ignore: tuple[str, ...] = ()) -> dict:
    """`out`, once reading it back gives `cfg` again (`require_same`, fields in `ignore` aside):
    the final guard behind `Fit`, which names the usual misfits with the family's rule."""
    back = conv.config_from_hf(out)
    require_same(cfg, back, conv.model_type, ignore=("init", "ffn.expert.multiple_of", *ignore))
    return out


def _comparable(cfg: ModelConfig) -> dict:
    """cfg as flat {dotted.field: value}, derived sizes resolved, so that two spellings of one
    architecture (head_dim None or 64 at d_model 512 / 8 heads) compare equal."""
    d = cfg.to_dict()
    d.update(head_dim=cfg.attn_head_dim, n_kv_heads=cfg.kv_heads, d_ff=cfg.ffn_dim)
    d["n_decoder_layers"] = cfg.decoder_layers if cfg.arch == "encoder-decoder" else None
    d["ffn"].pop("multiple_of", None)  # only used to derive d_ff, compared above
    flat: dict = {}

    def walk(prefix: str, node: object) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = node

    walk("", d)
    return flat


def require_same(
    cfg: ModelConfig, back: ModelConfig, family: str, ignore: tuple[str, ...] = ("init",)
) -> None:
    """Raise ConversionError listing every field where `back` (cfg written as the family's
    config.json and read again) differs from `cfg`: what the family cannot express."""
    a, b = _comparable(cfg), _comparable(back)
    problems = Problems()
    for k in sorted(set(a) | set(b)):
        if k not in ignore and a.get(k) != b.get(k):
            problems.add(f"{k} = {a.get(k)!r} ({family} can only give {b.get(k)!r})")
    problems.raise_as(ConversionError, _misfit(family))


def fits_glu_experts(fit: Fit, routing: str, why: str = "") -> bool:
    """Whether the config's FFN is a mixture of bias-free GLU experts routed by `routing`, each
    misfit recorded on `fit` (Mixtral's and DeepSeek's expert layout); False when it is no mixture
    at all (the kind's misfit recorded), so the caller has nothing more to write."""
    if fit.need("ffn.kind", "moe") != "moe":
        return False
    fit.need("ffn.expert.kind", "glu")
    fit.need("ffn.expert.bias", False)
    fit.need("ffn.routing", routing, why)
    return True
