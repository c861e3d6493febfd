"""An attnlab model -> a GGUF file that llama.cpp (and ollama, LM Studio) runs, written as
llama.cpp's own converter (convert_hf_to_gguf.py and its conversion/ package) writes the
transformers checkpoint the model converts to.

    save_gguf(model, "model.gguf", vocab=vocab_from_gguf("source.gguf"), outtype="q8_0")

The model goes through its transformers converter first (src/attnlab/interop/<family>.py:
`config_to_hf`, `weights_to_hf`), so the file is what llama.cpp's converter would write from the
HF folder `save_pretrained` writes: the metadata keys each family's `set_gguf_parameters` writes
(`parameters`), llama.cpp's tensor names (the `gguf` package's TensorNameMap, as the converter
calls it) and its changes to the values (`tensors`): q/k rows permuted for the llama-derived
classes (llama, smollm3, granite), Gemma's norms stored as 1 + w, experts stacked per kind,
GPT-OSS's interleaved gate/up split, DeepSeek's kv_b_proj split, Falcon's q/k/v groups as
[q | k | v], Llama 3's frequency factors as
`rope_freqs`, Phi-3's LongRoPE factors as `rope_factors_long` / `_short`. The reader beside it
(src/attnlab/interop/gguf.py) undoes each change; tests/interop/gguf/test_gguf_write.py checks the
two against each other and against transformers.

Storage types follow the converter's `prepare_tensors`: 1-D tensors, norms, biases and MoE routers
stay F32; the other weights take `outtype` (f32, f16, bf16, q8_0, and the block types q4_0, q4_1,
q5_0, q5_1 that llama.cpp's `llama-quantize --pure` gives every weight); a tensor whose rows are
not whole blocks falls back to F16, as the converter does. The blocks are the `gguf` package's
quantizers (gguf.quants), llama.cpp's reference rounding. K-quants (q4_k, q6_k) are refused:
that package cannot write them; quantize an f16 file with llama.cpp's llama-quantize instead.

The tokenizer is written from a `Vocab`: the `tokenizer.*` keys of a GGUF file copied with their
types (`vocab_from_gguf`, what a model read from GGUF and trained here carries out again), or a
byte-level BPE tokenizer.json written as the converter's `_set_vocab_gpt2` writes it
(`vocab_from_tokenizer`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .converter import ConversionError, config_to_hf, converter_for, model_type_of

# transformers model_type -> llama.cpp's general.architecture (gguf.py's ARCHITECTURES, inverted)
ARCH_OF = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "smollm3": "smollm3",
    "granite": "granite", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3",
    "qwen3_moe": "qwen3moe", "olmo2": "olmo2", "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss", "cohere": "command-r", "gpt2": "gpt2",
    "gpt_neox": "gptneox", "bloom": "bloom", "mpt": "mpt", "falcon": "falcon",
}  # fmt: skip
_ENUM = {  # general.architecture -> the gguf package's MODEL_ARCH member
    "llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "smollm3": "SMOLLM3",
    "granite": "GRANITE", "gemma2": "GEMMA2", "gemma3": "GEMMA3", "phi3": "PHI3",
    "qwen3moe": "QWEN3MOE", "olmo2": "OLMO2", "deepseek2": "DEEPSEEK2", "gpt-oss": "GPT_OSS",
    "command-r": "COMMAND_R", "gpt2": "GPT2", "gptneox": "GPTNEOX", "bloom": "BLOOM",
    "mpt": "MPT", "falcon": "FALCON",
}  # fmt: skip
# fused q/k/v that transformers interleaves per head ((H, 3, D) rows) and the converters
# (GPTNeoXModel / BloomModel.modify_tensors) store as [q | k | v]
_INTERLEAVED = (".attention.query_key_value.", ".self_attention.query_key_value.")
# GPT-2's Conv1D weights, stored (in, out) by transformers, transposed by GPT2Model.modify_tensors
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
_PERMUTED = ("llama", "smollm3", "granite")  # LlamaModel.permute's classes
OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
_REFUSED = {
    "q4_k": "the gguf package cannot quantize K-quants",
    "q6_k": "the gguf package cannot quantize K-quants",
}


@dataclass(frozen=True)
class Vocab:
    """The `tokenizer.*` keys a GGUF file gets (and, from a GGUF source, its model card's
    `general.*` keys: license, languages, ...): (key, value, GGUFValueType, array element type)."""

    items: tuple[tuple[str, Any, Any, Any], ...]

    def get(self, key: str, default: Any = None) -> Any:
        return next((v for k, v, _, _ in self.items if k == key), default)


# general.* keys the writer states itself rather than copies
_OWN_GENERAL = ("architecture", "name", "type", "file_type", "quantization_version", "alignment")


def vocab_from_gguf(path: str | Path) -> Vocab:
    """Every `tokenizer.*` key of a GGUF file, and its model card's `general.*` keys (basename,
    license, languages, ...), with their stored types, to write unchanged."""
    from gguf import GGUFReader, GGUFValueType

    from .gguf import _value

    reader = GGUFReader(str(path))
    items = []
    for key, f in reader.fields.items():
        own = key.startswith("general.") and key.split(".", 1)[1] in _OWN_GENERAL
        if not key.startswith(("tokenizer.", "general.")) or own:
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        items.append((key, _value(f), f.types[0], sub))
    return Vocab(tuple(items))


def vocab_from_tokenizer(tok, vocab_size: int, **special: Any) -> Vocab:
    """A byte-level BPE `tokenizers.Tokenizer` (an HF folder's or a run's tokenizer.json) as
    llama.cpp's converter writes it: gguf_tokenizer.py `gguf_vocab_items`, whose keywords
    (chat_template, bos, eos, pad, pre) `special` passes on."""
    from gguf import GGUFValueType as V

    from .gguf_tokenizer import gguf_vocab_items

    kinds = {
        "str": (V.STRING, None), "u32": (V.UINT32, None), "bool": (V.BOOL, None),
        "[str]": (V.ARRAY, V.STRING), "[i32]": (V.ARRAY, V.INT32),
    }  # fmt: skip
    items = gguf_vocab_items(tok, vocab_size, **special)
    return Vocab(tuple((k, v, *kinds[kind]) for k, v, kind in items))


# --- metadata: each family's set_gguf_parameters -------------------------------------------------


def hparams(hf: dict) -> dict:
    """config.json as `TextModel.__init__` (conversion/base.py) sees it: top-level
    original_max_position_embeddings / partial_rotary_factor copied into rope_parameters."""
    rope = dict(hf.get("rope_parameters") or {})
    if "full_attention" not in rope:
        for key in ("original_max_position_embeddings", "partial_rotary_factor"):
            if key not in rope and hf.get(key) is not None:
                rope[key] = hf[key]
    return dict(hf, rope_parameters=rope)


def _as_config_json(model_type: str, hf: dict) -> dict:
    """attnlab's config dict for `model_type` as the converter reads transformers' config.json:
    no head_dim where transformers' config class has none (SmolLM3, OLMo 2: the converter then
    writes no key_length), DeepSeek-V3's sigmoid routing stated (its config.json says
    scoring_func "sigmoid", which the converter writes as expert_gating_func; without it
    llama.cpp routes with a softmax)."""
    hf = dict(hf, model_type=model_type)
    if model_type in ("smollm3", "olmo2"):
        default = hf["hidden_size"] // hf["num_attention_heads"]
        if hf.get("head_dim") in (None, default):
            hf.pop("head_dim", None)
    if model_type == "deepseek_v3":
        hf.setdefault("scoring_func", "sigmoid")
    return hparams(hf)


def _base_parameters(w, hp: dict) -> None:
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


def _llama_parameters(w, hp: dict) -> None:
    """LlamaModel.set_gguf_parameters (conversion/llama.py): the base, vocab_size, rope dims."""
    _base_parameters(w, hp)
    w.add_vocab_size(hp["vocab_size"])
    w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])


def _gemma2_parameters(w, hp: dict) -> None:
    """Gemma2Model.set_gguf_parameters (conversion/gemma.py): its own list, no RoPE base (llama.cpp
    then reads the default 10000), the soft-caps and the window."""
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
    w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])


def _gemma3_parameters(w, hp: dict) -> None:
    """Gemma3Model.set_gguf_parameters (conversion/gemma.py): the base, then the global layers'
    RoPE base, the final soft-cap (Gemma 3 has no attention one) and the window."""
    _base_parameters(w, hp)
    rope = hp["rope_parameters"]
    w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])


def _phi3_parameters(w, hp: dict) -> None:
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
        scale = hp["max_position_embeddings"] / rope["original_max_position_embeddings"]
        orig = rope["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
        )


def _deepseek2_parameters(w, hp: dict) -> None:
    """DeepseekV2Model.set_gguf_parameters (conversion/deepseek.py): MLA written as MQA (one KV
    head of kv_lora_rank + rope dims), the MoE keys, the YaRN log multiplier."""
    _base_parameters(w, dict(hp, num_key_value_heads=1))
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


def parameters(w, hp: dict, arch: str) -> None:
    """The `<arch>.*` keys llama.cpp's converter writes for `arch` from config.json `hp`."""
    import gguf

    if arch == "falcon":  # FalconModel.set_gguf_parameters (conversion/falcon.py)
        d = hp["hidden_size"]
        w.add_context_length(hp.get("max_position_embeddings", 2048))  # the converter: 2048
        w.add_tensor_data_layout("jploski")  # the q/k/v re-order below
        w.add_embedding_length(d)
        w.add_feed_forward_length(hp.get("ffn_hidden_size") or 4 * d)  # the converter: 4 d
        w.add_block_count(hp["num_hidden_layers"])
        w.add_head_count(hp["num_attention_heads"])
        w.add_head_count_kv(falcon_kv_heads(hp))
        w.add_layer_norm_eps(hp["layer_norm_epsilon"])
        base = (hp.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        if base != 10000.0:  # the converter writes no base (llama.cpp's default is 10000)
            w.add_rope_freq_base(base)
    elif arch == "gptneox":  # GPTNeoXModel.set_gguf_parameters (conversion/gptneox.py)
        w.add_context_length(hp["max_position_embeddings"])
        w.add_embedding_length(hp["hidden_size"])
        w.add_block_count(hp["num_hidden_layers"])
        w.add_feed_forward_length(hp["intermediate_size"])
        rope = hp.get("rope_parameters") or {}
        fraction = rope.get("partial_rotary_factor") or hp.get("rotary_pct", 1.0)
        w.add_rope_dimension_count(int(fraction * (hp["hidden_size"] // hp["num_attention_heads"])))
        w.add_head_count(hp["num_attention_heads"])
        w.add_parallel_residual(hp.get("use_parallel_residual", True))
        w.add_layer_norm_eps(hp["layer_norm_eps"])
        base = rope.get("rope_theta") or hp.get("rotary_emb_base") or 10000.0
        if base != 10000.0:  # the converter writes no base (llama.cpp's default is 10000)
            w.add_rope_freq_base(base)
    elif arch == "bloom":  # BloomModel.set_gguf_parameters (conversion/bloom.py)
        d = hp["hidden_size"]
        w.add_context_length(hp.get("seq_length", d))  # its fallback when config.json has none
        w.add_embedding_length(d)
        w.add_feed_forward_length(4 * d)
        w.add_block_count(hp["n_layer"])
        w.add_head_count(hp["n_head"])
        w.add_head_count_kv(hp["n_head"])
        w.add_layer_norm_eps(hp["layer_norm_epsilon"])
    elif arch == "mpt":  # MPTModel.set_gguf_parameters (conversion/mpt.py)
        attn = {
            "alibi": True,
            "alibi_bias_max": 8,
            "clip_qkv": None,
            **(hp.get("attn_config") or {}),
        }
        w.add_context_length(hp.get("max_seq_len", 2048))
        w.add_embedding_length(hp["d_model"])
        w.add_block_count(hp["n_layers"])
        w.add_feed_forward_length(4 * hp["d_model"])
        w.add_head_count(hp["n_heads"])
        if kv := attn.get("kv_n_heads"):
            w.add_head_count_kv(kv)
        w.add_layer_norm_eps(hp.get("layer_norm_epsilon", 1e-5))  # the converter: always 1e-5
        if attn["clip_qkv"] is not None:
            w.add_clamp_kqv(attn["clip_qkv"])
        w.add_max_alibi_bias(float(attn["alibi_bias_max"]) if attn["alibi"] else 0.0)
    elif arch == "gpt2":  # GPT2Model.set_gguf_parameters (conversion/gpt2.py)
        w.add_block_count(hp["n_layer"])
        w.add_context_length(hp.get("n_ctx") or hp["n_positions"])
        w.add_embedding_length(hp["n_embd"])
        w.add_feed_forward_length(hp.get("n_inner") or 4 * hp["n_embd"])
        w.add_head_count(hp["n_head"])
        w.add_layer_norm_eps(hp["layer_norm_epsilon"])
    elif arch in ("llama", "smollm3"):  # SmolLM3Model(LlamaModel) adds nothing
        _llama_parameters(w, hp)
    elif arch == "granite":  # GraniteModel: head_dim popped, the four multipliers
        _llama_parameters(w, {k: v for k, v in hp.items() if k != "head_dim"})
        w.add_attention_scale(hp["attention_multiplier"])
        w.add_embedding_scale(hp["embedding_multiplier"])
        w.add_residual_scale(hp["residual_multiplier"])
        w.add_logit_scale(hp["logits_scaling"])
    elif arch == "gemma2":
        _gemma2_parameters(w, hp)
    elif arch == "gemma3":
        _gemma3_parameters(w, hp)
    elif arch == "phi3":
        _phi3_parameters(w, hp)
    elif arch == "deepseek2":
        _deepseek2_parameters(w, hp)
    elif arch == "qwen3moe":  # Qwen2MoeModel.set_gguf_parameters (conversion/qwen.py)
        _base_parameters(w, hp)
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    elif arch == "gpt-oss":  # GptOssModel.set_gguf_parameters (conversion/gpt_oss.py)
        _base_parameters(w, hp)
        w.add_sliding_window(hp["sliding_window"])
        w.add_expert_feed_forward_length(hp["intermediate_size"])
    elif arch == "command-r":  # CommandR2Model (conversion/command_r.py): logit scale, no scaling
        context = hp.get("model_max_length") or hp["max_position_embeddings"]  # its __init__
        _base_parameters(w, dict(hp, max_position_embeddings=context))
        w.add_logit_scale(hp["logit_scale"])
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    else:  # qwen2, qwen3, olmo2: the base alone (conversion/qwen.py, olmo.py)
        _base_parameters(w, hp)


def falcon_kv_heads(hp: dict) -> int:
    """Falcon's key/value heads as its model computes them: num_kv_heads in the new decoder
    architecture, else 1 for multi_query and every head otherwise. (The converter reads
    num_kv_heads, or 1 when config.json has none, as the hub's 7B has none; a config.json
    transformers wrote states num_kv_heads = num_attention_heads for the multi-query 7B too,
    which would make the file a multi-head model its weights do not fit.)"""
    if hp.get("new_decoder_architecture"):
        return hp.get("num_kv_heads") or hp["num_attention_heads"]
    return 1 if hp.get("multi_query", True) else hp["num_attention_heads"]


def llama_cpp_fit(hp: dict, arch: str) -> None:
    """Refuse, naming the part, a checkpoint transformers holds but llama.cpp's graph for `arch`
    does not compute (src/models/<arch>.cpp): Falcon with a sequential block or linear biases.
    Warn where llama.cpp computes it differently: DeepSeek-V2's group-limited greedy routing
    over more than one group (measured by benchmarks/check_llamacpp.py: the tiny V2 with two
    groups departs from transformers by 0.064 in llama.cpp, with one group it agrees within 1e-4;
    the groups are chosen otherwise in llama.cpp)."""
    groups = hp.get("n_group") or 1
    used = hp.get("topk_group") or groups
    if arch == "deepseek2" and hp.get("topk_method") == "group_limited_greedy" and used < groups:
        warnings.warn(
            f"DeepSeek-V2's group-limited routing ({used} of {groups} expert groups) is not "
            "llama.cpp's: the file loads, but llama.cpp routes some tokens to other experts "
            "than transformers and attnlab do",
            RuntimeWarning,
            stacklevel=3,
        )
    if arch != "falcon":
        return
    if not hp.get("parallel_attn", True):
        raise ConversionError(
            "a sequential Falcon block (parallel_attn false: attention, then the FFN, two norms) "
            "has no llama.cpp graph (llama.cpp's falcon runs attention and the FFN in parallel, "
            "residual 'parallel' or 'parallel-shared-norm'); save an HF folder instead "
            "(`attnlab convert SRC DIR --to hf`)"
        )
    if hp.get("bias"):
        raise ConversionError(
            "Falcon with linear biases (bias true) has no llama.cpp graph (llama.cpp's falcon "
            "loads no q/k/v, output or FFN biases); save an HF folder instead "
            "(`attnlab convert SRC DIR --to hf`)"
        )


# --- tensors -------------------------------------------------------------------------------------


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (conversion/llama.py), written from its definition:
    each head's rows from "rotate half" order to interleaved pairs."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_rope_factors(hp: dict) -> np.ndarray:
    """LlamaModel.generate_extra_tensors (conversion/llama.py), line by line: the divisor of each
    frequency, for the original context the model was trained with. (The converter reads it
    from config.json's top level only, so for a transformers-5 config, which keeps it in
    rope_parameters, it uses 8192; that would change the model, so the parameter is read first.)"""
    rope = hp["rope_parameters"]
    base = rope.get("rope_theta", 10000.0)
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings") or hp.get(
        "original_max_position_embeddings", 8192
    )
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def tensors(hp: dict, sd: dict[str, torch.Tensor], arch: str) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, fp32 array) of the transformers state dict `sd` in llama.cpp's layout, before
    any quantization: what the converter's modify_tensors / generate_extra_tensors yield."""
    import gguf

    n_layers = hp.get("num_hidden_layers") or hp.get("n_layer") or hp.get("n_layers")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[_ENUM[arch]], n_layers)
    out: list[tuple[str, np.ndarray]] = []
    rope = hp.get("rope_parameters") or {}
    if arch in _PERMUTED and rope.get("rope_type") == "llama3":
        out.append(("rope_freqs.weight", llama3_rope_factors(hp)))
    if arch == "phi3" and rope.get("long_factor"):  # Phi3MiniModel.generate_extra_tensors
        out.append(("rope_factors_long.weight", np.array(rope["long_factor"], np.float32)))
        out.append(("rope_factors_short.weight", np.array(rope["short_factor"], np.float32)))
    tied = hp.get("tie_word_embeddings", False)
    for name, p in sd.items():
        a = p.detach().float().cpu().numpy()
        bid = next((int(x) for x in name.split(".") if x.isdecimal()), None)
        if name == "lm_head.weight" and (tied or arch == "gemma2"):
            continue  # llama.cpp writes no output tensor for a tied head (Gemma 2: never)
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # GPT-2's causal-mask buffers: "we don't need these"
        if arch == "gpt2" and name.endswith(_CONV1D):
            a = a.T
        if arch == "falcon" and name.endswith("query_key_value.weight"):
            a = falcon_qkv(a, hp["num_attention_heads"], falcon_kv_heads(hp))
        if arch in ("gptneox", "bloom") and any(k in name for k in _INTERLEAVED):
            heads = hp.get("num_attention_heads") or hp["n_head"]
            a = a.reshape(heads, 3, -1, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
        if arch == "bloom" and name == "transformer.word_embeddings.weight" and tied:
            # BloomModel.modify_tensors: the tied head written out as a copy of the embedding
            out.append(("output.weight", a))
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            a = a + 1  # Gemma2Model / Gemma3Model.modify_tensors: (1 + w) stored
        if arch in _PERMUTED and name.endswith("q_proj.weight"):
            a = permute(a, hp["num_attention_heads"])
        if arch in _PERMUTED and name.endswith("k_proj.weight"):
            a = permute(a, hp.get("num_key_value_heads") or hp["num_attention_heads"])
        if ".mlp.experts." in name:
            out += _experts(name, a, arch, bid)
            continue
        if arch == "deepseek2" and name.endswith("kv_b_proj.weight"):
            # DeepseekV2Model.modify_tensors: (H, nope + v, lora) split; k_b transposed
            nope = hp["qk_nope_head_dim"]
            kv = a.reshape(hp["num_attention_heads"], nope + hp["v_head_dim"], -1)
            out.append((f"blk.{bid}.attn_k_b.weight", kv[:, :nope].transpose(0, 2, 1)))
            out.append((f"blk.{bid}.attn_v_b.weight", kv[:, nope:]))
            continue
        if name.endswith("e_score_correction_bias"):
            out.append((f"blk.{bid}.exp_probs_b.bias", a))
            continue
        if name.endswith("self_attn.sinks"):  # GptOssModel.filter_tensors: sinks -> .weight
            out.append((f"blk.{bid}.attn_sinks.weight", a))
            continue
        if arch == "gpt-oss" and ".mlp.router." in name:
            out.append((f"blk.{bid}.ffn_gate_inp.{name.rsplit('.', 1)[1]}", a))
            continue
        if arch == "bloom":  # BloomModel.modify_tensors maps the names without "transformer."
            name = name.removeprefix("transformer.")
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ConversionError(f"llama.cpp's {arch} converter has no name for {name}")
        out.append((new, a))
    return out


def falcon_qkv(a: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """FalconModel.modify_tensors (conversion/falcon.py), from its definition: Falcon's fused rows,
    one group per KV head of its H/KV queries, its key and its value, as [every q | every k |
    every v] ("jploski" layout)."""
    groups = a.reshape(kv_heads, heads // kv_heads + 2, -1, *a.shape[1:])
    q, k, v = groups[:, :-2], groups[:, -2], groups[:, -1]
    return np.concatenate([x.reshape(-1, *a.shape[1:]) for x in (q, k, v)])


def _experts(name: str, a: np.ndarray, arch: str, bid: int) -> list[tuple[str, np.ndarray]]:
    """transformers-5's fused expert tensors as llama.cpp's stacked per-kind ones."""
    import gguf

    T = gguf.MODEL_TENSOR
    g, u, d = (
        gguf.TENSOR_NAMES[t].format(bid=bid) for t in (T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP)
    )
    if arch == "gpt-oss":  # GptOssModel.modify_tensors: (E, H, 2I) transposed, gate even, up odd
        if name.endswith("gate_up_proj"):
            t = a.transpose(0, 2, 1)
            return [(f"{g}.weight", t[:, ::2]), (f"{u}.weight", t[:, 1::2])]
        if name.endswith("gate_up_proj_bias"):
            return [(f"{g}.bias", a[..., ::2]), (f"{u}.bias", a[..., 1::2])]
        if name.endswith("down_proj"):
            return [(f"{d}.weight", a.transpose(0, 2, 1))]
        return [(f"{d}.bias", a)]
    # Qwen3-MoE / DeepSeek checkpoints hold experts.{e}.{gate,up,down}_proj; the converters
    # stack them per kind (E, out, in): transformers' gate_up_proj is (E, 2I, H) = [gate | up]
    if name.endswith("gate_up_proj"):
        half = a.shape[1] // 2
        return [(f"{g}.weight", a[:, :half]), (f"{u}.weight", a[:, half:])]
    return [(f"{d}.weight", a)]


def storage_type(name: str, a: np.ndarray, outtype: str):
    """The converter's choice (`prepare_tensors`): F32 for 1-D tensors, norms, biases and MoE
    routers, else `outtype`'s type."""
    import gguf

    Q = gguf.GGMLQuantizationType
    stays_f32 = (
        a.ndim <= 1
        or name.endswith("_norm.weight")
        or not name.endswith(".weight")
        or ".ffn_gate_inp." in name
        or name.startswith(("position_embd.", "token_types."))
    )
    return Q.F32 if stays_f32 else Q[outtype.upper()]


def encode(a: np.ndarray, qtype) -> tuple[np.ndarray, Any]:
    """a in storage type qtype (the gguf package's quantizers); rows that are not whole blocks
    fall back to F16, as the converter does."""
    import gguf

    Q = gguf.GGMLQuantizationType
    a = np.ascontiguousarray(a, dtype=np.float32)
    if qtype == Q.F32:
        return a, Q.F32
    try:
        return gguf.quants.quantize(a, qtype), qtype
    except gguf.QuantError:
        return gguf.quants.quantize(a, Q.F16), Q.F16


def check_outtype(outtype: str) -> None:
    if outtype in _REFUSED:
        raise ValueError(
            f"outtype {outtype!r}: {_REFUSED[outtype]}; write f16 and run llama.cpp's "
            f"`llama-quantize model-f16.gguf model-{outtype}.gguf {outtype.upper()}`"
        )
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")


def gguf_architecture(model: nn.Module, model_type: str | None = None) -> tuple[str, str]:
    """(transformers model_type, llama.cpp architecture) of `model`, or a ConversionError naming
    what llama.cpp cannot run and what would."""
    model_type = model_type_of(model, model_type)
    if model_type not in ARCH_OF:
        raise ConversionError(
            f"no GGUF writer for model_type {model_type!r}: attnlab writes "
            f"{', '.join(sorted(ARCH_OF))}; save an HF folder instead (`attnlab convert SRC "
            "DIR --to hf`), which transformers and vLLM read"
        )
    return model_type, ARCH_OF[model_type]


def save_gguf(
    model: nn.Module,
    path: str | Path,
    *,
    vocab: Vocab,
    outtype: str = "f32",
    model_type: str | None = None,
    name: str | None = None,
    types: Callable[[str], Any] | None = None,
    file_type: int | None = None,
    progress: bool = False,
) -> Path:
    """Write `model` to the GGUF file `path`, whole or not at all (src/attnlab/atomic.py).
    vocab: the tokenizer.* keys (vocab_from_gguf); outtype: the weights' storage (OUTTYPES);
    types: a tensor name -> storage type that overrides outtype (None to keep it), for files
    that keep a source's per-tensor types (`source_types`), with that source's file_type;
    progress: a bar per tensor."""
    import gguf

    from ..atomic import atomic_file

    check_outtype(outtype)
    model_type, arch = gguf_architecture(model, model_type)
    conv = converter_for(model_type)
    hp = _as_config_json(model_type, config_to_hf(conv, model))
    llama_cpp_fit(hp, arch)
    sd = conv.weights_to_hf(dict(model.state_dict()), model.config)
    w = gguf.GGUFWriter(path=None, arch=arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or Path(path).stem)
    w.add_file_type(
        file_type if file_type is not None else gguf.LlamaFileType[_FILE_TYPES[outtype]]
    )
    parameters(w, hp, arch)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, vtype, sub in vocab.items:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for tname, a in tensors(hp, sd, arch):
        qtype = (types(tname) if types is not None else None) or storage_type(tname, a, outtype)
        data, qtype = encode(a, qtype)
        w.add_tensor(
            tname, data, raw_dtype=None if qtype == gguf.GGMLQuantizationType.F32 else qtype
        )
    with atomic_file(path) as tmp:
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=progress)
        w.close()
    return Path(path)


def source_types(path: str | Path) -> tuple[Callable[[str], Any], int | None]:
    """(tensor name -> its storage type in the GGUF file at path, the file's general.file_type):
    to write a model read from that file with every tensor as it was. Types attnlab cannot
    write (K-quants, i-quants) are refused, naming them and what to pass instead."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    kinds = {t.name: t.tensor_type for t in reader.tensors}
    writable = {gguf.GGMLQuantizationType[t.upper()] for t in OUTTYPES}
    other = sorted({k.name for k in kinds.values() if k not in writable})
    if other:
        raise ValueError(
            f"{path} stores tensors as {', '.join(other)}, which attnlab cannot write (the gguf "
            "package has no quantizer for them): pass --quant q8_0 / q4_0 / q4_1 or --dtype f16"
        )
    f = reader.fields.get("general.file_type")
    return kinds.get, (int(f.parts[f.data[0]][0]) if f is not None else None)


_FILE_TYPES = {  # outtype -> gguf.LlamaFileType (general.file_type)
    "f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1", "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1",
}  # fmt: skip
