"""gpt-oss (GptOssModel, conversion/gpt_oss.py): sinks, the router under ffn_gate_inp, the
experts' interleaved gate/up columns split (MXFP4 dequantized by gguf), YaRN without truncation
and the SwiGLU limit 7 (both hard-coded by llama.cpp)."""

from __future__ import annotations

import torch

from .base import Arch, Keys, text_parameters
from .moe import expert_names, moe_keys

_NAMES = {"ffn_gate_inp": "mlp.router", "attn_sinks": "self_attn.sinks"}


def _gpt_oss(k: Keys, meta, hf, tensors) -> dict:
    """Sinks, biases, the window on even layers (llama.cpp: `set_swa_pattern(2)`), the clamped
    SwiGLU's limit 7.0 and YaRN without truncation, none of which the file states: llama.cpp
    hard-codes the limit (LLM_FFN_SWIGLU_OAI_MOE in src/models/openai-moe-iswa.cpp) and every
    released config.json sets rope_parameters.truncate false."""
    n = hf["num_hidden_layers"]
    moe = moe_keys(k, "num_local_experts")
    rope = dict(hf["rope_parameters"])
    if rope.get("rope_type") == "yarn":
        rope["truncate"] = False
    return dict(
        num_local_experts=moe["num_local_experts"],
        num_experts_per_tok=moe["num_experts_per_tok"],
        intermediate_size=moe["moe_intermediate_size"],
        sliding_window=k("attention.sliding_window"),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        attention_bias=True,
        swiglu_limit=7.0,
        rope_parameters=rope,
    )


def _unmodify(sd: dict[str, torch.Tensor], hf: dict) -> None:
    """llama.cpp's stacked experts -> transformers' gate_up_proj (E, H, 2I), gate in the even
    columns and up in the odd ones, and down_proj (E, I, H), biases alike."""
    for i in range(hf["num_hidden_layers"]):
        g, u, d = expert_names(i)
        if f"{g}.weight" not in sd:
            continue
        out = f"model.layers.{i}.mlp.experts"
        gate, up, down = (sd.pop(f"{n}.weight") for n in (g, u, d))
        sd[f"{out}.gate_up_proj"] = torch.stack((gate, up), dim=2).flatten(1, 2).transpose(1, 2)
        sd[f"{out}.down_proj"] = down.transpose(1, 2).contiguous()
        if f"{g}.bias" in sd:
            bias = torch.stack((sd.pop(f"{g}.bias"), sd.pop(f"{u}.bias")), dim=-1)
            sd[f"{out}.gate_up_proj_bias"] = bias.flatten(-2)
            sd[f"{out}.down_proj_bias"] = sd.pop(f"{d}.bias")


def _parameters(w, hp: dict) -> None:
    """GptOssModel.set_gguf_parameters: the base, the window, the experts' width."""
    text_parameters(w, hp)
    w.add_sliding_window(hp["sliding_window"])
    w.add_expert_feed_forward_length(hp["intermediate_size"])


def _modify(name, a, hp, bid):
    """GptOssModel.modify_tensors / filter_tensors: (E, H, 2I) experts transposed and split, gate
    even, up odd; sinks as .weight; the router as ffn_gate_inp."""
    if ".mlp.experts." in name:
        g, u, d = expert_names(bid)
        if name.endswith("gate_up_proj"):
            t = a.transpose(0, 2, 1)
            return [(f"{g}.weight", t[:, ::2]), (f"{u}.weight", t[:, 1::2])]
        if name.endswith("gate_up_proj_bias"):
            return [(f"{g}.bias", a[..., ::2]), (f"{u}.bias", a[..., 1::2])]
        if name.endswith("down_proj"):
            return [(f"{d}.weight", a.transpose(0, 2, 1))]
        return [(f"{d}.bias", a)]
    if name.endswith("self_attn.sinks"):
        return [(f"blk.{bid}.attn_sinks.weight", a)]
    if ".mlp.router." in name:
        return [(f"blk.{bid}.ffn_gate_inp.{name.rsplit('.', 1)[1]}", a)]
    return None


GPT_OSS = Arch("gpt-oss", "gpt_oss", "GPT_OSS", _parameters, names=_NAMES, config=_gpt_oss,
               moe=True, scalings=("yarn",), unmodify=_unmodify, modify=_modify)  # fmt: skip
