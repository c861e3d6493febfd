"""MoE routing components of src/attnlab/nn/ffn/moe.py and the clamped GLU of
src/attnlab/nn/ffn/glu.py, each against a float64 loop over one token at a time written from
the papers' formulas:

- sigmoid scores with a selection bias that chooses experts but does not weigh them
  (auxiliary-loss-free balancing, Wang et al. 2024, arXiv:2408.15664, eq. 3-4; DeepSeek-V3,
  arXiv:2412.19437, eq. 12-16), normalised or not, times the routed scale;
- V3's grouped top-k (a group scored by the sum of its two best bias-corrected scores) beside
  V2's (its best score), for softmax and sigmoid scores;
- a router with a bias and softmax over the chosen logits (GPT-OSS);
- the bias update b_e += γ·sign(mean load - load_e) (arXiv:2408.15664, Algorithm 1);
- V3's sequence-wise balance loss over normalised sigmoid scores (arXiv:2412.19437, eq. 17-20);
- GPT-OSS's clamped SwiGLU, fused and unfused, and its activation x·σ(1.702·x);
- Qwen-MoE's dense layers among sparse ones (decoder_sparse_step, mlp_only_layers).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab as al
from attnlab.config import GLUFFN, ModelConfig, MoEFFN
from attnlab.nn.activations import ACTIVATIONS
from attnlab.nn.ffn.glu import GLUFFN as GLULayer
from attnlab.nn.ffn.moe import MoEFFN as MoELayer
from helpers.tolerance import assert_within_rounding

F64 = torch.float64
D, D_FF, E = 8, 6, 12


def moe(**kw) -> MoELayer:
    """A float64 layer whose router, biases and experts are far from their init."""
    torch.manual_seed(0)
    args = dict(d_model=D, d_ff=D_FF, expert={"kind": "glu", "bias": True}, n_experts=E, top_k=3)
    layer = MoELayer(**{**args, **kw}).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
        layer.router.weight.normal_()
        if layer.selection_bias is not None:  # of the size of the scores: it changes choices
            scale = 1.0 if layer.routing == "topk-softmax" else 0.3
            layer.selection_bias.copy_(torch.randn(E) * scale)
    return layer


def loop_route(layer: MoELayer, x: torch.Tensor) -> tuple[list[int], list[float]]:
    """One token x (D,), float64 and plain Python over the experts: (chosen ids, weights)."""
    w = layer.router.weight.to(F64)
    b = layer.router.bias.to(F64) if layer.router.bias is not None else torch.zeros(E, dtype=F64)
    logits = [float(w[e] @ x + b[e]) for e in range(E)]
    if layer.routing.startswith("sigmoid"):
        s = [1 / (1 + math.exp(-v)) for v in logits]
    else:
        z = sum(math.exp(v) for v in logits)
        s = [math.exp(v) / z for v in logits]
    base = logits if layer.routing == "topk-softmax" else s  # softmax keeps the logits' order
    sel = layer.selection_bias
    choice = [base[e] + (float(sel[e]) if sel is not None else 0.0) for e in range(E)]
    allowed = list(range(E))
    if layer.n_groups > 1:
        size = E // layer.n_groups
        groups = [choice[g * size : (g + 1) * size] for g in range(layer.n_groups)]
        if layer.group_score == "max":
            score = [max(g) for g in groups]
        else:  # DeepSeek-V3: the sum of the group's two best scores
            score = [sum(sorted(g)[-2:]) for g in groups]
        best = sorted(range(layer.n_groups), key=lambda g: -score[g])[: layer.top_k_groups]
        allowed = [e for g in best for e in range(g * size, (g + 1) * size)]
    chosen = sorted(allowed, key=lambda e: -choice[e])[: layer.top_k]
    if layer.routing == "topk-softmax":
        z = sum(math.exp(logits[e]) for e in chosen)
        weights = [math.exp(logits[e]) / z for e in chosen]
    else:  # the uncorrected scores: the bias chose, it does not weigh
        weights = [s[e] for e in chosen]
        if layer.routing == "sigmoid-topk-norm":
            total = sum(weights)
            weights = [v / total for v in weights]
    return chosen, [v * layer.routed_scale for v in weights]


CASES = {
    "deepseek-v3": dict(
        routing="sigmoid-topk-norm", selection_bias=True, n_groups=4, top_k_groups=2,
        group_score="top2-sum", routed_scale=2.5, n_shared_experts=1,
    ),
    "sigmoid-unnormalised": dict(routing="sigmoid-topk", selection_bias=True),
    "sigmoid-groups-max": dict(routing="sigmoid-topk-norm", n_groups=3, top_k_groups=2),
    "softmax-top2-sum-groups": dict(
        routing="softmax-topk", selection_bias=True, n_groups=4, top_k_groups=2,
        group_score="top2-sum",
    ),
    "gpt-oss": dict(routing="topk-softmax", router_bias=True),
    "topk-softmax-bias-groups": dict(
        routing="topk-softmax", selection_bias=True, n_groups=2, top_k_groups=1
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_routing_and_output_equal_a_loop(case: str) -> None:
    layer = moe(**CASES[case])
    x = torch.randn(40, D, dtype=F64, generator=torch.Generator().manual_seed(1))
    weights, ids, _ = layer.route(x)
    out, _ = layer(x)
    with torch.no_grad():
        for t in range(len(x)):
            chosen, want = loop_route(layer, x[t])
            got = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
            assert sorted(got) == sorted(chosen), t
            # the router is fp32 (moe.py): its logits sum D terms, then the score and weights
            got_w = torch.tensor([got[e] for e in chosen], dtype=F64)
            assert_within_rounding(got_w, torch.tensor(want, dtype=F64), D + E, dtype=torch.float32)
            y = sum(w * layer.experts[e](x[t])[0] for e, w in zip(chosen, want, strict=True))
            if layer.shared_experts is not None:
                y = y + layer.shared_experts(x[t])[0]
            assert_within_rounding(out[t], y, D + E, dtype=torch.float32)


def unbiased_choice(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    bias = layer.selection_bias.clone()
    layer.selection_bias.zero_()
    try:
        return layer.route(x)[1].sort(dim=-1).values
    finally:
        layer.selection_bias.copy_(bias)


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c].get("selection_bias")])
def test_selection_bias_chooses_but_does_not_weigh(case: str) -> None:
    """The corrected scores pick the experts (other ones than without the bias, for some
    tokens); the weights are the uncorrected scores of those experts."""
    layer = moe(**CASES[case])
    x = torch.randn(40, D, dtype=F64, generator=torch.Generator().manual_seed(2))
    weights, ids, _ = layer.route(x)
    assert (unbiased_choice(layer, x) != ids.sort(dim=-1).values).any(dim=-1).sum() >= 5
    logits = layer.router(x).float()
    if layer.routing == "topk-softmax":
        want = logits.gather(1, ids).softmax(-1)
    else:
        want = layer.scores(logits).gather(1, ids)
        if layer.routing == "sigmoid-topk-norm":
            want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, want * layer.routed_scale, rtol=1e-6, atol=0)


def test_nudge_selection_bias_is_the_papers_update() -> None:
    """b_e += γ·sign(mean load - load_e): overloaded experts down, underloaded up, and a few
    steps of it even out a skewed router's loads."""
    layer = moe(routing="sigmoid-topk-norm", selection_bias=True)
    with torch.no_grad():
        layer.selection_bias.zero_()
        layer.router.weight[0].mul_(0)  # expert 0's logit 0: σ = 1/2, above most others
        layer.router.weight[0].add_(layer.router.weight[1].abs())  # and skewed up
    x = torch.randn(200, D, dtype=F64, generator=torch.Generator().manual_seed(3))
    ids = layer.route(x)[1]
    load = layer.nudge_selection_bias(ids, speed=0.01)
    counts = [int((ids == e).sum()) for e in range(E)]
    assert load.tolist() == counts
    mean = sum(counts) / E
    want = [0.01 * ((mean > c) - (mean < c)) for c in counts]
    torch.testing.assert_close(layer.selection_bias, torch.tensor(want), rtol=0, atol=0)

    def spread() -> float:
        c = torch.bincount(layer.route(x)[1].reshape(-1), minlength=E).float()
        return float(c.max() - c.min())

    before = spread()
    for _ in range(100):
        layer.nudge_selection_bias(layer.route(x)[1], speed=0.01)
    assert spread() < before / 2
    with pytest.raises(ValueError, match="selection_bias"):
        moe(routing="sigmoid-topk").nudge_selection_bias(ids)


def test_selection_bias_stays_fp32() -> None:
    """Cast with the model (bf16, float64), the bias keeps fp32, as the router math does."""
    layer = moe(routing="sigmoid-topk-norm", selection_bias=True)
    before = layer.selection_bias.clone()
    assert layer.to(torch.bfloat16).selection_bias.dtype == torch.float32
    assert torch.equal(layer.double().selection_bias, before)


def test_sequence_balance_loss_uses_normalised_sigmoid_scores() -> None:
    """DeepSeek-V3 eq. 17-20: s'_e = s_e / Σ_j s_j per token, P_e its mean over the sequence,
    f_e = E/(K·T) · #tokens choosing e; α Σ_e f_e P_e, averaged over the batch."""
    layer = moe(routing="sigmoid-topk-norm", selection_bias=True, balance_loss="sequence")
    x = torch.randn(2, 9, D, dtype=F64, generator=torch.Generator().manual_seed(4))
    _, aux = layer(x)
    want = 0.0
    for b in range(2):
        ids = layer.route(x[b])[1]
        with torch.no_grad():
            s = torch.sigmoid(x[b] @ layer.router.weight.T)
            s = s / s.sum(-1, keepdim=True)
        for e in range(E):
            f = E / (3 * 9) * int((ids == e).sum())
            want += layer.aux_loss_coef * f * s[:, e].mean().item() / 2
    assert math.isclose(aux.item(), want, rel_tol=1e-6)  # fp32 router scores


# --- clamped SwiGLU (GPT-OSS) -------------------------------------------------------------------


def test_gelu_sigmoid_is_x_sigmoid_1702x() -> None:
    x = torch.linspace(-8, 8, 4001, dtype=F64)
    act = ACTIVATIONS.get("gelu-sigmoid")
    want = torch.tensor([v / (1 + math.exp(-1.702 * v)) for v in x.tolist()], dtype=F64)
    torch.testing.assert_close(act(x), want, rtol=1e-15, atol=1e-15)
    transformers = pytest.importorskip("transformers")
    from transformers.activations import ACT2FN

    assert torch.equal(act(x.float()), ACT2FN["quick_gelu"](x.float()))  # op for op
    del transformers


@torch.no_grad()
def test_clamped_glu_equals_gpt_oss_formula() -> None:
    """down(act(min(g, 7)) · (clamp(u, ±7) + 1)) + biases, token by token in float64; inputs
    large enough that both clamps bind; the fused layout computes the same."""
    torch.manual_seed(0)
    glu = GLULayer(
        d_model=D, d_ff=D_FF, activation="gelu-sigmoid", bias=True, limit=7.0, up_shift=1.0
    ).double()
    x = torch.randn(30, D, dtype=F64) * 8
    g, u = glu.gate_proj(x), glu.up_proj(x)
    assert (g > 7).any() and (u > 7).any() and (u < -7).any()
    out, _ = glu(x)
    for t in range(len(x)):
        h = []
        for j in range(D_FF):
            gj, uj = min(float(g[t, j]), 7.0), max(min(float(u[t, j]), 7.0), -7.0)
            h.append(gj / (1 + math.exp(-1.702 * gj)) * (uj + 1))
        want = glu.down_proj.weight @ torch.tensor(h, dtype=F64) + glu.down_proj.bias
        torch.testing.assert_close(out[t], want, rtol=1e-12, atol=1e-12)
    fused = glu.fused()
    torch.testing.assert_close(fused(x)[0], out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused.unfused()(x)[0], out, rtol=0, atol=0)


def test_clamped_glu_config_reaches_the_experts() -> None:
    expert = GLUFFN(activation="gelu-sigmoid", bias=True, limit=7.0, up_shift=1.0)
    cfg = ModelConfig(
        arch="decoder", vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=8,
        ffn=MoEFFN(expert=expert, n_experts=4, top_k=2, router_bias=True),
    )  # fmt: skip
    layer = al.build_model(cfg).decoder.blocks[0].ffn
    assert layer.router.bias is not None
    assert all((e.limit, e.up_shift, e.down_proj.bias is not None) == (7.0, 1.0, True)
               for e in layer.experts)  # fmt: skip
    with pytest.raises(al.ConfigError, match="limit"):
        GLUFFN(limit=0)


# --- dense layers among sparse ones (Qwen-MoE) ---------------------------------------------------


def test_sparse_step_and_dense_at_choose_dense_blocks() -> None:
    """Qwen3-MoE: block i is sparse when i is not in mlp_only_layers and (i + 1) % step == 0;
    DeepSeek's first blocks stay dense too; the config's is_dense says the same."""
    ffn = MoEFFN(n_experts=4, sparse_step=2, dense_at=(3,), dense_layers=0, dense_d_ff=24)
    cfg = ModelConfig(
        arch="decoder", vocab_size=64, d_model=16, n_layers=6, n_heads=2, d_ff=8, ffn=ffn
    )
    blocks = al.build_model(cfg).decoder.blocks
    dense = [b.ffn.dense is not None for b in blocks]
    assert dense == [True, False, True, True, True, False]
    assert dense == [ffn.is_dense(i) for i in range(6)]
    assert blocks[0].ffn.dense.up_proj.out_features == 24 and blocks[1].ffn.router is not None
    first = MoEFFN(n_experts=4, dense_layers=2)
    assert [first.is_dense(i) for i in range(4)] == [True, True, False, False]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(n_experts=8, n_groups=8, top_k=1, group_score="top2-sum"), "2 experts per group"),
        (dict(n_experts=8, routing="sigmoid-softmax"), "routing"),
        (dict(n_experts=8, group_score="mean"), "group_score"),
        (dict(n_experts=8, sparse_step=0), "sparse_step"),
    ],
)
def test_bad_routing_configs_are_refused(fields: dict, match: str) -> None:
    with pytest.raises(al.ConfigError, match=match):
        MoEFFN(**fields)


def test_tiny_keeps_choosing_groups_and_enough_blocks() -> None:
    """At test size a grouped router still drops groups when the full one does (V3: 4 of 8 ->
    3 of 4), and the model keeps a sparse block after its dense ones."""
    v3 = MoEFFN(
        n_experts=256, top_k=8, routing="sigmoid-topk-norm", n_groups=8, top_k_groups=4,
        group_score="top2-sum", dense_layers=3,
    )  # fmt: skip
    small = v3.tiny(al.config.TinySize(d_model=64, head_dim=16, full_d_model=7168))
    assert (small.n_experts, small.n_groups, small.top_k_groups) == (16, 4, 3)
    assert v3.tiny_layers() == 4  # three dense blocks, then a sparse one
    every = MoEFFN(n_experts=8, n_groups=4, top_k_groups=4, top_k=2)
    assert every.tiny(al.config.TinySize(d_model=64, head_dim=16, full_d_model=64)).n_groups == 2
    assert MoEFFN(n_experts=4, sparse_step=2).tiny_layers() == 2
    assert MoEFFN(n_experts=4).tiny_layers() == 1
    assert GLUFFN().tiny_layers() == 1
