"""qwen2, qwen3, qwen3moe (conversion/qwen.py): the llama layout under its own names, no
permutation; Qwen3-MoE's experts stacked per kind."""

from __future__ import annotations

from .base import Arch, Keys, text_parameters
from .moe import fuse_stacked, moe_keys, split_stacked


def _qwen3moe(k: Keys, meta, hf, tensors) -> dict:
    """Qwen3-MoE: every layer sparse; llama.cpp renormalises the top-k weights unconditionally
    (src/models/qwen3moe.cpp, norm_w = true), which is norm_topk_prob = True."""
    return dict(
        moe_keys(k, "num_experts"), norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]
    )


def _qwen3moe_parameters(w, hp: dict) -> None:
    """Qwen2MoeModel.set_gguf_parameters (conversion/qwen.py): the base and the experts' width."""
    text_parameters(w, hp)
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])


def _qwen3moe_modify(name, a, hp, bid):
    return split_stacked(name, a, bid) if ".mlp.experts." in name else None


QWEN2 = Arch("qwen2", "qwen2", "QWEN2", text_parameters, bias_from=("attn_output",))
QWEN3 = Arch("qwen3", "qwen3", "QWEN3", text_parameters, bias_from=("attn_output",))
QWEN3MOE = Arch(
    "qwen3moe",
    "qwen3_moe",
    "QWEN3MOE",
    _qwen3moe_parameters,
    config=_qwen3moe,
    moe=True,
    unmodify=fuse_stacked,
    modify=_qwen3moe_modify,
)
