"""Norm placements, multipliers and the final logit soft cap (src/attnlab/nn/block.py,
src/attnlab/nn/model.py), each against its formula written out in float64:

    pre            x + m·f(n(x))                  sandwich       x + m·n2(f(n1(x)))   (Gemma 2/3)
    post           n(x + m·f(x))                  post-sublayer  x + m·n(f(x))        (OLMo 2)
    embeddings     m_e·E[ids]                     logits         cap·tanh(m_l·(h·Eᵀ) / cap)

with m the residual multiplier (Granite). Cached decoding and greedy generation go through the
model's `logits`, so they are checked to carry the multiplier and the cap too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnlab as al
from attnlab import ModelConfig
from attnlab.config import ConfigError
from attnlab.decode.steps import decode_step, prefill
from attnlab.nn.block import PLACEMENTS, Block
from attnlab.nn.norms import RMSNorm
from helpers.tolerance import assert_within_rounding, forward_terms

D = 16


class Stub(nn.Module):
    """A sublayer with the attention / FFN call signatures: tanh(x·W), weights in float64."""

    def __init__(self, returns_aux: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D, dtype=torch.float64) / D**0.5)
        self.returns_aux = returns_aux

    def f(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.w)

    def forward(self, h, *args, **kwargs):
        return self.f(h), None


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def block(placement: str, m: float = 1.0, residual: str = "sequential") -> Block:
    torch.manual_seed(0)

    def make_norm() -> nn.Module:
        norm = RMSNorm(dim=D).double()
        nn.init.normal_(norm.weight, 1.0, 0.3)  # not the identity, so each norm is seen
        return norm

    return Block(
        self_attn=Stub(False),
        ffn=Stub(True),
        make_norm=make_norm,
        placement=placement,
        residual=residual,
        residual_multiplier=m,
    )


def by_formula(b: Block, x: torch.Tensor, m: float) -> torch.Tensor:
    a, g = b.self_attn.f, b.ffn.f
    n = {
        name: (lambda t, w=mod.weight: rms(t, w))
        for name, mod in b.named_children()
        if "norm" in name
    }
    if b.placement == "pre":
        x = x + m * a(n["attn_norm"](x))
        return x + m * g(n["ffn_norm"](x))
    if b.placement == "post":
        x = n["attn_norm"](x + m * a(x))
        return n["ffn_norm"](x + m * g(x))
    if b.placement == "sandwich":
        x = x + m * n["attn_post_norm"](a(n["attn_norm"](x)))
        return x + m * n["ffn_post_norm"](g(n["ffn_norm"](x)))
    assert b.placement == "post-sublayer"
    x = x + m * n["attn_norm"](a(x))
    return x + m * n["ffn_norm"](g(x))


@pytest.mark.parametrize("m", [1.0, 0.22])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_each_placement_is_its_formula(placement, m):
    b = block(placement, m)
    x = torch.randn(2, 5, D, dtype=torch.float64) * 3
    y, aux = b(x, ctx=None)
    assert aux is None
    # the same operations in the same order: float64 agrees to its rounding of a D-term sum
    torch.testing.assert_close(y, by_formula(b, x, m), rtol=1e-12, atol=1e-12)
    if m != 1.0:  # the multiplier is seen: without it the result differs
        assert not torch.allclose(y, by_formula(b, x, 1.0), atol=1e-3)


def test_parallel_residual_takes_the_multiplier_on_each_branch():
    b = block("pre", 0.3, "parallel")
    x = torch.randn(2, 5, D, dtype=torch.float64)
    h1 = rms(x, b.attn_norm.weight)
    h2 = rms(x, b.ffn_norm.weight)
    want = x + 0.3 * b.self_attn.f(h1) + 0.3 * b.ffn.f(h2)
    torch.testing.assert_close(b(x, ctx=None)[0], want, rtol=1e-12, atol=1e-12)


def test_the_norms_each_placement_holds():
    names = {p: {n for n, _ in block(p).named_children() if "norm" in n} for p in PLACEMENTS}
    assert names["pre"] == names["post"] == names["post-sublayer"] == {"attn_norm", "ffn_norm"}
    assert names["sandwich"] == {"attn_norm", "ffn_norm", "attn_post_norm", "ffn_post_norm"}


def cfg_of(**changes) -> ModelConfig:
    base = dict(
        arch="decoder",
        vocab_size=48,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        positional={"kind": "rope"},
        norm={"kind": "rmsnorm"},
        ffn={"kind": "glu"},
        tie_embeddings=False,
        init="normal",
    )
    return ModelConfig(**{**base, **changes})


def test_parameter_counts_by_placement():
    """Sandwich adds one norm per sublayer (its output norm): 2·d_model per decoder block, 3 with
    cross-attention; post-sublayer moves the norms and adds none."""
    pre = al.count_parameters(cfg_of())
    assert al.count_parameters(cfg_of(norm_placement="post-sublayer")) == pre
    assert al.count_parameters(cfg_of(norm_placement="sandwich")) == pre + 2 * 2 * 32
    ed = dict(arch="encoder-decoder", n_layers=1)
    assert al.count_parameters(cfg_of(norm_placement="sandwich", **ed)) == (
        al.count_parameters(cfg_of(**ed)) + 2 * 32 + 3 * 32
    )
    model = al.build_model(cfg_of(norm_placement="sandwich", **ed))
    names = set(model.state_dict())
    assert "decoder.blocks.0.cross_post_norm.weight" in names
    assert "encoder.blocks.0.cross_post_norm.weight" not in names


@pytest.mark.parametrize(
    "bad",
    [
        dict(norm_placement="sandwich", residual="parallel"),
        dict(norm_placement="post-sublayer", residual="parallel-shared-norm"),
        dict(norm_placement="post", residual="parallel"),
    ],
)
def test_parallel_residuals_need_pre_norm(bad):
    with pytest.raises(ConfigError) as info:
        cfg_of(**bad)
    (msg,) = info.value.problems
    for part in (repr(bad["residual"]), "needs norm_placement 'pre'", repr(bad["norm_placement"])):
        assert part in msg, msg
    with pytest.raises(ValueError, match="needs placement 'pre'"):
        block(bad["norm_placement"], residual=bad["residual"])


def test_first_attn_norm_false_needs_pre_norm():
    with pytest.raises(ConfigError, match="first_attn_norm"):
        cfg_of(norm_placement="sandwich", first_attn_norm=False)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(logit_multiplier=0.5), "logit_multiplier (0.5)"),
        (dict(final_logit_softcap=30.0), "final_logit_softcap (30.0)"),
    ],
)
def test_encoders_refuse_the_lm_logit_fields(changes, field):
    with pytest.raises(ConfigError) as info:
        ModelConfig(arch="encoder", vocab_size=10, d_model=8, n_layers=1, n_heads=2, **changes)
    (msg,) = info.value.problems
    assert field in msg and "arch 'encoder'" in msg and "remove it" in msg


def test_a_frontend_refuses_the_embedding_multiplier():
    vit = dict(arch="encoder", vocab_size=0, d_model=8, n_layers=1, n_heads=2)
    vit.update(positional={"kind": "none"})
    vit.update(frontend={"kind": "patches", "image_size": 8, "patch_size": 4})
    ModelConfig(**vit)
    with pytest.raises(ConfigError, match=r"embedding_multiplier \(2.0\) describes token"):
        ModelConfig(**vit, embedding_multiplier=2.0)


@pytest.mark.parametrize(
    "field", ["embedding_multiplier", "residual_multiplier", "logit_multiplier"]
)
def test_multipliers_must_be_positive(field):
    with pytest.raises(ConfigError, match=field):
        cfg_of(**{field: 0.0})
    with pytest.raises(ConfigError, match="final_logit_softcap"):
        cfg_of(final_logit_softcap=-1.0)


def test_new_fields_round_trip_through_json():
    cfg = cfg_of(
        norm_placement="sandwich",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        logit_multiplier=0.125,
        final_logit_softcap=30.0,
    )
    assert ModelConfig.from_json(cfg.to_json()) == cfg


GRANITE_GEMMA = dict(
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    logit_multiplier=1 / 8,
    final_logit_softcap=1.5,
)


def model_of(**changes) -> nn.Module:
    torch.manual_seed(0)
    return al.build_model(cfg_of(**changes)).double().eval()


@pytest.mark.parametrize("tied", [False, True])
@torch.no_grad()
def test_embed_and_logits_are_their_formulas(tied):
    model = model_of(tie_embeddings=tied, **GRANITE_GEMMA)
    ids = torch.randint(0, 48, (2, 5))
    E = model.embed_tokens.weight
    assert torch.equal(model.embed(ids), E[ids] * 12.0)
    h = torch.randn(2, 5, 32, dtype=torch.float64) * 4
    W = E if tied else model.lm_head.weight
    z = (h @ W.T) / 8
    want = 1.5 * torch.tanh(z / 1.5)
    torch.testing.assert_close(model.logits(h), want, rtol=1e-12, atol=1e-12)
    assert model.logits(h * 100).abs().max() <= 1.5  # the cap bounds every logit
    # every block carries the residual multiplier
    assert {b.residual_multiplier for b in model.decoder.blocks} == {0.22}


@torch.no_grad()
def test_defaults_add_no_operation():
    model = model_of()
    ids = torch.randint(0, 48, (2, 5))
    assert torch.equal(model.embed(ids), model.embed_tokens(ids))
    h = torch.randn(2, 5, 32, dtype=torch.float64)
    assert torch.equal(model.logits(h), model.lm_head(h))


@pytest.mark.parametrize("placement", ["sandwich", "post-sublayer"])
@torch.no_grad()
def test_cached_decoding_carries_the_multipliers_and_the_cap(placement):
    """prefill + decode_step (cached) give the logits of the full pass at each new position,
    and greedy generation picks their argmax: the cap and the multipliers reach decoding."""
    model = model_of(norm_placement=placement, **GRANITE_GEMMA).float()
    ids = torch.randint(0, 48, (2, 6))
    seq, logits, state = prefill(model, ids, 4)
    steps = [logits]
    for _ in range(3):
        token = steps[-1].argmax(-1)
        seq = torch.cat([seq, token[:, None]], dim=1)
        steps.append(decode_step(model, token, state))
    full = model(seq).logits[:, 5:]  # (B, 4, V): the logits after each prefix
    n = forward_terms(n_layers=2, d_model=32, d_ff=cfg_of().ffn_dim, keys=seq.shape[1])
    assert_within_rounding(torch.stack(steps, 1), full, n=n)
    assert full.abs().max() <= 1.5
    out = al.generate(model, ids, max_new_tokens=4)
    assert torch.equal(out[:, 6:], torch.cat([seq[:, 6:], steps[-1].argmax(-1)[:, None]], 1))
