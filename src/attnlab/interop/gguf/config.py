"""A GGUF file's metadata -> the transformers config.json dict it was converted from: the keys
`TextModel.set_gguf_parameters` (llama.cpp's conversion/base.py) writes for every architecture,
read here with llama.cpp's defaults, then the architecture's own (its table entry's `config`,
src/attnlab/interop/gguf/table.py). What the file cannot state or attnlab cannot compute exactly
(per-layer head counts or widths, partial rotary where the family has none, experts outside the
MoE families, a scaling type the family's converter never writes) is refused naming the key, every
problem at once."""

from __future__ import annotations

from typing import Any

from ...errors import Problems
from ..converter import ConversionError
from .archs.base import Arch, Keys
from .table import ARCHITECTURES, scalings_note


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
    hf = _decoder_config(ARCHITECTURES[arch], meta, tensors, problems)
    problems.raise_as(ConversionError, f"GGUF {arch} metadata for an exact conversion")
    return hf


def _decoder_config(
    spec: Arch, meta: dict[str, Any], tensors: dict[str, Any], problems: Problems
) -> dict[str, Any]:
    """llama.cpp's `<arch>.*` keys as the transformers config dict they were written from
    (convert_hf_to_gguf.py); `tensors` maps each tensor name to its shape, or its values for the
    small ones the config needs (rope_freqs, rope_factors_*); features attnlab does not compute
    go to `problems`."""
    arch = spec.name
    key = Keys(arch, meta, problems)
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
    if spec.mla:  # MLA's MQA form: the per-head sizes are the *_mla keys
        head_dim = key("attention.key_length_mla", head_dim)
    elif key("attention.value_length", head_dim) != head_dim:
        key.refuse("attention.value_length", f"differs from key_length ({head_dim}): not supported")
    rot = key("rope.dimension_count", head_dim)
    if rot != head_dim and not spec.partial_rotary:
        key.refuse(
            "rope.dimension_count",
            f"is not the head size ({head_dim}): partial rotary models are not supported",
        )
    if key("expert_count", 0) and not spec.moe:
        key.refuse("expert_count", f"mixture-of-experts {arch} files are not supported")
    if isinstance(key("feed_forward_length", 0), list):
        key.refuse("feed_forward_length", "a width per layer is not supported")
    scaling = key("rope.scaling.type", "none")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": key("rope.freq_base", 10000.0)}
    if scaling == "linear":
        rope.update(rope_type="linear", factor=key("rope.scaling.factor"))
    elif scaling not in ("none", *spec.scalings):
        key.refuse("rope.scaling.type", f"supported: {scalings_note()}")
    elif scaling == "yarn":
        rope.update(
            rope_type="yarn",
            factor=key("rope.scaling.factor"),
            original_max_position_embeddings=key("rope.scaling.original_context_length"),
            beta_fast=key("rope.scaling.yarn_beta_fast", 32.0),
            beta_slow=key("rope.scaling.yarn_beta_slow", 1.0),
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
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", spec.rms_norm_eps),
        rope_parameters=rope,
        max_position_embeddings=key("context_length", 2048),
        sliding_window=None,  # llama.cpp keeps none for the llama layout
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=any(f"blk.0.{t}.bias" in tensors for t in spec.bias_from),
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    if spec.config is not None:
        hf.update(spec.config(key, meta, hf, tensors))
    return hf
