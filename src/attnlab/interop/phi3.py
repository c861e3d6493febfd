"""Phi-3 (Abdin et al. 2024, arXiv:2404.14219) and Phi-4-mini (Microsoft 2025, arXiv:2503.01743)
<-> attnlab: transformers' model_type phi3.

Llama's body (pre-RMSNorm, rotate_half RoPE, GQA, SwiGLU, no biases) with two fused maps:
`qkv_proj`, rows [q (H·D); k (H_kv·D); v (H_kv·D)], and `gate_up_proj`, rows [gate; up], each
split into attnlab's separate projections and merged back (attnlab can fuse them again itself:
`al.fuse`). RoPE may be partial (`partial_rotary_factor`, Phi-4-mini: 0.75 of each head, the first
channels) and scaled by LongRoPE (`rope_type: longrope`, Ding et al. 2024, arXiv:2402.13753: per
pair short / long factors, the long ones once a forward pass reaches past
`original_max_position_embeddings`, a top-level key that transformers' Phi3Config puts before
rope_parameters' own; the old names "su" and "yarn" mean longrope there). `sliding_window`
(Phi-3-mini-4k: 2047) slides in every layer. `resid_pdrop` and `embd_pdrop` are attnlab's one
`dropout` (on the embeddings and each residual branch), so they must be equal.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..config import GLUFFN, ModelConfig
from ..config.scaling import LongRoPEScaling
from .converter import CONVERTERS, StateDict
from .hf_config import Fit, HFConfig
from .llama import _COMMON, LlamaConverter
from .rope_params import rope_from_hf, rope_to_hf

PAIRS = [  # (attnlab module, HF module under "model.")
    ("embed_tokens", "embed_tokens"),
    ("decoder.final_norm", "norm"),
    ("decoder.blocks.{i}.attn_norm", "layers.{i}.input_layernorm"),
    ("decoder.blocks.{i}.ffn_norm", "layers.{i}.post_attention_layernorm"),
    ("decoder.blocks.{i}.self_attn.o_proj", "layers.{i}.self_attn.o_proj"),
    ("decoder.blocks.{i}.ffn.down_proj", "layers.{i}.mlp.down_proj"),
]


class Phi3Converter(LlamaConverter):
    model_type, hf_class = "phi3", "Phi3ForCausalLM"
    pairs = PAIRS
    qkv, qkv_rows = "layers.{i}.self_attn.qkv_proj", "stacked"
    defaults: ClassVar[dict] = dict(
        _COMMON, vocab_size=32064, hidden_size=3072, intermediate_size=8192,
        num_key_value_heads=None, rms_norm_eps=1e-5, max_position_embeddings=4096,
        original_max_position_embeddings=4096, resid_pdrop=0.0, embd_pdrop=0.0,
        sliding_window=None, bos_token_id=1, eos_token_id=32000, pad_token_id=32000,
    )  # fmt: skip

    # --- config -------------------------------------------------------------------------------

    def _attention(self, hf: HFConfig) -> dict:
        return dict(qkv_bias=False, o_bias=False, sliding_window=hf["sliding_window"])

    def _attention_to_hf(self, fit: Fit) -> dict:
        # Phi3Config has no head_dim: its rope checks count pairs from hidden_size / heads
        fit.need("attn_head_dim", fit.cfg.d_model // fit.cfg.n_heads, " (d_model / n_heads)")
        fit.need("attention.qkv_bias", False, " (qkv_proj has no bias)")
        fit.need("attention.o_bias", False)
        return dict(sliding_window=fit.cfg.attention.sliding_window)

    def _ffn(self, hf: HFConfig, act: str):
        return GLUFFN(activation=act, bias=False)

    def _ffn_to_hf(self, fit: Fit) -> dict:
        if fit.need("ffn.kind", "glu") == "glu":
            fit.need("ffn.bias", False, " (gate_up_proj and down_proj have no bias)")
        return {}

    def _rope(self, hf: HFConfig):
        rope = rope_from_hf(
            hf,
            self.default_theta,
            partial_ok=True,
            original_key="original_max_position_embeddings",
            type_aliases={"su": "longrope", "yarn": "longrope"},
        )
        s, head_dim = rope.scaling, hf["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]
        pairs = rope.rotary_dim(head_dim) // 2
        if isinstance(s, LongRoPEScaling) and len(s.short_factor) != pairs:
            hf.reject(
                "rope_parameters.short_factor",
                f"{len(s.short_factor)} entries",
                f"needs one per rotated pair: {pairs} (head_dim {head_dim} · "
                f"partial_rotary_factor {rope.fraction} / 2)",
            )
            return rope.replace(scaling=None)
        return rope

    def _rope_to_hf(self, fit: Fit) -> dict:
        out = rope_to_hf(fit, self.defaults["max_position_embeddings"], partial_ok=True)
        params = out.get("rope_parameters", {})
        # Phi3Config's own key wins over rope_parameters': write the same length in both
        original = params.get(
            "original_max_position_embeddings", out.get("max_position_embeddings")
        )
        if original is not None:
            out["original_max_position_embeddings"] = original
        if "partial_rotary_factor" in params:
            out["partial_rotary_factor"] = params["partial_rotary_factor"]
        return out

    def _extra(self, hf: HFConfig) -> dict:
        resid, embd = hf["resid_pdrop"], hf["embd_pdrop"]
        if resid != embd:
            hf.reject("embd_pdrop", embd, f"attnlab has one dropout; resid_pdrop is {resid}")
        return dict(dropout=resid)

    def _extra_to_hf(self, fit: Fit) -> dict:
        return dict(resid_pdrop=fit.cfg.dropout, embd_pdrop=fit.cfg.dropout)

    # --- weights ------------------------------------------------------------------------------

    def _sizes(self, cfg: ModelConfig) -> list[int]:
        d = cfg.attn_head_dim
        return [cfg.n_heads * d, cfg.kv_heads * d, cfg.kv_heads * d]  # rows of q, k, v

    def _split(self, w: torch.Tensor, cfg: ModelConfig):
        return w.split(self._sizes(cfg), dim=0)  # (H·D + 2·H_kv·D, d) -> q, k, v rows

    def _merge(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig):
        return torch.cat([q, k, v])

    def _more_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        out: StateDict = {}
        for i in range(cfg.n_layers):
            w = sd.pop(f"layers.{i}.mlp.gate_up_proj.weight", None)
            if w is not None:  # (2·d_ff, d) = [gate; up]
                gate, up = w.chunk(2, dim=0)
                out[f"decoder.blocks.{i}.ffn.gate_proj.weight"] = gate
                out[f"decoder.blocks.{i}.ffn.up_proj.weight"] = up
        return out

    def _more_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        out: StateDict = {}
        for i in range(cfg.n_layers):
            ours = f"decoder.blocks.{i}.ffn"
            if f"{ours}.gate_proj.weight" in sd:
                gate, up = sd.pop(f"{ours}.gate_proj.weight"), sd.pop(f"{ours}.up_proj.weight")
                out[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat([gate, up])  # (2·d_ff, d)
        return out


CONVERTERS.register(Phi3Converter.model_type)(Phi3Converter())
