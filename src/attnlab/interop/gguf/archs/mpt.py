"""mpt (MPTModel, conversion/mpt.py): ALiBi (max_alibi_bias), LayerNorm, no biases, clip_qkv as
clamp_kqv."""

from __future__ import annotations

from .base import Arch, Keys

_GLOBAL = {
    "token_embd": "transformer.wte",
    "output_norm": "transformer.norm_f",
    "output": "lm_head",
}
_BLOCK = {
    "attn_norm": "norm_1",
    "attn_qkv": "attn.Wqkv",
    "attn_output": "attn.out_proj",
    "ffn_norm": "norm_2",
    "ffn_up": "ffn.up_proj",
    "ffn_down": "ffn.down_proj",
}


def _mpt(k: Keys, meta, hf, tensors) -> dict:
    """The context, ALiBi's maximum bias (0 for none), clip_qkv as clamp_kqv, LayerNorm's
    epsilon; no biases unless the file holds them."""
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


def _parameters(w, hp: dict) -> None:
    """MPTModel.set_gguf_parameters."""
    attn = {"alibi": True, "alibi_bias_max": 8, "clip_qkv": None, **(hp.get("attn_config") or {})}
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


MPT = Arch("mpt", "mpt", "MPT", _parameters, names=_BLOCK, own_names=True, global_names=_GLOBAL,
           block_prefix="transformer.blocks", config=_mpt, rms_norm_eps=None)  # fmt: skip
