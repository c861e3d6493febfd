"""Sparse mixture of experts (Shazeer et al. 2017, arXiv:1701.06538; Switch Transformer, Fedus et
al. 2021, arXiv:2101.03961; Mixtral, Jiang et al. 2024, arXiv:2401.04088; shared experts from
DeepSeekMoE, Dai et al. 2024, arXiv:2401.06066).

A linear router scores every expert per token; each token goes to its top-k experts and the
output is their weighted sum (plus the always-on shared experts). Two routing orders:

    "topk-softmax"   w = softmax(top-k logits)              (Mixtral; sums to 1)
    "softmax-topk"   w = top-k of softmax(all logits)       (Switch, DeepSeekMoE; sums to < 1)

Load balancing (Switch, eq. 4-6): aux = n_experts · Σ_e f_e · P_e, with f_e the fraction of
routing slots sent to expert e (k slots per token, as in HF Mixtral) and P_e the mean router
probability of e. Minimised by a uniform split; multiplied by `aux_loss_coef`.
Router logits and probabilities are fp32: routing decisions are discrete, and bf16 ties would
flip them between runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import check_choice
from .base import FFNS

ROUTINGS = ("topk-softmax", "softmax-topk")


@FFNS.register("moe")
class MoEFFN(nn.Module):
    def __init__(
        self,
        *,
        d_model: int,
        d_ff: int,
        expert: Mapping[str, Any],
        n_experts: int,
        top_k: int = 2,
        routing: str = "topk-softmax",
        n_shared_experts: int = 0,
        aux_loss_coef: float = 0.01,
        dropout: float = 0.0,
    ) -> None:
        """Args:
        d_model: input and output width.
        d_ff: hidden width of each expert.
        expert: the expert FFN as plain data, its kind and fields, e.g. {"kind": "glu",
            "activation": "silu"}; built from FFNS (base.py) with d_model, d_ff and dropout.
        n_experts: routed experts; each token goes to `top_k` of them.
        routing: "topk-softmax" (Mixtral) or "softmax-topk" (Switch, DeepSeekMoE), see above.
        n_shared_experts: always-on experts, merged into one FFN of n_shared_experts·d_ff.
        aux_loss_coef: weight of the load-balancing loss.
        dropout: on each expert's hidden activation (training only).
        """
        super().__init__()
        check_choice("routing", routing, ROUTINGS)
        if not 0 < top_k <= n_experts:
            raise ValueError(f"top_k ({top_k}) must be in 1..n_experts ({n_experts})")
        kind = expert.get("kind")

        def make(width: int) -> nn.Module:
            return FFNS.build(
                kind,
                expert,
                strict=("kind", "multiple_of"),  # multiple_of only derives d_ff (config.py)
                d_model=d_model,
                d_ff=width,
                dropout=dropout,
            )

        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(make(d_ff) for _ in range(n_experts))
        self.shared_experts = make(d_ff * n_shared_experts) if n_shared_experts else None
        self.top_k, self.routing, self.aux_loss_coef = top_k, routing, aux_loss_coef

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, d) -> (weights (N, k), expert ids (N, k), router probabilities (N, E))."""
        logits = self.router(x).float()
        probs = logits.softmax(dim=-1)
        if self.routing == "topk-softmax":
            top_logits, ids = logits.topk(self.top_k, dim=-1)
            weights = top_logits.softmax(dim=-1)
        else:
            weights, ids = probs.topk(self.top_k, dim=-1)
        return weights, ids, probs

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        weights, ids, probs = self.route(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            if token.numel() == 0:
                continue
            y, _ = expert(flat[token])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)[0]
        n_experts = len(self.experts)
        dispatch = F.one_hot(ids, n_experts).float().sum(dim=1).mean(dim=0)  # f_e (sums to k)
        aux = n_experts * (dispatch * probs.mean(dim=0)).sum() * self.aux_loss_coef
        return out.reshape(shape), aux
