"""Presets against their references.

Each family that `transformers` implements is built from its model card's config.json on the meta
device (no weights, no download) and compared with the preset twice: the exact number of unique
parameters, and every hyper-parameter, read from what the reference model does (its config after
`transformers` interprets it, and a few facts read off the built modules, such as the FFN
activation, evaluated numerically). The two 2017 Transformers have no `transformers` class: they
are counted in closed form from the paper. `tiny()` must keep every architecture, `attnlab
presets` must print the exact counts, and every preset must cite its source.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import attnlab as al
from attnlab import cli
from attnlab.config import ModelConfig, MoEFFN, RoPE
from attnlab.nn.activations import ACTIVATIONS
from attnlab.nn.positional.scaling import ROPE_SCALINGS

NAMES = al.presets.names()


_COUNTS: dict[str, int] = {}


def _count_config(cfg: ModelConfig) -> int:
    """al.count_parameters, once per distinct config in a session (DeepSeek-V3's 671B take
    ~20 s to build on meta, mostly its 44,000 expert matrices' init)."""
    key = cfg.to_json()
    if key not in _COUNTS:
        _COUNTS[key] = al.count_parameters(cfg)
    return _COUNTS[key]


def _count(name: str) -> int:
    return _count_config(al.presets.get(name))


def _one(*values: Any) -> Any:
    """attnlab has one value where a reference may have several: equal ones, or a tuple that
    matches nothing."""
    return values[0] if len(set(values)) == 1 else values


# --- what a reference does, in the vocabulary of `_view` below ----------------------------------
# Facts a config.json does not state come from the modeling file named in each docstring.

_DEFAULTS = dict(
    qk_norm=False,
    scale=None,
    sliding_window=None,
    norm_placement="pre",
    residual="sequential",
    final_norm=True,
    embedding_norm=False,
    scale_embeddings=False,
    round_embed_scale=False,
    type_vocab_size=0,
    pad_token_id=None,
    share_encoder_decoder_embeddings=None,
    scale_tied_logits=False,
    mlm_head=False,
    num_labels=0,
    experts=None,
    aux_loss_coef=None,
    activation_dropout=0.0,  # no dropout inside the FFN unless a view says otherwise
    attention_kind="softmax",
    k_bias=True,
    frontend=None,
    classifier_pooler=True,
    # per layer (window, positions, RoPE base) where layers differ (ModernBERT, SmolLM3's NoPE)
    layer_attention=None,
    mla=None,  # multi-head latent attention's sizes (DeepSeek-V2)
    deepseek_moe=None,  # (routed scale, groups, top groups, dense layers, dense d_ff, balance loss)
    first_attn_norm=True,
    mlm_dense_bias=True,
    stages=None,
    # issue 19: Gemma 2's capped scores and logits, GPT-OSS's sinks, OLMo 2's qk-norm scope,
    # Granite's and Cohere's multipliers, MoE routers' extras and clamped experts
    softcap=None,
    sinks=False,
    qk_norm_scope="head",
    embedding_multiplier=1.0,
    residual_multiplier=1.0,
    logit_multiplier=1.0,
    final_logit_softcap=None,
    moe_router=None,  # (router bias, selection bias, group score, dense_at, sparse_step)
    expert_clamp=None,  # (limit, up_shift) of a clamped GLU expert (GPT-OSS)
)


def _ref(**values: Any) -> dict[str, Any]:
    return {**_DEFAULTS, **values}


def _rope(c: Any, m: Any) -> dict[str, Any]:
    p = c.rope_parameters  # transformers 5 moves rope_theta / rotary_pct here
    p = p.get("full_attention", p)  # Gemma 3: one set per layer type (the layers' own: views)
    return dict(
        kind="rope",
        base=p["rope_theta"],
        layout="half",  # rotate_half in every modeling file below
        fraction=p.get("partial_rotary_factor", 1.0),
        scaling=_scaling(c, p, m),
    )


def _scaling(c: Any, p: dict, m: Any) -> dict[str, Any] | None:
    """transformers' rope_parameters `p` in attnlab's words (src/attnlab/config/scaling.py); the
    attention factor is read off model `m`'s rotary embedding, what it multiplies cos and
    sin by (modeling_rope_utils.py's ROPE_INIT_FUNCTIONS: YaRN's from mscale, LongRoPE's from
    the extension ratio max_position_embeddings / original_max_position_embeddings)."""
    kind, length = p["rope_type"], p.get("original_max_position_embeddings")
    if kind == "default":
        return None
    rot = m.base_model.rotary_emb
    if kind == "llama3":
        return dict(
            kind="llama3",
            factor=p["factor"],
            low_freq_factor=p["low_freq_factor"],
            high_freq_factor=p["high_freq_factor"],
            original_max_len=length,
        )
    if kind == "yarn":
        return dict(
            kind="yarn",
            factor=p["factor"],
            original_max_len=length,
            beta_fast=p.get("beta_fast") or 32.0,
            beta_slow=p.get("beta_slow") or 1.0,
            attention_factor=rot.attention_scaling,
            truncate=p.get("truncate", True),
        )
    if kind == "longrope":
        return dict(
            kind="longrope",
            short_factor=list(p["short_factor"]),
            long_factor=list(p["long_factor"]),
            original_max_len=length,
            factor=p.get("factor") or c.max_position_embeddings / length,
            attention_factor=rot.attention_scaling,
        )
    return dict(kind=f"unmodelled {kind}")


def _bert(c: Any, m: Any) -> dict[str, Any]:
    """modeling_bert.py / modeling_roberta.py: LayerNorm(x + sublayer(x)), embedding LayerNorm,
    no final norm, biases everywhere, MLM head tied to the word embeddings. RoBERTa numbers
    positions from padding_idx + 1."""
    emb = m.base_model.embeddings
    offset = emb.padding_idx + 1 if type(m).__name__.startswith("Roberta") else 0
    return _ref(
        arch="encoder",
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        kv_heads=c.num_attention_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        d_ff=c.intermediate_size,
        ffn="dense",
        ffn_bias=True,
        qkv_bias=True,
        o_bias=True,
        positional=dict(kind="learned", max_len=c.max_position_embeddings, offset=offset),
        norm=dict(kind="layernorm", eps=c.layer_norm_eps, bias=True),
        norm_placement="post",
        final_norm=False,
        embedding_norm=True,
        type_vocab_size=c.type_vocab_size,
        pad_token_id=c.pad_token_id,
        tie_embeddings=c.tie_word_embeddings,
        mlm_head=True,
        dropout=c.hidden_dropout_prob,
        attention_dropout=c.attention_probs_dropout_prob,
    )


def _longformer(c: Any, m: Any) -> dict[str, Any]:
    """modeling_longformer.py: RoBERTa's network (positions from padding_idx + 1) with
    LongformerSelfAttention: |i - j| <= attention_window / 2 in each layer (attnlab's window is
    attention_window / 2 + 1, one per stack), global q/k/v projections."""
    emb = m.base_model.embeddings
    positional = dict(kind="learned", max_len=c.max_position_embeddings, offset=emb.padding_idx + 1)
    return {
        **_bert(c, m),
        "positional": positional,
        "attention_kind": "longformer",
        "sliding_window": _one(*(w // 2 + 1 for w in c.attention_window)),
    }


def _bigbird(c: Any, m: Any) -> dict[str, Any]:
    """modeling_big_bird.py: BERT's network (positions from 0) with BigBirdBlockSparseAttention
    (attention_type "block_sparse"; block_size and num_random_blocks:
    tests/nn/attention/test_bigbird.py)."""
    assert c.attention_type == "block_sparse"
    return {**_bert(c, m), "attention_kind": "block-sparse"}


def _vit(c: Any, m: Any) -> dict[str, Any]:
    """modeling_vit.py: pre-norm ViTLayer (layernorm_before / _after), final layernorm, biases
    everywhere (q/k/v per qkv_bias), no token table: ViTEmbeddings' Conv2d patches, class token
    and learned positions (their table, so the stack has none). ViTForImageClassification builds
    ViTModel without pooler and maps the class token with one Linear."""
    emb = m.vit.embeddings
    side = emb.patch_embeddings.image_size[0] // emb.patch_embeddings.patch_size[0]
    assert emb.position_embeddings.shape[1] == side * side + 1  # the class token has a row
    attn = m.vit.layers[0].attention
    return _ref(
        arch="encoder",
        vocab_size=0,
        d_model=c.hidden_size,
        layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        kv_heads=c.num_attention_heads,
        head_dim=attn.head_dim,
        d_ff=c.intermediate_size,
        ffn="dense",
        ffn_bias=True,
        qkv_bias=attn.q_proj.bias is not None,
        o_bias=attn.o_proj.bias is not None,
        positional=dict(kind="none"),
        frontend=dict(
            kind="patches",
            image_size=c.image_size,
            patch_size=c.patch_size,
            num_channels=c.num_channels,
        ),
        norm=dict(kind="layernorm", eps=c.layer_norm_eps, bias=True),
        tie_embeddings=True,  # no token table to tie; the config's default
        num_labels=m.classifier.out_features,
        classifier_pooler=m.vit.pooler is not None,
        dropout=c.hidden_dropout_prob,
        attention_dropout=c.attention_probs_dropout_prob,
    )


def _modernbert(c: Any, m: Any) -> dict[str, Any]:
    """modeling_modernbert.py: pre-norm, no biases (LayerNorm(bias=norm_bias)), embedding norm,
    no attn_norm in layer 0 (Identity), GeGLU (Wi split into input and gate), final norm; each
    layer's flash window `sliding_window` = local_attention // 2 + 1 (|q - k| < it, as the sdpa
    mask's |q - k| <= local_attention // 2) and RoPE base by layer type; the MLM head's dense
    without bias (classifier_bias), the tied decoder with a bias."""
    layers = m.model.layers
    theta = {k: v["rope_theta"] for k, v in c.rope_parameters.items()}
    return _ref(
        arch="encoder",
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        kv_heads=c.num_attention_heads,
        head_dim=layers[0].attn.head_dim,
        d_ff=c.intermediate_size,
        ffn="glu",
        ffn_bias=layers[0].mlp.Wi.bias is not None,
        qkv_bias=layers[0].attn.Wqkv.bias is not None,
        o_bias=layers[0].attn.Wo.bias is not None,
        positional=dict(
            kind="rope", base=theta["full_attention"], layout="half", fraction=1.0, scaling=None
        ),
        norm=dict(kind="layernorm", eps=c.norm_eps, bias=c.norm_bias),
        embedding_norm=True,
        pad_token_id=c.pad_token_id,
        tie_embeddings=c.tie_word_embeddings,
        mlm_head=True,
        dropout=c.embedding_dropout,
        attention_dropout=c.attention_dropout,
        activation_dropout=c.mlp_dropout,
        layer_attention=[(x.attn.sliding_window, "rope", theta[x.attention_type]) for x in layers],
        first_attn_norm=not isinstance(layers[0].attn_norm, torch.nn.Identity),
        mlm_dense_bias=m.head.dense.bias is not None,
    )


def _swin(c: Any, m: Any) -> dict[str, Any]:
    """modeling_swin.py: SwinPatchEmbeddings (Conv2d) + LayerNorm, no absolute positions; stage s
    of depths[s] pre-norm SwinLayers of width embed_dim·2^s (q/k/v bias per qkv_bias, o_proj
    with bias, mlp fc1/fc2 of mlp_ratio·width), window attention of window_size with the
    relative bias table; SwinPatchMerging between stages; final layernorm."""
    layer = m.encoder.layers[0].blocks[0]
    return _ref(
        arch="encoder",
        vocab_size=0,
        d_model=c.embed_dim,
        layers=sum(c.depths),
        n_heads=c.num_heads[0],
        kv_heads=c.num_heads[0],
        head_dim=layer.attention.head_dim,
        d_ff=layer.mlp.fc1.out_features,
        ffn="dense",
        ffn_bias=layer.mlp.fc1.bias is not None,
        qkv_bias=layer.attention.q_proj.bias is not None,
        o_bias=layer.attention.o_proj.bias is not None,
        positional=dict(kind="none"),
        frontend=dict(
            kind="patch-grid",
            image_size=c.image_size,
            patch_size=c.patch_size,
            num_channels=c.num_channels,
        ),
        stages=dict(depths=list(c.depths), heads=list(c.num_heads), window_size=c.window_size),
        norm=dict(kind="layernorm", eps=c.layer_norm_eps, bias=True),
        tie_embeddings=True,  # no token table to tie; the config's default
        num_labels=m.classifier.out_features if hasattr(m, "classifier") else 0,
        classifier_pooler=False,  # SwinForImageClassification: mean token, one Linear
        dropout=c.hidden_dropout_prob,
        attention_dropout=c.attention_probs_dropout_prob,
    )


def _gpt2(c: Any, m: Any) -> dict[str, Any]:
    """modeling_gpt2.py: pre-norm, final ln_f, Conv1D layers with biases."""
    plain_scale = c.scale_attn_weights and not c.scale_attn_by_inverse_layer_idx
    return _ref(
        arch="decoder",
        vocab_size=c.vocab_size,
        d_model=c.n_embd,
        layers=c.n_layer,
        n_heads=c.n_head,
        kv_heads=c.n_head,
        head_dim=c.n_embd // c.n_head,
        d_ff=c.n_inner or 4 * c.n_embd,
        ffn="dense",
        ffn_bias=True,
        qkv_bias=True,
        o_bias=True,
        scale=None if plain_scale else "per-layer",
        positional=dict(kind="learned", max_len=c.n_positions, offset=0),
        norm=dict(kind="layernorm", eps=c.layer_norm_epsilon, bias=True),
        tie_embeddings=c.tie_word_embeddings,
        dropout=_one(c.embd_pdrop, c.resid_pdrop),
        attention_dropout=c.attn_pdrop,
    )


def _llama(c: Any, m: Any) -> dict[str, Any]:
    """modeling_llama.py and its copies (Qwen2, Qwen3, Mistral, Mixtral): pre-RMSNorm, SwiGLU,
    RoPE, no dropout outside attention. Biases are read off the modules (Qwen2 hard-codes q/k/v
    bias), and so is qk-norm (Qwen3Attention's q_norm / k_norm, before the rotation).
    Mixtral's router: softmax -> top-k -> renormalise, i.e. softmax over the k chosen logits."""
    attn = m.model.layers[0].self_attn
    moe = hasattr(c, "num_local_experts")
    return _ref(
        arch="decoder",
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        d_ff=c.intermediate_size,
        ffn="glu",
        ffn_bias=getattr(c, "mlp_bias", False),
        experts=(c.num_local_experts, c.num_experts_per_tok, "topk-softmax", 0) if moe else None,
        qkv_bias=_one(*(getattr(attn, p).bias is not None for p in ("q_proj", "k_proj", "v_proj"))),
        o_bias=attn.o_proj.bias is not None,
        qk_norm=hasattr(attn, "q_norm") and hasattr(attn, "k_norm"),
        sliding_window=c.sliding_window if hasattr(c, "sliding_window") else None,
        positional=_rope(c, m),
        norm=dict(kind="rmsnorm", eps=c.rms_norm_eps),
        pad_token_id=c.pad_token_id,
        tie_embeddings=c.tie_word_embeddings,
        dropout=0.0,
        attention_dropout=c.attention_dropout,
        aux_loss_coef=c.router_aux_loss_coef if moe else None,
    )


def _deepseek_v2(c: Any, m: Any) -> dict[str, Any]:
    """modeling_deepseek_v2.py: pre-RMSNorm, multi-head latent attention (its q/kv latents,
    decoupled RoPE keys rotated as complex pairs, softmax scale with YaRN's mscale_all_dim
    folded in: `scaling`), dense SwiGLU in the first first_k_dense_replace layers, then routed
    SwiGLU experts (softmax, top-k, times routed_scaling_factor, never renormalised) plus shared
    experts; DeepSeek's sequence-wise balance loss with aux_loss_alpha (config.json's keys)."""
    attn, k = m.model.layers[0].self_attn, c.first_k_dense_replace
    moe = m.model.layers[k].mlp
    scaling = _scaling(c, c.rope_parameters, m)
    grouped = getattr(c, "topk_method", None) == "group_limited_greedy"  # V3: its own view
    return _ref(
        arch="decoder",
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        kv_heads=c.num_attention_heads,
        head_dim=c.hidden_size // c.num_attention_heads,  # unused by MLA (mla= below)
        d_ff=moe.experts.intermediate_dim,
        ffn="glu",
        ffn_bias=False,
        experts=(moe.experts.num_experts, moe.gate.top_k, "softmax-topk", c.n_shared_experts),
        deepseek_moe=(
            moe.gate.routed_scaling_factor,
            c.n_group if grouped else 1,
            c.topk_group if grouped else 1,
            k,
            m.model.layers[0].mlp.gate_proj.out_features,
            "sequence" if getattr(c, "seq_aux", True) else "switch",
        ),
        qkv_bias=None,
        o_bias=None,
        scale=attn.scaling,
        attention_kind="mla",
        mla=dict(
            kv_lora_rank=attn.kv_lora_rank,
            q_lora_rank=attn.q_lora_rank,
            qk_nope_head_dim=attn.qk_nope_head_dim,
            qk_rope_head_dim=attn.qk_rope_head_dim,
            v_head_dim=attn.v_head_dim,
            bias=attn.o_proj.bias is not None,
        ),
        positional=dict(
            kind="rope",
            base=c.rope_parameters["rope_theta"],
            layout="interleaved",
            fraction=1.0,
            scaling=scaling,
        ),
        norm=dict(kind="rmsnorm", eps=c.rms_norm_eps),
        pad_token_id=c.pad_token_id,
        tie_embeddings=c.tie_word_embeddings,
        dropout=0.0,
        attention_dropout=c.attention_dropout,
        aux_loss_coef=getattr(c, "aux_loss_alpha", None),
    )


def _gemma(c: Any, m: Any) -> dict[str, Any]:
    """modeling_gemma.py: Llama's network with GemmaRMSNorm (x̂ · (1 + w), in fp32 before the
    cast) and GemmaTextScaledWordEmbedding, whose factor is sqrt(hidden_size) cast to the weight's
    dtype (`embed_scale.to(self.weight.dtype)`)."""
    emb = m.model.embed_tokens
    return {
        **_llama(c, m),
        "norm": dict(kind="rmsnorm-unit-offset", eps=c.rms_norm_eps),
        "scale_embeddings": emb.scalar_embed_scale == c.hidden_size**0.5,
        "round_embed_scale": True,
    }


def _phi3(c: Any, m: Any) -> dict[str, Any]:
    """modeling_phi3.py: Llama's network with q/k/v in one qkv_proj and gate/up in one
    gate_up_proj (the same parameters, split at load), resid_pdrop on both residual branches,
    partial rotary (partial_rotary_factor), Mistral's sliding-window mask when sliding_window is
    set: a window of max_position_embeddings or more never excludes a key (Phi-4-mini's 262,144
    at 131,072 positions), so it reads as none."""
    attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
    window = c.sliding_window
    if window is not None and window >= c.max_position_embeddings:
        window = None
    return _ref(
        arch="decoder",
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=attn.head_dim,
        d_ff=mlp.down_proj.in_features,
        ffn="glu",
        ffn_bias=mlp.gate_up_proj.bias is not None,
        qkv_bias=attn.qkv_proj.bias is not None,
        o_bias=attn.o_proj.bias is not None,
        sliding_window=window,
        positional=_rope(c, m),
        norm=dict(kind="rmsnorm", eps=c.rms_norm_eps),
        pad_token_id=c.pad_token_id,
        tie_embeddings=c.tie_word_embeddings,
        dropout=c.resid_pdrop,
        attention_dropout=c.attention_dropout,
    )


def _qwen3_moe(c: Any, m: Any) -> dict[str, Any]:
    """modeling_qwen3_moe.py: Qwen3's attention (qk-norm) with a sparse block in every layer
    (decoder_sparse_step 1, no mlp_only_layers): softmax over the experts, top-k, renormalised
    when norm_topk_prob (= softmax over the k chosen logits, attnlab's "topk-softmax"), no
    shared expert; Mixtral's switch balance loss times router_aux_loss_coef."""
    moe = m.model.layers[0].mlp
    routing = "topk-softmax" if c.norm_topk_prob else "softmax-topk"
    assert c.decoder_sparse_step == 1 and not c.mlp_only_layers  # every layer sparse
    return {
        **_llama(c, m),
        "d_ff": moe.experts.intermediate_dim,
        "experts": (moe.experts.num_experts, moe.gate.top_k, routing, 0),
    }


def _smollm3(c: Any, m: Any) -> dict[str, Any]:
    """modeling_smollm3.py: Llama's network where a layer with no_rope_layers[i] = 0 rotates
    nothing (`use_rope`): NoPE layers; windows only with use_sliding_window."""
    theta = c.rope_parameters["rope_theta"]
    layers = [x.self_attn for x in m.model.layers]
    return {
        **_llama(c, m),
        "sliding_window": None,
        "layer_attention": [
            (a.sliding_window, "rope" if a.use_rope else "none", theta if a.use_rope else None)
            for a in layers
        ],
    }


def _sandwich(layer: Any) -> bool:
    """Gemma 2/3's decoder layer: a norm before and after both sublayers."""
    names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm")
    return all(hasattr(layer, n) for n in (*names, "post_feedforward_layernorm"))


def _gemma2(c: Any, m: Any) -> dict[str, Any]:
    """modeling_gemma2.py / modeling_gemma3.py: Gemma's network with four norms per layer
    (input, post-attention, pre- and post-feedforward: the sandwich placement), a softmax scale
    query_pre_attn_scalar^-0.5 (`scaling`), soft-capped scores (attn_logit_softcapping, inside
    eager attention) and logits (final_logit_softcapping, in the causal LM's forward); each
    layer's window and RoPE base by its layer type (Gemma 3: rope_parameters per layer type,
    q_norm / k_norm over head_dim)."""
    layers = [x.self_attn for x in m.model.layers]
    attn = layers[0]
    nested = "full_attention" in c.rope_parameters  # Gemma 3: one set per layer type
    theta = {
        t: (c.rope_parameters[t] if nested else c.rope_parameters)["rope_theta"]
        for t in set(c.layer_types)
    }
    default_scale = attn.head_dim**-0.5
    return {
        **_gemma(c, m),
        "positional": dict(
            kind="rope", base=theta["full_attention"], layout="half", fraction=1.0, scaling=None
        ),
        "scale": None if attn.scaling == default_scale else attn.scaling,
        "sliding_window": None,
        "norm_placement": "sandwich" if _sandwich(m.model.layers[0]) else "?",
        "softcap": c.attn_logit_softcapping,
        "final_logit_softcap": c.final_logit_softcapping,
        "layer_attention": [(x.sliding_window, "rope", theta[x.layer_type]) for x in layers],
    }


def _olmo2(c: Any, m: Any) -> dict[str, Any]:
    """modeling_olmo2.py: Llama's network with no norm before the sublayers and one after each,
    x + post_attention_layernorm(attn(x)), then h + post_feedforward_layernorm(mlp(h)) (the
    post-sublayer placement, final norm kept); q_norm / k_norm over the whole q and k
    projections (n_heads·head_dim, n_kv_heads·head_dim channels) before RoPE."""
    layer = m.model.layers[0]
    attn = layer.self_attn
    post = not hasattr(layer, "input_layernorm") and hasattr(layer, "post_feedforward_layernorm")
    whole = attn.q_norm.weight.shape[0] == c.num_attention_heads * attn.head_dim
    return {
        **_llama(c, m),
        "norm_placement": "post-sublayer" if post else "?",
        "qk_norm_scope": "projection" if whole else "head",
    }


def _granite(c: Any, m: Any) -> dict[str, Any]:
    """modeling_granite.py: Llama's network with embeddings x embedding_multiplier, residual
    branches x residual_multiplier, the softmax scale attention_multiplier and logits /
    logits_scaling."""
    attn = m.model.layers[0].self_attn
    return {
        **_llama(c, m),
        "scale": attn.scaling,
        "embedding_multiplier": c.embedding_multiplier,
        "residual_multiplier": c.residual_multiplier,
        "logit_multiplier": 1 / c.logits_scaling,
    }


def _cohere(c: Any, m: Any) -> dict[str, Any]:
    """modeling_cohere.py: one input_layernorm per layer feeding attention and MLP in parallel,
    x + attn(ln(x)) + mlp(ln(x)); CohereLayerNorm subtracts the mean and has a weight but no
    bias; RoPE on interleaved pairs (rotate_half over x[..., ::2], x[..., 1::2] and
    repeat_interleave'd frequencies); logits x logit_scale; optional qk-norm (use_qk_norm).
    CohereLayerNorm computes in fp32 and rounds once (LayerNormConfig.upcast)."""
    layer = m.model.layers[0]
    attn, ln = layer.self_attn, layer.input_layernorm
    shared = not hasattr(layer, "post_attention_layernorm")
    return _ref(
        arch="decoder",
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=attn.head_dim,
        d_ff=c.intermediate_size,
        ffn="glu",
        ffn_bias=layer.mlp.gate_proj.bias is not None,
        qkv_bias=_one(*(getattr(attn, p).bias is not None for p in ("q_proj", "k_proj", "v_proj"))),
        o_bias=attn.o_proj.bias is not None,
        qk_norm=c.use_qk_norm,
        positional={**_rope(c, m), "layout": "interleaved"},
        # forward: x.to(torch.float32), normalised and scaled, .to(input_dtype): upcast
        norm=dict(kind="layernorm", eps=ln.variance_epsilon, bias=hasattr(ln, "bias"), upcast=True),
        residual="parallel-shared-norm" if shared else "?",
        pad_token_id=c.pad_token_id,
        tie_embeddings=c.tie_word_embeddings,
        dropout=0.0,
        attention_dropout=c.attention_dropout,
        logit_multiplier=c.logit_scale,
    )


def _deepseek_v3(c: Any, m: Any) -> dict[str, Any]:
    """modeling_deepseek_v3.py: DeepSeek-V2's network (the view above) with DeepseekV3TopkRouter:
    sigmoid scores, e_score_correction_bias (a buffer) added for choosing only, groups scored
    by the sum of their two best corrected scores, the chosen experts' uncorrected scores
    renormalised when norm_topk_prob, times routed_scaling_factor. transformers computes no
    balance loss: the V3 paper's sequence-wise one, α = 0.0001 (section 4.2), is the preset's."""
    k = c.first_k_dense_replace
    gate = m.model.layers[k].mlp.gate
    v2 = _deepseek_v2(c, m)
    n, top, _, shared = v2["experts"]
    routing = "sigmoid-topk-norm" if gate.norm_topk_prob else "sigmoid-topk"
    dense = v2["deepseek_moe"][3:5]  # first_k_dense_replace and their width
    return {
        **v2,
        "experts": (n, top, routing, shared),
        "deepseek_moe": (
            gate.routed_scaling_factor,
            gate.num_group,
            gate.topk_group,
            *dense,
            "sequence",  # the paper's complementary sequence-wise loss (eq. 17-20)
        ),
        "moe_router": (False, hasattr(gate, "e_score_correction_bias"), "top2-sum", [], 1),
        "aux_loss_coef": 0.0001,
    }


def _gpt_oss(c: Any, m: Any) -> dict[str, Any]:
    """modeling_gpt_oss.py: pre-RMSNorm, attention with q/k/v/o biases (attention_bias) and
    `sinks`, one learned logit per head in the softmax; each layer's window by its layer type;
    YaRN RoPE on halves (_apply_rotary_emb chunks x in two); GptOssTopKRouter (a linear map with
    bias, top-k of its logits, softmax over those k) and GptOssExperts with biases, whose
    _apply_gate is gate.clamp(max=limit)·σ(alpha·gate) · (up.clamp(±limit) + 1); Mixtral's
    switch balance loss times router_aux_loss_coef."""
    layers = [x.self_attn for x in m.model.layers]
    attn, mlp = layers[0], m.model.layers[0].mlp
    theta = c.rope_parameters["rope_theta"]
    return _ref(
        arch="decoder",
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=attn.head_dim,
        d_ff=mlp.experts.intermediate_size,
        ffn="glu",
        ffn_bias=mlp.experts.gate_up_proj_bias is not None,
        experts=(mlp.experts.num_experts, mlp.router.top_k, "topk-softmax", 0),
        moe_router=(mlp.router.bias is not None, False, "max", [], 1),
        expert_clamp=(mlp.experts.limit, 1.0),  # the `+ 1` of _apply_gate
        qkv_bias=_one(*(getattr(attn, p).bias is not None for p in ("q_proj", "k_proj", "v_proj"))),
        o_bias=attn.o_proj.bias is not None,
        sinks=attn.sinks.shape == (c.num_attention_heads,),
        scale=None if attn.scaling == attn.head_dim**-0.5 else attn.scaling,
        positional=_rope(c, m),
        layer_attention=[(x.sliding_window, "rope", theta) for x in layers],
        norm=dict(kind="rmsnorm", eps=c.rms_norm_eps),
        pad_token_id=c.pad_token_id,
        tie_embeddings=c.tie_word_embeddings,
        dropout=0.0,
        attention_dropout=c.attention_dropout,
        aux_loss_coef=c.router_aux_loss_coef,
    )


def _bloom(c: Any, m: Any) -> dict[str, Any]:
    """modeling_bloom.py: pre-norm, word_embeddings_layernorm, ALiBi, 4h MLP with biases."""
    return _ref(
        arch="decoder",
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        layers=c.n_layer,
        n_heads=c.n_head,
        kv_heads=c.n_head,
        head_dim=c.hidden_size // c.n_head,
        d_ff=m.transformer.h[0].mlp.dense_h_to_4h.out_features,
        ffn="dense",
        ffn_bias=True,
        qkv_bias=True,
        o_bias=True,
        positional=dict(kind="alibi"),
        norm=dict(kind="layernorm", eps=c.layer_norm_epsilon, bias=True),
        norm_placement="normed-residual" if c.apply_residual_connection_post_layernorm else "pre",
        embedding_norm=True,
        pad_token_id=c.pad_token_id,
        tie_embeddings=c.tie_word_embeddings,
        dropout=c.hidden_dropout,
        attention_dropout=c.attention_dropout,
    )


def _mpt(c: Any, m: Any) -> dict[str, Any]:
    """modeling_mpt.py: pre-norm, no_bias drops every bias (norms too), GELU MLP of
    expansion_ratio·d. ALiBi with alibi_bias_max 8 is the paper's slopes; with ALiBi on, MPT's
    `learned_pos_emb` is switched off (llm-foundry) and the HF model has no position table."""
    a = c.attn_config
    return _ref(
        arch="decoder",
        vocab_size=c.vocab_size,
        d_model=c.d_model,
        layers=c.n_layers,
        n_heads=c.n_heads,
        kv_heads=1 if a.attn_type == "multiquery_attention" else c.n_heads,
        head_dim=c.d_model // c.n_heads,
        d_ff=c.expansion_ratio * c.d_model,
        ffn="dense",
        ffn_bias=not c.no_bias,
        qkv_bias=not c.no_bias,
        o_bias=not c.no_bias,
        qk_norm=a.qk_ln,
        scale=a.softmax_scale,
        positional=dict(kind="alibi") if a.alibi and a.alibi_bias_max == 8 else dict(kind="?"),
        norm=dict(kind="layernorm", eps=c.layer_norm_epsilon, bias=not c.no_bias),
        pad_token_id=c.pad_token_id,
        tie_embeddings=c.tie_word_embeddings,
        dropout=_one(c.emb_pdrop, c.resid_pdrop),
        attention_dropout=a.attn_pdrop,
    )


def _neox(c: Any, m: Any) -> dict[str, Any]:
    """modeling_gpt_neox.py: two LayerNorms per block; use_parallel_residual gives
    x + attn(ln1(x)) + mlp(ln2(x)); partial rotary."""
    return _ref(
        arch="decoder",
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        kv_heads=c.num_attention_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        d_ff=c.intermediate_size,
        ffn="dense",
        ffn_bias=True,
        qkv_bias=c.attention_bias,
        o_bias=c.attention_bias,
        positional=_rope(c, m),
        norm=dict(kind="layernorm", eps=c.layer_norm_eps, bias=True),
        residual="parallel" if c.use_parallel_residual else "sequential",
        pad_token_id=c.pad_token_id,
        tie_embeddings=c.tie_word_embeddings,
        dropout=c.hidden_dropout,
        attention_dropout=c.attention_dropout,
    )


def _falcon(c: Any, m: Any) -> dict[str, Any]:
    """modeling_falcon.py: the old (7B) layout has multi_query = one K/V head and, with
    parallel_attn, one input_layernorm feeding both branches; `bias` covers every Linear."""
    kv = c.num_kv_heads if c.new_decoder_architecture or not c.multi_query else 1
    shared = c.parallel_attn and not c.new_decoder_architecture
    return _ref(
        arch="decoder",
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        kv_heads=kv,
        head_dim=c.head_dim,
        d_ff=c.ffn_hidden_size,
        ffn="dense",
        ffn_bias=c.bias,
        qkv_bias=c.bias,
        o_bias=c.bias,
        positional=dict(kind="alibi") if c.alibi else _rope(c, m),
        norm=dict(kind="layernorm", eps=c.layer_norm_epsilon, bias=True),
        residual="parallel-shared-norm" if shared else "other",
        pad_token_id=c.pad_token_id,
        tie_embeddings=c.tie_word_embeddings,
        dropout=c.hidden_dropout,
        attention_dropout=c.attention_dropout,
    )


def _t5(c: Any, m: Any) -> dict[str, Any]:
    """modeling_t5.py: pre-norm with T5LayerNorm (an RMSNorm), no biases, no 1/sqrt(d) (the
    module's `scaling`), relative bias, final norm per stack, shared embeddings; v1.0 scales the
    last hidden by d_model^-0.5 before the tied head; dropout_rate also drops attention weights."""
    return _ref(
        arch="encoder-decoder",
        vocab_size=c.vocab_size,
        d_model=c.d_model,
        layers=(c.num_layers, c.num_decoder_layers),
        n_heads=c.num_heads,
        kv_heads=c.num_heads,
        head_dim=c.d_kv,
        d_ff=c.d_ff,
        ffn="glu" if c.is_gated_act else "dense",
        ffn_bias=False,
        qkv_bias=False,
        o_bias=False,
        scale=m.encoder.block[0].layer[0].SelfAttention.scaling,
        positional=dict(
            kind="t5-relative",
            num_buckets=c.relative_attention_num_buckets,
            max_distance=c.relative_attention_max_distance,
        ),
        norm=dict(kind="rmsnorm", eps=c.layer_norm_epsilon),
        pad_token_id=c.pad_token_id,
        tie_embeddings=c.tie_word_embeddings,
        share_encoder_decoder_embeddings=m.encoder.embed_tokens.weight
        is m.decoder.embed_tokens.weight,
        scale_tied_logits=c.scale_decoder_outputs,
        dropout=c.dropout_rate,
        attention_dropout=c.dropout_rate,
        activation_dropout=c.dropout_rate,  # T5DenseActDense drops its hidden activation
    )


def _bart(c: Any, m: Any) -> dict[str, Any]:
    """modeling_bart.py: post-norm, layernorm_embedding, no final norm, positions offset by 2."""
    enc, dec = m.model.encoder, m.model.decoder
    heads = _one(c.encoder_attention_heads, c.decoder_attention_heads)
    return _ref(
        arch="encoder-decoder",
        vocab_size=c.vocab_size,
        d_model=c.d_model,
        layers=(c.encoder_layers, c.decoder_layers),
        n_heads=heads,
        kv_heads=heads,
        head_dim=c.d_model // c.encoder_attention_heads,
        d_ff=_one(c.encoder_ffn_dim, c.decoder_ffn_dim),
        ffn="dense",
        ffn_bias=True,
        qkv_bias=True,
        o_bias=True,
        positional=dict(
            kind="learned",
            max_len=enc.embed_positions.num_embeddings,
            offset=enc.embed_positions.offset,
        ),
        norm=dict(kind="layernorm", eps=enc.layers[0].self_attn_layer_norm.eps, bias=True),
        norm_placement="post",
        final_norm=False,
        embedding_norm=True,
        scale_embeddings=c.scale_embedding,
        pad_token_id=c.pad_token_id,
        tie_embeddings=c.tie_word_embeddings,
        share_encoder_decoder_embeddings=enc.embed_tokens.weight is dec.embed_tokens.weight,
        dropout=c.dropout,
        attention_dropout=c.attention_dropout,
        activation_dropout=c.activation_dropout,
    )


def _whisper(c: Any, m: Any) -> dict[str, Any]:
    """modeling_whisper.py: pre-norm layers and a final layer_norm per stack; WhisperAttention
    with biases on q, v and out_proj but none on k_proj; the encoder reads conv1 / conv2 over
    num_mel_bins channels plus a frozen sinusoid table of max_source_positions rows (the audio
    frontend), the decoder a learned table from 0; proj_out tied to the decoder's embed_tokens,
    the only token table (so "shared"); scale_embedding is stored but never applied."""
    enc, dec = m.model.encoder, m.model.decoder
    heads = _one(c.encoder_attention_heads, c.decoder_attention_heads)
    attn = enc.layers[0].self_attn
    return _ref(
        arch="encoder-decoder",
        vocab_size=c.vocab_size,
        d_model=c.d_model,
        layers=(c.encoder_layers, c.decoder_layers),
        n_heads=heads,
        kv_heads=heads,
        head_dim=c.d_model // heads,
        d_ff=_one(c.encoder_ffn_dim, c.decoder_ffn_dim),
        ffn="dense",
        ffn_bias=True,
        qkv_bias=attn.q_proj.bias is not None and attn.v_proj.bias is not None,
        k_bias=attn.k_proj.bias is not None,
        o_bias=attn.out_proj.bias is not None,
        positional=dict(kind="learned", max_len=dec.embed_positions.num_embeddings, offset=0),
        norm=dict(kind="layernorm", eps=enc.layers[0].self_attn_layer_norm.eps, bias=True),
        pad_token_id=c.pad_token_id,
        tie_embeddings=c.tie_word_embeddings,
        share_encoder_decoder_embeddings=True,
        frontend=dict(
            kind="audio",
            num_mel_bins=enc.conv1.in_channels,
            max_source_positions=enc.embed_positions.num_embeddings,
        ),
        dropout=c.dropout,
        attention_dropout=c.attention_dropout,
        activation_dropout=c.activation_dropout,
    )


# --- the model cards -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Card:
    url: str  # the model card's config.json
    config: str  # transformers config class
    model: str  # transformers model class, with the head the preset has
    values: dict  # config.json's architecture and dropout keys (token ids, dtype, etc. left out)
    # submodule holding the FFN activation, or model -> the activation (GPT-OSS's is inline)
    act: str | Callable[[Any], Callable[[torch.Tensor], torch.Tensor]]
    view: Callable[[Any, Any], dict[str, Any]]
    # parameters the reference builds but its forward never reads (not counted): BigBird's
    # *ForMaskedLM builds BigBirdModel(config) with its pooler, used by no MLM output
    unused: tuple[str, ...] = ()


_LLAMA = dict(hidden_act="silu", tie_word_embeddings=False)
_BERT = dict(hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
_BERT.update(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
_LLAMA_ACT = "model.layers.0.mlp.act_fn"
# Phi-4-mini's rope_scaling.long_factor, as its config.json lists it (short_factor: 48 x 1.0)
_PHI4_LONG = [
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
    2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023,
    4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372,
    10.4687158, 11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807,
    22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66,
    32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
]  # fmt: skip

CARDS: dict[str, Card] = {
    "bert-base": Card(
        "https://huggingface.co/google-bert/bert-base-uncased/blob/main/config.json",
        "BertConfig",
        "BertForMaskedLM",
        dict(
            _BERT,
            vocab_size=30522,
            max_position_embeddings=512,
            type_vocab_size=2,
            layer_norm_eps=1e-12,
            pad_token_id=0,
        ),
        "bert.encoder.layer.0.intermediate.intermediate_act_fn",
        _bert,
    ),
    "roberta-base": Card(
        "https://huggingface.co/FacebookAI/roberta-base/blob/main/config.json",
        "RobertaConfig",
        "RobertaForMaskedLM",
        dict(
            _BERT,
            vocab_size=50265,
            max_position_embeddings=514,
            type_vocab_size=1,
            layer_norm_eps=1e-5,
            pad_token_id=1,
        ),
        "roberta.encoder.layer.0.intermediate.intermediate_act_fn",
        _bert,
    ),
    "longformer-base-4096": Card(
        "https://huggingface.co/allenai/longformer-base-4096/blob/main/config.json",
        "LongformerConfig",
        "LongformerForMaskedLM",
        dict(
            _BERT,
            vocab_size=50265,
            max_position_embeddings=4098,
            type_vocab_size=1,
            layer_norm_eps=1e-5,
            pad_token_id=1,
            attention_window=[512] * 12,
        ),
        "longformer.encoder.layer.0.intermediate.intermediate_act_fn",
        _longformer,
    ),
    "bigbird-roberta-base": Card(
        "https://huggingface.co/google/bigbird-roberta-base/blob/main/config.json",
        "BigBirdConfig",
        "BigBirdForMaskedLM",
        dict(
            _BERT,
            hidden_act="gelu_new",
            vocab_size=50358,
            max_position_embeddings=4096,
            type_vocab_size=2,
            layer_norm_eps=1e-12,
            pad_token_id=0,
            attention_type="block_sparse",
            block_size=64,
            num_random_blocks=3,
            use_bias=True,
            rescale_embeddings=False,
        ),
        "bert.encoder.layer.0.intermediate.intermediate_act_fn",
        _bigbird,
        unused=("bert.pooler.",),
    ),
    "vit-base-patch16-224": Card(
        "https://huggingface.co/google/vit-base-patch16-224/blob/main/config.json",
        "ViTConfig",
        "ViTForImageClassification",
        dict(
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            hidden_act="gelu",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            layer_norm_eps=1e-12,
            image_size=224,
            patch_size=16,
            num_channels=3,
            qkv_bias=True,
            num_labels=1000,  # the card's id2label: the ImageNet-1k classes
        ),
        "vit.layers.0.mlp.activation_fn",
        _vit,
    ),
    "modernbert-base": Card(
        "https://huggingface.co/answerdotai/ModernBERT-base/blob/main/config.json",
        "ModernBertConfig",
        "ModernBertForMaskedLM",
        dict(
            vocab_size=50368,
            hidden_size=768,
            intermediate_size=1152,
            num_hidden_layers=22,
            num_attention_heads=12,
            hidden_activation="gelu",
            max_position_embeddings=8192,
            norm_eps=1e-5,
            norm_bias=False,
            global_rope_theta=160000.0,
            local_rope_theta=10000.0,
            global_attn_every_n_layers=3,
            local_attention=128,
            attention_bias=False,
            mlp_bias=False,
            attention_dropout=0.0,
            embedding_dropout=0.0,
            mlp_dropout=0.0,
            classifier_activation="gelu",
            decoder_bias=True,
            pad_token_id=50283,
        ),
        "model.layers.0.mlp.act",
        _modernbert,
    ),
    "swin-tiny": Card(
        "https://huggingface.co/microsoft/swin-tiny-patch4-window7-224/blob/main/config.json",
        "SwinConfig",
        "SwinModel",  # the card's backbone (its checkpoint adds an ImageNet classifier)
        dict(
            image_size=224,
            patch_size=4,
            num_channels=3,
            embed_dim=96,
            depths=[2, 2, 6, 2],
            num_heads=[3, 6, 12, 24],
            window_size=7,
            mlp_ratio=4.0,
            qkv_bias=True,
            hidden_act="gelu",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            drop_path_rate=0.1,  # stochastic depth, training only: not modelled
            use_absolute_embeddings=False,
            layer_norm_eps=1e-5,
        ),
        "encoder.layers.0.blocks.0.mlp.activation_fn",
        _swin,
    ),
    "gpt2-small": Card(
        "https://huggingface.co/openai-community/gpt2/blob/main/config.json",
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            vocab_size=50257,
            n_positions=1024,
            n_embd=768,
            n_layer=12,
            n_head=12,
            activation_function="gelu_new",
            resid_pdrop=0.1,
            embd_pdrop=0.1,
            attn_pdrop=0.1,
            layer_norm_epsilon=1e-5,
        ),
        "transformer.h.0.mlp.act",
        _gpt2,
    ),
    "llama2-7b": Card(
        "https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json",
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            _LLAMA,
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
        ),
        _LLAMA_ACT,
        _llama,
    ),
    "llama2-70b": Card(
        "https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json",
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            _LLAMA,
            vocab_size=32000,
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
        ),
        _LLAMA_ACT,
        _llama,
    ),
    "qwen2-7b": Card(
        "https://huggingface.co/Qwen/Qwen2-7B/blob/main/config.json",
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            _LLAMA,
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            sliding_window=131072,  # inert: use_sliding_window is false
            use_sliding_window=False,
            max_window_layers=28,
            attention_dropout=0.0,
        ),
        _LLAMA_ACT,
        _llama,
    ),
    "qwen3-0.6b": Card(
        "https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            _LLAMA,
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=28,
            attention_dropout=0.0,
            tie_word_embeddings=True,
        ),
        _LLAMA_ACT,
        _llama,
    ),
    "mistral-7b": Card(
        "https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json",
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            _LLAMA,
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            sliding_window=4096,
        ),
        _LLAMA_ACT,
        _llama,
    ),
    "mixtral-8x7b": Card(
        "https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json",
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            _LLAMA,
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            rope_theta=1000000.0,
            sliding_window=None,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.02,
            attention_dropout=0.0,
        ),
        "model.layers.0.mlp.experts.act_fn",
        _llama,
    ),
    "deepseek-v2-lite": Card(
        "https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json",
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            _LLAMA,
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            max_position_embeddings=163840,
            rms_norm_eps=1e-6,
            rope_scaling=dict(
                type="yarn",
                factor=40,
                original_max_position_embeddings=4096,
                beta_fast=32,
                beta_slow=1,
                mscale=0.707,
                mscale_all_dim=0.707,
            ),
            rope_theta=10000,
            attention_bias=False,
            attention_dropout=0.0,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            first_k_dense_replace=1,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            n_group=1,
            topk_group=1,
            topk_method="greedy",
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            aux_loss_alpha=0.001,
            seq_aux=True,
        ),
        "model.layers.0.mlp.act_fn",
        _deepseek_v2,
    ),
    "gemma-2b": Card(
        "https://huggingface.co/google/gemma-2b/blob/main/config.json",
        "GemmaConfig",
        "GemmaForCausalLM",
        dict(
            vocab_size=256000,
            hidden_size=2048,
            intermediate_size=16384,
            num_hidden_layers=18,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=256,
            hidden_act="gelu",  # GemmaConfig reads the card's legacy "gelu" as the tanh form
            max_position_embeddings=8192,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            attention_bias=False,
            attention_dropout=0.0,
            pad_token_id=0,
            tie_word_embeddings=True,
        ),
        _LLAMA_ACT,
        _gemma,
    ),
    "bloom-560m": Card(
        "https://huggingface.co/bigscience/bloom-560m/blob/main/config.json",
        "BloomConfig",
        "BloomForCausalLM",
        dict(
            vocab_size=250880,
            hidden_size=1024,
            n_layer=24,
            n_head=16,
            layer_norm_epsilon=1e-5,
            apply_residual_connection_post_layernorm=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            pad_token_id=3,
        ),
        "transformer.h.0.mlp.gelu_impl",
        _bloom,
    ),
    "mpt-7b": Card(
        "https://huggingface.co/mosaicml/mpt-7b/blob/main/config.json",
        "MptConfig",
        "MptForCausalLM",
        dict(
            d_model=4096,
            n_heads=32,
            n_layers=32,
            expansion_ratio=4,
            max_seq_len=2048,
            vocab_size=50432,
            no_bias=True,
            learned_pos_emb=True,
            emb_pdrop=0,
            resid_pdrop=0,
            attn_config=dict(
                alibi=True,
                alibi_bias_max=8,
                attn_type="multihead_attention",
                attn_pdrop=0,
                qk_ln=False,
                clip_qkv=None,
                softmax_scale=None,
            ),
        ),
        "transformer.blocks.0.ffn.act",
        _mpt,
    ),
    "gpt-neox-20b": Card(
        "https://huggingface.co/EleutherAI/gpt-neox-20b/blob/main/config.json",
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            vocab_size=50432,
            hidden_size=6144,
            num_hidden_layers=44,
            num_attention_heads=64,
            intermediate_size=24576,
            hidden_act="gelu_fast",
            layer_norm_eps=1e-5,
            max_position_embeddings=2048,
            rotary_emb_base=10000,
            rotary_pct=0.25,
            use_parallel_residual=True,
            tie_word_embeddings=False,
        ),
        "gpt_neox.layers.0.mlp.act",
        _neox,
    ),
    "falcon-7b": Card(
        "https://huggingface.co/tiiuae/falcon-7b/blob/main/config.json",
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            vocab_size=65024,
            hidden_size=4544,
            num_hidden_layers=32,
            num_attention_heads=71,
            layer_norm_epsilon=1e-5,
            alibi=False,
            bias=False,
            multi_query=True,
            new_decoder_architecture=False,
            parallel_attn=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
        "transformer.h.0.mlp.act",
        _falcon,
    ),
    "t5-small": Card(
        "https://huggingface.co/google-t5/t5-small/blob/main/config.json",
        "T5Config",
        "T5ForConditionalGeneration",
        dict(
            vocab_size=32128,
            d_model=512,
            d_kv=64,
            d_ff=2048,
            num_layers=6,
            num_heads=8,
            relative_attention_num_buckets=32,
            dropout_rate=0.1,
            layer_norm_epsilon=1e-6,
            feed_forward_proj="relu",
            pad_token_id=0,
        ),
        "encoder.block.0.layer.1.DenseReluDense.act",
        _t5,
    ),
    "bart-base": Card(
        "https://huggingface.co/facebook/bart-base/blob/main/config.json",
        "BartConfig",
        "BartForConditionalGeneration",
        dict(
            vocab_size=50265,
            d_model=768,
            encoder_layers=6,
            decoder_layers=6,
            encoder_attention_heads=12,
            decoder_attention_heads=12,
            encoder_ffn_dim=3072,
            decoder_ffn_dim=3072,
            activation_function="gelu",
            dropout=0.1,
            attention_dropout=0.1,
            activation_dropout=0.1,
            max_position_embeddings=1024,
            scale_embedding=False,
            pad_token_id=1,
        ),
        "model.encoder.layers.0.activation_fn",
        _bart,
    ),
    **{
        f"whisper-{size}": Card(
            f"https://huggingface.co/openai/whisper-{size}/blob/main/config.json",
            "WhisperConfig",
            "WhisperForConditionalGeneration",
            dict(
                vocab_size=51865,
                num_mel_bins=80,
                d_model=d,
                encoder_layers=n,
                decoder_layers=n,
                encoder_attention_heads=h,
                decoder_attention_heads=h,
                encoder_ffn_dim=4 * d,
                decoder_ffn_dim=4 * d,
                activation_function="gelu",
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                max_source_positions=1500,
                max_target_positions=448,
                scale_embedding=False,
                pad_token_id=50257,
                bos_token_id=50257,
                eos_token_id=50257,
                decoder_start_token_id=50258,
            ),
            "model.encoder.layers.0.activation_fn",
            _whisper,
        )
        for size, d, n, h in (("tiny", 384, 4, 6), ("base", 512, 6, 8))
    },
    # --- issue 19. Where each card's values come from: recalled from the model card and checked
    # against copies of its config.json stored in public GitHub repositories (the stored search
    # index: whole files for Phi-4-mini, Gemma 3 1B, SmolLM3; key-by-key for the others), and
    # against the transformers config class's defaults where the class defaults to that model
    # (noted per card). Token ids other than padding, dtype and quantisation are left out.
    **{
        name: Card(
            # recalled from the cards; LlamaConfig's defaults are Llama 2's, so every size is set
            f"https://huggingface.co/meta-llama/{repo}/blob/main/config.json",
            "LlamaConfig",
            "LlamaForCausalLM",
            dict(
                _LLAMA,
                vocab_size=128256,
                hidden_size=d,
                intermediate_size=d_ff,
                num_hidden_layers=n,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=d // 32,
                max_position_embeddings=131072,
                rms_norm_eps=1e-5,
                rope_theta=500000.0,
                rope_scaling=dict(
                    rope_type="llama3",
                    factor=factor,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=8192,
                ),
                attention_bias=False,
                mlp_bias=False,
                attention_dropout=0.0,
                tie_word_embeddings=tied,
            ),
            _LLAMA_ACT,
            _llama,
        )
        for name, repo, d, d_ff, n, factor, tied in (
            ("llama3.2-1b", "Llama-3.2-1B", 2048, 8192, 16, 32.0, True),
            ("llama3.1-8b", "Llama-3.1-8B", 4096, 14336, 32, 8.0, False),
        )
    },
    "phi3-mini-4k": Card(
        # Phi3Config's defaults are this card's sizes (vocab 32064, 3072 x 32, 8192, 4096
        # positions, pad 32000); sliding_window 2047 and the dropouts from the card
        "https://huggingface.co/microsoft/Phi-3-mini-4k-instruct/blob/main/config.json",
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            _LLAMA,
            vocab_size=32064,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            rope_scaling=None,
            sliding_window=2047,
            attention_bias=False,
            attention_dropout=0.0,
            embd_pdrop=0.0,
            resid_pdrop=0.0,
            pad_token_id=32000,
        ),
        "model.layers.0.mlp.activation_fn",
        _phi3,
    ),
    "phi4-mini": Card(
        # a whole copy of the card's config.json in the stored index (transformers 4.45.0 era)
        "https://huggingface.co/microsoft/Phi-4-mini-instruct/blob/main/config.json",
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            _LLAMA,
            vocab_size=200064,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=24,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            partial_rotary_factor=0.75,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            rope_scaling=dict(type="longrope", short_factor=[1.0] * 48, long_factor=_PHI4_LONG),
            sliding_window=262144,
            attention_bias=False,
            mlp_bias=False,
            attention_dropout=0.0,
            embd_pdrop=0.0,
            resid_pdrop=0.0,
            pad_token_id=199999,
            tie_word_embeddings=True,
        ),
        "model.layers.0.mlp.activation_fn",
        _phi3,
    ),
    "gemma2-2b": Card(
        # Gemma2Config's defaults are this card's (2304 x 26, 8/4 heads of 256, 9216, caps 50
        # and 30, window 4096, query_pre_attn_scalar 256), recalled from the card too
        "https://huggingface.co/google/gemma-2-2b/blob/main/config.json",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            vocab_size=256000,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            hidden_activation="gelu_pytorch_tanh",
            max_position_embeddings=8192,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            attention_bias=False,
            attention_dropout=0.0,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            pad_token_id=0,
            tie_word_embeddings=True,
        ),
        _LLAMA_ACT,
        _gemma2,
    ),
    "gemma3-1b": Card(
        # whole copies of the card's config.json in the stored index (transformers 4.50 / 4.52);
        # Gemma3TextConfig reads rope_local_base_freq and sliding_window_pattern into
        # rope_parameters and layer_types
        "https://huggingface.co/google/gemma-3-1b-pt/blob/main/config.json",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            vocab_size=262144,
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            hidden_activation="gelu_pytorch_tanh",
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1000000,
            rope_local_base_freq=10000,
            rope_scaling=None,
            attention_bias=False,
            attention_dropout=0.0,
            query_pre_attn_scalar=256,
            sliding_window=512,
            sliding_window_pattern=6,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            pad_token_id=0,
            tie_word_embeddings=True,
        ),
        _LLAMA_ACT,
        _gemma2,
    ),
    "olmo2-1b": Card(
        # recalled from the card (Olmo2Config's defaults are the 7B's)
        "https://huggingface.co/allenai/OLMo-2-0425-1B/blob/main/config.json",
        "Olmo2Config",
        "Olmo2ForCausalLM",
        dict(
            _LLAMA,
            vocab_size=100352,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_theta=500000,
            rope_scaling=None,
            attention_bias=False,
            attention_dropout=0.0,
            pad_token_id=100277,
        ),
        _LLAMA_ACT,
        _olmo2,
    ),
    "granite-3.1-2b": Card(
        # recalled from the card; vocab 49155, rope_theta 5e6 and the four multipliers as
        # several stored copies of the 3.1-2B's config.json give them (GraniteConfig's defaults
        # are Llama's)
        "https://huggingface.co/ibm-granite/granite-3.1-2b-instruct/blob/main/config.json",
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            _LLAMA,
            vocab_size=49155,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=40,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=5000000.0,
            rope_scaling=None,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.015625,
            logits_scaling=8.0,
            attention_bias=False,
            mlp_bias=False,
            attention_dropout=0.1,
            pad_token_id=0,
            tie_word_embeddings=True,
        ),
        _LLAMA_ACT,
        _granite,
    ),
    "command-r": Card(
        # CohereConfig's defaults are this card's but rope_theta (8e6 on the card, 5e5 in the
        # class); recalled from the card
        "https://huggingface.co/CohereForAI/c4ai-command-r-v01/blob/main/config.json",
        "CohereConfig",
        "CohereForCausalLM",
        dict(
            hidden_act="silu",
            vocab_size=256000,
            hidden_size=8192,
            intermediate_size=22528,
            num_hidden_layers=40,
            num_attention_heads=64,
            num_key_value_heads=64,
            max_position_embeddings=8192,
            layer_norm_eps=1e-5,
            rope_theta=8000000.0,
            logit_scale=0.0625,
            use_qk_norm=False,
            attention_bias=False,
            pad_token_id=0,
            tie_word_embeddings=True,
        ),
        _LLAMA_ACT,
        _cohere,
    ),
    "deepseek-v3": Card(
        # DeepseekV3Config's defaults are this card's sizes and routing (7168 x 61, 128 heads,
        # latents 1536 / 512, 256 + 1 experts of 2048, top-8 of 8 groups / 4, x 2.5, first 3
        # dense of 18432); rope_scaling, rope_theta and positions recalled from the card
        # (scoring_func, topk_method: what DeepseekV3TopkRouter always does)
        "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            _LLAMA,
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=128,
            num_key_value_heads=128,
            max_position_embeddings=163840,
            rms_norm_eps=1e-6,
            rope_theta=10000,
            rope_scaling=dict(
                type="yarn",
                factor=40,
                original_max_position_embeddings=4096,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            attention_bias=False,
            attention_dropout=0.0,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            first_k_dense_replace=3,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            num_nextn_predict_layers=1,  # the MTP module: not built by transformers
        ),
        "model.layers.0.mlp.act_fn",
        _deepseek_v3,
    ),
    "gpt-oss-20b": Card(
        # GptOssConfig's defaults are the 120B's (36 layers, 128 experts); the 20B's 24 layers,
        # 32 experts and router_aux_loss_coef 0.9 recalled from the card, the rest as the class
        "https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json",
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            _LLAMA,
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=150000,
            rope_scaling=dict(
                rope_type="yarn",
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=4096,
            ),
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * 12,
            num_local_experts=32,
            num_experts_per_tok=4,
            swiglu_limit=7.0,
            router_aux_loss_coef=0.9,
            attention_bias=True,
            attention_dropout=0.0,
            pad_token_id=199999,
        ),
        # _apply_gate on (gate x, up 0): x·σ(alpha·x), the clamp above 7 outside the range tested
        lambda m: (
            lambda x, e=m.model.layers[0].mlp.experts: e._apply_gate(
                torch.stack([x, torch.zeros_like(x)], -1).flatten(-2)
            )
        ),
        _gpt_oss,
    ),
    "qwen3-30b-a3b": Card(
        # Qwen3MoeConfig's defaults hold this card's widths (2048, 32/4 heads, 768 x 128 experts,
        # top-8, aux 0.001); layers (48), head_dim, RoPE base, positions and norm_topk_prob
        # (true) from the card
        "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            _LLAMA,
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            rope_scaling=None,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.001,
            attention_bias=False,
            attention_dropout=0.0,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=48,
        ),
        "model.layers.0.mlp.experts.act_fn",
        _qwen3_moe,
    ),
    "smollm3-3b": Card(
        # SmolLM3Config's defaults hold the sizes and pad 128004; rope_theta 5e6 (the class
        # says 2e6) and 65,536 positions from the card
        "https://huggingface.co/HuggingFaceTB/SmolLM3-3B/blob/main/config.json",
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(
            _LLAMA,
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=4,
            max_position_embeddings=65536,
            rms_norm_eps=1e-6,
            rope_theta=5000000.0,
            rope_scaling=None,
            no_rope_layer_interval=4,
            no_rope_layers=[1, 1, 1, 0] * 9,
            use_sliding_window=False,
            sliding_window=None,
            attention_bias=False,
            mlp_bias=False,
            attention_dropout=0.0,
            pad_token_id=128004,
            tie_word_embeddings=True,
        ),
        _LLAMA_ACT,
        _smollm3,
    ),
}
HF_NAMES = list(CARDS)


@functools.cache
def _hf(name: str) -> tuple[Any, torch.nn.Module]:
    transformers = pytest.importorskip("transformers")
    card = CARDS[name]
    config = getattr(transformers, card.config)(**card.values)
    with torch.device("meta"):
        model = getattr(transformers, card.model)(config)
    return config, model


_MLA = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "bias")


def _deepseek_moe(ffn: Any) -> tuple | None:
    """DeepSeek's routing and dense layers, where a MoE config sets any of them."""
    if not isinstance(ffn, MoEFFN):
        return None
    view = (ffn.routed_scale, ffn.n_groups, ffn.top_k_groups, ffn.dense_layers, ffn.dense_d_ff)
    view += (ffn.balance_loss,)
    return None if view == (1.0, 1, 1, 0, None, "switch") else view


def _moe_router(ffn: Any) -> tuple | None:
    """The router's extras (config/ffn.py, MoEFFN), where a MoE config sets any of them."""
    if not isinstance(ffn, MoEFFN):
        return None
    view = (ffn.router_bias, ffn.selection_bias, ffn.group_score, list(ffn.dense_at))
    view += (ffn.sparse_step,)
    return None if view == (False, False, "max", [], 1) else view


def _view(cfg: ModelConfig) -> dict[str, Any]:
    """A preset in the vocabulary of the reference views above."""
    ffn = cfg.ffn
    expert = ffn.expert if isinstance(ffn, MoEFFN) else ffn
    a = cfg.attention
    encdec = cfg.arch == "encoder-decoder"
    return dict(
        arch=cfg.arch,
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        layers=(cfg.n_layers, cfg.decoder_layers) if encdec else cfg.n_layers,
        n_heads=cfg.n_heads,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.attn_head_dim,
        d_ff=cfg.ffn_dim,
        ffn=expert.kind,
        ffn_bias=expert.bias,
        experts=(ffn.n_experts, ffn.top_k, ffn.routing, ffn.n_shared_experts)
        if isinstance(ffn, MoEFFN)
        else None,
        qkv_bias=getattr(a, "qkv_bias", None),  # MLA: its own biases, in mla=
        k_bias=getattr(a, "k_bias", True),  # False: q and v biased, k not (Whisper)
        o_bias=getattr(a, "o_bias", None),
        qk_norm=a.qk_norm,
        scale=a.scale,
        attention_kind=a.kind,
        mla={k: v for k, v in a.to_dict().items() if k in _MLA} if a.kind == "mla" else None,
        deepseek_moe=_deepseek_moe(ffn),
        sliding_window=a.sliding_window,
        positional=_positional(cfg),
        norm=_norm(cfg),
        norm_placement=cfg.norm_placement,
        residual=cfg.residual,
        final_norm=cfg.final_norm,
        embedding_norm=cfg.embedding_norm,
        scale_embeddings=cfg.scale_embeddings,
        round_embed_scale=cfg.round_embed_scale,
        type_vocab_size=cfg.type_vocab_size,
        pad_token_id=cfg.pad_token_id,
        tie_embeddings=cfg.tie_embeddings,
        share_encoder_decoder_embeddings=cfg.share_encoder_decoder_embeddings if encdec else None,
        scale_tied_logits=cfg.scale_tied_logits,
        mlm_head=cfg.mlm_head,
        num_labels=cfg.num_labels,
        frontend=cfg.frontend.to_dict() if cfg.frontend is not None else None,
        classifier_pooler=cfg.classifier_pooler,
        layer_attention=_layer_attention(cfg),
        first_attn_norm=cfg.first_attn_norm,
        mlm_dense_bias=cfg.mlm_dense_bias,
        stages=cfg.stages.to_dict() if cfg.stages is not None else None,
        softcap=getattr(a, "softcap", None),
        sinks=getattr(a, "sinks", False),
        qk_norm_scope=getattr(a, "qk_norm_scope", "head"),
        embedding_multiplier=cfg.embedding_multiplier,
        residual_multiplier=cfg.residual_multiplier,
        logit_multiplier=cfg.logit_multiplier,
        final_logit_softcap=cfg.final_logit_softcap,
        moe_router=_moe_router(ffn),
        expert_clamp=None
        if expert.kind != "glu" or expert.limit is None
        else (
            expert.limit,
            expert.up_shift,
        ),
    )


def _norm(cfg: ModelConfig) -> dict[str, Any]:
    """The norm's fields; a LayerNorm's `upcast` only when set (CohereLayerNorm's fp32): False
    is nn.LayerNorm's behaviour, which every other reference uses."""
    d = cfg.norm.to_dict()
    if d.get("upcast") is False:
        del d["upcast"]
    return d


def _positional(cfg: ModelConfig) -> dict[str, Any]:
    """The positional scheme's fields, a scaling's attention factor as the built scaling uses
    it (None: its default, src/attnlab/nn/positional/scaling.py)."""
    d = cfg.positional.to_dict()
    sc = d.get("scaling")
    if sc and sc.get("attention_factor", 0) is None:
        built = ROPE_SCALINGS.get(sc["kind"])(**{k: v for k, v in sc.items() if k != "kind"})
        sc["attention_factor"] = built.attention_factor
    return d


def _layer_attention(cfg: ModelConfig) -> list[tuple[int | None, str, float | None]] | None:
    """(window, positional kind, RoPE base or None) of each layer, where a layer pattern makes
    them differ."""
    if cfg.layer_pattern is None:
        return None
    pattern = cfg.layer_pattern
    specs = [pattern[i % len(pattern)] for i in range(cfg.n_layers)]
    out = []
    for s in specs:
        pos = s.positional or cfg.positional
        out.append((s.sliding_window, pos.kind, pos.base if pos.kind == "rope" else None))
    return out


def _regularisation(cfg: ModelConfig) -> dict[str, Any]:
    moe = isinstance(cfg.ffn, MoEFFN)
    return dict(
        dropout=cfg.dropout,
        attention_dropout=cfg.attention.dropout,
        activation_dropout=cfg.activation_dropout,
        aux_loss_coef=cfg.ffn.aux_loss_coef if moe else None,
    )


def _activations_matching(fn: Callable[[torch.Tensor], torch.Tensor]) -> list[str]:
    """attnlab activations computing the same function as `fn` (GELU and its tanh form differ
    by up to ~1e-3 here, far above the tolerance)."""
    x = torch.linspace(-6, 6, 2401, dtype=torch.float64)
    with torch.no_grad():
        y = fn(x)
    return [
        k
        for k, ref in ((k, ACTIVATIONS.get(k)) for k in ACTIVATIONS)
        if torch.allclose(y, ref(x), rtol=0, atol=1e-6)
    ]


def _breakdown(model: torch.nn.Module) -> dict[str, int]:
    """Unique parameters per submodule two levels down, to locate a count difference."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            key = ".".join(name.split(".")[:2])
            out[key] = out.get(key, 0) + p.numel()
    return out


@pytest.mark.hf
@pytest.mark.parametrize("name", HF_NAMES)
def test_parameter_count_equals_transformers(name: str) -> None:
    _, ref = _hf(name)
    unused = CARDS[name].unused
    # unique: tied weights once, no buffers
    expected = sum(p.numel() for n, p in ref.named_parameters() if not n.startswith(unused))
    got = _count(name)  # al.count_parameters: built on meta, unique parameters
    if got != expected:  # where they differ
        with torch.device("meta"):
            ours = al.build_model(al.presets.get(name))
        pytest.fail(
            f"{name}: attnlab {got:,} vs transformers {expected:,} (diff {got - expected:+,})\n"
            f"attnlab: {_breakdown(ours)}\ntransformers: {_breakdown(ref)}"
        )


@pytest.mark.hf
@pytest.mark.parametrize("name", HF_NAMES)
def test_architecture_equals_model_card(name: str) -> None:
    config, ref = _hf(name)
    cfg = al.presets.get(name)
    want = CARDS[name].view(config, ref)
    got = _view(cfg)
    diff = {k: (got[k], want[k]) for k in got if got[k] != want[k]}
    assert not diff, f"{name}: (attnlab, reference) differ in {diff}"
    expert = cfg.ffn.expert if isinstance(cfg.ffn, MoEFFN) else cfg.ffn
    act = CARDS[name].act
    hf_act = ref.get_submodule(act) if isinstance(act, str) else act(ref)
    assert _activations_matching(hf_act) == [expert.activation], (
        f"{name}: the reference FFN uses {getattr(hf_act, '__name__', type(hf_act).__name__)}, which computes "
        f"{_activations_matching(hf_act)}; the preset says {expert.activation!r}"
    )


@pytest.mark.hf
@pytest.mark.parametrize("name", HF_NAMES)
def test_dropout_and_aux_loss_equal_model_card(name: str) -> None:
    config, ref = _hf(name)
    want = CARDS[name].view(config, ref)
    got = _regularisation(al.presets.get(name))
    diff = {k: (got[k], want[k]) for k in got if got[k] != want[k]}
    assert not diff, f"{name}: (attnlab, model card) differ in {diff}"


def test_every_reference_family_has_a_card() -> None:
    """Only the 2017 models and Transformer-XL (transformers 5 dropped TransfoXL) lack a
    `transformers` class; a new preset must add its card."""
    no_class = ["transformer-base-2017", "transformer-big-2017", "transformer-xl-enwik8-12l"]
    assert sorted(set(NAMES) - set(CARDS)) == no_class


# --- 2017: closed form from the paper -----------------------------------------------------------


def _vaswani_count(vocab: int, d: int, d_ff: int, n: int) -> int:
    """Vaswani et al. 2017: one V×d embedding shared by encoder, decoder and pre-softmax
    projection (3.4); W^Q, W^K, W^V, W^O without bias (3.2.2); FFN with biases (eq. 2);
    LayerNorm gain and bias after each sublayer (3.1): 2 per encoder layer, 3 per decoder layer;
    no final norm; sinusoidal positions have no parameters (3.5)."""
    attention = 4 * d * d
    ffn = d * d_ff + d_ff + d_ff * d + d
    norm = 2 * d
    encoder = n * (attention + ffn + 2 * norm)
    decoder = n * (2 * attention + ffn + 3 * norm)
    return vocab * d + encoder + decoder


# Table 3: N, d_model, d_ff, h and the reported size; 37,000 shared BPE tokens (5.1).
@pytest.mark.parametrize(
    ("name", "d", "d_ff", "h", "paper"),
    [
        ("transformer-base-2017", 512, 2048, 8, 65e6),
        ("transformer-big-2017", 1024, 4096, 16, 213e6),
    ],
)
def test_vaswani_2017_closed_form(name: str, d: int, d_ff: int, h: int, paper: float) -> None:
    cfg = al.presets.get(name)
    assert (cfg.arch, cfg.vocab_size, cfg.d_model, cfg.d_ff, cfg.n_heads) == (
        "encoder-decoder",
        37000,
        d,
        d_ff,
        h,
    )
    assert (cfg.n_layers, cfg.decoder_layers, cfg.kv_heads) == (6, 6, h)
    assert cfg.tie_embeddings and cfg.share_encoder_decoder_embeddings
    assert cfg.norm_placement == "post" and not cfg.final_norm
    assert cfg.positional.kind == "sinusoidal" and cfg.ffn.activation == "relu"
    expected = _vaswani_count(37000, d, d_ff, 6)
    assert _count(name) == expected
    assert abs(expected - paper) / paper < 0.05


# --- Transformer-XL: closed form from the paper and its code -----------------------------------


def _transformer_xl_count(vocab: int, d: int, d_ff: int, n: int, heads: int, d_head: int) -> int:
    """Dai et al. 2019 (the original code's MemTransformerLM, attn_type 0): per layer q, k, v, o
    of d × H·d_head without bias and W_R (r_net) of d × H·d_head, an FFN with biases, two
    LayerNorms (gain and bias, post-norm); u and v (r_w_bias, r_r_bias) of H × d_head once,
    shared by all layers; the V × d embedding tied to the output layer; R has no parameters.
    (The original's output bias of V is not modelled: tests/test_presets.py, preset docstring.)"""
    attention = 4 * d * heads * d_head + d * heads * d_head
    ffn = d * d_ff + d_ff + d_ff * d + d
    norms = 2 * 2 * d
    return vocab * d + n * (attention + ffn + norms) + 2 * heads * d_head


def test_transformer_xl_closed_form() -> None:
    """Table 2 of the paper reports 41M parameters for the 12-layer enwik8 model."""
    cfg = al.presets.get("transformer-xl-enwik8-12l")
    sizes = (cfg.vocab_size, cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.n_heads, cfg.attn_head_dim)
    assert sizes == (204, 512, 2048, 12, 8, 64)
    assert (cfg.attention.mem_len, cfg.attention.segment_len) == (512, 512)
    assert cfg.norm_placement == "post" and not cfg.final_norm and cfg.tie_embeddings
    assert not cfg.positional.per_layer_uv and cfg.scale_embeddings
    expected = _transformer_xl_count(*sizes)
    assert expected == 41_055_232  # = 204·512 + 12·3,412,480 + 2·8·64
    assert _count("transformer-xl-enwik8-12l") == expected
    assert abs(expected - 41e6) / 41e6 < 0.01
    untied = cfg.merged(positional={"per_layer_uv": True})  # 11 more (u, v) pairs
    assert al.count_parameters(untied) == expected + 11 * 2 * 8 * 64


# --- tiny(): same architecture at test size -----------------------------------------------------

SIZES = {"vocab_size", "d_model", "n_layers", "n_decoder_layers", "n_heads", "n_kv_heads"}
SIZES |= {"head_dim", "d_ff", "pad_token_id"}


def _architecture(cfg: ModelConfig) -> dict[str, Any]:
    """Everything but sizes and lengths."""
    d = {k: v for k, v in cfg.to_dict().items() if k not in SIZES}
    d["positional"].pop("max_len", None)
    if d["positional"].get("scaling"):
        d["positional"]["scaling"].pop("original_max_len", None)
        for per_pair in ("short_factor", "long_factor"):  # LongRoPE's: one per rotated pair
            d["positional"]["scaling"].pop(per_pair, None)
    d["attention"]["sliding_window"] = cfg.attention.sliding_window is not None
    for spec in d["layer_pattern"] or ():  # a layer's window is a length too
        spec["sliding_window"] = spec["sliding_window"] is not None
    d["stages"] = d["stages"] is not None  # depths, heads and window are sizes
    d["attention"].pop("attention_window", None)  # Longformer's width: a length too
    d["attention"].pop("mem_len", None)  # Transformer-XL's memory and segment: lengths too
    d["attention"].pop("segment_len", None)
    if d["attention"]["kind"] == "mla":  # MLA's widths are sizes; a query latent or none is not
        for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "scale"):
            d["attention"].pop(k)
        d["attention"]["q_lora_rank"] = d["attention"]["q_lora_rank"] is not None
    if d["ffn"]["kind"] == "moe":  # DeepSeek's dense layers' width: a size
        d["ffn"].pop("dense_d_ff")
        # the group counts are sizes; grouped routing, and choosing among the groups, are not
        g, k = d["ffn"].pop("n_groups"), d["ffn"].pop("top_k_groups")
        d["ffn"]["groups"] = (g > 1, k < g)
    expert = d["ffn"]["expert"] if d["ffn"]["kind"] == "moe" else d["ffn"]
    expert.pop("multiple_of", None)
    d["ffn"].pop("n_experts", None)
    if d["frontend"]:  # image and patch sides, audio frames are sizes; kind, channels are not
        for size in ("image_size", "patch_size", "max_source_positions"):
            d["frontend"].pop(size, None)
    return d


def _attention_kind(cfg: ModelConfig) -> str:
    if cfg.kv_heads == cfg.n_heads:
        return "MHA"
    return "MQA" if cfg.kv_heads == 1 else "GQA"


def _long_context(name: str, scaling: dict) -> ModelConfig:
    cfg = al.presets.get(name)
    return cfg.replace(positional=RoPE(base=cfg.positional.base, scaling=scaling))


def _layer_kinds(cfg: ModelConfig, n: int) -> set[tuple[bool, str | None]]:
    """(windowed, own positional kind) of the first n layers: the kinds of layer a model has."""
    p = cfg.layer_pattern
    specs = [p[i % len(p)] for i in range(n)]
    return {(s.sliding_window is not None, s.positional and s.positional.kind) for s in specs}


def _layers_for_every_kind(pattern: tuple) -> int:
    """The fewest leading layers in which each kind of layer of the pattern occurs, counted
    layer by layer (SmolLM3's [rope, rope, rope, none]: 4)."""
    want = {(s.sliding_window is not None, s.positional and s.positional.kind) for s in pattern}
    seen = set()
    for i, s in enumerate(pattern):
        seen.add((s.sliding_window is not None, s.positional and s.positional.kind))
        if seen == want:
            return i + 1
    raise AssertionError("unreachable: the whole pattern holds every kind")


# Scalings no preset uses (llama3, longrope and yarn do): these variants reach tiny() too.
TINY_CASES = [(n, al.presets.get(n)) for n in NAMES] + [
    (
        "llama2-7b+yarn",
        _long_context("llama2-7b", dict(kind="yarn", factor=4, original_max_len=4096)),
    ),
    (
        "mistral-7b+dynamic-ntk",
        _long_context("mistral-7b", dict(kind="dynamic-ntk", factor=2, original_max_len=4096)),
    ),
    ("qwen2-7b+linear", _long_context("qwen2-7b", dict(kind="linear", factor=4))),
]


@pytest.mark.parametrize("cfg", [c for _, c in TINY_CASES], ids=[n for n, _ in TINY_CASES])
def test_tiny_keeps_the_architecture(cfg: ModelConfig) -> None:
    small = al.presets.tiny(cfg)
    assert _architecture(small) == _architecture(cfg)
    assert _attention_kind(small) == _attention_kind(cfg)
    if _attention_kind(cfg) == "GQA":
        assert small.n_heads // small.kv_heads == cfg.n_heads // cfg.kv_heads
    if isinstance(cfg.ffn, MoEFFN):  # still sparse: more experts than the top-k it keeps
        assert small.ffn.top_k == cfg.ffn.top_k < small.ffn.n_experts <= cfg.ffn.n_experts
    if cfg.attention.sliding_window is not None:
        assert small.attention.sliding_window <= min(8, cfg.attention.sliding_window)
    if cfg.positional.kind == "learned":
        assert small.positional.max_len - small.positional.offset >= 128
    assert (cfg.pad_token_id is None) == (small.pad_token_id is None)
    assert abs(small.ffn_dim / small.d_model - cfg.ffn_dim / cfg.d_model) <= 0.25
    layers = 2 if cfg.stages is None else 4  # Swin: two stages of two blocks
    if cfg.layer_pattern is not None:  # every kind of layer still occurs, in as few layers
        layers = max(2, _layers_for_every_kind(cfg.layer_pattern))
        assert _layer_kinds(small, small.n_layers) == _layer_kinds(cfg, cfg.n_layers)
    if isinstance(cfg.ffn, MoEFFN):  # dense and sparse layers both still occur
        kinds = {cfg.ffn.is_dense(i) for i in range(cfg.n_layers)}
        assert {small.ffn.is_dense(i) for i in range(small.n_layers)} == kinds
        layers = max(layers, 1 + cfg.ffn.dense_layers)
    assert (small.d_model, small.n_layers, small.decoder_layers) == (64, layers, layers)
    assert small.attn_head_dim == 16 and small.vocab_size == (256 if cfg.vocab_size else 0)
    assert al.count_parameters(small) < 1_000_000


# --- the command line ---------------------------------------------------------------------------


def test_cli_presets_prints_every_exact_count(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("attnlab.build.count_parameters", _count_config)  # built once each
    assert cli.main(["presets"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:2] == ["preset", "parameters"]
    assert [r.split()[0] for r in rows] == NAMES
    for row in rows:
        name, count = row.split()[:2]
        assert re.fullmatch(r"\d{1,3}(,\d{3})*", count), row
        assert int(count.replace(",", "")) == _count(name), row


def test_cli_presets_sources_prints_each_source(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("attnlab.build.count_parameters", lambda cfg: 1234)  # counts: test above
    assert cli.main(["presets", "--sources"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    for name in NAMES:
        row = next(i for i, line in enumerate(lines) if line.split()[0] == name)
        assert lines[row + 1].strip() == al.presets.source(name)


# --- sources ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_source_cites_a_paper_or_model_card(name: str) -> None:
    source = al.presets.source(name)
    arxiv = re.search(r"arXiv:\d{4}\.\d{4,5}", source)
    card = re.search(r"huggingface\.co/[\w.-]+/[\w.-]+", source)
    assert arxiv or card, f"{name}: {source!r} names no arXiv id and no model card"
    if name in CARDS:  # the card compared above is the one the preset cites
        repo = re.search(r"huggingface\.co/([\w.-]+/[\w.-]+)/blob", CARDS[name].url).group(1)
        assert f"huggingface.co/{repo}" in source, f"{name}: {source!r} does not cite {repo}"


def test_closed_form_matches_a_hand_count() -> None:
    """The closed form itself, on sizes small enough to count by hand: V=10, d=2, d_ff=3, N=1:
    embedding 20; encoder 16 + 17 + 8 = 41; decoder 32 + 17 + 12 = 61."""
    assert _vaswani_count(10, 2, 3, 1) == 20 + 41 + 61


def test_a_preset_name_is_found_up_to_case():
    assert al.presets.get("Llama2-7B") == al.presets.get("llama2-7b")
    with pytest.raises(ValueError, match="Did you mean 'llama2-7b'"):
        al.presets.get("Llama2-7")
