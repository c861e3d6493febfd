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

DeepSeek-V2 (arXiv:2405.04434, section 2.2) adds, as transformers' DeepseekV2Moe computes it:

    routed_scale    the routed weights are multiplied by it (routed_scaling_factor), the shared
                    experts' output is not
    n_groups        group-limited routing (topk_method "group_limited_greedy"): the experts are
                    split into n_groups equal groups, each scored by its best expert; a token
                    picks its top_k experts among those of its top_k_groups best groups
    "sequence"      the expert-level balance loss (eq. 23-25), per sequence: N/(K·T) · count_e
                    times the mean probability of e over the sequence, summed over e, averaged
                    over the batch; it is the Switch loss of each sequence divided by top_k
                    (DeepSeek's released code with seq_aux; transformers 5.24 computes no aux loss)
    dense_layers    the first blocks of a stack are dense (first_k_dense_replace): there the
                    layer holds one expert-kind FFN, `dense`, of width dense_d_ff, and no router

The device- and communication-level balance losses (eq. 26-31) need expert parallelism across
devices and are not modelled.
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
BALANCE_LOSSES = ("switch", "sequence")


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
        balance_loss: str = "switch",
        routed_scale: float = 1.0,
        n_groups: int = 1,
        top_k_groups: int = 1,
        dense_layers: int = 0,
        dense_d_ff: int | None = None,
        layer_index: int = 0,
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
        balance_loss: "switch" (whole batch) or "sequence" (DeepSeek-V2, per sequence, / top_k).
        routed_scale: multiplies the routed experts' weights (DeepSeek's routed_scaling_factor).
        n_groups, top_k_groups: group-limited routing, see the module docstring (1, 1: none).
        dense_layers, dense_d_ff, layer_index: block `layer_index` of its stack is dense when
            it is among the first `dense_layers`: one `expert` FFN of width dense_d_ff (None:
            d_ff), no router, no aux loss (DeepSeek's first_k_dense_replace).
        dropout: on each expert's hidden activation (training only).
        """
        super().__init__()
        check_choice("routing", routing, ROUTINGS)
        check_choice("balance_loss", balance_loss, BALANCE_LOSSES)
        if not 0 < top_k <= n_experts:
            raise ValueError(f"top_k ({top_k}) must be in 1..n_experts ({n_experts})")
        if n_experts % n_groups or not 0 < top_k_groups <= n_groups:
            raise ValueError(
                f"n_groups ({n_groups}) must divide n_experts ({n_experts}) and top_k_groups "
                f"({top_k_groups}) be in 1..n_groups"
            )
        if top_k > top_k_groups * (n_experts // n_groups):
            raise ValueError(
                f"top_k ({top_k}) exceeds the experts of top_k_groups ({top_k_groups}) groups of "
                f"{n_experts // n_groups}: raise top_k_groups"
            )
        kind = expert.get("kind")

        def make(width: int) -> nn.Module:
            return FFNS.build(
                kind,
                expert,
                strict=("kind", "multiple_of"),  # multiple_of only derives d_ff (config/ffn.py)
                d_model=d_model,
                d_ff=width,
                dropout=dropout,
            )

        self.dense = make(dense_d_ff or d_ff) if layer_index < dense_layers else None
        sparse = self.dense is None
        self.router = nn.Linear(d_model, n_experts, bias=False) if sparse else None
        self.experts = nn.ModuleList(make(d_ff) for _ in range(n_experts if sparse else 0))
        shared = n_shared_experts and sparse
        self.shared_experts = make(d_ff * n_shared_experts) if shared else None
        self.top_k, self.routing, self.aux_loss_coef = top_k, routing, aux_loss_coef
        self.balance_loss, self.routed_scale = balance_loss, routed_scale
        self.n_groups, self.top_k_groups = n_groups, top_k_groups

    def _group_limit(self, scores: torch.Tensor, fill: float) -> torch.Tensor:
        """scores (N, E) with every expert outside the top_k_groups best groups set to `fill`;
        a group's score is its best expert's (DeepSeek's group_limited_greedy)."""
        N, E = scores.shape
        grouped = scores.view(N, self.n_groups, E // self.n_groups)  # (N, G, E/G)
        best = grouped.amax(dim=-1).topk(self.top_k_groups, dim=-1).indices  # (N, top_k_groups)
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], fill).view(N, E)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, d) -> (weights (N, k), expert ids (N, k), router probabilities (N, E))."""
        logits = self.router(x).float()
        probs = logits.softmax(dim=-1)
        if self.routing == "topk-softmax":
            pick = logits if self.n_groups == 1 else self._group_limit(logits, float("-inf"))
            top_logits, ids = pick.topk(self.top_k, dim=-1)
            weights = top_logits.softmax(dim=-1)
        else:  # transformers zeroes the probabilities outside the groups (all others are > 0)
            pick = probs if self.n_groups == 1 else self._group_limit(probs, 0.0)
            weights, ids = pick.topk(self.top_k, dim=-1)
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        return weights, ids, probs

    def _aux(self, ids: torch.Tensor, probs: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The balance loss of `balance_loss` times aux_loss_coef; ids (N, k), probs (N, E)."""
        E = len(self.experts)
        if self.balance_loss == "switch":
            dispatch = F.one_hot(ids, E).float().sum(dim=1).mean(dim=0)  # f_e (sums to k)
            return E * (dispatch * probs.mean(dim=0)).sum() * self.aux_loss_coef
        rows = shape[0] if len(shape) > 2 else 1  # (B, T, d): one loss per sequence
        counts = F.one_hot(ids, E).float().sum(dim=1).view(rows, -1, E)  # (B, T, E)
        f = counts.mean(dim=1) * E / self.top_k  # (B, E): N/(K·T) · count_e
        p = probs.view(rows, -1, E).mean(dim=1)  # (B, E): mean probability over the sequence
        return (f * p).sum(dim=1).mean() * self.aux_loss_coef

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.dense is not None:  # one of DeepSeek's first, dense blocks
            return self.dense(x)
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
        return out.reshape(shape), self._aux(ids, probs, shape)
