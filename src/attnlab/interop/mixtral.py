"""Mixtral (Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088;
huggingface.co/mistralai/Mixtral-8x7B-v0.1) <-> attnlab: Mistral's layout
(src/attnlab/interop/llama.py) with a sparse mixture of SwiGLU experts in place of the FFN, top-2
of 8 routing by softmax -> top-k -> renormalise, which gives the weights attnlab's "topk-softmax"
routing gives.

transformers 5 keeps the experts as fused 3-D tensors, `experts.gate_up_proj` (E, 2·d_ff, d)
= [gate; up] per expert and `experts.down_proj` (E, d, d_ff); the router is `mlp.gate`.
Checkpoints on the Hub (and transformers 5's `save_pretrained`) store them per expert as
`block_sparse_moe.experts.{e}.w1/w2/w3` (gate/down/up). Both are read; the fused form is
written (it is the state dict `to_hf` loads, and transformers 5 reads it from a folder too).
"""

from __future__ import annotations

from typing import ClassVar

from ..config import GLUFFN, ModelConfig, MoEFFN
from .converter import CONVERTERS, StateDict
from .hf_config import Fit, HFConfig, fits_glu_experts
from .layouts import move, stack_experts, swap, unstack_experts
from .llama import MistralConverter

HUB_EXPERT = (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3"))


class MixtralConverter(MistralConverter):
    model_type, hf_class = "mixtral", "MixtralForCausalLM"
    defaults: ClassVar[dict] = dict(
        MistralConverter.defaults, rms_norm_eps=1e-5, sliding_window=None,
        num_experts_per_tok=2, num_local_experts=8, router_aux_loss_coef=0.001,
    )  # fmt: skip
    default_theta = 1e6

    def _ffn(self, hf: HFConfig, act: str):
        return MoEFFN(
            expert=GLUFFN(activation=act, bias=False),
            n_experts=hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            routing="topk-softmax",  # softmax -> top-k -> renormalise, the same weights
            aux_loss_coef=hf["router_aux_loss_coef"],
        )

    def _ffn_to_hf(self, fit: Fit) -> dict:
        f = fit.cfg.ffn
        if not fits_glu_experts(fit, "topk-softmax"):
            return {}
        fit.need("ffn.n_shared_experts", 0)
        return dict(
            num_local_experts=f.n_experts,
            num_experts_per_tok=f.top_k,
            router_aux_loss_coef=f.aux_loss_coef,
        )

    def _more_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        n_experts, d_ff = cfg.ffn.n_experts, cfg.ffn_dim
        pairs = []
        for mlp in ("mlp", "block_sparse_moe"):  # transformers 5's module name, the Hub's
            pairs.append(("decoder.blocks.{i}.ffn.router", f"layers.{{i}}.{mlp}.gate"))
            for e in range(n_experts):  # the Hub's per-expert w1 / w2 / w3
                ours, theirs = (
                    f"decoder.blocks.{{i}}.ffn.experts.{e}",
                    f"layers.{{i}}.{mlp}.experts.{e}",
                )
                pairs += [(f"{ours}.{a}", f"{theirs}.{b}") for a, b in HUB_EXPERT]
        out = move(sd, swap(pairs), cfg.n_layers)
        for i in range(cfg.n_layers):
            ours, theirs = f"decoder.blocks.{i}.ffn", f"layers.{i}.mlp"
            out.update(unstack_experts(sd, theirs, ours, n_experts, d_ff))
        return out

    def _more_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        out = move(sd, [("decoder.blocks.{i}.ffn.router", "layers.{i}.mlp.gate")], cfg.n_layers)
        for i in range(cfg.n_layers):
            ours, theirs = f"decoder.blocks.{i}.ffn", f"layers.{i}.mlp"
            out.update(stack_experts(sd, ours, theirs, cfg.ffn.n_experts))
        return out


CONVERTERS.register("mixtral")(MixtralConverter())
