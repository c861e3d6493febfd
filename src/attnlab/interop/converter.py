"""The converter contract: one object per `transformers` model_type, registered by name.

A converter translates in both directions, on plain data, so that reading a checkpoint folder
needs no `transformers` at all:

    config_from_hf(dict) -> ModelConfig        HF config.json contents -> attnlab config
    config_to_hf(cfg) -> dict                  attnlab config -> HF config.json contents
    weights_from_hf(state_dict, cfg) -> dict   HF tensor names/layouts -> attnlab's
    weights_to_hf(state_dict, cfg) -> dict     and back (exact: to_hf(from_hf(m)) == m)

`hf_class` names the `transformers` class `to_hf` instantiates (e.g. "LlamaForCausalLM").
`weights_from_hf` accepts the state dict of the bare model or of the model with its head
(prefixes such as "model." or "transformer." are the converter's business). `converter_for` and
`model_type_of` look one up for from_hf / to_hf and the folder functions of
src/attnlab/interop/pretrained.py.

The toolkit the families share: src/attnlab/interop/hf_config.py reads and writes config.json
(defaults, the one activation map, every misfit reported at once), and
src/attnlab/interop/layouts.py renames and fuses tensors.

A model's own generation settings (start token, EOS, forced tokens, beams...) are not
architecture: they travel beside the config as `model.generation` (src/attnlab/decode/settings.py).
`generation_from_hf` / `generation_to_hf` carry them between a `transformers` model's
`generation_config` and that attribute; src/attnlab/interop/pretrained.py reads and writes
generation_config.json.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ..config import ModelConfig
from ..decode.settings import GenerationSettings
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


def converter_for(model_type: str) -> Converter:
    """The registered converter of a transformers model_type, or an error naming them all."""
    if model_type not in CONVERTERS:
        raise ConversionError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(CONVERTERS.names()))}"
        )
    return CONVERTERS.get(model_type)


def model_type_of(model: nn.Module, model_type: str | None = None) -> str:
    """`model_type`, else the one a model loaded by from_hf / load_pretrained remembers."""
    model_type = model_type or getattr(model, "hf_model_type", None)
    if model_type is None:
        raise ConversionError(
            f"which transformers family? pass model_type=..., one of {', '.join(sorted(CONVERTERS.names()))} "
            f"(models loaded with from_hf/load_pretrained remember theirs)"
        )
    return model_type


def generation_from_hf(hf_model: nn.Module) -> GenerationSettings | None:
    """The set fields of a `transformers` model's generation_config (None: it has none, as an
    encoder, or sets nothing attnlab implements)."""
    gen = getattr(hf_model, "generation_config", None)
    if gen is None:
        return None
    settings = GenerationSettings.from_hf(gen.to_dict())
    return None if settings.is_empty() else settings


def generation_to_hf(hf_model: nn.Module, settings: GenerationSettings | None) -> None:
    """Give `hf_model` a generation_config holding `settings` (None: keep the one transformers
    derived from the model config)."""
    if settings is None:
        return
    from transformers import GenerationConfig

    hf_model.generation_config = GenerationConfig(**settings.to_hf())


def config_to_hf(conv: Converter, model: nn.Module) -> dict:
    """conv.config_to_hf(model.config), with the context the checkpoint states it was trained
    for as max_position_embeddings where the family has that key: `model.context_length`, which
    from_hf, load_pretrained and load_gguf remember (a RoPE or ALiBi config does not fix it, so
    the config alone would give the family's default). What every writer (to_hf,
    save_pretrained, the GGUF writer) writes."""
    out = conv.config_to_hf(model.config)
    context = getattr(model, "context_length", None)
    key = next((k for k in CONTEXT_KEYS if k in out), None)
    if context is not None and key is not None:
        out[key] = context
    return out


# config.json's names for the context a checkpoint was trained for (MPT's max_seq_len)
CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len")


def context_of(hf: dict) -> int | None:
    """The context a config.json states (CONTEXT_KEYS), or None."""
    return next((hf[k] for k in CONTEXT_KEYS if hf.get(k) is not None), None)
