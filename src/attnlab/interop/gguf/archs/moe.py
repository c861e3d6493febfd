"""What the mixture-of-experts architectures share (qwen3moe, deepseek2, gpt-oss): the expert
keys, and the experts stacked per kind. llama.cpp stores each block's experts as three tensors
(E, out, in), ffn_{gate,up,down}_exps (the gguf package's MODEL_TENSOR.FFN_*_EXP);
transformers 5 fuses gate and up. Qwen3-MoE's and DeepSeek's gate_up_proj is (E, 2I, H) =
[gate | up] and down_proj (E, H, I), which the converters (Qwen2MoeModel / DeepseekV2Model
.modify_tensors) stack per kind; GPT-OSS's own layout is in src/attnlab/interop/gguf/archs/gpt_oss.py."""

from __future__ import annotations

import numpy as np
import torch

from .base import Keys, Tensors

EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def moe_keys(k: Keys, experts_key: str) -> dict:
    return {
        experts_key: k("expert_count"),
        "num_experts_per_tok": k("expert_used_count"),
        "moe_intermediate_size": k("expert_feed_forward_length"),
    }


def expert_names(bid: int) -> tuple[str, str, str]:
    return tuple(f"blk.{bid}.{kind}" for kind in EXPERTS)  # type: ignore[return-value]


def fuse_stacked(sd: dict[str, torch.Tensor], hf: dict) -> None:
    """llama.cpp's stacked experts -> transformers' gate_up_proj and down_proj, in place."""
    for i in range(hf["num_hidden_layers"]):
        g, u, d = expert_names(i)
        if f"{g}.weight" in sd:
            out = f"model.layers.{i}.mlp.experts"
            sd[f"{out}.gate_up_proj"] = torch.cat((sd.pop(f"{g}.weight"), sd.pop(f"{u}.weight")), 1)
            sd[f"{out}.down_proj"] = sd.pop(f"{d}.weight")


def split_stacked(name: str, a: np.ndarray, bid: int) -> Tensors:
    """transformers' fused expert tensor `name` as llama.cpp's stacked per-kind ones."""
    g, u, d = expert_names(bid)
    if name.endswith("gate_up_proj"):
        half = a.shape[1] // 2
        return [(f"{g}.weight", a[:, :half]), (f"{u}.weight", a[:, half:])]
    return [(f"{d}.weight", a)]
