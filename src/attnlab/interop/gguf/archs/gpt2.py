"""gpt2 (GPT2Model, conversion/gpt2.py): its own names under transformer.h.{i}, learned positions
(the table is context_length), and its Conv1D weights, which transformers stores (in, out) and
the converter transposes to (out, in) (`conv1d`)."""

from __future__ import annotations

import warnings

from .base import Arch, Keys

_GLOBAL = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
_BLOCK = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}


def _gpt2(k: Keys, meta, hf, tensors) -> dict:
    """n_ctx is the position table, LayerNorm's epsilon, the FFN width; tanh-GELU and scaled
    scores, which the file does not state, as every GPT-2."""
    return dict(
        n_positions=k("context_length"),
        n_inner=k("feed_forward_length", None),
        layer_norm_epsilon=k("attention.layer_norm_epsilon"),
        activation_function="gelu_new",
    )


def _parameters(w, hp: dict) -> None:
    """GPT2Model.set_gguf_parameters."""
    w.add_block_count(hp["n_layer"])
    w.add_context_length(hp.get("n_ctx") or hp["n_positions"])
    w.add_embedding_length(hp["n_embd"])
    w.add_feed_forward_length(hp.get("n_inner") or 4 * hp["n_embd"])
    w.add_head_count(hp["n_head"])
    w.add_layer_norm_eps(hp["layer_norm_epsilon"])


def _fit(hp: dict) -> None:
    """Warn where llama.cpp computes it differently: its gpt2 graph (src/models/gpt2.cpp,
    LLM_FFN_GELU) computes GELU's tanh approximation, whatever config.json says; exact (erf) GELU,
    nanoGPT's and configs/shakespeare-char.yaml's, differs from it by at most 4.7e-4 per
    activation (at x = 2.70)."""
    if hp.get("activation_function") in ("gelu", "gelu_python"):
        warnings.warn(
            "the model's FFN computes exact (erf) GELU, llama.cpp's gpt2 its tanh approximation "
            "(at most 4.7e-4 apart per activation): the file runs in llama.cpp, with logits "
            "slightly off attnlab's and transformers'",
            RuntimeWarning,
            stacklevel=3,
        )


def _modify(name, a, hp, bid):
    """GPT2Model.modify_tensors: the causal-mask buffers dropped ("we don't need these")."""
    return [] if name.endswith((".attn.bias", ".attn.masked_bias")) else None


GPT2 = Arch(
    "gpt2",
    "gpt2",
    "GPT2",
    _parameters,
    names=_BLOCK,
    own_names=True,
    global_names=_GLOBAL,
    block_prefix="transformer.h",
    conv1d=("attn_qkv", "attn_output", "ffn_up", "ffn_down"),
    config=_gpt2,
    rms_norm_eps=None,
    fit=_fit,
    modify=_modify,
)
