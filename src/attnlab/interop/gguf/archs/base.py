"""What every GGUF architecture's entry is made of (`Arch`), and what they all share: llama.cpp's
tensor names for the llama layout, its metadata keys read with its defaults (`Keys`), and the keys
its converter's `TextModel.set_gguf_parameters` writes (`text_parameters`, conversion/base.py).

An entry holds both directions of one llama.cpp architecture, as llama.cpp's converter
(convert_hf_to_gguf.py, its conversion/ package) holds one class per architecture:

    reading (src/attnlab/interop/gguf/reader.py)    writing (src/attnlab/interop/gguf/writer.py)
    config: <arch>.* keys -> config.json dict        parameters: config.json -> <arch>.* keys
    names: GGUF tensor names -> transformers'        gguf's TensorNameMap for `enum` (+ `strip`)
    unmodify: the family's tensor changes undone     modify: its modify_tensors
    permuted, norm_offset, conv1d, interleaved_qkv: value changes undone and made, by GGUF name
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ....errors import Problems

# GGUF tensor names -> transformers names: the whole-model ones, then the ones of block {i}
# (llama.cpp's gguf-py/gguf/tensor_mapping.py read backwards); an architecture's `names` override
GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qk-norm (Qwen3, Gemma 3, OLMo 2, Command R)
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",  # OLMo 2's post-norms, Gemma's sandwich
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate_inp": "mlp.gate",  # the router of an MoE block
}


class Keys:
    """`<arch>.*` metadata keys read with llama.cpp's defaults; a missing required one, or a
    feature attnlab does not compute, goes to `problems` (all reported together)."""

    def __init__(self, arch: str, meta: dict[str, Any], problems: Problems):
        self.arch, self.meta, self.problems = arch, meta, problems

    def __call__(self, name: str, default: Any = ...) -> Any:
        if f"{self.arch}.{name}" in self.meta:
            return self.meta[f"{self.arch}.{name}"]
        if default is ...:
            self.problems.add(
                f"{self.arch}.{name} is missing: the file does not describe a whole model "
                "(re-convert it with llama.cpp's convert_hf_to_gguf.py)"
            )
            return 1
        return default

    def refuse(self, name: str, why: str) -> None:
        self.problems.add(f"{self.arch}.{name} = {self(name, None)!r}: {why}")


Tensors = list[tuple[str, np.ndarray]]  # (GGUF name, fp32 array), in the order written
# (keys, metadata, the config dict so far, the file's tensors: shapes, or values of the RoPE ones)
ConfigRule = Callable[[Keys, dict[str, Any], dict[str, Any], dict[str, Any]], dict[str, Any]]
# (transformers name, its array, config.json, block number) -> what the converter writes instead
ModifyRule = Callable[[str, np.ndarray, dict[str, Any], "int | None"], "Tensors | None"]


@dataclass(frozen=True)
class Arch:
    """One llama.cpp architecture (`general.architecture`) and the transformers family it is
    converted from and to. Every fact cites llama.cpp: its converter (convert_hf_to_gguf.py, the
    conversion/ package) for what the file holds, its loader (src/llama-model.cpp) for what it
    leaves implicit."""

    name: str  # general.architecture
    model_type: str  # the converter (src/attnlab/interop/<family>.py) that reads the config dict
    enum: str  # the gguf package's MODEL_ARCH member (its TensorNameMap names the tensors)
    parameters: Callable[[Any, dict[str, Any]], None]  # set_gguf_parameters(GGUFWriter, config)
    writes: tuple[str, ...] = ()  # the model_types written as this architecture (model_type)

    # --- both directions: the file's tensor names and the value changes, by GGUF name ---
    names: dict[str, str] = field(default_factory=dict)  # block names that differ from BLOCK
    own_names: bool = False  # `names` is the whole block table (GPT-2), not changes to BLOCK
    global_names: dict[str, str] = field(default_factory=lambda: GLOBAL)
    block_prefix: str = "model.layers"
    permuted: bool = False  # q/k rows reordered (LlamaModel.permute: llama, smollm3, granite)
    norm_offset: bool = False  # norms stored as 1 + w (Gemma2Model / Gemma3Model.modify_tensors)
    conv1d: tuple[str, ...] = ()  # block tensors transformers stores (in, out) (GPT-2's Conv1D)
    interleaved_qkv: bool = False  # transformers' fused q/k/v rows (H, 3, D), the file's [q|k|v]

    # --- reading: the metadata's config.json, what it may hold ---
    config: ConfigRule | None = None  # the family's own config keys
    mla: bool = False  # per-head sizes in the *_mla keys (DeepSeek's MLA written as MQA)
    partial_rotary: bool = False  # rope.dimension_count may be less than the head size
    moe: bool = False  # expert_count is read (the file's experts fused by `unmodify`)
    scalings: tuple[str, ...] = ()  # rope.scaling.type beyond none and linear
    rms_norm_eps: Any = ...  # attention.layer_norm_rms_epsilon's default (... = required)
    bias_from: tuple[str, ...] = ("attn_output", "attn_q")  # block 0 biases: attention_bias
    unmodify: Callable[[dict[str, torch.Tensor], dict[str, Any]], None] | None = None
    file_names: Callable[[Collection[str]], dict[str, str]] | None = None  # names by tensors held

    # --- writing: the converter's set_gguf_parameters, modify_tensors, generate_extra_tensors ---
    config_json: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # as config.json has it
    fit: Callable[[dict[str, Any]], None] | None = None  # refuse / warn what llama.cpp computes not
    modify: ModifyRule | None = None
    extra_tensors: Callable[[dict[str, Any]], Tensors] | None = None
    strip: str = ""  # a prefix the converter drops before TensorNameMap (BloomModel)

    def block_names(self, tensors: Collection[str] = ()) -> dict[str, str]:
        """GGUF block tensor kinds -> transformers' names, for a file holding `tensors`."""
        names = self.names if self.own_names else {**BLOCK, **self.names}
        return {**names, **self.file_names(tensors)} if self.file_names else names

    def model_types(self) -> tuple[str, ...]:
        return self.writes or (self.model_type,)


def text_parameters(w, hp: dict) -> None:
    """`TextModel.set_gguf_parameters` (conversion/base.py), the keys it writes from config.json."""
    import gguf

    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    if hp.get("intermediate_size") is not None:
        w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    if hp.get("num_key_value_heads") is not None:
        w.add_head_count_kv(hp["num_key_value_heads"])
    rope = hp.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    kind = full.get("rope_type")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        if full.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(full["attention_factor"])
        if full.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        if full.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    elif kind == "longrope":
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    if full.get("rope_theta") is not None:
        w.add_rope_freq_base(full["rope_theta"])
    if (swa := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(swa)
    if hp.get("rms_norm_eps") is not None:
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("layer_norm_eps") is not None:
        w.add_layer_norm_eps(hp["layer_norm_eps"])
    experts = hp.get("num_local_experts") or hp.get("num_experts") or hp.get("n_routed_experts")
    if experts:
        w.add_expert_count(experts)
    if hp.get("num_experts_per_tok"):
        w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("n_group") is not None:
        w.add_expert_group_count(hp["n_group"])
    if hp.get("topk_group") is not None:
        w.add_expert_group_used_count(hp["topk_group"])
    if hp.get("scoring_func") is not None:
        w.add_expert_gating_func(
            gguf.ExpertGatingFuncType.SIGMOID
            if hp["scoring_func"] == "sigmoid"
            else gguf.ExpertGatingFuncType.SOFTMAX
        )
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])


def shortest(x: Any) -> float:
    """A float32 as the shortest decimal that rounds back to it (numpy's str of a float32)."""
    return float(str(np.float32(x)))
