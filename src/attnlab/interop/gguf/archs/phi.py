"""phi3 (Phi3MiniModel, conversion/phi.py): fused qkv and gate_up kept as they are, partial
rotary, LongRoPE's factors as the rope_factors_long / _short tensors."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import Arch, Keys, Tensors, shortest

_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # kept fused


def _phi3(k: Keys, meta, hf, tensors) -> dict:
    """Phi-3: LongRoPE's factors as the tensors rope_factors_long / _short and its attention
    factor as rope.scaling.attn_factor (Phi3MiniModel.generate_extra_tensors); the window 0 for
    none (Phi-4). llama.cpp itself ignores the window (its loader: "Phi SWA is currently
    disabled"); the transformers model the file was written from slides it, so attnlab does."""
    out: dict[str, Any] = {"sliding_window": k("attention.sliding_window", 0) or None}
    rope = dict(hf["rope_parameters"])
    rope["partial_rotary_factor"] = k("rope.dimension_count", hf["head_dim"]) / hf["head_dim"]
    if "rope_factors_long.weight" in tensors:
        original = k("rope.scaling.original_context_length")
        rope.update(
            rope_type="longrope",
            long_factor=[shortest(x) for x in tensors["rope_factors_long.weight"]],
            short_factor=[shortest(x) for x in tensors["rope_factors_short.weight"]],
            original_max_position_embeddings=original,
        )
        out["original_max_position_embeddings"] = original  # Phi3Config keeps it at the top
        default = _attn_factor(hf["max_position_embeddings"], original)
        factor = k("rope.scaling.attn_factor", default)
        if not math.isclose(factor, default, rel_tol=1e-6):  # transformers' own default otherwise
            rope["attention_factor"] = factor
    out["rope_parameters"] = rope
    return out


def _attn_factor(context: int, original: int) -> float:
    """LongRoPE's attention factor for a context stretched from `original` (Phi3MiniModel)."""
    scale = context / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0


def _parameters(w, hp: dict) -> None:
    """Phi3MiniModel.set_gguf_parameters (conversion/phi.py): its own list; the window is written
    as 0 when the config has none."""
    rope = hp["rope_parameters"]
    heads, d = hp["num_attention_heads"], hp["hidden_size"]
    w.add_context_length(hp["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings"))
    w.add_embedding_length(d)
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * d) // heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(hp.get("sliding_window") or 0)
    if rope.get("long_factor"):  # Phi3MiniModel.generate_extra_tensors: the longrope factor
        orig = rope["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(_attn_factor(hp["max_position_embeddings"], orig))


def _rope_factors(hp: dict) -> Tensors:
    """Phi3MiniModel.generate_extra_tensors: LongRoPE's factors as two tensors."""
    rope = hp.get("rope_parameters") or {}
    if not rope.get("long_factor"):
        return []
    return [
        ("rope_factors_long.weight", np.array(rope["long_factor"], np.float32)),
        ("rope_factors_short.weight", np.array(rope["short_factor"], np.float32)),
    ]


PHI3 = Arch("phi3", "phi3", "PHI3", _parameters, names=_NAMES, config=_phi3,
            partial_rotary=True, scalings=("longrope",), extra_tensors=_rope_factors)  # fmt: skip
