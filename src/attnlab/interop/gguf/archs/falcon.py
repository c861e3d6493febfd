"""falcon: Falcon 7B / 40B / 11B (FalconModel, conversion/falcon.py). The fused q/k/v's KV groups
([q_1..q_g, k, v] per group in transformers) are stored as [q | k | v] ("jploski" layout); the
layout (multi-query, GQA, one or two norms) is read off the head counts and attn_norm_2;
llama.cpp computes only the parallel block, without linear biases."""

from __future__ import annotations

import numpy as np
import torch

from ...converter import ConversionError
from .base import Arch, Keys

_GLOBAL = {
    "token_embd": "transformer.word_embeddings",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
# attn_norm is input_layernorm, or ln_mlp beside attn_norm_2 = ln_attn (the 40B: `_two_norms`)
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_norm_2": "ln_attn",
    "attn_qkv": "self_attention.query_key_value",
    "attn_output": "self_attention.dense",
    "ffn_up": "mlp.dense_h_to_4h",
    "ffn_down": "mlp.dense_4h_to_h",
}

# --- reading -------------------------------------------------------------------------------------


def _falcon(k: Keys, meta, hf, tensors) -> dict:
    """FalconModel.set_gguf_parameters: the layout from the head counts and the norms — one KV
    head and one norm: the 7B (multi-query), every head its own KV and one norm: the legacy
    multi-head layout, else the new decoder architecture (40B: attn_norm_2 is ln_attn, attn_norm
    ln_mlp; 11B: one norm); always the parallel block (llama.cpp's only one)."""
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


def _two_norms(tensors) -> dict[str, str]:
    """The 40B layout: attn_norm feeds the FFN (ln_mlp) beside attn_norm_2 (ln_attn)."""
    return {"attn_norm": "ln_mlp"} if "blk.0.attn_norm_2.weight" in tensors else {}


def qkv_grouped(w: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Fused q/k/v rows [q_1..q_H | k_1..k_KV | v_1..v_KV] -> Falcon's, one group per KV head of
    its H/KV queries, its key and its value ((KV, H/KV + 2, D) rows): the inverse of
    FalconModel.modify_tensors's "jploski" re-order (`falcon_qkv`)."""
    d = w.shape[0] // (heads + 2 * kv_heads)
    rest = w.shape[1:]
    q, k, v = w.split((heads * d, kv_heads * d, kv_heads * d))
    q = q.reshape(kv_heads, heads // kv_heads, d, *rest)
    k, v = (x.reshape(kv_heads, 1, d, *rest) for x in (k, v))
    return torch.cat((q, k, v), dim=1).reshape(w.shape)


def _unmodify(sd: dict[str, torch.Tensor], hf: dict) -> None:
    for name in [n for n in sd if ".attn_qkv." in n]:
        sd[name] = qkv_grouped(sd[name], hf["num_attention_heads"], hf["num_key_value_heads"])


# --- writing -------------------------------------------------------------------------------------


def falcon_kv_heads(hp: dict) -> int:
    """Falcon's key/value heads as its model computes them: num_kv_heads in the new decoder
    architecture, else 1 for multi_query and every head otherwise. (The converter reads
    num_kv_heads, or 1 when config.json has none, as the hub's 7B has none; a config.json
    transformers wrote states num_kv_heads = num_attention_heads for the multi-query 7B too,
    which would make the file a multi-head model its weights do not fit.)"""
    if hp.get("new_decoder_architecture"):
        return hp.get("num_kv_heads") or hp["num_attention_heads"]
    return 1 if hp.get("multi_query", True) else hp["num_attention_heads"]


def _parameters(w, hp: dict) -> None:
    """FalconModel.set_gguf_parameters."""
    d = hp["hidden_size"]
    w.add_context_length(hp.get("max_position_embeddings", 2048))  # the converter: 2048
    w.add_tensor_data_layout("jploski")  # the q/k/v re-order (`falcon_qkv`)
    w.add_embedding_length(d)
    w.add_feed_forward_length(hp.get("ffn_hidden_size") or 4 * d)  # the converter: 4 d
    w.add_block_count(hp["num_hidden_layers"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(falcon_kv_heads(hp))
    w.add_layer_norm_eps(hp["layer_norm_epsilon"])
    base = (hp.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    if base != 10000.0:  # the converter writes no base (llama.cpp's default is 10000)
        w.add_rope_freq_base(base)


def _fit(hp: dict) -> None:
    """Refuse, naming the part, what llama.cpp's falcon graph (src/models/falcon.cpp) does not
    compute: a sequential block, linear biases."""
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


def falcon_qkv(a: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """FalconModel.modify_tensors, from its definition: Falcon's fused rows, one group per KV
    head of its H/KV queries, its key and its value, as [every q | every k | every v]
    ("jploski" layout)."""
    groups = a.reshape(kv_heads, heads // kv_heads + 2, -1, *a.shape[1:])
    q, k, v = groups[:, :-2], groups[:, -2], groups[:, -1]
    return np.concatenate([x.reshape(-1, *a.shape[1:]) for x in (q, k, v)])


def _modify(name, a, hp, bid):
    if name.endswith("query_key_value.weight"):
        qkv = falcon_qkv(a, hp["num_attention_heads"], falcon_kv_heads(hp))
        return [(f"blk.{bid}.attn_qkv.weight", qkv)]
    return None


FALCON = Arch(
    "falcon",
    "falcon",
    "FALCON",
    _parameters,
    names=_BLOCK,
    own_names=True,
    global_names=_GLOBAL,
    block_prefix="transformer.h",
    config=_falcon,
    rms_norm_eps=None,
    unmodify=_unmodify,
    file_names=_two_norms,
    fit=_fit,
    modify=_modify,
)
