"""A tiny transformers model written as a GGUF file the way llama.cpp's converter writes it.

No real GGUF file of the issue-19 families is available offline, so the tests write their own:
`write_gguf(path, hf_model, arch)` emulates llama.cpp's `convert_hf_to_gguf.py` (the per-family
classes of its `conversion/` package: llama.py, gemma.py, phi.py, qwen.py, olmo.py, deepseek.py,
gpt_oss.py, granite.py, command_r.py, smollm3.py) for one architecture:

- metadata: the keys `TextModel.set_gguf_parameters` (conversion/base.py) writes from config.json
  (block count, context, sizes, heads, RoPE base and scaling type, norm epsilons, expert counts,
  gating function, key/value length), then each family's own keys (below, per `arch`);
- tensors: renamed with the gguf package's own `TensorNameMap` (what the converter calls), stored
  F32 unless `types` says otherwise, with the family's value changes: q/k rows permuted for the
  `llama`-derived classes (`LlamaModel.permute`: llama, smollm3, granite), Gemma's norms stored
  as `w + 1`, experts split / stacked into `ffn_{gate,up,down}_exps`, GPT-OSS's interleaved
  gate/up columns split, DeepSeek's `kv_b_proj` split into `attn_k_b` (transposed) and `attn_v_b`,
  Llama 3's frequency factors generated as `rope_freqs`, Phi-3's long/short factors as
  `rope_factors_long` / `rope_factors_short`;
- tokenizer: a byte-level BPE ("gpt2") vocabulary or a SentencePiece ("llama") one with scores
  and byte pieces, and a chat template.

Every step cites the converter code it follows, so a loader that reads these files reads llama.cpp's.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
T = gguf.MODEL_TENSOR

# --- tokenizers ----------------------------------------------------------------------------------

BPE_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t", "Ġ w", "o r"]
BPE_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Gemma's turn markers, as its template writes them
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\n' + m['content']"
    " + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<start_of_turn>model\n' }}{% endif %}"
)
SPM_PIECES = [  # SentencePiece pieces after the bytes, best score first ("▁" is the space)
    "▁", "e", "t", "h", "a", "i", "n", "o", "r", "s", "w", "l", "d", "▁t", "he", "▁the", "in",
    "▁a", "er", "on", "re", "at", "▁w", "or", "ll", "▁the▁", "wor", "ld", "▁wor", "▁world",
]  # fmt: skip


def bpe_vocab() -> tuple[list[str], list[int], dict]:
    """256 byte tokens, the merged tokens of BPE_MERGES, a user-defined `<think>` and control
    tokens (last, so their ids are not the bytes'); the special ids."""
    from attnlab.interop.gguf_tokenizer import byte_alphabet

    tokens = [byte_alphabet()[b] for b in range(256)] + [m.replace(" ", "") for m in BPE_MERGES]
    tokens += ["<think>", *BPE_SPECIAL]
    types = [1] * (len(tokens) - 4) + [4, 3, 3, 3]
    ids = dict(bos=tokens.index("<|im_start|>"), eos=tokens.index("<|im_end|>"))
    return tokens, types, ids


def spm_vocab(arch: str) -> tuple[list[str], list[int], list[float], dict]:
    """A SentencePiece vocabulary as llama.cpp's `_set_vocab_sentencepiece` writes one: control
    tokens, `<0x00>`..`<0xFF>` byte pieces (type 6), the pieces with descending scores. Gemma's
    ids and turn tokens ([pad, eos, bos, unk] first) and an all-space piece stored as spaces;
    Llama / Phi-3's [unk, s, /s] and Phi-3's chat tokens."""
    if arch.startswith("gemma"):
        head = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2)]
        head += [("<start_of_turn>", 3), ("<end_of_turn>", 3)]
        ids = dict(bos=2, eos=1, unk=3, pad=0)
    else:
        head = [("<unk>", 2), ("<s>", 3), ("</s>", 3)]
        ids = dict(bos=1, eos=2, unk=0)
    tokens = [t for t, _ in head] + [f"<0x{b:02X}>" for b in range(256)]
    types = [k for _, k in head] + [6] * 256
    pieces = [*SPM_PIECES, "  "] if arch.startswith("gemma") else SPM_PIECES
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * (len(head) + 256) + [-float(i) for i in range(len(pieces))]
    if arch == "phi3":  # added chat tokens: special -> CONTROL (Phi3MiniModel.set_vocab)
        for t in ("<|user|>", "<|assistant|>", "<|end|>"):
            tokens.append(t)
            types.append(3)
            scores.append(-1000.0)
    return tokens, types, scores, ids


def vocab_size(tokenizer: str, arch: str = "llama") -> int:
    return len(bpe_vocab()[0]) if tokenizer == "gpt2" else len(spm_vocab(arch)[0])


def _write_tokenizer(w, tokenizer: str, arch: str, add_bos: bool | None, template: str) -> None:
    if tokenizer == "gpt2":  # TextModel._set_vocab_gpt2
        tokens, types, ids = bpe_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(BPE_MERGES)
    else:  # TextModel._set_vocab_sentencepiece
        tokens, types, scores, ids = spm_vocab(arch)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(ids["unk"])
        if "pad" in ids:
            w.add_pad_token_id(ids["pad"])
        if arch.startswith("gemma"):  # Gemma2Model / Gemma3Model.set_vocab
            w.add_add_space_prefix(False)
    w.add_bos_token_id(ids["bos"])
    w.add_eos_token_id(ids["eos"])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template(template)


# --- metadata ------------------------------------------------------------------------------------


def _base_parameters(w, hp: dict, arch: str) -> None:
    """`TextModel.set_gguf_parameters` (conversion/base.py), the keys it writes from config.json."""
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
    _base_parameters(w, hp, "llama")
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
    _base_parameters(w, hp, "gemma3")
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
    _base_parameters(w, dict(hp, num_key_value_heads=1), "deepseek2")
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


def _parameters(w, hp: dict, arch: str) -> None:
    if arch in ("llama", "smollm3"):  # SmolLM3Model(LlamaModel) adds nothing
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
        _base_parameters(w, hp, arch)
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    elif arch == "gpt-oss":  # GptOssModel.set_gguf_parameters (conversion/gpt_oss.py)
        _base_parameters(w, hp, arch)
        w.add_sliding_window(hp["sliding_window"])
        w.add_expert_feed_forward_length(hp["intermediate_size"])
    elif arch == "command-r":  # CommandR2Model (conversion/command_r.py): logit scale, no scaling
        context = hp.get("model_max_length") or hp["max_position_embeddings"]  # its __init__
        _base_parameters(w, dict(hp, max_position_embeddings=context), arch)
        w.add_logit_scale(hp["logit_scale"])
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    else:  # olmo2: Olmo2Model adds nothing to the base (conversion/olmo.py)
        _base_parameters(w, hp, arch)


# --- tensors -------------------------------------------------------------------------------------


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (conversion/llama.py), written from its definition."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_rope_factors(hp: dict) -> np.ndarray:
    """LlamaModel.generate_extra_tensors (conversion/llama.py), line by line: the divisor of each
    frequency. `original_max_position_embeddings` is read from the top level of config.json (a
    transformers-5 config keeps it in rope_parameters, so llama.cpp then uses 8192)."""
    rope = hp["rope_parameters"]
    base = rope.get("rope_theta", 10000.0)
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = hp.get("original_max_position_embeddings", 8192)
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


def _hparams(config) -> dict:
    """config.json as `TextModel.__init__` (conversion/base.py) sees it: top-level
    original_max_position_embeddings / partial_rotary_factor copied into rope_parameters."""
    hp = config.to_dict()
    rope = dict(hp.get("rope_parameters") or {})
    if "full_attention" not in rope:
        for key in ("original_max_position_embeddings", "partial_rotary_factor"):
            if key not in rope and hp.get(key) is not None:
                rope[key] = hp[key]
    return dict(hp, rope_parameters=rope)


def _tensors(hf, arch: str) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, array) in llama.cpp's layout, before any quantization."""
    c, hp = hf.config, _hparams(hf.config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[_ENUM[arch]], c.num_hidden_layers)
    out: list[tuple[str, np.ndarray]] = []
    if arch in ("llama", "smollm3", "granite") and (
        (hp.get("rope_parameters") or {}).get("rope_type") == "llama3"
    ):
        out.append(("rope_freqs.weight", llama3_rope_factors(hp)))
    rope = hp.get("rope_parameters") or {}
    if arch == "phi3" and rope.get("long_factor"):  # Phi3MiniModel.generate_extra_tensors
        out.append(("rope_factors_long.weight", np.array(rope["long_factor"], np.float32)))
        out.append(("rope_factors_short.weight", np.array(rope["short_factor"], np.float32)))
    tied = c.tie_word_embeddings
    for name, p in hf.state_dict().items():
        a = p.detach().float().numpy()
        bid = next((int(x) for x in name.split(".") if x.isdecimal()), None)
        if name == "lm_head.weight" and (tied or arch == "gemma2"):
            continue  # llama.cpp writes no output tensor for a tied head (Gemma 2: never)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            a = a + 1  # Gemma2Model / Gemma3Model.modify_tensors: (1 + w) stored
        if arch in ("llama", "smollm3", "granite") and name.endswith("q_proj.weight"):
            a = permute(a, c.num_attention_heads)
        if arch in ("llama", "smollm3", "granite") and name.endswith("k_proj.weight"):
            a = permute(a, c.num_key_value_heads)
        if ".mlp.experts." in name:
            out += _experts(name, a, arch, bid, c)
            continue
        if arch == "deepseek2" and name.endswith("kv_b_proj.weight"):
            # DeepseekV2Model.modify_tensors: (H, nope + v, lora) split; k_b transposed
            kv = a.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
            out.append(
                (f"blk.{bid}.attn_k_b.weight", kv[:, : c.qk_nope_head_dim].transpose(0, 2, 1))
            )
            out.append((f"blk.{bid}.attn_v_b.weight", kv[:, c.qk_nope_head_dim :]))
            continue
        if name.endswith("e_score_correction_bias"):
            out.append((f"blk.{bid}.exp_probs_b.bias", a))
            continue
        if name.endswith("self_attn.sinks"):  # GptOssModel.filter_tensors: sinks -> .weight
            out.append((f"blk.{bid}.attn_sinks.weight", a))
            continue
        if arch == "gpt-oss" and name.endswith("mlp.router.weight"):
            out.append((f"blk.{bid}.ffn_gate_inp.weight", a))
            continue
        if arch == "gpt-oss" and name.endswith("mlp.router.bias"):
            out.append((f"blk.{bid}.ffn_gate_inp.bias", a))
            continue
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"llama.cpp's {arch} converter has no name for {name}")
        out.append((new, a))
    return out


def _experts(name: str, a: np.ndarray, arch: str, bid: int, c) -> list[tuple[str, np.ndarray]]:
    """transformers-5's fused expert tensors in llama.cpp's stacked per-kind ones."""
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


_ENUM = {
    "llama": "LLAMA", "smollm3": "SMOLLM3", "granite": "GRANITE", "gemma2": "GEMMA2",
    "gemma3": "GEMMA3", "phi3": "PHI3", "qwen3moe": "QWEN3MOE", "olmo2": "OLMO2",
    "deepseek2": "DEEPSEEK2", "gpt-oss": "GPT_OSS", "command-r": "COMMAND_R",
}  # fmt: skip


def quantize_q4_k(a: np.ndarray) -> np.ndarray:
    """a (N, K) fp32, K a multiple of 256 -> its Q4_K bytes (N, K / 256 · 144), the layout
    ggml-quants.c's `block_q4_K` has and the gguf package's `Q4_K.dequantize_blocks` reads (which
    cannot quantize Q4_K): per 256 weights fp16 d and dmin, 12 bytes of 6-bit sub-block scales
    and mins, 128 bytes of nibbles (sub-blocks 2p and 2p + 1 share bytes 32p ... 32p + 31, low and
    high). Each sub-block of 32 is scaled from its extremes (min clipped to ≤ 0), a simpler
    choice than llama.cpp's search: the layout is what is tested, not the rounding."""
    n, k = a.shape
    x = a.reshape(-1, 8, 32).astype(np.float32)  # (blocks, sub-blocks, 32)
    lo = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - lo) / 15
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = ((-lo).max(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32), dmin.astype(np.float32)
    safe = lambda v: np.where(v == 0, 1, v)  # noqa: E731
    sc = np.clip(np.round(scale / safe(df)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / safe(dminf)[:, None]), 0, 63).astype(np.uint8)
    step = df[:, None] * sc.astype(np.float32)
    q = np.round((x + (dminf[:, None] * mn)[..., None]) / safe(step)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8)
    scales = np.concatenate(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
        ],
        axis=1,
    )
    nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, nibbles],
        axis=1,
    )
    return blocks.reshape(n, k // 256 * 144)


def quantize_q6_k(a: np.ndarray) -> np.ndarray:
    """a (N, K) fp32, K a multiple of 256 -> its Q6_K bytes (N, K / 256 · 210), ggml-quants.c's
    `block_q6_K` as `Q6_K.dequantize_blocks` reads it: per 256 weights 128 bytes of low nibbles,
    64 of high 2-bit pairs, 16 int8 scales (one per 16 weights) and fp16 d; w = d·sc·(q − 32).
    Element e of a half h = e // 128 (r = e % 128) has its low nibble in byte h·64 + r % 64
    (high nibble when r ≥ 64) and its top 2 bits at bits 2·(r // 32) of byte h·32 + r % 32. As
    ggml-quants.c's quantize_row_q6_K signs them: each 16's scale puts q − 32 = −32 at its
    largest magnitude, d = −(the largest scale)/128, so d and the int8 sc take either sign."""
    n, k = a.shape
    x = a.reshape(-1, 16, 16).astype(np.float32)  # (blocks, sixteenths, 16)
    v = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    scale = v / -32
    top = np.take_along_axis(scale, np.abs(scale).argmax(-1)[:, None], -1)[:, 0]
    d = (-top / 128).astype(np.float16)
    df = d.astype(np.float32)
    sc = np.clip(np.round(scale / np.where(df == 0, 1, df)[:, None]), -128, 127).astype(np.int8)
    step = df[:, None] * sc.astype(np.float32)
    q = np.round(x / np.where(step == 0, 1, step)[..., None])
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # (blocks, half, 128)
    ql = (q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)  # (blocks, 2, 64)
    top = (q >> 4).reshape(-1, 2, 4, 32)
    qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
    blocks = np.concatenate(
        [
            ql.reshape(-1, 128),
            qh.reshape(-1, 64),
            sc.view(np.uint8).reshape(-1, 16),
            d.view(np.uint8).reshape(-1, 2),
        ],
        axis=1,
    )
    return blocks.reshape(n, k // 256 * 210)


def write_gguf(
    path: Path,
    hf,
    arch: str,
    tokenizer: str = "gpt2",
    types: dict | None = None,
    add_bos: bool | None = False,
    template: str = TEMPLATE,
    **extra,
) -> Path:
    """`hf` (a transformers model) as llama.cpp's converter writes it for `arch`; `types` maps a
    GGUF tensor-name fragment to its storage type (default F32; 1-D tensors stay F32, as
    llama.cpp keeps them); `extra` adds or replaces keys ("tensor:NAME" adds a tensor)."""
    hp = _hparams(hf.config)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    _parameters(w, hp, arch)
    _write_tokenizer(w, tokenizer, arch, add_bos, template)
    for key, value in extra.items():
        if key.startswith("tensor:"):
            continue
        if key in w.kv_data[0]:
            del w.kv_data[0][key]
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_string(key, value)
    tensors = _tensors(hf, arch)
    tensors += [(k[len("tensor:") :], v) for k, v in extra.items() if k.startswith("tensor:")]
    for name, a in tensors:
        a = np.ascontiguousarray(a, dtype=np.float32)
        qtype = next((t for frag, t in (types or {}).items() if frag in name), Q.F32)
        if a.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, a)
        elif qtype == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
        elif qtype in (Q.Q4_K, Q.Q6_K):  # the gguf package dequantizes K-quants only
            quantize = quantize_q4_k if qtype == Q.Q4_K else quantize_q6_k
            w.add_tensor(name, quantize(a), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
