"""Presets in words: `describe(cfg)`, one line of the components a config uses (`attnlab
inspect`), and `components_table()`, the preset x components table of docs/components.md."""

from __future__ import annotations

from ..config import ModelConfig
from .base import get, names


def describe(cfg: ModelConfig) -> str:
    """One line: the components a config uses (each kind's `label`)."""
    kv = cfg.kv_heads
    heads = "MHA" if kv == cfg.n_heads else ("MQA" if kv == 1 else f"GQA({kv})")
    attn = cfg.attention.label(heads)  # "MHA", "longformer MHA", "MLA"
    fields = cfg.attention.to_dict()
    if cfg.attention.qk_norm:  # per head, or over the whole projection (OLMo 2)
        attn += " qk-norm" + (
            " (projection)" if fields.get("qk_norm_scope") == "projection" else ""
        )
    if fields.get("softcap") is not None:  # Gemma 2
        attn += f" softcap {fields['softcap']:g}"
    if fields.get("sinks"):  # GPT-OSS
        attn += " sinks"
    if cfg.layer_pattern is not None:  # "MHA layers [global, window 65 + rope 10000, ...]"
        attn += f" layers {_pattern(cfg)}"
    if cfg.stages is not None:  # "MHA in 7x7 shifted windows, stages [2, 2, 6, 2]"
        w = cfg.stages.window_size
        attn += f" in {w}x{w} shifted windows, stages {list(cfg.stages.depths)}"
    pos = cfg.positional.kind if cfg.frontend is None else cfg.frontend.summary
    if cfg.frontend is not None and cfg.arch == "encoder-decoder":  # the frontend feeds the encoder
        pos += f"; decoder {cfg.positional.kind}"
    pos += _scaling(cfg, "+{}")  # "rope+llama3"
    return (
        f"{cfg.arch}, {pos}, {attn}, {cfg.norm.kind}, {cfg.norm_placement}-norm, "
        f"{cfg.ffn.label}, {', '.join([cfg.residual, *_scales(cfg)])}"
    )


def _scaling(cfg: ModelConfig, words: str) -> str:
    """The RoPE scaling's kind in `words` ("+{}" -> "+llama3"), or "" without one."""
    scaling = cfg.positional.to_dict().get("scaling")
    return words.format(scaling["kind"]) if scaling else ""


def _scales(cfg: ModelConfig) -> list[str]:
    """The model's multipliers and logit cap where set (Granite, Cohere, Gemma 2):
    ["embeddings x12", "residual x0.22", "logits x0.125", "logits capped at 30"]."""
    out = []
    for name, what in (
        ("embedding_multiplier", "embeddings"),
        ("residual_multiplier", "residual"),
        ("logit_multiplier", "logits"),
    ):
        if getattr(cfg, name) != 1.0:
            out.append(f"{what} x{getattr(cfg, name):g}")
    if cfg.final_logit_softcap is not None:
        out.append(f"logits capped at {cfg.final_logit_softcap:g}")
    return out


def _pattern(cfg: ModelConfig) -> str:
    """A layer pattern in a few words: [global, window 65 + rope 10000, ...]; a run of three
    or more equal layers as one entry (Gemma 3: [5 x window 512 + rope 10000, global])."""
    parts: list[list] = []  # [words, run length]
    for spec in cfg.layer_pattern or ():
        part = f"window {spec.sliding_window}" if spec.sliding_window else "global"
        if spec.positional is not None:
            part += f" + {spec.positional.layer_label}"
        if parts and parts[-1][0] == part:
            parts[-1][1] += 1
        else:
            parts.append([part, 1])
    words = [f"{n} x {w}" if n >= 3 else ", ".join([w] * n) for w, n in parts]
    return "[" + ", ".join(words) + "]"


def components_table() -> str:
    """Markdown table, preset x components, generated from the presets (docs/components.md);
    each kind says its own words (`summary`)."""
    head = "| preset | arch | positional | attention | norm | placement | FFN | residual |"
    rows = [head, "|" + "---|" * 8]
    for name in names():
        cfg = get(name)
        pos = cfg.positional.summary
        if cfg.frontend is not None:  # the frontend's positions, not the stack's
            pos = cfg.frontend.summary
            if cfg.arch == "encoder-decoder":  # Whisper: the frontend's are the encoder's
                pos = f"encoder: {pos}; decoder: {cfg.positional.kind}"
        kv = cfg.kv_heads
        heads = "MHA" if kv == cfg.n_heads else ("MQA" if kv == 1 else f"GQA {cfg.n_heads}/{kv}")
        attn = cfg.attention.summary(heads, cfg.n_heads)
        if cfg.layer_pattern is not None:
            attn += f", layers cycle {_pattern(cfg)}"
        if cfg.stages is not None:  # Swin: softmax attention without a window of its own
            st = cfg.stages
            depths = "-".join(map(str, st.depths))
            attn += f", {st.window_size}x{st.window_size} shifted windows, stages {depths}"
        pos += _scaling(cfg, ", {} scaling")
        residual = ", ".join([cfg.residual, *_scales(cfg)])
        rows.append(
            f"| {name} | {cfg.arch} | {pos} | {attn} | {cfg.norm.kind} | {cfg.norm_placement} | {cfg.ffn.summary} | {residual} |"
        )
    return "\n".join(rows)
