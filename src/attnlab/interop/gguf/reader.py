"""GGUF files (llama.cpp's single-file format) -> an attnlab model and its tokenizer, without
`transformers`.

    g = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    g.model, g.tokenizer, g.chat_template, g.bos_token_id, g.eos_token_ids, g.name
    text = g.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

A GGUF file holds key/value metadata (the architecture's sizes under `<arch>.*`, the tokenizer
under `tokenizer.*`) and tensors under llama.cpp's names, each stored whole-precision (F32, F16,
BF16) or block-quantized (Q4_0 ... Q8_0, the K-quants Q4_K / Q5_K / Q6_K, ...). The `gguf` package
(llama.cpp's own reader, the `gguf` extra) reads both; its `gguf.quants.dequantize` turns every
quantized type it knows into float32, which is what attnlab computes with here: the model is the
dequantized checkpoint, exactly what transformers' GGUF loading builds.

Reading is table-driven (`ARCHITECTURES`): the metadata becomes the config.json dict of the
transformers family it was converted from, and the tensor names (llama.cpp's
gguf-py/gguf/tensor_mapping.py, read backwards) the transformers names, so a GGUF checkpoint and
an HF folder go through the same converter (src/attnlab/interop/<family>.py). Supported
`general.architecture`s and what llama.cpp's converter (convert_hf_to_gguf.py, its conversion/
package) changed on the way, undone here:

    llama      Llama 1-3, SmolLM: q/k rows permuted (below); Llama 3.1's scaling only as the
               `rope_freqs` tensor, recovered as the llama3 parameters (`llama3_from_factors`)
    qwen2, qwen3, olmo2 (post-sublayer norms, qk-norm over the projection): names only
    smollm3    llama's permutation; no RoPE in every 4th layer (llama.cpp hard-codes it)
    granite    llama's permutation; the embedding / residual / attention / logit multipliers
    gemma2, gemma3   norms stored as 1 + w; the query scale, window pattern and local RoPE base
               llama.cpp's loader implies (no keys)
    phi3       fused qkv and gate_up kept; LongRoPE's factors as rope_factors_long / _short
    qwen3moe   experts stacked per kind (ffn_{gate,up,down}_exps), fused back
    deepseek2  DeepSeek-V2 / V3 (expert_gating_func 2 = sigmoid): kv_b_proj split into attn_k_b
               (transposed) and attn_v_b, the routing bias as exp_probs_b, YaRN's mscale
    gpt-oss    sinks, the interleaved gate/up experts split (MXFP4 dequantized by gguf), YaRN
               without truncation, SwiGLU limit 7 (hard-coded by llama.cpp)
    command-r  Cohere's Command R: LayerNorm, logit scale, the head tied
    gpt2       GPT-2: its own names, Conv1D weights transposed back, learned positions (the
               table is context_length)
    gptneox    GPT-NeoX / Pythia: fused q/k/v re-ordered to transformers' per-head interleave,
               partial rotary, the parallel residual
    bloom      BLOOM: ALiBi, the embedding norm, q/k/v as GPT-NeoX's; the converter's copied head
    mpt        MPT: ALiBi (max_alibi_bias), no biases, clamp_kqv read as clip_qkv (refused)
    falcon     Falcon 7B / 40B / 11B: the fused q/k/v's kv groups ([q_1..q_g, k, v] per group in
               transformers) stored as [q | k | v] ("jploski" layout); the layout (multi-query,
               GQA, one or two norms) read off the head counts and attn_norm_2

What the file cannot state or attnlab cannot compute exactly (per-layer head counts or widths,
partial rotary outside Phi-3 / DeepSeek, experts outside the MoE families, a scaling type the
family's converter never writes, another rope_freqs curve, unknown tensors) is refused naming the
key. The q/k permutation: llama.cpp's `LlamaModel.permute` reorders the rows of each attention head
of q_proj and k_proj from transformers' "rotate half" RoPE layout ([x_0..x_{D/2-1} |
x_{D/2}..x_{D-1}]) to its interleaved one ([x_0, x_{D/2}, x_1, ...]) for the classes derived from
it (llama, smollm3, granite); `_unpermute` undoes it. Command R and DeepSeek are interleaved in
transformers too, so llama.cpp leaves them as they are. The tokenizer is built in
src/attnlab/interop/gguf_tokenizer.py; tests/helpers/gguf_writing.py writes test files as llama.cpp
does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ..errors import Problems, reading
from .converter import ConversionError, converter_for
from .layouts import check_finite, check_loaded

if TYPE_CHECKING:
    from ..config import ModelConfig as ModelConfigT
    from ..nn.quant_blocks import BlockScales

_FIX = "the file is truncated, damaged or not a model llama.cpp wrote: download or convert it again"

# GGUF tensor names -> transformers names: the whole-model ones, then the ones of block {i}
# (llama.cpp's gguf-py/gguf/tensor_mapping.py read backwards); an architecture's `names` override
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
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
_GEMMA = {"ffn_norm": "pre_feedforward_layernorm"}
_PHI3 = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # kept fused
_DEEPSEEK = {
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
_GPT_OSS = {"ffn_gate_inp": "mlp.router", "attn_sinks": "self_attn.sinks"}
# GPT-2 (GPT2Model in conversion/gpt2.py): its own names under transformer.h.{i}, and its Conv1D
# weights, which the converter transposed to (out, in), are transposed back
_GPT2_GLOBAL = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
_GPT2 = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
# GPT-NeoX and BLOOM (GPTNeoXModel / BloomModel): their own names; their fused q/k/v, interleaved
# per head in transformers ((H, 3, D) rows), stored as [q | k | v] by the converter
_NEOX_GLOBAL = {
    "token_embd": "gpt_neox.embed_in",
    "output_norm": "gpt_neox.final_layer_norm",
    "output": "embed_out",
}
_BLOOM_GLOBAL = {
    "token_embd": "transformer.word_embeddings",
    "token_embd_norm": "transformer.word_embeddings_layernorm",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
_NEOX_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "attention.query_key_value",
    "attn_output": "attention.dense",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.dense_h_to_4h",
    "ffn_down": "mlp.dense_4h_to_h",
}
_MPT_GLOBAL = {
    "token_embd": "transformer.wte",
    "output_norm": "transformer.norm_f",
    "output": "lm_head",
}
_MPT_BLOCK = {
    "attn_norm": "norm_1",
    "attn_qkv": "attn.Wqkv",
    "attn_output": "attn.out_proj",
    "ffn_norm": "norm_2",
    "ffn_up": "ffn.up_proj",
    "ffn_down": "ffn.down_proj",
}
_BLOOM_BLOCK = {
    **_NEOX_BLOCK,
    "attn_qkv": "self_attention.query_key_value",
    "attn_output": "self_attention.dense",
}
# Falcon (FalconModel): attn_norm is input_layernorm, or ln_mlp beside attn_norm_2 = ln_attn (the
# 40B layout: `_falcon_norms` renames it)
_FALCON_GLOBAL = {
    "token_embd": "transformer.word_embeddings",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
_FALCON_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_norm_2": "ln_attn",
    "attn_qkv": "self_attention.query_key_value",
    "attn_output": "self_attention.dense",
    "ffn_up": "mlp.dense_h_to_4h",
    "ffn_down": "mlp.dense_4h_to_h",
}


@dataclass
class GGUFModel:
    """What a GGUF file holds: the model (eval mode), its tokenizer and chat template, and the
    token ids generation needs (`eos_token_ids`: every id that ends a turn, first the EOS)."""

    model: nn.Module
    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    name: str
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)
    packed: dict[str, int] | None = None  # load_gguf(packed=True): maps kept as each block kind

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = False, **kwargs: Any
    ) -> str:
        """The conversation as the prompt text the model was trained on (the file's Jinja
        template, rendered as transformers' `apply_chat_template(tokenize=False)` does)."""
        from .gguf_tokenizer import render_chat

        if self.chat_template is None:
            raise ValueError(
                f"{self.name} has no tokenizer.chat_template: format the prompt yourself"
            )
        return render_chat(
            self.chat_template, messages, self.metadata, add_generation_prompt, **kwargs
        )


# --- metadata ------------------------------------------------------------------------------------


def _value(f) -> Any:
    """A `gguf.ReaderField` as a Python value (str, int, float, bool, or a list of them). A
    float32 is given as the shortest decimal that rounds to it (1e-05, not 9.99999974e-06), the
    number config.json held."""
    from gguf import GGUFValueType

    def one(part, kind) -> Any:
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        if kind == GGUFValueType.FLOAT32:
            return _shortest(part[0])
        return part[0].item()

    if f.types[0] == GGUFValueType.ARRAY:
        if f.types[-1] == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        if not f.data:
            return []
        return [one(f.parts[i], f.types[-1]) for i in f.data]
    return one(f.parts[f.data[0]], f.types[0])


def _shortest(x: Any) -> float:
    """A float32 as the shortest decimal that rounds back to it (numpy's str of a float32)."""
    return float(str(np.float32(x)))


def read_metadata(reader) -> dict[str, Any]:
    """Every key of a `gguf.GGUFReader` except the file-format ones (GGUF.version, ...)."""
    return {k: _value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


# --- config --------------------------------------------------------------------------------------


class _Keys:
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


@dataclass(frozen=True)
class Arch:
    """How one GGUF architecture maps onto a transformers family (whose converter reads it).
    Every fact cites llama.cpp: its converter (convert_hf_to_gguf.py, the conversion/ package)
    for what the file holds, its loader (src/llama-model.cpp) for what it leaves implicit."""

    model_type: str  # the converter (src/attnlab/interop/<family>.py) that reads the config dict
    permuted: bool = False  # q/k rows reordered (LlamaModel.permute: llama, smollm3, granite)
    norm_offset: bool = False  # norms stored as 1 + w (Gemma2Model / Gemma3Model.modify_tensors)
    names: dict[str, str] = field(default_factory=dict)  # block names that differ from _BLOCK
    own_names: bool = False  # `names` is the whole block table (GPT-2), not changes to _BLOCK
    global_names: dict[str, str] = field(default_factory=lambda: _GLOBAL)
    block_prefix: str = "model.layers"
    conv1d: tuple[str, ...] = ()  # block tensors transformers stores (in, out) (GPT-2's Conv1D)
    interleaved_qkv: bool = (
        False  # transformers' fused q/k/v rows are (H, 3, D), the file's [q|k|v]
    )
    grouped_qkv: bool = False  # transformers' are (KV, H/KV + 2, D) (Falcon), the file's [q|k|v]
    extra: Any = None  # (keys, meta, hf dict, tensors) -> the family's config keys


def _llama(k: _Keys, meta, hf, tensors) -> dict:
    """Llama 3's scaling from `rope_freqs` (LlamaModel.generate_extra_tensors writes no scaling
    keys, only that tensor): recovered as the llama3 parameters that reproduce it."""
    if "rope_freqs.weight" not in tensors:
        return {}
    rope = dict(hf["rope_parameters"])
    rope.update(
        llama3_from_factors(tensors["rope_freqs.weight"], rope["rope_theta"], hf["head_dim"], k)
    )
    return {"rope_parameters": rope}


def _smollm3(k: _Keys, meta, hf, tensors) -> dict:
    """No RoPE in every 4th layer: llama.cpp has no key for it, its loader hard-codes
    `hparams.n_no_rope_layer_step = 4` (src/llama-model.cpp, LLM_ARCH_SMOLLM3) and rotates layer
    il unless (il + 1) % 4 == 0, as SmolLM3Config's no_rope_layer_interval = 4."""
    n = hf["num_hidden_layers"]
    return dict(
        _llama(k, meta, hf, tensors),
        no_rope_layer_interval=4,
        no_rope_layers=[int((i + 1) % 4 != 0) for i in range(n)],
        use_sliding_window=False,
    )


def _granite(k: _Keys, meta, hf, tensors) -> dict:
    """GraniteModel.set_gguf_parameters's four multipliers (conversion/granite.py)."""
    return dict(
        _llama(k, meta, hf, tensors),
        embedding_multiplier=k("embedding_scale", 1.0),
        residual_multiplier=k("residual_scale", 1.0),
        attention_multiplier=k("attention.scale", 1.0 / hf["head_dim"] ** 0.5),
        logits_scaling=k("logit_scale", 1.0),
    )


def _query_scalar(k: _Keys, hf: dict, big: int) -> int:
    """Gemma's query_pre_attn_scalar, which the file does not hold: llama.cpp's loader scales
    queries by 1/sqrt(d_model / heads) for the 27B models (identified by their layer count:
    Gemma 2 46, Gemma 3 62) and 1/sqrt(head_dim) otherwise (src/llama-model.cpp,
    `f_attention_scale`, after gemma_pytorch's config.py)."""
    return (
        hf["hidden_size"] // hf["num_attention_heads"]
        if hf["num_hidden_layers"] == big
        else hf["head_dim"]
    )


def _gemma2(k: _Keys, meta, hf, tensors) -> dict:
    """Gemma 2: soft-caps, the window on even layers (llama.cpp: `set_swa_pattern(2)`), GELU-tanh,
    the embedding tied (Gemma2Model drops lm_head)."""
    n = hf["num_hidden_layers"]
    return dict(
        query_pre_attn_scalar=_query_scalar(k, hf, 46),
        sliding_window=k("attention.sliding_window", 4096),  # llama.cpp's default for Gemma 2
        attn_logit_softcapping=k("attn_logit_softcapping", None),
        final_logit_softcapping=k("final_logit_softcapping", None),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    )


def _gemma3(k: _Keys, meta, hf, tensors) -> dict:
    """Gemma 3: five local layers to one global (llama.cpp: `set_swa_pattern(6)`), the local
    layers' RoPE base rope.freq_base_swa (llama.cpp's loader: 10000 when absent) unscaled, the
    global ones' rope.freq_base with the file's scaling."""
    n = hf["num_hidden_layers"]
    full = dict(hf["rope_parameters"])
    return dict(
        model_type="gemma3_text",
        query_pre_attn_scalar=_query_scalar(k, hf, 62),
        sliding_window=k("attention.sliding_window"),
        final_logit_softcapping=k("final_logit_softcapping", None),
        attn_logit_softcapping=None,
        layer_types=[
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)
        ],
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={
            "full_attention": full,
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": k("rope.freq_base_swa", 10000.0),
            },
        },
    )


def _phi3(k: _Keys, meta, hf, tensors) -> dict:
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
            long_factor=[_shortest(x) for x in tensors["rope_factors_long.weight"]],
            short_factor=[_shortest(x) for x in tensors["rope_factors_short.weight"]],
            original_max_position_embeddings=original,
        )
        out["original_max_position_embeddings"] = original  # Phi3Config keeps it at the top
        scale = hf["max_position_embeddings"] / original
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        factor = k("rope.scaling.attn_factor", default)
        if not math.isclose(factor, default, rel_tol=1e-6):  # transformers' own default otherwise
            rope["attention_factor"] = factor
    out["rope_parameters"] = rope
    return out


def _moe(k: _Keys, experts_key: str) -> dict:
    return {
        experts_key: k("expert_count"),
        "num_experts_per_tok": k("expert_used_count"),
        "moe_intermediate_size": k("expert_feed_forward_length"),
    }


def _qwen3moe(k: _Keys, meta, hf, tensors) -> dict:
    """Qwen3-MoE: every layer sparse; llama.cpp renormalises the top-k weights unconditionally
    (src/models/qwen3moe.cpp, norm_w = true), which is norm_topk_prob = True."""
    return dict(
        _moe(k, "num_experts"), norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]
    )


def _gpt_oss(k: _Keys, meta, hf, tensors) -> dict:
    """GPT-OSS: sinks, biases, the window on even layers (llama.cpp: `set_swa_pattern(2)`), the
    clamped SwiGLU's limit 7.0 and YaRN without truncation, none of which the file states:
    llama.cpp hard-codes the limit (LLM_FFN_SWIGLU_OAI_MOE in src/models/openai-moe-iswa.cpp)
    and every released config.json sets rope_parameters.truncate false."""
    n = hf["num_hidden_layers"]
    moe = _moe(k, "num_local_experts")
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


def _deepseek2(k: _Keys, meta, hf, tensors) -> dict:
    """DeepSeek-V2 / V3 (DeepseekV2Model in conversion/deepseek.py): MLA written as MQA with
    key_length = kv_lora_rank + rope dims; the per-head sizes are the *_mla keys; sigmoid gating
    (expert_gating_func 2) is V3's. llama.cpp keeps only 0.1·mscale_all_dim of YaRN's mscales
    (rope.scaling.yarn_log_multiplier); both are set from it (V2's and V3's configs have them
    equal), which makes YaRN's attention factor 1 and the softmax scale mscale²/sqrt(d)."""
    rope_dim = k("rope.dimension_count")
    gating = k("expert_gating_func", 1)  # llama.cpp: softmax when absent (V2 files)
    out = dict(
        _moe(k, "n_routed_experts"),
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


def _cohere(k: _Keys, meta, hf, tensors) -> dict:
    """Command R (CommandR2Model): LayerNorm (layer_norm_epsilon), a logit scale, qk-norm when
    its tensors are there, the head tied to the embedding."""
    return dict(
        layer_norm_eps=k("attention.layer_norm_epsilon"),
        logit_scale=k("logit_scale"),
        use_qk_norm="blk.0.attn_q_norm.weight" in tensors,
        tie_word_embeddings=True,
    )


def _olmo2(k: _Keys, meta, hf, tensors) -> dict:
    """OLMo 2: names only. Olmo2Model also writes OLMo 3 (a window on three layers of four,
    attention.sliding_window / _pattern), which transformers' olmo2 family does not have."""
    if k("attention.sliding_window", None) is not None:
        k.refuse(
            "attention.sliding_window",
            "an OLMo 3 file (sliding-window layers); attnlab reads OLMo 2 (no window) only",
        )
    return {}


def qkv_per_head(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Fused q/k/v rows [q | k | v] (3·H·D, ...) -> transformers' GPT-NeoX / BLOOM order, each
    head's q, k, v together ((H, 3, D) rows): the inverse of the converters' re-format."""
    rows = w.shape[0]
    return w.reshape(3, heads, rows // 3 // heads, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def qkv_grouped(w: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Fused q/k/v rows [q_1..q_H | k_1..k_KV | v_1..v_KV] -> Falcon's, one group per KV head of
    its H/KV queries, its key and its value ((KV, H/KV + 2, D) rows): the inverse of
    FalconModel.modify_tensors's "jploski" re-order."""
    d = w.shape[0] // (heads + 2 * kv_heads)
    rest = w.shape[1:]
    q, k, v = w.split((heads * d, kv_heads * d, kv_heads * d))
    q = q.reshape(kv_heads, heads // kv_heads, d, *rest)
    k, v = (x.reshape(kv_heads, 1, d, *rest) for x in (k, v))
    return torch.cat((q, k, v), dim=1).reshape(w.shape)


def _falcon(k: _Keys, meta, hf, tensors) -> dict:
    """Falcon (FalconModel.set_gguf_parameters): the layout from the head counts and the norms —
    one KV head and one norm: the 7B (multi-query), every head its own KV and one norm: the
    legacy multi-head layout, else the new decoder architecture (40B: attn_norm_2 is ln_attn,
    attn_norm ln_mlp; 11B: one norm); always the parallel block (llama.cpp's only one)."""
    layout = k("tensor_data_layout", "jploski")
    if layout != "jploski":
        k.refuse("tensor_data_layout", "only the 'jploski' q/k/v order (the converter's) is read")
    heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    two_norms = "blk.0.attn_norm_2.weight" in tensors
    if two_norms or kv not in (1, heads):
        shape = dict(new_decoder_architecture=True, num_ln_in_parallel_attn=2 if two_norms else 1)
    else:
        shape = dict(new_decoder_architecture=False, multi_query=kv == 1)
    return dict(
        shape,
        num_kv_heads=kv,
        parallel_attn=True,
        alibi=False,
        bias="blk.0.attn_qkv.bias" in tensors,
        ffn_hidden_size=k("feed_forward_length", None),
        layer_norm_epsilon=k("attention.layer_norm_epsilon"),
        activation="gelu",
    )


def _gptneox(k: _Keys, meta, hf, tensors) -> dict:
    """GPT-NeoX (GPTNeoXModel.set_gguf_parameters): the rotated fraction of each head, the
    parallel residual, LayerNorm's epsilon; RoPE's base only if the file states one (the
    converter writes none, llama.cpp then uses 10000)."""
    return dict(
        rotary_pct=k("rope.dimension_count", hf["head_dim"]) / hf["head_dim"],
        rotary_emb_base=k("rope.freq_base", 10000.0),
        use_parallel_residual=bool(k("use_parallel_residual", True)),
        layer_norm_eps=k("attention.layer_norm_epsilon"),
        hidden_act="gelu",
        attention_bias="blk.0.attn_qkv.bias" in tensors,
    )


def _bloom(k: _Keys, meta, hf, tensors) -> dict:
    """BLOOM (BloomModel.set_gguf_parameters): ALiBi (no positions), LayerNorm's epsilon, an
    embedding norm; the head tied unless the file holds one (the converter writes a copy of the
    embedding as output.weight, so a file it wrote reads back untied, with equal values)."""
    return dict(layer_norm_epsilon=k("attention.layer_norm_epsilon"))


def _mpt(k: _Keys, meta, hf, tensors) -> dict:
    """MPT (MPTModel.set_gguf_parameters): the context, ALiBi's maximum bias (0 for none),
    clip_qkv as clamp_kqv, LayerNorm's epsilon; no biases unless the file holds them."""
    bias_max = k("attention.max_alibi_bias", 0.0)
    return dict(
        max_seq_len=k("context_length"),
        layer_norm_epsilon=k("attention.layer_norm_epsilon"),
        attn_config=dict(
            alibi=bias_max > 0,
            alibi_bias_max=int(bias_max) if float(bias_max).is_integer() else bias_max,
            clip_qkv=k("attention.clamp_kqv", None),
        ),
        no_bias="blk.0.attn_qkv.bias" not in tensors,
    )


def _gpt2(k: _Keys, meta, hf, tensors) -> dict:
    """GPT-2 (GPT2Model.set_gguf_parameters): n_ctx is the position table, LayerNorm's epsilon,
    the FFN width; tanh-GELU and scaled scores, which the file does not state, as every GPT-2."""
    return dict(
        n_positions=k("context_length"),
        n_inner=k("feed_forward_length", None),
        layer_norm_epsilon=k("attention.layer_norm_epsilon"),
        activation_function="gelu_new",
    )


# general.architecture -> its family
ARCHITECTURES = {
    "llama": Arch("llama", permuted=True, extra=_llama),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3"),
    "smollm3": Arch("smollm3", permuted=True, extra=_smollm3),
    "granite": Arch("granite", permuted=True, extra=_granite),
    "gemma2": Arch("gemma2", norm_offset=True, names=_GEMMA, extra=_gemma2),
    "gemma3": Arch("gemma3_text", norm_offset=True, names=_GEMMA, extra=_gemma3),
    "phi3": Arch("phi3", names=_PHI3, extra=_phi3),
    "qwen3moe": Arch("qwen3_moe", extra=_qwen3moe),
    "olmo2": Arch("olmo2", extra=_olmo2),
    "deepseek2": Arch("deepseek_v3", names=_DEEPSEEK, extra=_deepseek2),
    "gpt-oss": Arch("gpt_oss", names=_GPT_OSS, extra=_gpt_oss),
    "command-r": Arch("cohere", extra=_cohere),
    "gpt2": Arch(
        "gpt2",
        names=_GPT2,
        own_names=True,
        global_names=_GPT2_GLOBAL,
        block_prefix="transformer.h",
        conv1d=("attn_qkv", "attn_output", "ffn_up", "ffn_down"),
        extra=_gpt2,
    ),
    "gptneox": Arch(
        "gpt_neox",
        names=_NEOX_BLOCK,
        own_names=True,
        global_names=_NEOX_GLOBAL,
        block_prefix="gpt_neox.layers",
        interleaved_qkv=True,
        extra=_gptneox,
    ),
    "mpt": Arch(
        "mpt",
        names=_MPT_BLOCK,
        own_names=True,
        global_names=_MPT_GLOBAL,
        block_prefix="transformer.blocks",
        extra=_mpt,
    ),
    "falcon": Arch(
        "falcon",
        names=_FALCON_BLOCK,
        own_names=True,
        global_names=_FALCON_GLOBAL,
        block_prefix="transformer.h",
        grouped_qkv=True,
        extra=_falcon,
    ),
    "bloom": Arch(
        "bloom",
        names=_BLOOM_BLOCK,
        own_names=True,
        global_names=_BLOOM_GLOBAL,
        block_prefix="transformer.h",
        interleaved_qkv=True,
        extra=_bloom,
    ),
}
_MOE = ("qwen3moe", "deepseek2", "gpt-oss")  # the architectures whose experts attnlab reads
_LAYERNORM = ("gpt2", "gptneox", "bloom", "mpt", "falcon")  # their own epsilon key
_SCALINGS = {  # rope.scaling.type -> what each architecture's converter writes with it
    "none": (), "linear": ("*",), "yarn": ("gpt-oss", "deepseek2"), "longrope": ("phi3",),
}  # fmt: skip


def llama3_from_factors(
    factors: np.ndarray, base: float, head_dim: int, k: _Keys | None = None
) -> dict[str, Any]:
    """Llama 3's scaling parameters from the `rope_freqs` llama.cpp wrote (the divisor of each
    frequency: 1 above the band, `factor` below, 1/((1 - s)/factor + s) in it, s linear in the
    frequency). Only original_max_len / low_freq_factor and / high_freq_factor are identifiable,
    so low_freq_factor is taken as 1 (Meta's value); the parameters are then checked to give
    back every factor of the file (to float32 rounding), else refused."""
    r = np.asarray(factors, dtype=np.float64)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factor = float(r.max())
    inner = np.flatnonzero((r > 1 + 1e-6) & (r < factor * (1 - 1e-6)))
    candidates = [(8192.0, 4.0)]  # llama.cpp's defaults (Llama 3.1, lf 1, hf 4)
    if len(inner) >= 2 and factor > 1:  # s = a·freq + b with a = L/(2π(hf - 1)), b = -1/(hf - 1)
        s = (1 / r[inner] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(freqs[inner], s, 1)
        if b < 0:
            high = 1 - 1 / b
            candidates.insert(0, (a * 2 * math.pi * (high - 1), high))
    elif len(inner) == 1:  # with hf = 4: s = (L/λ - 1)/3
        wavelen = 2 * math.pi / freqs[inner[0]]
        s = (1 / r[inner[0]] - 1 / factor) / (1 - 1 / factor)
        candidates.insert(0, (wavelen * (3 * s + 1), 4.0))
    for length, high in candidates:
        length = round(length) if abs(length - round(length)) < 1e-3 * length else length
        if factor == 1 or length != int(length):
            continue
        high = float(f"{high:.6g}")
        if np.allclose(_llama3_factors(freqs, factor, 1.0, high, length), r, rtol=1e-5, atol=0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(length),
            }
    if k is not None:
        k.problems.add(
            f"rope_freqs.weight = {np.round(r, 4).tolist()}: these frequency divisors are not "
            "Llama 3's RoPE scaling (no factor, low/high_freq_factor and original context give "
            "them), the one kind of rope_freqs attnlab computes"
        )
    return {}


def _llama3_factors(freqs, factor, low, high, length) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors formula (the divisor of each frequency)."""
    wavelen = 2 * math.pi / freqs
    smooth = (length / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < length / high, 1.0, np.where(wavelen > length / low, factor, mid))


def _decoder_config(
    arch: str, meta: dict[str, Any], tensors: dict[str, Any], problems: Problems
) -> dict[str, Any]:
    """llama.cpp's `<arch>.*` keys as the transformers config dict they were written from
    (convert_hf_to_gguf.py); `tensors` maps each tensor name to its shape, or its values for the
    small ones the config needs (rope_freqs, rope_factors_*); features attnlab does not compute
    go to `problems`."""
    key = _Keys(arch, meta, problems)
    spec = ARCHITECTURES[arch]
    heads = key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    d_model = key("embedding_length")
    if isinstance(kv_heads, list) or isinstance(heads, list):
        problems.add(
            f"{arch}.attention.head_count(_kv) = {heads!r} / {kv_heads!r}: a head count per "
            "layer is not supported (attnlab builds every layer with the same heads)"
        )
        heads = heads[0] if isinstance(heads, list) else heads
        kv_heads = kv_heads[0] if isinstance(kv_heads, list) else kv_heads
    head_dim = key("attention.key_length", d_model // heads if isinstance(heads, int) else 0)
    if arch == "deepseek2":  # MLA's MQA form: the per-head sizes are the *_mla keys
        head_dim = key("attention.key_length_mla", head_dim)
    elif key("attention.value_length", head_dim) != head_dim:
        key.refuse("attention.value_length", f"differs from key_length ({head_dim}): not supported")
    rot = key("rope.dimension_count", head_dim)
    if rot != head_dim and arch not in ("phi3", "deepseek2", "gptneox"):
        key.refuse(
            "rope.dimension_count",
            f"is not the head size ({head_dim}): partial rotary models are not supported",
        )
    if key("expert_count", 0) and arch not in _MOE:
        key.refuse("expert_count", f"mixture-of-experts {arch} files are not supported")
    if isinstance(key("feed_forward_length", 0), list):
        key.refuse("feed_forward_length", "a width per layer is not supported")
    scaling = key("rope.scaling.type", "none")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": key("rope.freq_base", 10000.0)}
    allowed = _SCALINGS.get(scaling)
    if scaling == "linear":
        rope.update(rope_type="linear", factor=key("rope.scaling.factor"))
    elif scaling == "yarn" and allowed and arch in allowed:
        rope.update(
            rope_type="yarn",
            factor=key("rope.scaling.factor"),
            original_max_position_embeddings=key("rope.scaling.original_context_length"),
            beta_fast=key("rope.scaling.yarn_beta_fast", 32.0),
            beta_slow=key("rope.scaling.yarn_beta_slow", 1.0),
        )
    elif scaling not in ("none", "longrope") or (scaling == "longrope" and arch != "phi3"):
        key.refuse(
            "rope.scaling.type",
            "supported: 'none' and 'linear' everywhere, 'yarn' for gpt-oss and deepseek2, "
            "'longrope' for phi3 (with its rope_factors tensors)",
        )
    embed = tensors.get("token_embd.weight")
    hf = dict(
        model_type=spec.model_type,
        vocab_size=(
            embed[0]
            if isinstance(embed, tuple)
            else key("vocab_size", len(meta.get("tokenizer.ggml.tokens", ())) or None)
        ),
        hidden_size=d_model,
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=key("feed_forward_length", None),
        rms_norm_eps=key(
            "attention.layer_norm_rms_epsilon",
            dict(dict.fromkeys(_LAYERNORM), **{"command-r": 1e-6}).get(
                arch, ...
            ),  # the LayerNorm families: None (their own key)
        ),
        rope_parameters=rope,
        max_position_embeddings=key("context_length", 2048),
        sliding_window=None,  # llama.cpp keeps none for the llama layout
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_output.bias" in tensors or "blk.0.attn_q.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    if arch in ("qwen2", "qwen3", "llama"):
        hf["attention_bias"] = "blk.0.attn_output.bias" in tensors  # Llama / Qwen3: all four
    if spec.extra is not None:
        hf.update(spec.extra(key, meta, hf, tensors))
    return hf


# --- tensors -------------------------------------------------------------------------------------


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows [0, D/2, 1, D/2+1, ...] -> [0, 1, ..., D-1]
    (its permute reshapes to (H, 2, D/2, ...) and swaps axes 1 and 2; this is the inverse)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def _dequantize(t) -> torch.Tensor:
    """One `gguf.ReaderTensor` as a float32 tensor in transformers' (out, in) layout."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    if t.tensor_type in (Q.F32, Q.F16, Q.F64):  # the reader already gives them typed
        data = np.array(t.data, dtype=np.float32)  # a copy: the file is mapped read-only
    else:
        try:
            data = dequantize(t.data, t.tensor_type)
        except NotImplementedError as err:
            raise ConversionError(
                f"tensor {t.name} is stored as {t.tensor_type.name}, which the installed gguf "
                f"package cannot dequantize ({err}); upgrade it (pip install -U gguf) or "
                "re-quantize the model to a common type (Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, F16)"
            ) from err
    return torch.from_numpy(np.ascontiguousarray(data).reshape(tuple(reversed(t.shape.tolist()))))


# bytes per block of the types whose scales `_block_scales` reads (gguf-py `quants.py`)
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}


def _fp16(b: np.ndarray, at: int) -> np.ndarray:
    """Column `at` .. at + 2 of byte rows b as fp16 values, widened to fp32."""
    return np.ascontiguousarray(b[:, at : at + 2]).view(np.float16)[:, 0].astype(np.float32)


def _block_scales(t) -> tuple[str, np.ndarray, np.ndarray | None] | None:
    """The scales a quantized tensor states per block of 32 weights, in memory order, as
    quant_blocks.BlockScales takes them: ("q4", d, m) for w = d·q + m, ("q8", d, None) for
    w = d·q, ("q8", d of the first 16, d of the second) for Q6_K; None for a type without such
    blocks (Q5_1, Q5_K, floats, ...). Q4_K's 256 weights have fp16 d, dmin and 6-bit sc, mn per
    sub-block of 32 (12 bytes: sc[j] and mn[j] are the low 6 bits of bytes j and j + 4 for j < 4;
    for j >= 4 the nibbles of byte j + 4 with the top 2 bits of bytes j − 4 and j above them):
    w = (d·sc)·q − dmin·mn. Q6_K's 256 have 192 bytes of 6-bit quants, an int8 sc per 16 and an
    fp16 d: w = (d·sc)·(q − 32). The products are exact in fp32, as the gguf package's
    dequantization forms them."""
    kind = t.tensor_type.name
    if kind not in _BLOCK_BYTES:
        return None
    b = np.asarray(t.data).view(np.uint8).reshape(-1, _BLOCK_BYTES[kind])
    if kind == "Q6_K":
        sc = b[:, 192:208].copy().view(np.int8).astype(np.float32).reshape(-1, 8, 2)
        half = _fp16(b, 208)[:, None, None] * sc
        return "q8", half[..., 0].ravel(), half[..., 1].ravel()
    d = _fp16(b, 0)
    if kind == "Q4_0":  # w = d·(q − 8)
        return "q4", d, -8 * d
    if kind == "Q4_1":
        return "q4", d, _fp16(b, 2)
    if kind in ("Q5_0", "Q8_0"):  # Q5_0: w = d·(q − 16) with q − 16 in [−16, 15]
        return "q8", d, None
    dmin = _fp16(b, 2)
    s = b[:, 4:16].astype(np.uint8).reshape(-1, 3, 4)
    low, high, mixed = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([low & 63, (mixed & 15) | ((low >> 6) << 4)], axis=1)
    mn = np.concatenate([high & 63, (mixed >> 4) | ((high >> 6) << 4)], axis=1)
    return (
        "q4",
        (d[:, None] * sc.astype(np.float32)).ravel(),
        -(dmin[:, None] * mn.astype(np.float32)).ravel(),
    )


def _block_names(spec: Arch) -> dict[str, str]:
    return spec.names if spec.own_names else {**_BLOCK, **spec.names}


def _hf_name(name: str, arch: str) -> str | None:
    """A GGUF tensor name as transformers'; None when attnlab has no place for it."""
    spec = ARCHITECTURES[arch]
    stem, _, kind = name.rpartition(".")
    if stem in spec.global_names:
        return f"{spec.global_names[stem]}.{kind}"
    parts = stem.split(".")
    block = _block_names(spec)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in block:
        hf = f"{spec.block_prefix}.{parts[1]}.{block[parts[2]]}"
        if parts[2] == "attn_sinks":  # a bare parameter (GptOssModel.filter_tensors adds .weight)
            return hf
        if parts[2] == "exp_probs_b":  # DeepSeek-V3's routing bias correction
            return f"{hf}.e_score_correction_bias"
        return f"{hf}.{kind}"
    return None


# the tensors llama.cpp generates for RoPE, read into the config instead
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _experts(sd: dict[str, torch.Tensor], arch: str, n_layers: int) -> None:
    """llama.cpp's stacked experts (E, out, in) per kind -> transformers-5's fused tensors:
    Qwen3-MoE / DeepSeek gate_up_proj (E, 2I, H) = [gate | up], down_proj (E, H, I); GPT-OSS
    gate_up_proj (E, H, 2I) with gate in the even columns and up in the odd ones, down_proj
    (E, I, H), biases alike (GptOssModel.modify_tensors splits them so)."""
    for i in range(n_layers):
        g, u, d = (f"blk.{i}.{kind}" for kind in _EXPERTS)
        if f"{g}.weight" not in sd:
            continue
        out = f"model.layers.{i}.mlp.experts"
        gate, up, down = (sd.pop(f"{n}.weight") for n in (g, u, d))
        if arch == "gpt-oss":
            sd[f"{out}.gate_up_proj"] = torch.stack((gate, up), dim=2).flatten(1, 2).transpose(1, 2)
            sd[f"{out}.down_proj"] = down.transpose(1, 2).contiguous()
            if f"{g}.bias" in sd:
                bias = torch.stack((sd.pop(f"{g}.bias"), sd.pop(f"{u}.bias")), dim=-1)
                sd[f"{out}.gate_up_proj_bias"] = bias.flatten(-2)
                sd[f"{out}.down_proj_bias"] = sd.pop(f"{d}.bias")
        else:
            sd[f"{out}.gate_up_proj"] = torch.cat((gate, up), dim=1)
            sd[f"{out}.down_proj"] = down


def _kv_b(sd: dict[str, torch.Tensor], n_layers: int) -> None:
    """DeepSeek's kv_b_proj from llama.cpp's attn_k_b (H, kv_lora, nope: transposed) and attn_v_b
    (H, v, kv_lora) (DeepseekV2Model.modify_tensors splits it so): rows (H, nope + v)."""
    for i in range(n_layers):
        kb, vb = f"blk.{i}.attn_k_b.weight", f"blk.{i}.attn_v_b.weight"
        if kb in sd and vb in sd:
            k, v = sd.pop(kb).transpose(1, 2), sd.pop(vb)  # (H, nope, kv_lora), (H, v, kv_lora)
            sd[f"blk.{i}.attn_kv_b.weight"] = torch.cat((k, v), dim=1).flatten(0, 1)


def read_weights(
    reader, hf: dict[str, Any], arch: str = "llama", scales: BlockScales | None = None
) -> dict[str, torch.Tensor]:
    """The file's tensors, dequantized, under transformers' names and in its layouts; `scales`
    (a quant_blocks.BlockScales) collects the blocks' stated scales (`_block_scales`)."""
    from tqdm.auto import tqdm

    spec = ARCHITECTURES[arch]
    sd = {}
    big = sum(int(t.n_bytes) for t in reader.tensors) > 256 * 2**20
    bar = tqdm(  # a bar on a terminal for files that take seconds; nothing elsewhere
        reader.tensors, desc="reading", unit=" tensors", leave=False, disable=None if big else True
    )
    for t in bar:
        if t.name in _ROPE_TENSORS:
            continue
        sd[t.name] = _dequantize(t)
        stated = _block_scales(t) if scales is not None else None
        if stated is not None:
            kind, d, m = stated
            scales.add(
                kind, sd[t.name], torch.from_numpy(d), None if m is None else torch.from_numpy(m)
            )
    n = hf["num_hidden_layers"]
    _experts(sd, arch, n)
    _kv_b(sd, n)
    unknown = [k for k in sd if _hf_name(k, arch) is None and ".mlp.experts." not in k]
    if unknown:
        raise ConversionError(
            f"GGUF {arch} tensors attnlab cannot place: {', '.join(unknown[:8])} (a variant of "
            f"the architecture attnlab does not read; supported tensors: "
            f"{', '.join(sorted(_block_names(spec)))} per block)"
        )
    out = {}
    for name, w in sd.items():
        if spec.permuted and ".attn_q." in name:
            w = _unpermute(w, hf["num_attention_heads"])
        elif spec.permuted and ".attn_k." in name:
            w = _unpermute(w, hf["num_key_value_heads"])
        if spec.norm_offset and name.endswith("norm.weight"):
            w = w - 1  # exact: fl(1 + w) - 1 has no rounding for |w| <= 1 (Sterbenz)
        if w.dim() == 2 and name.endswith(".weight") and name.split(".")[-2] in spec.conv1d:
            w = w.t().contiguous()
        if spec.interleaved_qkv and ".attn_qkv." in name:
            heads = hf.get("num_attention_heads") or hf["n_head"]
            w = qkv_per_head(w, heads)
        if spec.grouped_qkv and ".attn_qkv." in name:
            w = qkv_grouped(w, hf["num_attention_heads"], hf["num_key_value_heads"])
        out[name if ".mlp.experts." in name else _hf_name(name, arch)] = w
    if arch == "falcon" and "blk.0.attn_norm_2.weight" in sd:  # the 40B layout
        out = {k.replace(".input_layernorm.", ".ln_mlp."): v for k, v in out.items()}
    return out


# --- the whole file ------------------------------------------------------------------------------


def _reader(path: str | Path):
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise ImportError(
            "reading GGUF files needs the gguf package: pip install 'attnlab[gguf]' (or gguf)"
        ) from err
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file {path}")
    fix = "it is not a GGUF file the gguf package can read, or it is truncated: download or convert it again"
    with reading(path, "a GGUF file", fix):  # the reader checks the magic and the version;
        return GGUFReader(path)  # a file cut inside its header fails in it with an IndexError


def gguf_config(meta: dict[str, Any], tensors: dict[str, Any] | set[str]) -> dict[str, Any]:
    """The transformers config dict of a GGUF file's metadata. `tensors` names the file's tensors
    (they tell whether the output head is tied and whether projections carry biases), mapped to
    their shapes (the vocabulary is the embedding's rows) or, for llama.cpp's RoPE tensors
    (rope_freqs, rope_factors_long / _short), their values."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConversionError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    if isinstance(tensors, (set, frozenset)):
        tensors = dict.fromkeys(tensors)
    problems = Problems()
    hf = _decoder_config(arch, meta, tensors, problems)
    problems.raise_as(ConversionError, f"GGUF {arch} metadata for an exact conversion")
    return hf


def _tensor_facts(reader) -> dict[str, Any]:
    """Each tensor's (out, in) shape, the RoPE tensors' values."""
    return {
        t.name: _dequantize(t).numpy()
        if t.name in _ROPE_TENSORS
        else tuple(reversed(t.shape.tolist()))
        for t in reader.tensors
    }


def gguf_file_config(path: str | Path) -> tuple[dict[str, Any], ModelConfigT]:
    """(the transformers config dict, the attnlab config) a GGUF file's metadata describes,
    without reading its weights."""
    reader = _reader(path)
    with reading(path, "the GGUF metadata", _FIX):
        hf = gguf_config(read_metadata(reader), _tensor_facts(reader))
        return hf, converter_for(hf["model_type"]).config_from_hf(hf)


def gguf_file_tokenizer(path: str | Path):
    """The `tokenizers.Tokenizer` a GGUF file's tokenizer.* metadata describes."""
    from .gguf_tokenizer import tokenizer_from_gguf

    reader = _reader(path)
    with reading(path, "the GGUF metadata", _FIX):
        return tokenizer_from_gguf(read_metadata(reader))


def load_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    *,
    packed: bool = False,
    allow_nonfinite: bool = False,
) -> GGUFModel:
    """A GGUF file -> GGUFModel: the attnlab model with the dequantized weights (eval mode, in
    `dtype`), the tokenizer and chat template its metadata describes. Needs the `gguf` package,
    not `transformers`. Every failure of reading the file is an attnlab error naming it (a
    truncated or hostile file included); NaN or infinite weights are refused unless
    `allow_nonfinite`.

    packed: keep the file's Q4_0 / Q4_1 / Q4_K weights as 4-bit blocks and its Q8_0 / Q5_0 /
    Q6_K weights as 8-bit ones (fp32 models only): the projections fused (`al.fuse`, where the
    parts are of one block kind), then every weight that is exactly such blocks stored as them
    (`pack_exact` with the scales the file states, src/attnlab/nn/quant_blocks.py), a tied token
    table included, so the loaded model holds about the file's bytes and a decode step reads
    them; it computes the same weights (the dequantized model's, up to fp32 summation order).
    Other types (Q5_1, Q5_K, F16, ...) stay float. `GGUFModel.packed` counts the maps of each
    kind."""
    from ..build import build_model
    from .gguf_tokenizer import tokenizer_from_gguf

    reader = _reader(path)
    with reading(path, "the GGUF metadata", _FIX):
        meta = read_metadata(reader)
        hf = gguf_config(meta, _tensor_facts(reader))
        conv = converter_for(hf["model_type"])
        cfg = conv.config_from_hf(hf)
    model = build_model(cfg)  # refuses sizes this machine cannot hold (build.py)
    if packed and dtype != torch.float32:
        raise ValueError(f"load_gguf(packed=True) keeps blocks for fp32 models; got {dtype}")
    scales = None
    if packed:
        from ..nn.quant_blocks import BlockScales

        scales = BlockScales()
    with reading(path, "the GGUF tensors", _FIX):
        raw = read_weights(reader, hf, meta["general.architecture"], scales)
    if not allow_nonfinite:
        check_finite(raw, f"the tensors of {path}")
    with reading(path, "the GGUF tensors", _FIX):
        sd = conv.weights_from_hf(raw, cfg)
        check_loaded(f"load_gguf({path})", *model.load_state_dict(sd, strict=False))
    model.hf_model_type = conv.model_type  # for to_hf / save_pretrained
    model.context_length = hf["max_position_embeddings"]  # context_length, written back out
    eos = [
        meta[k]
        for k in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        )
        if k in meta
    ]
    model = model.to(dtype).eval()
    counts = None
    if packed:
        from ..nn.fuse import fuse
        from ..nn.quant_blocks import pack_exact, same_block_kind

        # q/k/v (gate/up) fused only where one block kind holds them all: Q4_K_M files store
        # attn_v as Q6_K beside Q4_K q and k in half the layers
        counts = pack_exact(fuse(model, alike=same_block_kind(scales)), scales)
    out = GGUFModel(
        model=model,
        tokenizer=tokenizer_from_gguf(meta),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)),
        name=meta.get("general.name") or Path(path).stem,
        metadata=meta,
        packed=counts,
    )
    _attach_generation(out)
    return out


def _attach_generation(g: GGUFModel) -> None:
    """`model.generation` (src/attnlab/decode/settings.py) from the file's special tokens, so
    `al.generate(g.model, ids)` stops where llama.cpp and transformers stop."""
    try:
        from ..decode.settings import GenerationSettings
    except ImportError:  # an attnlab without per-model generation settings
        return
    eos = g.eos_token_ids
    g.model.generation = GenerationSettings(
        bos_token_id=g.bos_token_id,
        eos_token_id=(eos[0] if len(eos) == 1 else tuple(eos)) if eos else None,
        pad_token_id=g.model.config.pad_token_id,
    )
