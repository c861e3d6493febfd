"""`attnlab inspect`: an architecture summary of a preset or an HF-format folder.

Components, sizes, exact parameter count (built on the meta device) and KV-cache bytes per
token — the number that decides how many tokens fit in memory when decoding (GQA/MQA shrink it by
n_heads / n_kv_heads).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import presets
from ..build import count_parameters
from ..config import ModelConfig, MoEFFN
from ..decode.cache.base import kv_bytes


def resolve(target: str) -> tuple[str, ModelConfig]:
    """A preset name or a folder with config.json -> (label, config); no weights are read."""
    path = Path(target)
    if (path / "config.json").exists():
        from ..interop.converter import converter_for

        hf = json.loads((path / "config.json").read_text())
        conv = converter_for(hf.get("model_type", "<missing model_type>"))
        return f"{path} ({conv.model_type})", conv.config_from_hf(hf)
    if path.exists():
        raise FileNotFoundError(
            f"{path} has no config.json: pass an HF-format folder or a preset name"
        )
    return target, presets.get(target)


def kv_bytes_per_token(cfg: ModelConfig, bytes_per_value: int) -> int:
    """K and V of every self-attention layer that caches them, for one token of one sequence."""
    layers = cfg.decoder_layers if cfg.arch == "encoder-decoder" else cfg.n_layers
    return kv_bytes(layers, cfg.kv_heads, cfg.attn_head_dim, bytes_per_value)


def summarize(cfg: ModelConfig) -> list[tuple[str, str]]:
    f = cfg.ffn
    ffn = (
        f"{f.kind} ({f.activation})"
        if not isinstance(f, MoEFFN)
        else (
            f"MoE: {f.n_experts} x {f.expert.kind} ({f.expert.activation}), top-{f.top_k}, {f.routing}"
            + (f", {f.n_shared_experts} shared" if f.n_shared_experts else "")
        )
    )
    pos = cfg.positional
    rows = [
        ("architecture", cfg.arch),
        (
            "layers",
            str(cfg.n_layers)
            + (f" + {cfg.decoder_layers} decoder" if cfg.arch == "encoder-decoder" else ""),
        ),
        ("d_model / d_ff", f"{cfg.d_model} / {cfg.ffn_dim}"),
        ("heads (q / kv) x head_dim", f"{cfg.n_heads} / {cfg.kv_heads} x {cfg.attn_head_dim}"),
        ("vocabulary", f"{cfg.vocab_size:,}"),
        (
            "positional",
            pos.kind + "".join(f", {k}={v}" for k, v in pos.to_dict().items() if k != "kind"),
        ),
        (
            "attention",
            ", ".join(
                f"{k}={v}"
                for k, v in cfg.attention.to_dict().items()
                if v not in (None, False, 0.0)
            )
            or "defaults",
        ),
        ("norm", f"{cfg.norm.kind} (eps {cfg.norm.eps}), {cfg.norm_placement}-norm"),
        ("FFN", ffn),
        ("residual", cfg.residual),
        ("output head", _head(cfg)),
        ("parameters", f"{count_parameters(cfg):,}"),
    ]
    if cfg.frontend is not None:  # what the inputs are, before the vocabulary row
        rows.insert(4, ("frontend", f"{cfg.frontend.kind}: {cfg.frontend.summary}"))
    if cfg.arch != "encoder":
        rows.append(
            (
                "KV cache per token",
                f"{kv_bytes_per_token(cfg, 2):,} B in bf16/fp16, "
                f"{kv_bytes_per_token(cfg, 4):,} B in fp32",
            )
        )
    return rows


def _head(cfg: ModelConfig) -> str:
    if cfg.arch != "encoder":
        return "tied to embeddings" if cfg.tie_embeddings else "separate"
    if cfg.num_labels:
        pooler = "dense + tanh pooler, " if cfg.classifier_pooler else ""
        return f"classifier ({pooler}{cfg.num_labels} labels, first token)"
    return "MLM, tied to embeddings" if cfg.mlm_head else "none (hidden states)"


def format_summary(label: str, cfg: ModelConfig) -> str:
    rows = summarize(cfg)
    width = max(len(k) for k, _ in rows)
    return "\n".join([label] + [f"  {k:<{width}}  {v}" for k, v in rows])


def run(args: argparse.Namespace) -> int:
    print(format_summary(*resolve(args.target)))
    return 0


def register(sub) -> None:
    p = sub.add_parser("inspect", help="architecture summary of a preset or an HF-format folder")
    p.add_argument(
        "target", help="a preset name (see `attnlab presets`) or a folder with config.json"
    )
    p.set_defaults(func=run)
