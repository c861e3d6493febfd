"""Norms and feed-forward networks against float64 formulas, torch built-ins and transformers.

Formulas: LayerNorm (Ba et al. 2016, eq. 4), RMSNorm (Zhang & Sennrich 2019, eq. 4), GELU exact
and tanh (Hendrycks & Gimpel 2016, section 2), SiLU, GLU FFNs (Shazeer 2020, eq. 5-6), MoE routing
and the Switch load-balancing loss (Fedus et al. 2021, eq. 4-6) as moe.py states them.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import attnlab as al
from attnlab.build import build_ffn
from attnlab.config import GLUFFN as GLUConfig
from attnlab.config import DenseFFN as DenseConfig
from attnlab.config import MoEFFN as MoEConfig
from attnlab.nn.ffn import GLUFFN, DenseFFN, MoEFFN
from attnlab.nn.norms import LayerNorm, RMSNorm
from helpers.tolerance import assert_within_rounding

F64 = torch.float64


def randomise(module: nn.Module, std: float = 0.5, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.ndim == 1 else 0.0))
    return module


# --- norms --------------------------------------------------------------------------------------


@torch.no_grad()
def layer_norm_ref(x, weight, bias, eps):
    x = x.to(F64)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased variance, as the paper
    y = (x - mean) / torch.sqrt(var + eps) * weight.to(F64)
    return y + bias.to(F64) if bias is not None else y


def rms_norm_ref(x, weight, eps):
    x, weight = x.to(F64), weight.detach()
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * weight.to(F64)


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_torch_and_formula(bias):
    norm = randomise(LayerNorm(dim=24, eps=1e-5, bias=bias))
    assert (norm.bias is not None) == bias
    x = torch.randn(3, 5, 24) * 4 + 2
    out = norm(x)
    ref = nn.functional.layer_norm(x, (24,), norm.weight, norm.bias, 1e-5)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        out.to(F64), layer_norm_ref(x, norm.weight, norm.bias, 1e-5), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("eps", [1e-6, 1e-1])
def test_rms_norm_matches_formula(eps):
    norm = randomise(RMSNorm(dim=24, eps=eps))
    x = torch.randn(3, 5, 24) * 0.5 + 0.3  # non-zero mean: RMSNorm must not subtract it
    torch.testing.assert_close(
        norm(x).to(F64), rms_norm_ref(x, norm.weight, eps), rtol=1e-5, atol=1e-6
    )


def naive_bf16_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What RMSNorm would be with its sum of squares kept in bf16 (a running bf16 accumulator)."""
    acc = torch.zeros(x.shape[:-1], dtype=torch.bfloat16)
    for i in range(x.shape[-1]):
        acc = acc + x[..., i] * x[..., i]  # each partial sum rounded to bf16
    rms = torch.rsqrt(acc / x.shape[-1] + eps)
    return weight * (x * rms[..., None])


def test_rms_norm_bf16_accumulates_in_fp32():
    d = 1024
    norm = randomise(RMSNorm(dim=d, eps=1e-6)).to(torch.bfloat16)
    x = (torch.randn(4, d, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    ref = rms_norm_ref(x, norm.weight, 1e-6)
    # fp32 inside, then two bf16 roundings (normalised x, then times the weight), each within
    # the unit roundoff 2^-8 of bf16's 8-bit significand: at most 2^-7 from the exact result
    rel = (out.to(F64) - ref).abs() / ref.abs().clamp(min=1e-30)
    assert rel.max() <= 2.0**-7
    # a bf16 accumulator stalls once the sum outgrows the squares it adds (8 mantissa bits)
    naive = naive_bf16_rms_norm(x, norm.weight, 1e-6)
    naive_rel = (naive.to(F64) - ref).abs() / ref.abs().clamp(min=1e-30)
    assert naive_rel.max() > 4 * 2.0**-7
    assert naive_rel.mean() > rel.mean()


def test_rms_norm_fp16_does_not_overflow():
    norm = randomise(RMSNorm(dim=64)).to(torch.float16)
    # |x| up to ~1000 is fine in fp16 (max 65504), but x² is not: an fp16 sum of squares is inf
    x = (torch.randn(3, 64, generator=torch.Generator().manual_seed(6)) * 500).to(torch.float16)
    assert torch.isinf(x.pow(2).sum(-1)).all()
    out = norm(x)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    ref = rms_norm_ref(x, norm.weight, 1e-6)
    # two fp16 roundings of 2^-11 relative each
    assert ((out.to(F64) - ref).abs() <= 2.0**-10 * ref.abs() + 1e-6).all()


# --- dense and gated FFNs -----------------------------------------------------------------------

ACTIVATION_REFS = {
    "relu": lambda x: x.clamp(min=0),
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "gelu-tanh": lambda x: (
        0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    ),
    "silu": lambda x: x / (1 + torch.exp(-x)),
}


@torch.no_grad()
def linear_ref(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = x.to(F64) @ layer.weight.to(F64).T
    return y + layer.bias.to(F64) if layer.bias is not None else y


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", list(ACTIVATION_REFS))
def test_dense_ffn_matches_formula(activation, bias):
    ffn = randomise(DenseFFN(d_model=12, d_ff=40, activation=activation, bias=bias), std=0.4)
    x = torch.randn(2, 5, 12)
    out, aux = ffn(x)
    act = ACTIVATION_REFS[activation]
    ref = linear_ref(ffn.down_proj, act(linear_ref(ffn.up_proj, x)))
    assert_within_rounding(out, ref, 12 + 40 + 1)  # d, d_ff, the activation
    assert aux is None


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", list(ACTIVATION_REFS))
def test_glu_ffn_matches_formula(activation, bias):
    ffn = randomise(GLUFFN(d_model=12, d_ff=40, activation=activation, bias=bias), std=0.4)
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(0))  # fixed: fp32 vs f64
    out, aux = ffn(x)
    act = ACTIVATION_REFS[activation]
    hidden = act(linear_ref(ffn.gate_proj, x)) * linear_ref(ffn.up_proj, x)  # gate is activated
    assert_within_rounding(out, linear_ref(ffn.down_proj, hidden), 12 + 40 + 2)  # + act, gate
    assert aux is None


def test_glu_hidden_size_rule():
    cfg = al.presets.get("llama2-7b")
    assert cfg.d_ff is None  # derived, not pasted: intermediate_size 11008 on the model card
    assert cfg.ffn_dim == 256 * math.ceil(8 * 4096 / 3 / 256) == 11008
    assert cfg.replace(d_ff=1000).ffn_dim == 1000  # an explicit d_ff wins
    multiple = cfg.replace(ffn=GLUConfig(multiple_of=64))  # 2/3·4·4096 = 10922.7 -> 10944
    assert multiple.ffn_dim == 64 * math.ceil(8 * 4096 / 3 / 64) == 10944
    assert cfg.replace(ffn=DenseConfig()).ffn_dim == 4 * 4096
    moe = cfg.replace(ffn=MoEConfig(n_experts=4))  # each GLU expert follows the same rule
    assert moe.ffn_dim == 11008
    tiny = al.presets.tiny(cfg)
    assert build_ffn(tiny).up_proj.out_features == tiny.ffn_dim


def test_built_moe_passes_its_config_through():
    cfg = al.presets.tiny(al.presets.get("llama2-7b")).replace(
        ffn=MoEConfig(n_experts=4, top_k=2, routing="softmax-topk", n_shared_experts=2)
    )
    moe = build_ffn(cfg)
    assert isinstance(moe, MoEFFN) and len(moe.experts) == 4
    assert (moe.top_k, moe.routing, moe.aux_loss_coef) == (2, "softmax-topk", 0.01)
    assert all(e.up_proj.out_features == cfg.ffn_dim for e in moe.experts)
    # DeepSeekMoE: n shared experts act as one always-on expert n times as wide
    assert moe.shared_experts.up_proj.out_features == 2 * cfg.ffn_dim


# --- mixture of experts -------------------------------------------------------------------------


def make_moe(
    n_experts=4, top_k=2, routing="topk-softmax", shared=False, coef=0.01, d=12, d_ff=20, seed=0
):
    torch.manual_seed(seed)
    moe = MoEFFN(
        d_model=d,
        d_ff=d_ff,
        expert={"kind": "glu"},
        n_experts=n_experts,
        top_k=top_k,
        routing=routing,
        n_shared_experts=2 if shared else 0,  # one shared FFN of width 2·d_ff
        aux_loss_coef=coef,
    )
    for e, expert in enumerate(moe.experts):
        randomise(expert, std=0.4, seed=seed + e)
    if shared:
        randomise(moe.shared_experts, std=0.4, seed=99)
    with torch.no_grad():
        moe.router.weight.copy_(torch.randn(moe.router.weight.shape) * 0.3)
    return moe


@torch.no_grad()
def routing_ref(moe: MoEFFN, flat: torch.Tensor):
    """Float64 routing: (weights (N, k), ids (N, k), probabilities (N, E))."""
    probs = (flat.to(F64) @ moe.router.weight.to(F64).T).softmax(-1)
    top, ids = probs.topk(moe.top_k, dim=-1)
    if moe.routing == "topk-softmax":  # HF Mixtral: softmax -> top-k -> renormalise
        top = top / top.sum(-1, keepdim=True)
    return top, ids, probs


@torch.no_grad()
def moe_loop_ref(moe: MoEFFN, x: torch.Tensor):
    """Token by token: Σ over its chosen experts of weight · expert(token) (+ shared experts)."""
    flat = x.reshape(-1, x.shape[-1])
    weights, ids, probs = routing_ref(moe, flat)
    out = torch.zeros(flat.shape, dtype=F64)
    for n in range(flat.shape[0]):
        for j in range(moe.top_k):
            expert = moe.experts[int(ids[n, j])]
            out[n] += weights[n, j] * expert(flat[n : n + 1])[0][0].to(F64)
        if moe.shared_experts is not None:
            out[n] += moe.shared_experts(flat[n : n + 1])[0][0].to(F64)
    # Switch load balancing, eq. 4-6: f_e = routing slots sent to e per token (k per token, so
    # Σ f_e = k, as HF Mixtral counts), P_e = mean router probability of e
    n_tokens, n_experts = flat.shape[0], len(moe.experts)
    aux = 0.0
    for e in range(n_experts):
        f_e = sum(int(ids[n, j]) == e for n in range(n_tokens) for j in range(moe.top_k)) / n_tokens
        p_e = float(probs[:, e].mean())
        aux += f_e * p_e
    return out.reshape(x.shape), n_experts * aux * moe.aux_loss_coef


def test_moe_with_one_expert_equals_that_expert():
    for routing in ("topk-softmax", "softmax-topk"):
        moe = make_moe(n_experts=1, top_k=1, routing=routing, coef=0.3)
        x = torch.randn(2, 5, 12)
        out, aux = moe(x)
        assert torch.equal(out, moe.experts[0](x)[0])
        assert aux.item() == pytest.approx(0.3, rel=1e-6)  # 1 expert · f=1 · P=1 · coef


@pytest.mark.parametrize("routing", ["topk-softmax", "softmax-topk"])
def test_moe_routing_weights(routing):
    moe = make_moe(n_experts=6, top_k=3, routing=routing)
    flat = torch.randn(10, 12)
    weights, ids, probs = moe.route(flat)
    ref_w, ref_ids, ref_probs = routing_ref(moe, flat)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.to(F64), ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs.to(F64), ref_probs, rtol=1e-5, atol=1e-6)
    sums = weights.sum(-1)
    if routing == "topk-softmax":
        torch.testing.assert_close(sums, torch.ones(10))
    else:  # unnormalised top-k probabilities: strictly below 1 with k < n_experts
        assert (sums < 1).all() and sums.min() < 0.9


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("routing", ["topk-softmax", "softmax-topk"])
def test_moe_equals_per_token_loop_and_aux_loss(routing, shared):
    moe = make_moe(n_experts=5, top_k=2, routing=routing, shared=shared, coef=0.02)
    x = torch.randn(3, 4, 12)
    out, aux = moe(x)
    ref_out, ref_aux = moe_loop_ref(moe, x)
    # the router (d 12), an expert (d, then d_ff: 20, the shared one's 40) and the mix of
    # top_k + shared outputs: the longest chain of rounded sums (tests/helpers/tolerance.py)
    assert_within_rounding(out, ref_out, 12 + 12 + 40 + 3)
    assert aux.item() == pytest.approx(ref_aux, rel=1e-5)
    if shared:  # the shared experts add a dense term to every token
        moe.shared_experts, shared_ffn = None, moe.shared_experts
        routed, _ = moe(x)
        torch.testing.assert_close(out, routed + shared_ffn(x)[0], rtol=0, atol=1e-6)


@pytest.mark.hf
@pytest.mark.parametrize("routing", ["topk-softmax", "softmax-topk"])
def test_moe_aux_loss_matches_transformers(routing):
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    moe = make_moe(n_experts=5, top_k=2, routing=routing, coef=1.0)
    x = torch.randn(3, 7, 12)
    _, aux = moe(x)
    logits = moe.router(x.reshape(-1, 12))
    ref = load_balancing_loss_func((logits,), num_experts=5, top_k=2)
    torch.testing.assert_close(aux, ref, rtol=1e-6, atol=0)


@pytest.mark.hf
def test_moe_matches_transformers_mixtral_block():
    pytest.importorskip("transformers")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    d, d_ff, n_experts = 12, 20, 4
    moe = make_moe(n_experts=n_experts, top_k=2, d=d, d_ff=d_ff)
    config = MixtralConfig(
        hidden_size=d, intermediate_size=d_ff, num_local_experts=n_experts, num_experts_per_tok=2
    )
    config._experts_implementation = "eager"
    hf = MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        hf.gate.weight.copy_(moe.router.weight)
        for e, expert in enumerate(moe.experts):  # gate_up_proj[e] = [gate; up], (2·d_ff, d)
            hf.experts.gate_up_proj[e].copy_(
                torch.cat([expert.gate_proj.weight, expert.up_proj.weight])
            )
            hf.experts.down_proj[e].copy_(expert.down_proj.weight)
    x = torch.randn(2, 6, d)
    torch.testing.assert_close(moe(x)[0], hf(x), rtol=0, atol=1e-5)
