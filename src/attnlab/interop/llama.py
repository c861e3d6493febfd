"""Llama (Touvron et al. 2023, arXiv:2302.13971 and arXiv:2307.09288), Qwen2 (Yang et al. 2024,
arXiv:2407.10671), Qwen3 (Yang et al. 2025, arXiv:2505.09388), Mistral (Jiang et al. 2023,
arXiv:2310.06825) and Mixtral (Jiang et al. 2024, arXiv:2401.04088) <-> attnlab.

One layout: pre-RMSNorm blocks, RoPE in the "half" (rotate_half) layout, GQA, a SwiGLU FFN and
separate q/k/v/o projections, so names map one to one. The families differ in biases (Llama and
Qwen3: `attention_bias` on all four projections, Llama's `mlp_bias`; Qwen2: q/k/v only), the
sliding window (Mistral's `sliding_window`; Qwen2's and Qwen3's `use_sliding_window`, refused when
only some layers slide), Qwen3's qk-norm (an RMSNorm over head_dim on each query / key head, before
the rotation: attnlab's `attention.qk_norm`) and Mixtral's sparse mixture of experts
(src/attnlab/interop/mixtral.py, built on these). Gemma (src/attnlab/interop/gemma.py) is this
layout with another norm, a scaled embedding and GeGLU; Phi-3 (src/attnlab/interop/phi3.py) with
fused projections, SmolLM3 (src/attnlab/interop/smollm3.py) with NoPE layers.

Llama 3.x (Llama 3 herd, arXiv:2407.21783) is model_type llama with `rope_type: llama3` (3.1 /
3.2 / 3.3: frequency-dependent scaling, attnlab's `llama3` scaling) and, from 3.2's small models
on, tied embeddings; src/attnlab/interop/rope_params.py reads and writes every rope_type.
"""

from __future__ import annotations

from typing import ClassVar

from ..config import GLUFFN, AttentionConfig, ModelConfig, RMSNormConfig
from .converter import CONVERTERS, StateDict
from .hf_config import (
    ACT_TO_HF,
    DECODER_ONLY,
    Fit,
    HFConfig,
    common_sizes,
    confirmed,
    qkv_bias,
    special_tokens,
)
from .layouts import DecoderWeights, move, swap
from .rope_params import rope_from_hf, rope_to_hf

_COMMON = dict(
    vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
    head_dim=None, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
    attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
PAIRS = [  # (attnlab module, HF module under "model.")
    ("embed_tokens", "embed_tokens"),
    ("decoder.final_norm", "norm"),
    ("decoder.blocks.{i}.attn_norm", "layers.{i}.input_layernorm"),
    ("decoder.blocks.{i}.ffn_norm", "layers.{i}.post_attention_layernorm"),
] + [
    (f"decoder.blocks.{{i}}.self_attn.{p}", f"layers.{{i}}.self_attn.{p}")
    for p in ("q_proj", "k_proj", "v_proj", "o_proj")
]
QK_NORM = [  # Qwen3
    (f"decoder.blocks.{{i}}.self_attn.{p}", f"layers.{{i}}.self_attn.{p}")
    for p in ("q_norm", "k_norm")
]
DENSE = [
    (f"decoder.blocks.{{i}}.ffn.{p}", f"layers.{{i}}.mlp.{p}")
    for p in ("gate_proj", "up_proj", "down_proj")
]


class LlamaConverter(DecoderWeights):
    model_type, hf_class = "llama", "LlamaForCausalLM"
    prefix, pairs, buffers = "model.", PAIRS, ("rotary_emb.inv_freq",)
    defaults: ClassVar[dict] = dict(
        _COMMON, intermediate_size=11008, num_key_value_heads=None, max_position_embeddings=2048,
        attention_bias=False, mlp_bias=False,
    )  # fmt: skip
    default_theta = 10000.0
    needs: ClassVar[tuple] = DECODER_ONLY  # what config_to_hf requires (Fit)
    norm_config: ClassVar[type] = RMSNormConfig  # the norm of every block, the final one, qk-norm
    embedding: ClassVar[dict] = {}  # ModelConfig fields of the token embedding (Gemma scales it)

    # --- the parts where the families differ ---------------------------------------------------

    def _activation(self, hf: HFConfig) -> str:
        return hf.activation("hidden_act")

    def _attention(self, hf: HFConfig) -> dict:
        bias = hf["attention_bias"]
        return dict(qkv_bias=bias, o_bias=bias)

    def _attention_to_hf(self, fit: Fit) -> dict:
        bias = qkv_bias(fit.cfg)
        fit.need("attention.o_bias", bias, " (attention_bias covers q, k, v and o)")
        fit.need("attention.sliding_window", None)
        return dict(attention_bias=bias)

    def _ffn(self, hf: HFConfig, act: str):
        return GLUFFN(activation=act, bias=hf.get("mlp_bias", False))

    def _ffn_to_hf(self, fit: Fit) -> dict:
        fit.need("ffn.kind", "glu")
        return dict(mlp_bias=getattr(fit.cfg.ffn, "bias", False))

    def _rope(self, hf: HFConfig):
        return rope_from_hf(hf, self.default_theta)

    def _rope_to_hf(self, fit: Fit) -> dict:
        return rope_to_hf(fit, self.defaults["max_position_embeddings"])

    def _extra(self, hf: HFConfig) -> dict:
        """More ModelConfig fields the family sets (Phi-3's dropout, SmolLM3's layer_pattern)."""
        return {}

    def _extra_to_hf(self, fit: Fit) -> dict:
        """The config.json keys of `_extra`'s fields."""
        return {}

    # --- config -------------------------------------------------------------------------------

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig(self.model_type, data, self.defaults, {"num_experts": "num_local_experts"})
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf["head_dim"] or d // heads
        act = self._activation(hf)
        rope = self._rope(hf)
        attention = AttentionConfig(dropout=hf["attention_dropout"], **self._attention(hf))
        ffn = self._ffn(hf, act)
        extra = self._extra(hf)
        hf.done()
        return ModelConfig(
            arch="decoder",
            **hf.vocabulary(),
            d_model=d,
            n_layers=hf["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=None  # None in config.json means MHA; 0 is left for the config to refuse
            if (heads if hf["num_key_value_heads"] is None else hf["num_key_value_heads"]) == heads
            else hf["num_key_value_heads"],
            head_dim=None if head_dim * heads == d else head_dim,
            d_ff=hf["intermediate_size"],
            positional=rope,
            attention=attention,
            norm=self.norm_config(eps=hf["rms_norm_eps"]),
            ffn=ffn,
            init="normal",
            **self.embedding,
            **extra,
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        fit = Fit(cfg, self.model_type, self.needs)
        fit.need("attention.scale", None, " (1/sqrt(head_dim))")
        for field, value in (
            ("norm.kind", self.norm_config.model_fields["kind"].default),
            ("residual", "sequential"),
            ("embedding_norm", False),
        ):
            fit.need(field, value)
        out = dict(
            self._rope_to_hf(fit),
            **self._attention_to_hf(fit),
            **self._ffn_to_hf(fit),
            **self._extra_to_hf(fit),
        )
        expert = cfg.ffn.dense  # an MoE's expert, or the FFN itself
        if isinstance(expert, GLUFFN):
            fit.need(
                "ffn.activation" if expert is cfg.ffn else "ffn.expert.activation", tuple(ACT_TO_HF)
            )
        fit.done()  # before reading fields a misfit config may not have
        return confirmed(
            self,
            cfg,
            dict(
                out,
                **common_sizes(cfg),
                intermediate_size=cfg.ffn_dim,
                num_key_value_heads=cfg.kv_heads,
                head_dim=cfg.attn_head_dim,
                hidden_act=ACT_TO_HF[expert.activation],
                rms_norm_eps=cfg.norm.eps,
                attention_dropout=cfg.attention.dropout,
                tie_word_embeddings=cfg.tie_embeddings,
                **special_tokens(cfg, self.defaults),
            ),
        )

    # --- weights ------------------------------------------------------------------------------

    def _more_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        return move(sd, swap(DENSE), cfg.n_layers)

    def _more_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        return move(sd, DENSE, cfg.n_layers)


class Qwen2Converter(LlamaConverter):
    model_type, hf_class = "qwen2", "Qwen2ForCausalLM"
    defaults: ClassVar[dict] = dict(
        _COMMON, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32,
        max_position_embeddings=32768, use_sliding_window=False, sliding_window=4096,
        max_window_layers=28, layer_types=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip

    def _attention(self, hf: HFConfig) -> dict:  # q/k/v biased, o not; layers may slide
        return dict(qkv_bias=True, o_bias=False, sliding_window=self._window(hf))

    def _window(self, hf: HFConfig) -> int | None:
        """The window of `use_sliding_window` models when every layer slides, else None."""
        window = hf["sliding_window"] if hf["use_sliding_window"] else None
        n = hf["num_hidden_layers"]
        kinds = hf["layer_types"] or [
            "sliding_attention"
            if window is not None and i >= hf["max_window_layers"]
            else "full_attention"
            for i in range(n)
        ]
        if window is not None and len(set(kinds)) > 1:
            hf.reject("layer_types", kinds, "attnlab slides the window in every layer or none")
        sliding = window is not None and kinds[0] == "sliding_attention"
        return window if sliding else None

    def _attention_to_hf(self, fit: Fit) -> dict:
        fit.need("attention.qkv_bias", True)
        fit.need("attention.o_bias", False)
        return self._window_to_hf(fit)

    def _window_to_hf(self, fit: Fit) -> dict:
        w, n = fit.cfg.attention.sliding_window, fit.cfg.n_layers
        kinds = ["sliding_attention" if w else "full_attention"] * n
        return dict(
            use_sliding_window=w is not None,
            sliding_window=w,
            max_window_layers=0 if w else n,
            layer_types=kinds,
        )

    def _ffn(self, hf: HFConfig, act: str):
        return GLUFFN(activation=act, bias=False)

    def _ffn_to_hf(self, fit: Fit) -> dict:
        fit.need("ffn.kind", "glu")
        if isinstance(fit.cfg.ffn, GLUFFN):
            fit.need("ffn.bias", False)
        return {}


class Qwen3Converter(Qwen2Converter):
    """Qwen2's window rules with Llama's `attention_bias` (all four projections, off on every
    released model) and qk-norm: Qwen3Attention applies q_norm / k_norm (RMSNorm over head_dim,
    eps rms_norm_eps) to each head right after the projection, then the rotation, as attnlab's
    Attention does (src/attnlab/nn/attention/layer.py). head_dim is its own key (128 by default,
    whatever hidden_size / num_attention_heads is)."""

    model_type, hf_class = "qwen3", "Qwen3ForCausalLM"
    pairs = PAIRS + QK_NORM
    needs: ClassVar[tuple] = (
        *(n for n in DECODER_ONLY if n[0] != "attention.qk_norm"),
        ("attention.qk_norm", True),
    )
    defaults: ClassVar[dict] = dict(
        _COMMON, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32, head_dim=128,
        max_position_embeddings=32768, attention_bias=False, use_sliding_window=False,
        sliding_window=4096, max_window_layers=28, layer_types=None, bos_token_id=None,
        eos_token_id=None,
    )  # fmt: skip

    def _attention(self, hf: HFConfig) -> dict:
        bias = hf["attention_bias"]
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window=self._window(hf))

    def _attention_to_hf(self, fit: Fit) -> dict:
        bias = qkv_bias(fit.cfg)
        fit.need("attention.o_bias", bias, " (attention_bias covers q, k, v and o)")
        return dict(attention_bias=bias, **self._window_to_hf(fit))


class MistralConverter(Qwen2Converter):
    model_type, hf_class = "mistral", "MistralForCausalLM"
    defaults: ClassVar[dict] = dict(
        _COMMON, intermediate_size=14336, num_key_value_heads=8,
        max_position_embeddings=4096 * 32, sliding_window=4096,
    )  # fmt: skip

    def _attention(self, hf: HFConfig) -> dict:
        return dict(qkv_bias=False, o_bias=False, sliding_window=hf["sliding_window"])

    def _attention_to_hf(self, fit: Fit) -> dict:
        fit.need("attention.qkv_bias", False)
        fit.need("attention.o_bias", False)
        return dict(sliding_window=fit.cfg.attention.sliding_window)


for _conv in (LlamaConverter(), Qwen2Converter(), Qwen3Converter(), MistralConverter()):
    CONVERTERS.register(_conv.model_type)(_conv)
