"""GPT-OSS (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card", arXiv:2508.10925;
huggingface.co/openai/gpt-oss-20b) <-> attnlab, as transformers 5.24's GptOssForCausalLM
computes it.

- Attention: GQA with biases on q, k, v and o (`attention_bias`), head_dim its own key, and
  attention sinks: a learned logit per head, `self_attn.sinks` (n_heads,), in every softmax
  denominator (attnlab's `attention.sinks`, src/attnlab/nn/attention/layer.py).
- Layers alternate banded (sliding_window 128) and full attention: `layer_types`, read as the
  shortest repeating `layer_pattern` (src/attnlab/config/layer_pattern.py), every layer's kind
  written back.
- RoPE in the "half" layout (the two halves of each head), YaRN factor 32 from 4,096 positions
  with `truncate: false` (the ramp's ends unrounded; attnlab's YaRNScaling.truncate), base
  150,000 by default.
- MoE in every block (src/attnlab/nn/ffn/moe.py): the router `mlp.router` is a linear map with
  a bias; the top k of its logits, softmax over those k ("topk-softmax"); no shared expert.
  Experts are GLUs with biases and GPT-OSS's clamp (src/attnlab/nn/ffn/glu.py):
  down(act(min(g, limit)) · (clamp(u, ±limit) + 1)), act(g) = g·σ(1.702·g) ("gelu-sigmoid"),
  limit `swiglu_limit`; `swiglu_alpha` other than 1.702 is refused, `hidden_act` is read and
  ignored (the experts never use it, as in transformers).
- Expert tensors are stacked and transposed: `mlp.experts.gate_up_proj` (E, d, 2·d_ff) with gate
  and up interleaved along the last axis (gate = [..., ::2], up = [..., 1::2]),
  `gate_up_proj_bias` (E, 2·d_ff) likewise, `down_proj` (E, d_ff, d), `down_proj_bias` (E, d);
  attnlab keeps nn.Linear weights (out, in) per expert. The Hub's MXFP4 checkpoints
  (`*_blocks`, `*_scales`) are refused by name: dequantize them with transformers first.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..config import GLUFFN, LayerSpec, ModelConfig, MoEFFN
from .converter import CONVERTERS, ConversionError, StateDict
from .hf_config import (
    DECODER_ONLY,
    Fit,
    HFConfig,
    common_sizes,
    confirmed,
    qkv_bias,
    special_tokens,
)
from .llama import _COMMON, PAIRS, LlamaConverter

SLIDING, FULL = "sliding_attention", "full_attention"
ALPHA = 1.702  # gelu-sigmoid's (src/attnlab/nn/activations.py)
YARN = dict(  # GptOssConfig's rope_parameters when none are given
    rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
    original_max_position_embeddings=4096,
)  # fmt: skip


def pattern_of(kinds: list[str]) -> list[str]:
    """The shortest prefix p of `kinds` with kinds[i] == p[i % len(p)] for every i."""
    for n in range(1, len(kinds) + 1):
        if all(k == kinds[i % n] for i, k in enumerate(kinds)):
            return kinds[:n]
    return kinds


class GptOssConverter(LlamaConverter):
    model_type, hf_class = "gpt_oss", "GptOssForCausalLM"
    pairs = PAIRS
    defaults: ClassVar[dict] = dict(  # GptOssConfig's
        _COMMON, num_hidden_layers=36, num_local_experts=128, vocab_size=201088,
        hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
        num_key_value_heads=8, sliding_window=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=YARN, num_experts_per_tok=4, swiglu_alpha=ALPHA,
        swiglu_limit=7.0, router_aux_loss_coef=0.001, layer_types=None, bos_token_id=None,
        eos_token_id=None, attention_bias=True,
    )  # fmt: skip
    default_theta = 150000.0
    needs: ClassVar[tuple] = DECODER_ONLY

    # --- config -------------------------------------------------------------------------------

    def _activation(self, hf: HFConfig) -> str:
        if hf["swiglu_alpha"] != ALPHA:
            hf.reject("swiglu_alpha", hf["swiglu_alpha"], f"attnlab's gelu-sigmoid uses {ALPHA}")
        return "gelu-sigmoid"

    def _kinds(self, hf: HFConfig) -> list[str]:
        n = hf["num_hidden_layers"]
        kinds = hf["layer_types"] or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
        bad = sorted(set(kinds) - {SLIDING, FULL})
        if bad or len(kinds) != n:
            hf.reject("layer_types", kinds, f"one of {SLIDING!r}, {FULL!r} per layer ({n})")
            return [FULL] * n
        return kinds

    def _attention(self, hf: HFConfig) -> dict:
        bias, kinds = hf["attention_bias"], self._kinds(hf)
        uniform = len(set(kinds)) == 1
        window = hf["sliding_window"] if uniform and kinds[0] == SLIDING else None
        return dict(qkv_bias=bias, o_bias=bias, sinks=True, sliding_window=window)

    def _extra(self, hf: HFConfig) -> dict:
        kinds = self._kinds(hf)
        if len(set(kinds)) == 1:
            return {}
        w = hf["sliding_window"]
        spec = {SLIDING: LayerSpec(sliding_window=w), FULL: LayerSpec()}
        return {"layer_pattern": tuple(spec[k] for k in pattern_of(kinds))}

    def _ffn(self, hf: HFConfig, act: str) -> MoEFFN:
        expert = GLUFFN(activation=act, bias=True, limit=hf["swiglu_limit"], up_shift=1.0)
        return MoEFFN(
            expert=expert,
            n_experts=hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            routing="topk-softmax",
            router_bias=True,
            aux_loss_coef=hf["router_aux_loss_coef"],
        )

    def _attention_to_hf(self, fit: Fit) -> dict:
        a, cfg = fit.cfg.attention, fit.cfg
        fit.need("attention.o_bias", qkv_bias(cfg), " (attention_bias covers q, k, v and o)")
        fit.need("attention.sinks", True, " (GptOssAttention always has them)")
        windows = (
            [s.sliding_window for s in cfg.layer_pattern] if cfg.layer_pattern else [None]
        ) + [a.sliding_window]
        sizes = {w for w in windows if w is not None}
        if len(sizes) > 1:
            fit.fail("layer_pattern", cfg.layer_pattern, "one sliding_window for every layer")
        if cfg.layer_pattern and any(s.positional is not None for s in cfg.layer_pattern):
            fit.fail("layer_pattern", cfg.layer_pattern, "no per-layer positional scheme")
        if cfg.layer_pattern:
            pattern = cfg.layer_pattern
            kinds = [
                SLIDING if pattern[i % len(pattern)].sliding_window else FULL
                for i in range(cfg.n_layers)
            ]
        else:
            kinds = [SLIDING if a.sliding_window else FULL] * cfg.n_layers
        window = min(sizes) if sizes else self.defaults["sliding_window"]
        return dict(attention_bias=qkv_bias(cfg), layer_types=kinds, sliding_window=window)

    def _ffn_to_hf(self, fit: Fit) -> dict:
        if fit.need("ffn.kind", "moe") != "moe":
            return {}
        for field, value in (
            ("expert.kind", "glu"),
            ("routing", "topk-softmax"),
            ("expert.bias", True),
            ("expert.activation", "gelu-sigmoid"),
            ("expert.up_shift", 1.0),
            ("router_bias", True),
            ("selection_bias", False),
            ("n_shared_experts", 0),
            ("routed_scale", 1.0),
            ("n_groups", 1),
            ("dense_layers", 0),
            ("dense_at", ()),
            ("sparse_step", 1),
            ("balance_loss", "switch"),
        ):
            fit.need(f"ffn.{field}", (value,))
        f = fit.cfg.ffn
        if f.expert.limit is None:
            fit.fail("ffn.expert.limit", None, "GPT-OSS clamps its experts (swiglu_limit)")
        return dict(
            num_local_experts=f.n_experts,
            num_experts_per_tok=f.top_k,
            router_aux_loss_coef=f.aux_loss_coef,
            swiglu_limit=f.expert.limit,
            swiglu_alpha=ALPHA,
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        fit = Fit(cfg, self.model_type, self.needs)
        fit.need("attention.scale", None, " (1/sqrt(head_dim))")
        for field, value in (
            ("norm.kind", "rmsnorm"),
            ("residual", "sequential"),
            ("embedding_norm", False),
        ):
            fit.need(field, value)
        out = dict(self._rope_to_hf(fit), **self._attention_to_hf(fit), **self._ffn_to_hf(fit))
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
                hidden_act="silu",  # unused (module docstring)
                rms_norm_eps=cfg.norm.eps,
                attention_dropout=cfg.attention.dropout,
                tie_word_embeddings=cfg.tie_embeddings,
                **special_tokens(cfg, self.defaults),
            ),
        )

    # --- weights ------------------------------------------------------------------------------

    def _more_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        out: StateDict = {}
        d_ff = cfg.ffn_dim
        for i in range(cfg.n_layers):
            ours, theirs = f"decoder.blocks.{i}", f"layers.{i}"
            out[f"{ours}.self_attn.sinks"] = sd.pop(f"{theirs}.self_attn.sinks")
            for leaf in ("weight", "bias"):
                out[f"{ours}.ffn.router.{leaf}"] = sd.pop(f"{theirs}.mlp.router.{leaf}")
            x = f"{theirs}.mlp.experts"
            if f"{x}.gate_up_proj" not in sd:
                continue  # check_consumed names what the file holds instead (MXFP4 blocks)
            gate_up = sd.pop(f"{x}.gate_up_proj")  # (E, d, 2·d_ff), gate and up interleaved
            if gate_up.shape[-1] != 2 * d_ff:
                raise ConversionError(
                    f"gpt_oss {x}.gate_up_proj has shape {tuple(gate_up.shape)}, the config "
                    f"says (n_experts, d_model, 2 x intermediate_size {d_ff}): wrong config?"
                )
            gate_up_bias = sd.pop(f"{x}.gate_up_proj_bias")  # (E, 2·d_ff)
            down, down_bias = sd.pop(f"{x}.down_proj"), sd.pop(f"{x}.down_proj_bias")
            for e in range(cfg.ffn.n_experts):
                y = f"{ours}.ffn.experts.{e}"
                w = gate_up[e].T  # (2·d_ff, d)
                out[f"{y}.gate_proj.weight"] = w[0::2].contiguous()  # (d_ff, d)
                out[f"{y}.up_proj.weight"] = w[1::2].contiguous()
                out[f"{y}.gate_proj.bias"] = gate_up_bias[e, 0::2].contiguous()
                out[f"{y}.up_proj.bias"] = gate_up_bias[e, 1::2].contiguous()
                out[f"{y}.down_proj.weight"] = down[e].T.contiguous()  # (d, d_ff)
                out[f"{y}.down_proj.bias"] = down_bias[e]
        return out

    def _more_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        out: StateDict = {}
        for i in range(cfg.n_layers):
            ours, theirs = f"decoder.blocks.{i}", f"layers.{i}"
            out[f"{theirs}.self_attn.sinks"] = sd.pop(f"{ours}.self_attn.sinks")
            for leaf in ("weight", "bias"):
                out[f"{theirs}.mlp.router.{leaf}"] = sd.pop(f"{ours}.ffn.router.{leaf}")
            weights, biases, downs, down_biases = [], [], [], []
            for e in range(cfg.ffn.n_experts):
                y = f"{ours}.ffn.experts.{e}"
                gate, up = sd.pop(f"{y}.gate_proj.weight"), sd.pop(f"{y}.up_proj.weight")
                weights.append(torch.stack([gate, up], dim=1).flatten(0, 1).T)  # (d, 2·d_ff)
                gb, ub = sd.pop(f"{y}.gate_proj.bias"), sd.pop(f"{y}.up_proj.bias")
                biases.append(torch.stack([gb, ub], dim=1).flatten())  # (2·d_ff,)
                downs.append(sd.pop(f"{y}.down_proj.weight").T)  # (d_ff, d)
                down_biases.append(sd.pop(f"{y}.down_proj.bias"))
            x = f"{theirs}.mlp.experts"
            out[f"{x}.gate_up_proj"] = torch.stack(weights).contiguous()
            out[f"{x}.gate_up_proj_bias"] = torch.stack(biases)
            out[f"{x}.down_proj"] = torch.stack(downs).contiguous()
            out[f"{x}.down_proj_bias"] = torch.stack(down_biases)
        return out


CONVERTERS.register("gpt_oss")(GptOssConverter())
