"""Which outside family a model attnlab built itself leaves as: the transformers model_type (for
an HF folder) or the llama.cpp architecture (for a .gguf file, named by the model_type it is
converted from) whose architecture computes exactly what the model's config computes.

    choose_family(cfg, "hf")     # configs/shakespeare-char.yaml -> "gpt2"
    choose_family(cfg, "gguf")   # configs/shakespeare-char-modern.yaml -> "llama"

A model read from HF or GGUF knows its family (`hf_model_type`) and a run fine-tuned from one
is written as that one (src/attnlab/cli/convert.py); this is for the rest, the models trained
here from a preset. Each candidate family's converter (src/attnlab/interop/<family>.py) is asked
to write the config, which it does only when reading it back gives the same model
(`hf_config.confirmed`), so "matches" means exactly, field for field, with one allowance:
GPT-2's biases, which a config without them gets as zeros (the same function,
src/attnlab/interop/gpt2.py). The candidates are tried in the order below, the plainest first
(Llama for RoPE / RMSNorm / SwiGLU, GPT-2 for learned positions and LayerNorm), so a config two
families express goes to the one more tools run. For a .gguf file only the families llama.cpp
has a graph for count (src/attnlab/interop/gguf/table.py), and that graph's own refusals too.

Encoder-decoder models are src/attnlab/interop/bart.py's business (`export_family`: Marian for
the 2017 Transformer; llama.cpp has no Marian). When no candidate fits, the error names, for
the nearest ones, each config field that has no counterpart there.
"""

from __future__ import annotations

import warnings
from typing import Literal

from ..config import ModelConfig
from .converter import CONVERTERS, ConversionError

Target = Literal["hf", "gguf"]

# (arch, the families tried for it, in order)
CANDIDATES: dict[str, tuple[str, ...]] = {
    "decoder": (
        "llama", "gpt2", "qwen2", "qwen3", "mistral", "mixtral", "gemma", "gemma2",
        "gemma3_text", "phi3", "olmo2", "granite", "smollm3", "cohere", "gpt_neox", "mpt",
        "bloom", "falcon", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3",
    ),
    "encoder": ("bert", "roberta", "modernbert", "big_bird", "longformer", "vit", "swin"),
}  # fmt: skip
_WHERE = {"hf": "transformers", "gguf": "llama.cpp"}
_SHOWN = 2  # the nearest misfits a refusal spells out


def choose_family(cfg: ModelConfig, target: Target) -> str:
    """The transformers model_type `cfg` is written as for `target` ("hf": an HF folder,
    "gguf": a llama.cpp file), or a ConversionError naming what no family expresses."""
    if target not in _WHERE:
        raise ValueError(f"target {target!r}: 'hf' or 'gguf'")
    if cfg.arch == "encoder-decoder":
        from .bart import export_family

        return export_family(cfg, target)
    tried = [f for f in CANDIDATES[cfg.arch] if f in CONVERTERS]
    if target == "gguf":
        from .gguf.table import WRITTEN_AS

        tried = [f for f in tried if f in WRITTEN_AS]
        if not tried:
            raise ConversionError(
                f"llama.cpp runs decoder-only models: this is an {cfg.arch} (arch = "
                f"{cfg.arch!r}); write an HF folder instead (`attnlab convert SRC DIR --to hf`)"
            )
    misfits: dict[str, list[str]] = {}
    for family in tried:
        problems = _misfits(cfg, family, target)
        if not problems:
            return family
        misfits[family] = problems
    nearest = sorted(misfits, key=lambda f: len(misfits[f]))[:_SHOWN]
    lines = [f"  as {f}: {'; '.join(misfits[f])}" for f in nearest]
    others = [f for f in tried if f not in nearest]
    raise ConversionError(
        f"no {_WHERE[target]} family computes this model exactly; the nearest, with each "
        "config field that has no counterpart there:\n"
        + "\n".join(lines)
        + (f"\n  (also tried: {', '.join(others)})" if others else "")
        + "\nchange those fields in the recipe and train again, or name a family with "
        "--model-type to see all of its misfits"
    )


def _misfits(cfg: ModelConfig, family: str, target: Target) -> list[str]:
    """The problem lines of writing `cfg` as `family` ([] when it fits)."""
    conv = CONVERTERS.get(family)
    try:
        hf = conv.config_to_hf(cfg)
        if target == "gguf":
            from .gguf.table import WRITTEN_AS
            from .gguf.writer import config_json

            spec = WRITTEN_AS[family]
            if spec.fit is not None:
                with warnings.catch_warnings():  # the writer warns again when it writes
                    warnings.simplefilter("ignore")
                    spec.fit(config_json(spec, family, hf))
    except ConversionError as err:  # every converter refuses this way, whatever the config
        return _lines(str(err))  # (tests/interop/test_converter_refusals.py)
    return []


def _lines(message: str) -> list[str]:
    """A problem list's bullet lines (src/attnlab/errors.py `problem_list`), else the message."""
    bullets = [x.strip()[2:] for x in message.splitlines() if x.strip().startswith("- ")]
    return bullets or [message]
