"""Config pieces the decoder-only converters (gpt2, llama, bloom, mpt, gpt_neox, falcon) share.

- `HFConfig`: a plain config.json dict read with a family's defaults (transformers is not
  needed), collecting every feature attnlab does not model exactly so they fail together;
- `Fit`: checks that an attnlab config is one a family can express, before writing its config;
- activation names with exactly attnlab's functions, and the bos/eos ids to write.

RoPE settings are in rope_params.py, tensor names and fused layouts in layouts.py.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from ..config import ModelConfig
from .base import ConversionError, require_same

# transformers.activations.ACT2FN names whose function equals an attnlab activation exactly
# (the tanh-approximate GELUs all compute 0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))))
ACT_FROM_HF = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu-tanh",
    "gelu_pytorch_tanh": "gelu-tanh",
    "gelu_python_tanh": "gelu-tanh",
    "gelu_fast": "gelu-tanh",
    "gelu_accurate": "gelu-tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
ACT_TO_HF = {"gelu": "gelu", "gelu-tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu"}
_MISSING = object()


class HFConfig:
    """A transformers config.json dict seen through a family's defaults and key aliases."""

    def __init__(self, family: str, data: dict, defaults: dict, aliases: dict | None = None):
        self.family, self.data, self.defaults = family, dict(data), defaults
        for old, new in (aliases or {}).items():  # e.g. GPT-2's hidden_size -> n_embd
            if old in self.data and new not in self.data:
                self.data[new] = self.data[old]
        self.problems: list[str] = []

    def __getitem__(self, key: str) -> Any:
        value = self.data.get(key, self.defaults.get(key, _MISSING))
        if value is _MISSING:
            raise ConversionError(f"{self.family} config.json has no {key!r} and no default for it")
        return value

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, self.defaults.get(key, default))

    def reject(self, key: str, value: Any, why: str) -> None:
        self.problems.append(f"{key} = {value!r}: {why}")

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

    def pad_token_id(self, vocab_size: int) -> int | None:
        pad = self.get("pad_token_id")  # only generation uses it; -1 and out-of-vocab ids mean none
        return pad if isinstance(pad, int) and 0 <= pad < vocab_size else None

    def done(self) -> None:
        if self.problems:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            raise ConversionError(f"cannot convert this {self.family} config exactly:\n{lines}")


class Fit:
    """Checks that an attnlab config can be written as a transformers `family` config."""

    def __init__(self, cfg: ModelConfig, family: str) -> None:
        self.cfg, self.family, self.problems = cfg, family, []
        for field, allowed in (
            ("arch", "decoder"),
            ("norm_placement", "pre"),
            ("final_norm", True),
            ("scale_embeddings", False),
            ("scale_tied_logits", False),
            ("attention.qk_norm", False),
        ):
            self.need(field, allowed)

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
        self.problems.append(f"{field} = {value!r}: {why}")

    def mha(self) -> None:
        self.need("kv_heads", self.cfg.n_heads, " (one K/V head per query head)")

    def plain_heads(self) -> None:
        """head_dim = d_model / n_heads and the usual 1/sqrt(head_dim) scale."""
        hd = self.cfg.d_model // self.cfg.n_heads
        self.need("attn_head_dim", hd, " (d_model / n_heads)")
        self.need("attention.scale", None, " (1/sqrt(head_dim))")

    def done(self) -> None:
        if self.problems:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            raise ConversionError(
                f"this config has no transformers {self.family} equivalent:\n{lines}"
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


def confirmed(conv, cfg: ModelConfig, out: dict) -> dict:
    """`out`, once reading it back gives `cfg` again (base.require_same): the final guard behind
    `Fit`, which names the usual misfits with the family's rule."""
    back = conv.config_from_hf(out)
    require_same(cfg, back, conv.model_type, ignore=("init", "ffn.expert.multiple_of"))
    return out
