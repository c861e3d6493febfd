"""deepseek2: DeepSeek-V2 and V3 (DeepseekV2Model, conversion/deepseek.py). MLA is written as MQA
(one KV head of kv_lora_rank + rope dims, the per-head sizes in the *_mla keys); kv_b_proj is
split into attn_k_b (transposed) and attn_v_b; the experts are stacked per kind; V3's routing
bias is exp_probs_b; sigmoid gating (expert_gating_func 2) is V3's."""

from __future__ import annotations

import warnings

import torch

from .base import Arch, Keys, text_parameters
from .moe import fuse_stacked, moe_keys, split_stacked

_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "exp_probs_b": "mlp.gate",  # exp_probs_b.bias -> mlp.gate.e_score_correction_bias
}

# --- reading -------------------------------------------------------------------------------------


def _deepseek2(k: Keys, meta, hf, tensors) -> dict:
    """llama.cpp keeps only 0.1·mscale_all_dim of YaRN's mscales (rope.scaling.yarn_log_multiplier);
    both are set from it (V2's and V3's configs have them equal), which makes YaRN's attention
    factor 1 and the softmax scale mscale²/sqrt(d)."""
    rope_dim = k("rope.dimension_count")
    gating = k("expert_gating_func", 1)  # llama.cpp: softmax when absent (V2 files)
    out = dict(
        moe_keys(k, "n_routed_experts"),
        model_type="deepseek_v3" if gating == 2 else "deepseek_v2",
        num_key_value_heads=hf["num_attention_heads"],
        q_lora_rank=k("attention.q_lora_rank", None),
        kv_lora_rank=k("attention.kv_lora_rank"),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=k("attention.key_length_mla") - rope_dim,
        v_head_dim=k("attention.value_length_mla"),
        head_dim=rope_dim,
        n_shared_experts=k("expert_shared_count", 0),
        first_k_dense_replace=k("leading_dense_block_count", 0),
        routed_scaling_factor=k("expert_weights_scale", 1.0),
        norm_topk_prob=bool(k("expert_weights_norm", False)),
        n_group=k("expert_group_count", 1),
        topk_group=k("expert_group_used_count", 1),
        scoring_func="sigmoid" if gating == 2 else "softmax",
        rope_interleave=True,
    )
    if gating != 2:  # V2's routing: group-limited when the file has groups (DeepSeek-V2 236B)
        out["topk_method"] = "group_limited_greedy" if out["n_group"] > 1 else "greedy"
    if gating not in (1, 2):
        k.refuse("expert_gating_func", "supported: 1 (softmax, DeepSeek-V2) and 2 (sigmoid, V3)")
    rope = dict(hf["rope_parameters"])
    if rope.get("rope_type") == "yarn":
        mscale = k("rope.scaling.yarn_log_multiplier", 0.0) / 0.1
        rope.update(mscale=mscale, mscale_all_dim=mscale)
    out["rope_parameters"] = rope
    return out


def _unmodify(sd: dict[str, torch.Tensor], hf: dict) -> None:
    """The experts fused; kv_b_proj rebuilt from attn_k_b (H, kv_lora, nope: transposed) and
    attn_v_b (H, v, kv_lora): rows (H, nope + v)."""
    fuse_stacked(sd, hf)
    for i in range(hf["num_hidden_layers"]):
        kb, vb = f"blk.{i}.attn_k_b.weight", f"blk.{i}.attn_v_b.weight"
        if kb in sd and vb in sd:
            k, v = sd.pop(kb).transpose(1, 2), sd.pop(vb)  # (H, nope, kv_lora), (H, v, kv_lora)
            sd[f"blk.{i}.attn_kv_b.weight"] = torch.cat((k, v), dim=1).flatten(0, 1)


# --- writing -------------------------------------------------------------------------------------


def _config_json(hf: dict) -> dict:
    """DeepSeek-V3's sigmoid routing stated: its config.json says scoring_func "sigmoid", which
    the converter writes as expert_gating_func; without it llama.cpp routes with a softmax."""
    if hf["model_type"] == "deepseek_v3":
        hf = {"scoring_func": "sigmoid", **hf}
    return hf


def _parameters(w, hp: dict) -> None:
    """DeepseekV2Model.set_gguf_parameters: MLA written as MQA (one KV head of kv_lora_rank + rope
    dims), the MoE keys, the YaRN log multiplier."""
    text_parameters(w, dict(hp, num_key_value_heads=1))
    w.add_leading_dense_block_count(hp.get("first_k_dense_replace") or 0)
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    lora = hp["kv_lora_rank"]
    w.add_kv_lora_rank(lora)
    w.add_key_length(lora + hp["qk_rope_head_dim"])
    w.add_value_length(lora)
    w.add_key_length_mla(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
    w.add_value_length_mla(hp["v_head_dim"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp.get("n_shared_experts", 0))
    if hp.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(hp["qk_rope_head_dim"])
    if (mscale_all := (hp.get("rope_parameters") or {}).get("mscale_all_dim")) is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * mscale_all)


def _fit(hp: dict) -> None:
    """Warn where llama.cpp computes it differently: DeepSeek-V2's group-limited greedy routing
    over more than one group (measured by benchmarks/check_llamacpp.py: the tiny V2 with two
    groups departs from transformers by 0.064 in llama.cpp, with one group it agrees within 1e-4;
    the groups are chosen otherwise in llama.cpp)."""
    groups = hp.get("n_group") or 1
    used = hp.get("topk_group") or groups
    if hp.get("topk_method") == "group_limited_greedy" and used < groups:
        warnings.warn(
            f"DeepSeek-V2's group-limited routing ({used} of {groups} expert groups) is not "
            "llama.cpp's: the file loads, but llama.cpp routes some tokens to other experts "
            "than transformers and attnlab do",
            RuntimeWarning,
            stacklevel=3,
        )


def _modify(name, a, hp, bid):
    """DeepseekV2Model.modify_tensors: the experts stacked, kv_b_proj's (H, nope + v, lora) rows
    split (k_b transposed), the routing bias renamed."""
    if ".mlp.experts." in name:
        return split_stacked(name, a, bid)
    if name.endswith("kv_b_proj.weight"):
        nope = hp["qk_nope_head_dim"]
        kv = a.reshape(hp["num_attention_heads"], nope + hp["v_head_dim"], -1)
        return [
            (f"blk.{bid}.attn_k_b.weight", kv[:, :nope].transpose(0, 2, 1)),
            (f"blk.{bid}.attn_v_b.weight", kv[:, nope:]),
        ]
    if name.endswith("e_score_correction_bias"):
        return [(f"blk.{bid}.exp_probs_b.bias", a)]
    return None


DEEPSEEK2 = Arch(
    "deepseek2",
    "deepseek_v3",
    "DEEPSEEK2",
    _parameters,
    writes=("deepseek_v2", "deepseek_v3"),
    names=_NAMES,
    config=_deepseek2,
    mla=True,
    partial_rotary=True,
    moe=True,
    scalings=("yarn",),
    unmodify=_unmodify,
    config_json=_config_json,
    fit=_fit,
    modify=_modify,
)
