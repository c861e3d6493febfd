"""Qwen3-MoE (Yang et al. 2025, "Qwen3 Technical Report", arXiv:2505.09388, section 2;
huggingface.co/Qwen/Qwen3-30B-A3B) <-> attnlab, as transformers 5.24's Qwen3MoeForCausalLM
computes it.

- Attention: Qwen3's (src/attnlab/interop/llama.py, Qwen3Converter): qk-norm over head_dim
  before the rotation, GQA, `attention_bias` on all four projections, RoPE in the "half"
  layout. `use_sliding_window` slides every layer (Qwen3MoeConfig keeps no max_window_layers
  or layer_types, whatever config.json carries).
- FFN: fine-grained SwiGLU experts of moe_intermediate_size, no shared expert; the router
  `mlp.gate` takes the softmax over all experts in fp32 and the top k, renormalised when
  `norm_topk_prob` (attnlab's "topk-softmax": the softmax over the chosen logits, the same
  weights) or not ("softmax-topk"); `router_aux_loss_coef` is the Switch loss's weight
  (transformers adds it only with output_router_logits). Block i is a dense SwiGLU of
  intermediate_size when i is in `mlp_only_layers` or (i + 1) % `decoder_sparse_step` != 0
  (attnlab's MoEFFN.dense_at / sparse_step, src/attnlab/nn/ffn/moe.py).
- Experts are transformers 5's fused `mlp.experts.gate_up_proj` (E, 2·d_ff, d) = [gate; up]
  and `down_proj` (E, d, d_ff), or the Hub's per-expert `mlp.experts.{e}.gate_proj / up_proj /
  down_proj`; both are read, the fused form is written (src/attnlab/interop/layouts.py).
"""

from __future__ import annotations

from typing import ClassVar

from ..config import GLUFFN, ModelConfig, MoEFFN
from .converter import CONVERTERS, StateDict
from .hf_config import (
    ACT_TO_HF,
    Fit,
    HFConfig,
    common_sizes,
    confirmed,
    fits_glu_experts,
    special_tokens,
)
from .layouts import move, stack_experts, swap, unstack_experts
from .llama import _COMMON, Qwen3Converter

GLU = ("gate_proj", "up_proj", "down_proj")


def moe_pairs(cfg: ModelConfig, router: str = "gate") -> list[tuple[int, list[tuple[str, str]]]]:
    """Per block i, the (attnlab module, HF module) pairs of its FFN in the DeepSeek / Qwen-MoE
    layout: a dense block's `mlp.{gate,up,down}_proj`, a sparse block's router `mlp.{router}`,
    shared experts and the Hub's per-expert tensors (the fused ones: `unstack_experts`)."""
    out = []
    for i in range(cfg.n_layers):
        ours, theirs = f"decoder.blocks.{i}.ffn", f"layers.{i}.mlp"
        if cfg.ffn.is_dense(i):
            out.append((i, [(f"{ours}.dense.{p}", f"{theirs}.{p}") for p in GLU]))
            continue
        pairs = [(f"{ours}.router", f"{theirs}.{router}")]
        pairs += [(f"{ours}.shared_experts.{p}", f"{theirs}.shared_experts.{p}") for p in GLU]
        pairs += [
            (f"{ours}.experts.{e}.{p}", f"{theirs}.experts.{e}.{p}")
            for e in range(cfg.ffn.n_experts)
            for p in GLU
        ]
        out.append((i, pairs))
    return out


def moe_from_hf(sd: StateDict, cfg: ModelConfig, router: str = "gate") -> StateDict:
    """The FFN tensors of every block (`moe_pairs`), popped from `sd`, under attnlab's names."""
    out: StateDict = {}
    for i, pairs in moe_pairs(cfg, router):
        out.update(move(sd, swap(pairs), 1))
        if not cfg.ffn.is_dense(i):
            ours, theirs = f"decoder.blocks.{i}.ffn", f"layers.{i}.mlp"
            out.update(unstack_experts(sd, theirs, ours, cfg.ffn.n_experts, cfg.ffn_dim))
    return out


def moe_to_hf(sd: StateDict, cfg: ModelConfig, router: str = "gate") -> StateDict:
    """The inverse of `moe_from_hf`, experts written fused (transformers 5's state dict)."""
    out: StateDict = {}
    for i, pairs in moe_pairs(cfg, router):
        dense = cfg.ffn.is_dense(i)
        out.update(move(sd, pairs if dense else pairs[: 1 + len(GLU)], 1))
        if not dense:
            ours, theirs = f"decoder.blocks.{i}.ffn", f"layers.{i}.mlp"
            out.update(stack_experts(sd, ours, theirs, cfg.ffn.n_experts))
    return out


class Qwen3MoeConverter(Qwen3Converter):
    model_type, hf_class = "qwen3_moe", "Qwen3MoeForCausalLM"
    defaults: ClassVar[dict] = dict(  # Qwen3MoeConfig's
        _COMMON, vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=24, num_key_value_heads=4, head_dim=None,
        max_position_embeddings=32768, attention_bias=False, use_sliding_window=False,
        sliding_window=4096, decoder_sparse_step=1, moe_intermediate_size=768,
        num_experts_per_tok=8, num_local_experts=128, norm_topk_prob=False,
        router_aux_loss_coef=0.001, mlp_only_layers=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip

    def _window(self, hf: HFConfig) -> int | None:
        """Every layer slides when use_sliding_window (Qwen3MoeConfig.__post_init__)."""
        return hf["sliding_window"] if hf["use_sliding_window"] else None

    def _window_to_hf(self, fit: Fit) -> dict:
        w = fit.cfg.attention.sliding_window
        return dict(use_sliding_window=w is not None, sliding_window=w)

    def _ffn(self, hf: HFConfig, act: str) -> MoEFFN:
        n, n_layers = hf["num_local_experts"], hf["num_hidden_layers"]  # num_experts
        if not n:
            hf.reject(
                "num_local_experts", n, "no experts (num_experts 0): that model is model_type qwen3"
            )
        step, only = hf["decoder_sparse_step"], sorted(set(hf["mlp_only_layers"] or ()))
        if not isinstance(step, int) or step < 1:
            hf.reject("decoder_sparse_step", step, "must be a whole number >= 1")
            step = 1
        dense_at = tuple(i for i in only if 0 <= i < n_layers)
        dense = [i in dense_at or (i + 1) % step for i in range(n_layers)]
        d_ff, d_dense = hf["moe_intermediate_size"], hf["intermediate_size"]
        return MoEFFN(
            expert=GLUFFN(activation=act, bias=False),
            n_experts=max(n, 1),
            top_k=hf["num_experts_per_tok"],
            routing="topk-softmax" if hf["norm_topk_prob"] else "softmax-topk",
            aux_loss_coef=hf["router_aux_loss_coef"],
            dense_at=dense_at,
            sparse_step=step,
            # intermediate_size builds nothing when no block is dense
            dense_d_ff=d_dense if any(dense) and d_dense != d_ff else None,
        )

    def config_from_hf(self, data: dict) -> ModelConfig:
        cfg = super().config_from_hf(data)  # d_ff there is the dense intermediate_size
        hf = HFConfig(self.model_type, data, self.defaults)
        return cfg.replace(d_ff=hf["moe_intermediate_size"])

    def _ffn_to_hf(self, fit: Fit) -> dict:
        if not fits_glu_experts(fit, ("topk-softmax", "softmax-topk")):
            return {}
        f = fit.cfg.ffn
        for field, value in (
            ("n_shared_experts", 0),
            ("router_bias", False),
            ("selection_bias", False),
            ("routed_scale", 1.0),
            ("n_groups", 1),
            ("dense_layers", 0),
            ("balance_loss", "switch"),
        ):
            fit.need(f"ffn.{field}", value)
        return dict(
            num_experts=f.n_experts,
            num_experts_per_tok=f.top_k,
            norm_topk_prob=f.routing == "topk-softmax",
            router_aux_loss_coef=f.aux_loss_coef,
            decoder_sparse_step=f.sparse_step,
            mlp_only_layers=list(f.dense_at),
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        """Qwen3's keys (LlamaConverter.config_to_hf's checks) with the experts' width as
        moe_intermediate_size and the dense blocks' as intermediate_size."""
        fit = Fit(cfg, self.model_type, self.needs)
        fit.need("attention.scale", None, " (1/sqrt(head_dim))")
        for field, value in (
            ("norm.kind", "rmsnorm"),
            ("residual", "sequential"),
            ("embedding_norm", False),
            ("layer_pattern", None),
        ):
            fit.need(field, value)
        out = dict(self._rope_to_hf(fit), **self._attention_to_hf(fit), **self._ffn_to_hf(fit))
        if isinstance(cfg.ffn, MoEFFN):
            fit.need("ffn.expert.activation", tuple(ACT_TO_HF))
        fit.done()  # before reading fields a misfit config may not have
        f = cfg.ffn
        return confirmed(
            self,
            cfg,
            dict(
                out,
                **common_sizes(cfg),
                intermediate_size=f.dense_d_ff or cfg.ffn_dim,
                moe_intermediate_size=cfg.ffn_dim,
                num_key_value_heads=cfg.kv_heads,
                head_dim=cfg.attn_head_dim,
                hidden_act=ACT_TO_HF[f.expert.activation],
                rms_norm_eps=cfg.norm.eps,
                attention_dropout=cfg.attention.dropout,
                tie_word_embeddings=cfg.tie_embeddings,
                **special_tokens(cfg, self.defaults),
            ),
        )

    def _more_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        return moe_from_hf(sd, cfg)

    def _more_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        return moe_to_hf(sd, cfg)


CONVERTERS.register("qwen3_moe")(Qwen3MoeConverter())
