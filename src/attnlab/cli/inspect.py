"""`attnlab inspect`: an architecture summary of a preset or an HF-format folder.

Components, sizes, exact parameter count (built on the meta device) and KV-cache bytes per
token — the number that decides how many tokens fit in memory when decoding (GQA/MQA shrink it by
n_heads / n_kv_heads; MLA caches one latent per token, src/attnlab/cache/latent.py) — next
to what MHA, GQA, MQA and MLA would cache at the same size (DeepSeek-V2, arXiv:2405.04434,
Table 1).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import presets
from ..build import count_parameters
from ..cache.base import kv_bytes
from ..config import MLAConfig, ModelConfig, MoEFFN


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


def _cached_layers(cfg: ModelConfig) -> int:
    return cfg.decoder_layers if cfg.arch == "encoder-decoder" else cfg.n_layers


def kv_bytes_per_token(cfg: ModelConfig, bytes_per_value: int) -> int:
    """K and V of every self-attention layer that caches them, for one token of one sequence;
    for MLA its latent cache's entry, L · (kv_lora_rank + qk_rope_head_dim) values."""
    a = cfg.attention
    if isinstance(a, MLAConfig):
        return _cached_layers(cfg) * (a.kv_lora_rank + a.qk_rope_head_dim) * bytes_per_value
    return kv_bytes(_cached_layers(cfg), cfg.kv_heads, cfg.attn_head_dim, bytes_per_value)


def kv_bytes_compared(cfg: ModelConfig, bytes_per_value: int) -> dict[str, int]:
    """Bytes per token of the same layers, heads and head width d_h under each attention kind:
    MHA (2·H·d_h per layer), GQA with 8 K/V heads (Llama-2-70B's; the model's own count when it
    is GQA), MQA (2·d_h) and MLA (d_c + d_R: the model's own, else DeepSeek-V2's proportions
    d_c = 4·d_h, d_R = d_h / 2, section 2.1.4). d_h is head_dim, or MLA's qk_nope_head_dim (the
    paper's d_h, Table 1)."""
    L, H, a = _cached_layers(cfg), cfg.n_heads, cfg.attention
    mla = isinstance(a, MLAConfig)
    d_h = a.qk_nope_head_dim if mla else cfg.attn_head_dim
    groups = cfg.kv_heads if 1 < cfg.kv_heads < H else min(8, H)
    latent = a.kv_lora_rank + a.qk_rope_head_dim if mla else 4 * d_h + d_h // 2
    return {
        "MHA": kv_bytes(L, H, d_h, bytes_per_value),
        f"GQA ({groups} K/V heads)": kv_bytes(L, groups, d_h, bytes_per_value),
        "MQA": kv_bytes(L, 1, d_h, bytes_per_value),
        "MLA": L * latent * bytes_per_value,
    }


def summarize(cfg: ModelConfig) -> list[tuple[str, str]]:
    f = cfg.ffn
    ffn = (
        f"{f.kind} ({f.activation})"
        if not isinstance(f, MoEFFN)
        else (
            f"MoE: {f.n_experts} x {f.expert.kind} ({f.expert.activation}), top-{f.top_k}, {f.routing}"
            + (f", {f.n_shared_experts} shared" if f.n_shared_experts else "")
            + (f", weights x {f.routed_scale:g}" if f.routed_scale != 1 else "")
            + (f", top-{f.top_k_groups} of {f.n_groups} groups" if f.n_groups > 1 else "")
            + (
                f", first {f.dense_layers} dense (d_ff {f.dense_d_ff or cfg.ffn_dim})"
                if f.dense_layers
                else ""
            )
            + f", {f.balance_loss} balance loss"
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
        ("heads (q / kv) x head_dim", _heads(cfg)),
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
        same = kv_bytes_compared(cfg, 2)
        rows.append(("KV per token, same size", ", ".join(f"{k} {v:,} B" for k, v in same.items())))
    return rows


def _heads(cfg: ModelConfig) -> str:
    a = cfg.attention
    if not isinstance(a, MLAConfig):
        return f"{cfg.n_heads} / {cfg.kv_heads} x {cfg.attn_head_dim}"
    q = "q_proj" if a.q_lora_rank is None else f"q latent {a.q_lora_rank}"
    return (
        f"{cfg.n_heads} x (q/k {a.qk_nope_head_dim} + {a.qk_rope_head_dim} rope, "
        f"v {a.v_head_dim}); MLA: KV latent {a.kv_lora_rank} + shared rope key, {q}"
    )


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
