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
                k = k[len(p):]
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
