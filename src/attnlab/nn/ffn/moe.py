"""Sparse mixture of experts (Shazeer et al. 2017, arXiv:1701.06538; Switch Transformer, Fedus et
al. 2021, arXiv:2101.03961; Mixtral, Jiang et al. 2024, arXiv:2401.04088; shared experts from
DeepSeekMoE, Dai et al. 2024, arXiv:2401.06066).

A linear router (with a bias in GPT-OSS) scores every expert per token; each token goes to its
top-k experts and the output is their weighted sum (plus the always-on shared experts). With
l the router's logits, s the scores, b the selection bias (0 without one):

    routing              s             chosen                weights w
    "topk-softmax"       softmax(l)    top-k of l + b        softmax(l of the chosen)  (Mixtral,
                                                             GPT-OSS, Qwen3-MoE; sums to 1)
    "softmax-topk"       softmax(l)    top-k of s + b        s of the chosen  (Switch, DeepSeekMoE,
                                                             V2; sums to < 1)
    "sigmoid-topk"       σ(l)          top-k of s + b        s of the chosen  (DeepSeek-V3 unnormed)
    "sigmoid-topk-norm"  σ(l)          top-k of s + b        s / (Σ chosen s + 1e-20)  (V3)

The selection bias is auxiliary-loss-free balancing (Wang et al. 2024, "Auxiliary-Loss-Free Load
Balancing Strategy for Mixture-of-Experts", arXiv:2408.15664, eq. 3-4; DeepSeek-V3, arXiv:
2412.19437, section 2.1.2): b only decides which experts a token reaches, never how much they
weigh, so adjusting it between steps (`nudge_selection_bias`: b_e += γ·sign(mean load - load_e))
balances the load without a loss term pulling on the router. It is a buffer,
`selection_bias` (n_experts,), kept in fp32 (transformers' e_score_correction_bias).

Load balancing (Switch, eq. 4-6): aux = n_experts · Σ_e f_e · P_e, with f_e the fraction of
routing slots sent to expert e (k slots per token, as in HF Mixtral) and P_e the mean router
probability of e. Minimised by a uniform split; multiplied by `aux_loss_coef`.
Router logits and probabilities are fp32: routing decisions are discrete, and bf16 ties would
flip them between runs.

DeepSeek-V2 (arXiv:2405.04434, section 2.2) adds, as transformers' DeepseekV2Moe computes it:

    routed_scale    the routed weights are multiplied by it (routed_scaling_factor), the shared
                    experts' output is not
    n_groups        group-limited routing (topk_method "group_limited_greedy"): the experts are
                    split into n_groups equal groups, each scored by its best expert
                    (group_score "max"; DeepSeek-V3's noaux_tc: "top2-sum", the sum of its two
                    best bias-corrected scores); a token picks its top_k experts among those of
                    its top_k_groups best groups
    "sequence"      the expert-level balance loss (eq. 23-25), per sequence: N/(K·T) · count_e
                    times the mean probability of e over the sequence, summed over e, averaged
                    over the batch; it is the Switch loss of each sequence divided by top_k
                    (DeepSeek's released code with seq_aux; transformers 5.24 computes no aux loss)
    dense_layers    the first blocks of a stack are dense (first_k_dense_replace): there the
                    layer holds one expert-kind FFN, `dense`, of width dense_d_ff, and no router;
                    so do the blocks in `dense_at` and, for sparse_step s > 1, those with
                    (i + 1) % s != 0 (Qwen-MoE's mlp_only_layers and decoder_sparse_step)

The device- and communication-level balance losses (eq. 26-31) need expert parallelism across
devices and are not modelled.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import check_choice
from .base import FFNS

ROUTINGS = ("topk-softmax", "softmax-topk", "sigmoid-topk", "sigmoid-topk-norm")
BALANCE_LOSSES = ("switch", "sequence")
GROUP_SCORES = ("max", "top2-sum")


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
        router_bias: bool = False,
        selection_bias: bool = False,
        n_shared_experts: int = 0,
        aux_loss_coef: float = 0.01,
        balance_loss: str = "switch",
        routed_scale: float = 1.0,
        n_groups: int = 1,
        top_k_groups: int = 1,
        group_score: str = "max",
        dense_layers: int = 0,
        dense_at: Collection[int] = (),
        sparse_step: int = 1,
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
        routing: "topk-softmax" (Mixtral), "softmax-topk" (Switch, DeepSeekMoE),
            "sigmoid-topk" or "sigmoid-topk-norm" (DeepSeek-V3), see above.
        router_bias: a bias on the router's linear map (GPT-OSS).
        selection_bias: a per-expert bias added to the scores to choose experts, not to weigh
            them (the `selection_bias` buffer; auxiliary-loss-free balancing, see above).
        n_shared_experts: always-on experts, merged into one FFN of n_shared_experts·d_ff.
        aux_loss_coef: weight of the load-balancing loss.
        balance_loss: "switch" (whole batch) or "sequence" (DeepSeek-V2, per sequence, / top_k).
        routed_scale: multiplies the routed experts' weights (DeepSeek's routed_scaling_factor).
        n_groups, top_k_groups: group-limited routing, see the module docstring (1, 1: none).
        group_score: how a group is scored, "max" (V2) or "top2-sum" (V3).
        dense_layers, dense_at, sparse_step, dense_d_ff, layer_index: block `layer_index` of its
            stack is dense when it is among the first `dense_layers`, listed in `dense_at`, or
            (layer_index + 1) % sparse_step != 0: one `expert` FFN of width dense_d_ff (None:
            d_ff), no router, no aux loss (DeepSeek's first_k_dense_replace, Qwen-MoE's
            mlp_only_layers and decoder_sparse_step).
        dropout: on each expert's hidden activation (training only).
        """
        super().__init__()
        check_choice("routing", routing, ROUTINGS)
        check_choice("balance_loss", balance_loss, BALANCE_LOSSES)
        check_choice("group_score", group_score, GROUP_SCORES)
        if group_score == "top2-sum" and n_groups > 1 and n_experts // n_groups < 2:
            raise ValueError(
                f"group_score 'top2-sum' needs >= 2 experts per group (n_experts {n_experts} / "
                f"n_groups {n_groups}): lower n_groups or use 'max'"
            )
        if sparse_step < 1:
            raise ValueError(f"sparse_step ({sparse_step}) must be >= 1 (1: every block sparse)")
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

        dense = (
            layer_index < dense_layers
            or layer_index in dense_at
            or (layer_index + 1) % sparse_step != 0
        )
        self.dense = make(dense_d_ff or d_ff) if dense else None
        sparse = self.dense is None
        self.router = nn.Linear(d_model, n_experts, bias=router_bias) if sparse else None
        self.experts = nn.ModuleList(make(d_ff) for _ in range(n_experts if sparse else 0))
        shared = n_shared_experts and sparse
        self.shared_experts = make(d_ff * n_shared_experts) if shared else None
        bias = torch.zeros(n_experts, dtype=torch.float32) if sparse and selection_bias else None
        self.register_buffer("selection_bias", bias)  # None: no correction
        self.top_k, self.routing, self.aux_loss_coef = top_k, routing, aux_loss_coef
        self.balance_loss, self.routed_scale = balance_loss, routed_scale
        self.n_groups, self.top_k_groups, self.group_score = n_groups, top_k_groups, group_score

    def _group_limit(self, choice: torch.Tensor) -> torch.Tensor:
        """choice (N, E) with every expert outside the top_k_groups best groups set to -inf; a
        group's score is its best expert's ("max", V2's group_limited_greedy) or the sum of its
        two best ("top2-sum", V3's noaux_tc)."""
        N, E = choice.shape
        grouped = choice.view(N, self.n_groups, E // self.n_groups)  # (N, G, E/G)
        if self.group_score == "max":
            score = grouped.amax(dim=-1)  # (N, G)
        else:
            score = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (N, G)
        best = score.topk(self.top_k_groups, dim=-1).indices  # (N, top_k_groups)
        keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(N, E)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The per-expert scores s of fp32 logits (N, E): softmax or sigmoid by `routing`."""
        return logits.sigmoid() if self.routing.startswith("sigmoid") else logits.softmax(dim=-1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, d) -> (weights (N, k), expert ids (N, k), router probabilities (N, E)); the
        probabilities are the scores normalised over all experts (for the balance loss)."""
        logits = self.router(x).float()  # (N, E)
        scores = self.scores(logits)
        # "topk-softmax" ranks the logits (softmax keeps their order; GPT-OSS ranks them), the
        # other routings their scores
        choice = logits if self.routing == "topk-softmax" else scores
        if self.selection_bias is not None:
            choice = choice + self.selection_bias.float()
        if self.n_groups > 1:
            choice = self._group_limit(choice)
        ids = choice.topk(self.top_k, dim=-1).indices  # (N, k)
        if self.routing == "topk-softmax":
            weights = logits.gather(1, ids).softmax(dim=-1)
        else:
            weights = scores.gather(1, ids)
            if self.routing == "sigmoid-topk-norm":  # DeepSeek-V3's 1e-20 guards a zero sum
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        sigmoid = self.routing.startswith("sigmoid")
        probs = scores / scores.sum(dim=-1, keepdim=True) if sigmoid else scores
        return weights, ids, probs

    def _apply(self, fn: Any, recurse: bool = True) -> MoEFFN:
        """Module.to / .half() / .double() cast the selection bias too; it stays fp32, as the
        router math (transformers keeps e_score_correction_bias in fp32 too): rounded to bf16
        it would choose other experts."""
        b = self._buffers.pop("selection_bias", None)
        super()._apply(fn, recurse)
        moved = None if b is None else fn(b)  # where fn sends it; the values stay fp32
        self._buffers["selection_bias"] = None if b is None else b.float().to(moved.device)
        return self

    @torch.no_grad()
    def nudge_selection_bias(self, ids: torch.Tensor, speed: float = 1e-3) -> torch.Tensor:
        """Auxiliary-loss-free balancing's update (arXiv:2408.15664, Algorithm 1): after a
        step whose routing chose `ids` (N, k), b_e += speed · sign(mean load - load_e), so
        overloaded experts become less likely to be chosen. Returns the loads (E,)."""
        if self.selection_bias is None:
            raise ValueError(
                "this MoE layer has no selection_bias to adjust: build it with selection_bias "
                "True (config: MoEFFN(selection_bias=True))"
            )
        b = self.selection_bias
        load = torch.bincount(ids.reshape(-1), minlength=len(self.experts)).to(b.dtype)  # (E,)
        b += speed * torch.sign(load.mean() - load)
        return load

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

    def _every_expert(
        self,
        flat: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        shape: torch.Size,
    ) -> torch.Tensor:
        """The routed sum as a traced graph computes it (the compiled decode step,
        src/attnlab/decode/compiled_step.py): every expert on every row, weighted by its routing
        weight, 0 where it was not chosen, in the eager loop's expert order. The same values
        (an unchosen expert adds exactly 0, even where its output overflowed), for E / top_k
        times the experts' work: the price of shapes that do not depend on the routing, which any
        compiled inference forward pays (the compiled step runs only decode steps' rows)."""
        dense = torch.zeros(
            flat.shape[0], len(self.experts), dtype=weights.dtype, device=flat.device
        )
        dense = dense.scatter(1, ids, weights)  # (N, E)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            y, _ = expert(flat)
            w = dense[:, e, None]
            out = out + torch.where(w > 0, y * w, 0).to(out.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)[0]
        return out.reshape(shape)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.dense is not None:  # one of DeepSeek's first, dense blocks
            return self.dense(x)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        weights, ids, probs = self.route(flat)
        # a compiled inference graph (the decode step): no shape decided by the routing;
        # compiled training keeps the loop (its graph breaks cost less than E / top_k the work)
        if torch.compiler.is_compiling() and not torch.is_grad_enabled():
            return self._every_expert(flat, weights, ids, shape), self._aux(ids, probs, shape)
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
