"""gptneox and bloom (GPTNeoXModel, conversion/gptneox.py; BloomModel, conversion/bloom.py):
their own names, LayerNorm, and the fused q/k/v that transformers interleaves per head ((H, 3, D)
rows) stored as [q | k | v] (`interleaved_qkv`). GPT-NeoX: partial rotary, the parallel
residual; BLOOM: ALiBi (no positions), the embedding norm, the tied head written as a copy."""

from __future__ import annotations

from .base import Arch, Keys

_NEOX_GLOBAL = {
    "token_embd": "gpt_neox.embed_in",
    "output_norm": "gpt_neox.final_layer_norm",
    "output": "embed_out",
}
_NEOX_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "attention.query_key_value",
    "attn_output": "attention.dense",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.dense_h_to_4h",
    "ffn_down": "mlp.dense_4h_to_h",
}
_BLOOM_GLOBAL = {
    "token_embd": "transformer.word_embeddings",
    "token_embd_norm": "transformer.word_embeddings_layernorm",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
_BLOOM_BLOCK = {
    **_NEOX_BLOCK,
    "attn_qkv": "self_attention.query_key_value",
    "attn_output": "self_attention.dense",
}


def _gptneox(k: Keys, meta, hf, tensors) -> dict:
    """The rotated fraction of each head, the parallel residual, LayerNorm's epsilon; RoPE's
    base only if the file states one (the converter writes none, llama.cpp then uses 10000)."""
    return dict(
        rotary_pct=k("rope.dimension_count", hf["head_dim"]) / hf["head_dim"],
        rotary_emb_base=k("rope.freq_base", 10000.0),
        use_parallel_residual=bool(k("use_parallel_residual", True)),
        layer_norm_eps=k("attention.layer_norm_epsilon"),
        hidden_act="gelu",
        attention_bias="blk.0.attn_qkv.bias" in tensors,
    )


def _bloom(k: Keys, meta, hf, tensors) -> dict:
    """LayerNorm's epsilon; the head tied unless the file holds one (the converter writes a copy
    of the embedding as output.weight, so a file it wrote reads back untied, with equal values)."""
    return dict(layer_norm_epsilon=k("attention.layer_norm_epsilon"))


def _gptneox_parameters(w, hp: dict) -> None:
    """GPTNeoXModel.set_gguf_parameters."""
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


def _bloom_parameters(w, hp: dict) -> None:
    """BloomModel.set_gguf_parameters."""
    d = hp["hidden_size"]
    w.add_context_length(hp.get("seq_length", d))  # its fallback when config.json has none
    w.add_embedding_length(d)
    w.add_feed_forward_length(4 * d)
    w.add_block_count(hp["n_layer"])
    w.add_head_count(hp["n_head"])
    w.add_head_count_kv(hp["n_head"])
    w.add_layer_norm_eps(hp["layer_norm_epsilon"])


def _bloom_modify(name, a, hp, bid):
    """BloomModel.modify_tensors: the tied head written out as a copy of the embedding."""
    if name == "transformer.word_embeddings.weight" and hp.get("tie_word_embeddings", False):
        return [("output.weight", a), ("token_embd.weight", a)]
    return None


GPTNEOX = Arch(
    "gptneox",
    "gpt_neox",
    "GPTNEOX",
    _gptneox_parameters,
    names=_NEOX_BLOCK,
    own_names=True,
    global_names=_NEOX_GLOBAL,
    block_prefix="gpt_neox.layers",
    interleaved_qkv=True,
    config=_gptneox,
    partial_rotary=True,
    rms_norm_eps=None,
)
BLOOM = Arch(
    "bloom",
    "bloom",
    "BLOOM",
    _bloom_parameters,
    names=_BLOOM_BLOCK,
    own_names=True,
    global_names=_BLOOM_GLOBAL,
    block_prefix="transformer.h",
    interleaved_qkv=True,
    config=_bloom,
    rms_norm_eps=None,
    modify=_bloom_modify,
    strip="transformer.",  # BloomModel.modify_tensors maps the names without it
)
