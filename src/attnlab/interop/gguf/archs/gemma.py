"""gemma2, gemma3 (Gemma2Model / Gemma3Model, conversion/gemma.py): norms stored as 1 + w
(`norm_offset`), the sandwich norms' names, and what llama.cpp's loader implies without keys: the
query scale, the window pattern and the local layers' RoPE base."""

from __future__ import annotations

from .base import Arch, Keys, text_parameters

_NAMES = {"ffn_norm": "pre_feedforward_layernorm"}


def _query_scalar(k: Keys, hf: dict, big: int) -> int:
    """Gemma's query_pre_attn_scalar, which the file does not hold: llama.cpp's loader scales
    queries by 1/sqrt(d_model / heads) for the 27B models (identified by their layer count:
    Gemma 2 46, Gemma 3 62) and 1/sqrt(head_dim) otherwise (src/llama-model.cpp,
    `f_attention_scale`, after gemma_pytorch's config.py)."""
    return (
        hf["hidden_size"] // hf["num_attention_heads"]
        if hf["num_hidden_layers"] == big
        else hf["head_dim"]
    )


def _gemma2(k: Keys, meta, hf, tensors) -> dict:
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


def _gemma3(k: Keys, meta, hf, tensors) -> dict:
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
    text_parameters(w, hp)
    rope = hp["rope_parameters"]
    w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])


def _gemma2_modify(name, a, hp, bid):
    """Gemma2Model.modify_tensors: lm_head dropped, tied or not (llama.cpp's graph uses the
    embedding)."""
    return [] if name == "lm_head.weight" else None


GEMMA2 = Arch("gemma2", "gemma2", "GEMMA2", _gemma2_parameters, names=_NAMES, norm_offset=True,
              config=_gemma2, modify=_gemma2_modify)  # fmt: skip
GEMMA3 = Arch("gemma3", "gemma3_text", "GEMMA3", _gemma3_parameters, names=_NAMES,
              norm_offset=True, config=_gemma3)  # fmt: skip
