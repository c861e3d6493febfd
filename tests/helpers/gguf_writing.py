"""A tiny transformers model written as a GGUF file the way llama.cpp's converter writes it.

No real GGUF file of the issue-19 families is available offline, so the tests write their own:
`write_gguf(path, hf_model, arch)` emulates llama.cpp's `convert_hf_to_gguf.py` (the per-family
classes of its `conversion/` package: llama.py, gemma.py, phi.py, qwen.py, olmo.py, deepseek.py,
gpt_oss.py, granite.py, command_r.py, smollm3.py) for one architecture, through attnlab's own
writer's metadata and tensor functions (src/attnlab/interop/gguf/writer.py, which cite the
converter) with the test vocabularies below and any storage type (K-quants included):

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

from pathlib import Path

import gguf
import numpy as np

from attnlab.interop.gguf.archs.llama import llama3_rope_factors  # noqa: F401
from attnlab.interop.gguf.writer import encode, hparams, parameters
from attnlab.interop.gguf.writer import tensors as gguf_tensors

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
    from attnlab.interop.gguf.tokenizer import byte_alphabet

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
    if arch == "phi3":  # added chat tokens: special -> CONTROL (Phi3MiniModel.set_vocab);
        # <|endoftext|> as Phi-3's 32000 (llama.cpp's vocabulary loader looks it up by text in a
        # file whose general.name says phi3, and fails on a vocabulary without it)
        for t in ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"):
            tokens.append(t)
            types.append(3)
            scores.append(-1000.0)
    return tokens, types, scores, ids


def vocab_size(tokenizer: str, arch: str = "llama") -> int:
    return len(bpe_vocab()[0]) if tokenizer == "gpt2" else len(spm_vocab(arch)[0])


def tiny_hf_llama():
    """A tiny random transformers Llama (seed 0) whose vocabulary fits the GPT-2 tokenizer
    `write_gguf` writes."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size("gpt2"), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


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
    hp = hparams(hf.config.to_dict())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    parameters(w, hp, arch)
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
    tensors = gguf_tensors(hp, hf.state_dict(), arch)
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
        else:  # the converter's quantizers, and its F16 fallback (rows not whole blocks)
            data, qtype = encode(a, qtype)
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
