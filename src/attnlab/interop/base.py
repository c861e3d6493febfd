"""The converter contract: one object per `transformers` model_type, registered by name.

A converter translates in both directions, on plain data, so that reading a checkpoint folder
needs no `transformers` at all:

    config_from_hf(dict) -> ModelConfig        HF config.json contents -> attnlab config
    config_to_hf(cfg) -> dict                  attnlab config -> HF config.json contents
    weights_from_hf(state_dict, cfg) -> dict   HF tensor names/layouts -> attnlab's
    weights_to_hf(state_dict, cfg) -> dict     and back (exact: to_hf(from_hf(m)) == m)

`hf_class` names the `transformers` class `to_hf` instantiates (e.g. "LlamaForCausalLM").
`weights_from_hf` accepts the state dict of the bare model or of the model with its head
(prefixes such as "model." or "transformer." are the converter's business).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import ModelConfig
from ..registry import Registry

StateDict = dict[str, torch.Tensor]


class Converter(Protocol):
    model_type: str
    hf_class: str

    def config_from_hf(self, hf: dict) -> ModelConfig: ...

    def config_to_hf(self, cfg: ModelConfig) -> dict: ...

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict: ...

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict: ...


CONVERTERS: Registry[Converter] = Registry("transformers model_type")


class ConversionError(ValueError):
    """A checkpoint or model that a converter cannot translate exactly (names the reason)."""


def strip_prefix(sd: StateDict, prefixes: tuple[str, ...]) -> StateDict:
    """Drop the first matching prefix from every key (e.g. "model.", "transformer.")."""
    out = {}
    for k, v in sd.items():
        for p in prefixes:
            if k.startswith(p):
                k = k[len(p) :]
                break
        out[k] = v
    return out


@dataclass(frozen=True)
class Renamer:
    """Rename keys by ordered (old, new) substring pairs; `inverse()` swaps the direction."""

    pairs: tuple[tuple[str, str], ...]

    def __call__(self, sd: StateDict) -> StateDict:
        out = {}
        for k, v in sd.items():
            for old, new in self.pairs:
                if old in k:
                    k = k.replace(old, new)
            out[k] = v
        return out

    def inverse(self) -> Renamer:
        return Renamer(tuple((new, old) for old, new in reversed(self.pairs)))


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
    diffs = [
        f"{k} = {a.get(k)!r} ({family} can only give {b.get(k)!r})"
        for k in sorted(set(a) | set(b))
        if k not in ignore and a.get(k) != b.get(k)
    ]
    if diffs:
        raise ConversionError(
            f"{family} cannot express this model exactly:\n  - " + "\n  - ".join(diffs)
        )
