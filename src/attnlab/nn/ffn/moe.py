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

import torch
import torch.nn.functional as F
from torch import nn

from .dense import FFNS


@FFNS.register("moe")
class MoEFFN(nn.Module):
    def __init__(
        self,
        d_model: int,
        experts: list[nn.Module],
        top_k: int,
        routing: str = "topk-softmax",
        shared: nn.Module | None = None,
        aux_loss_coef: float = 0.01,
    ) -> None:
        super().__init__()
        self.router = nn.Linear(d_model, len(experts), bias=False)
        self.experts = nn.ModuleList(experts)
        self.shared_experts = shared
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
