"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners";
huggingface.co/openai-community/gpt2) <-> attnlab.

A pre-norm decoder with learned absolute positions, biases everywhere and a tanh-GELU FFN
(`gelu_new`). Its linear layers are `Conv1D`s, which store the weight transposed, (in, out),
and attention's q, k, v are one `c_attn` matrix whose output columns are [q | k | v].
Refused: per-layer score scaling (`scale_attn_by_inverse_layer_idx`) and cross-attention.

Written: a config without some of those biases too (nanoGPT's `bias=False`, attnlab's
configs/shakespeare-char.yaml): GPT-2 gets a zero bias where attnlab has none, which computes
the same function exactly (x·W + 0 = x·W; a LayerNorm's shift by 0), so transformers and
llama.cpp, whose GPT-2 always has them, run the model unchanged.
"""

from __future__ import annotations

import torch

from ..config import AttentionConfig, DenseFFN, LayerNormConfig, LearnedPositions, ModelConfig
from .converter import CONVERTERS, StateDict
from .hf_config import ACT_TO_HF, Fit, HFConfig, confirmed, special_tokens
from .layouts import DecoderWeights

# transformers' GPT2Config defaults, for config.json files that leave keys out
DEFAULTS = dict(
    vocab_size=50257,
    n_positions=1024,
    n_embd=768,
    n_layer=12,
    n_head=12,
    n_inner=None,
    activation_function="gelu_new",
    resid_pdrop=0.1,
    embd_pdrop=0.1,
    attn_pdrop=0.1,
    layer_norm_epsilon=1e-5,
    scale_attn_weights=True,
    scale_attn_by_inverse_layer_idx=False,
    add_cross_attention=False,
    tie_word_embeddings=True,
    bos_token_id=50256,
    eos_token_id=50256,
)
ALIASES = {
    "hidden_size": "n_embd",
    "max_position_embeddings": "n_positions",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
}
# (attnlab module, HF module under "transformer.")
PAIRS = [
    ("embed_tokens", "wte"),
    ("decoder.positional", "wpe"),
    ("decoder.final_norm", "ln_f"),
    ("decoder.blocks.{i}.attn_norm", "h.{i}.ln_1"),
    ("decoder.blocks.{i}.ffn_norm", "h.{i}.ln_2"),
    ("decoder.blocks.{i}.self_attn.o_proj", "h.{i}.attn.c_proj"),
    ("decoder.blocks.{i}.ffn.up_proj", "h.{i}.mlp.c_fc"),
    ("decoder.blocks.{i}.ffn.down_proj", "h.{i}.mlp.c_proj"),
]
CONV1D = (".attn.c_attn.", ".attn.c_proj.", ".mlp.c_fc.", ".mlp.c_proj.")
# the config fields of the biases GPT-2 always has: written as zeros where attnlab has none
BIASES = ("attention.qkv_bias", "attention.o_bias", "norm.bias", "ffn.bias")


def _conv1d(sd: StateDict) -> StateDict:
    """Conv1D weights (in, out) <-> Linear's (out, in); biases unchanged."""
    return {k: v.t() if v.dim() == 2 and any(m in k for m in CONV1D) else v for k, v in sd.items()}


class GPT2Converter(DecoderWeights):
    model_type = "gpt2"
    hf_class = "GPT2LMHeadModel"
    prefix, pairs = "transformer.", PAIRS
    qkv, qkv_rows = "h.{i}.attn.c_attn", "stacked"
    buffers = (".attn.bias", ".attn.masked_bias")  # causal-mask tables of old checkpoints

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig("gpt2", data, DEFAULTS, ALIASES)
        hf.require("scale_attn_by_inverse_layer_idx", (False,))
        hf.require("add_cross_attention", (False,), "a decoder-only model has no cross-attention")
        activation = hf.activation("activation_function")
        hf.done()
        return ModelConfig(
            arch="decoder",
            **hf.vocabulary(),
            d_model=hf["n_embd"],
            n_layers=hf["n_layer"],
            n_heads=hf["n_head"],
            d_ff=None if hf["n_inner"] == 4 * hf["n_embd"] else hf["n_inner"],
            positional=LearnedPositions(max_len=hf["n_positions"]),
            attention=AttentionConfig(
                qkv_bias=True,
                o_bias=True,
                scale=None if hf["scale_attn_weights"] else 1.0,
                dropout=hf["attn_pdrop"],
            ),
            norm=LayerNormConfig(eps=hf["layer_norm_epsilon"]),
            ffn=DenseFFN(activation=activation, bias=True),
            dropout=hf["resid_pdrop"],  # embd_pdrop: attnlab has one dropout rate (training only)
            init="gpt2",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        fit = Fit(cfg, "gpt2")
        fit.mha()
        fit.need("attn_head_dim", cfg.d_model // cfg.n_heads, " (d_model / n_heads)")
        fit.need("attention.scale", (None, 1.0), " (scale_attn_weights on or off)")
        fit.need("positional.kind", "learned")
        if isinstance(cfg.positional, LearnedPositions):
            fit.need("positional.offset", 0)
        fit.need("attention.k_bias", True, " (c_attn's bias covers q, k and v)")
        fit.need("residual", "sequential")
        fit.need("embedding_norm", False)
        fit.dense_layernorm(norm_bias=(True, False), ffn_bias=(True, False))
        fit.done()  # before reading fields a misfit config may not have
        return confirmed(
            self,
            cfg,
            dict(
                vocab_size=cfg.vocab_size,
                n_positions=cfg.positional.max_len,
                n_embd=cfg.d_model,
                n_layer=cfg.n_layers,
                n_head=cfg.n_heads,
                n_inner=None if cfg.ffn_dim == 4 * cfg.d_model else cfg.ffn_dim,
                activation_function=ACT_TO_HF[cfg.ffn.activation],
                layer_norm_epsilon=cfg.norm.eps,
                scale_attn_weights=cfg.attention.scale != 1.0,
                resid_pdrop=cfg.dropout,
                embd_pdrop=cfg.dropout,
                attn_pdrop=cfg.attention.dropout,
                tie_word_embeddings=cfg.tie_embeddings,
                **special_tokens(cfg, DEFAULTS),
            ),
            ignore=tuple(f for f in BIASES if not _get(cfg, f)),  # zero biases: the same model
        )

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        return super().weights_from_hf(_conv1d(sd), cfg)

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        return _zero_biases(_conv1d(super().weights_to_hf(sd, cfg)), cfg)


def _get(cfg: ModelConfig, field: str) -> object:
    head, leaf = field.split(".")
    return getattr(getattr(cfg, head), leaf)


def _zero_biases(sd: StateDict, cfg: ModelConfig) -> StateDict:
    """`sd` with every bias GPT-2 has, each right after its weight: a zero vector where
    attnlab's config has none (BIASES)."""
    modules = ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
    has_bias = {f"transformer.h.{i}.{m}" for i in range(cfg.n_layers) for m in modules}
    has_bias.add("transformer.ln_f")
    out: StateDict = {}
    for key, w in sd.items():
        out[key] = w
        module = key.removesuffix(".weight")
        if module in has_bias and f"{module}.bias" not in sd:
            n = w.shape[-1] if w.dim() == 2 else w.shape[0]  # Conv1D (in, out): out columns
            out[f"{module}.bias"] = torch.zeros(n, dtype=w.dtype, device=w.device)
    return out


CONVERTERS.register("gpt2")(GPT2Converter())
