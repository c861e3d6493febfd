"""Named presets: one function each, citing the paper or model card it follows.

Every preset reproduces its reference architecture exactly; tests/test_presets.py checks each
parameter count against the reference implementation in `transformers` built on the meta device
(no weights). `tiny(cfg)` keeps an architecture and shrinks its sizes for tests.

    import attnlab as al
    al.presets.names()               # every preset
    cfg = al.presets.get("mistral-7b")
    small = al.presets.tiny(cfg)     # d_model 64, 2 layers, same GQA ratio, window, MoE, ...

One module per lineage, each registering its presets in PRESETS (base.py) when imported:

    encoder_decoders.py  the 2017 original, T5, BART
    encoders.py          BERT, RoBERTa, Longformer, BigBird, ModernBERT
    vision_audio.py      ViT, Swin, Whisper
    gpt.py               GPT-2, Transformer-XL, BLOOM, MPT, GPT-NeoX, Falcon
    llama.py             Llama 2 and 3, Qwen2, Qwen3, Mistral, SmolLM3 (and the Llama frame)
    llama_variants.py    Phi-3, Phi-4-mini, OLMo 2, Granite, Command R
    gemma.py             Gemma, Gemma 2, Gemma 3
    moe.py               Mixtral, DeepSeek-V2-Lite, Qwen3-30B-A3B, DeepSeek-V3, GPT-OSS

shrink.py holds `tiny`, summary.py `describe` and `components_table`.
"""

from .base import PRESETS, get, names, source
from .shrink import tiny
from .summary import components_table, describe

# isort: off
# the lineages, imported in the order `names()` lists their presets
from . import encoder_decoders, encoders, vision_audio, gpt  # noqa: F401
from . import llama, llama_variants, gemma, moe  # noqa: F401
# isort: on

__all__ = ["PRESETS", "components_table", "describe", "get", "names", "source", "tiny"]
