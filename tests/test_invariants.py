"""Invariants every model must keep, whatever its components.

Causality, padding invariance, permutation equivariance, cached == uncached decoding, residual
wiring against hand-written formulas, weight tying, the MoE auxiliary loss and the init schemes.
Models are tiny, seeded, dropout 0, in eval mode, and initialised with "xavier" so that attention
is far from uniform: with 0.02-std weights every score is ~0 and a positional bug would move the
outputs by less than the tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnlab as al
from attnlab.cache import CacheFullError
from attnlab.config import (
    GLUFFN,
    ALiBi,
    AttentionConfig,
    DynamicNTKScaling,
    LearnedPositions,
    LinearScaling,
    ModelConfig,
    MoEFFN,
    NoPositions,
    NTKScaling,
    RoPE,
    Sinusoidal,
    T5RelativeBias,
    YaRNScaling,
)
from attnlab.nn.attention.layer import AttnContext
from attnlab.nn.block import Block
from helpers.tolerance import assert_within_rounding, forward_terms

V, D, H, LAYERS = 61, 32, 4, 2
# an encoder and a decoder of LAYERS layers over at most 32 keys: the longest chain of rounded
# sums (tests/helpers/tolerance.py) bounds what the order of summation alone can change; the broken
# cases differ by > 1e-2
TERMS = forward_terms(n_layers=2 * LAYERS, d_model=D, d_ff=64, keys=32)

# Every positional scheme, every layout and every RoPE scaling kind. The "original" lengths of
# YaRN and dynamic NTK are 4 so that the scaling is active on the 4..12-token inputs used here.
SCHEMES = {
    "sinusoidal-interleaved": Sinusoidal(layout="interleaved"),
    "sinusoidal-split": Sinusoidal(layout="split"),
    "learned": LearnedPositions(max_len=32),
    "learned-offset": LearnedPositions(max_len=34, offset=2),
    "rope-half": RoPE(layout="half"),
    "rope-interleaved": RoPE(layout="interleaved"),
    "rope-partial": RoPE(fraction=0.5),
    "rope-linear": RoPE(scaling=LinearScaling(factor=2.0)),
    "rope-ntk": RoPE(scaling=NTKScaling(factor=2.0)),
    "rope-dynamic-ntk": RoPE(scaling=DynamicNTKScaling(factor=2.0, original_max_len=4)),
    "rope-dynamic-ntk-short": RoPE(scaling=DynamicNTKScaling(factor=2.0, original_max_len=64)),
    "rope-yarn": RoPE(scaling=YaRNScaling(factor=4.0, original_max_len=4)),
    "alibi": ALiBi(),
    "t5-relative": T5RelativeBias(num_buckets=8, max_distance=16),
    "none": NoPositions(),
}

# Dynamic NTK recomputes the RoPE base from max(positions) + 1 over the *whole batch* once that
# exceeds original_max_len. So (1) a padded row's result depends on its batch-mates' lengths (a
# per-row length would fix this) and (2) cached keys keep the base of the step that wrote them,
# while a full forward rotates every key with the final length's base (inherent to dynamic NTK;
# transformers' implementation behaves the same). Strict: a fix turns these into XPASS failures,
# which is the signal to drop the mark. Below original_max_len ("rope-dynamic-ntk-short") it is
# plain RoPE and must pass everything.
DYNAMIC_NTK_XFAIL = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="dynamic NTK base depends on the batch-wide max position: batch- and cache-dependent",
)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread; two pytest-xdist workers then share 2 cores without
    oversubscription. Restored afterwards for other test files."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def schemes_with(xfail_dynamic: bool) -> list:
    out = []
    for name in SCHEMES:
        marks = [DYNAMIC_NTK_XFAIL] if xfail_dynamic and name == "rope-dynamic-ntk" else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def config(arch: str, scheme: str = "rope-half", **changes) -> ModelConfig:
    base = dict(
        arch=arch,
        vocab_size=V,
        d_model=D,
        n_layers=LAYERS,
        n_heads=H,
        d_ff=64,
        positional=SCHEMES[scheme],
        init="xavier",
    )
    return ModelConfig(**{**base, **changes})


def build(cfg: ModelConfig, kernel: str = "naive", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return al.set_kernel(al.build_model(cfg), kernel).eval()


VARIANTS = {  # attention kinds and block wirings, on RoPE
    "mha": {},
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "window": dict(attention=AttentionConfig(sliding_window=3)),
    "parallel": dict(residual="parallel"),
    "parallel-shared-norm": dict(residual="parallel-shared-norm"),
    "post-norm": dict(norm_placement="post"),
    "moe": dict(ffn=MoEFFN(expert=GLUFFN(multiple_of=16), n_experts=4, top_k=2)),
}


def padded(seqs: list[torch.Tensor], side: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad with *random* ids (not a fixed pad id) so that any leak through the mask shows."""
    T = max(len(s) for s in seqs)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (len(seqs), T), generator=g)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        where = slice(0, len(s)) if side == "right" else slice(T - len(s), T)
        ids[i, where], mask[i, where] = s, 1
    return ids, mask


def real(x: torch.Tensor, mask: torch.Tensor, i: int) -> torch.Tensor:
    return x[i][mask[i].bool()]


def random_seqs(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in lengths]


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert_within_rounding(a, b, TERMS)


# --- causality -----------------------------------------------------------------------------------


def assert_causal(run, T: int = 10, t: int = 4) -> None:
    """run(ids) -> (logits, hidden). Tokens after t change; outputs at <= t must not."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, T), generator=g)
    changed = ids.clone()
    changed[:, t + 1 :] = (ids[:, t + 1 :] + 1 + torch.randint(0, V - 1, (2, T - t - 1))) % V
    (la, ha), (lb, hb) = run(ids), run(changed)
    close(la[:, : t + 1], lb[:, : t + 1])
    close(ha[:, : t + 1], hb[:, : t + 1])
    assert (ha[:, t + 1 :] - hb[:, t + 1 :]).abs().amax() > 1e-2  # the change was real


@pytest.mark.parametrize("kernel", ["naive", "auto"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_decoder_is_causal_for_every_scheme(scheme: str, kernel: str) -> None:
    model = build(config("decoder", scheme), kernel)
    with torch.no_grad():
        assert_causal(lambda ids: (lambda o: (o.logits, o.hidden))(model(ids)))


@pytest.mark.parametrize("kernel", ["naive", "auto"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decoder_is_causal_for_every_variant(variant: str, kernel: str) -> None:
    model = build(config("decoder", **VARIANTS[variant]), kernel)
    with torch.no_grad():
        assert_causal(lambda ids: (lambda o: (o.logits, o.hidden))(model(ids)))


@pytest.mark.parametrize("kernel", ["naive", "auto"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_encoder_decoder_decoder_is_causal(scheme: str, kernel: str) -> None:
    model = build(config("encoder-decoder", scheme), kernel)
    src = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert_causal(lambda ids: (lambda o: (o.logits, o.hidden))(model(src, ids)))


@pytest.mark.parametrize("arch", ["encoder", "encoder-decoder"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_encoder_is_bidirectional(scheme: str, arch: str) -> None:
    """The counterpart of causality: an encoder's first position sees the last token."""
    model = build(config(arch, scheme))
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, -1] = (ids[:, -1] + 1) % V
    encode = model.encode if arch == "encoder-decoder" else (lambda x: model(x).hidden)
    with torch.no_grad():
        delta = (encode(ids)[:, 0] - encode(changed)[:, 0]).abs().amax()
    assert delta > 1e-3


@pytest.mark.parametrize("kernel", ["naive", "auto"])
@pytest.mark.parametrize("arch", ["decoder", "encoder"])
@pytest.mark.parametrize("scheme", ["sinusoidal-interleaved", "rope-half", "alibi", "none"])
def test_sliding_window_locality(scheme: str, arch: str, kernel: str) -> None:
    """One layer, window w: the output at t sees tokens t-w+1..t (decoder) or |s-t| < w
    (encoder), so changing the token just outside changes nothing and just inside does."""
    w, t, T = 3, 6, 10
    model = build(config(arch, scheme, n_layers=1, attention=AttentionConfig(sliding_window=w)))
    al.set_kernel(model, kernel)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))

    def at_t_after_changing(s: int) -> torch.Tensor:
        changed = ids.clone()
        changed[:, s] = (ids[:, s] + 1) % V
        with torch.no_grad():
            return model(changed).hidden[:, t]

    with torch.no_grad():
        h = model(ids).hidden[:, t]
    outside = [t - w] + ([t + w] if arch == "encoder" else [])
    inside = [t - w + 1] + ([t + w - 1] if arch == "encoder" else [])
    for s in outside:
        close(at_t_after_changing(s), h)
    for s in inside:
        assert (at_t_after_changing(s) - h).abs().amax() > 1e-3, s


# --- padding invariance --------------------------------------------------------------------------

LENGTHS = [7, 4, 6]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("scheme", schemes_with(xfail_dynamic=True))
def test_decoder_padding_invariance(scheme: str, side: str) -> None:
    """Left padding works because default positions count real tokens only."""
    model = build(config("decoder", scheme), "auto")
    seqs = random_seqs(LENGTHS)
    ids, mask = padded(seqs, side)
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        for i, s in enumerate(seqs):
            alone = model(s[None])
            close(real(out.hidden, mask, i), alone.hidden[0])
            close(real(out.logits, mask, i), alone.logits[0])


@pytest.mark.parametrize("kernel", ["naive", "auto"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("variant", ["gqa", "mqa", "window", "parallel", "moe"])
def test_decoder_padding_invariance_variants(variant: str, side: str, kernel: str) -> None:
    model = build(config("decoder", **VARIANTS[variant]), kernel)
    seqs = random_seqs(LENGTHS)
    ids, mask = padded(seqs, side)
    with torch.no_grad():
        hidden = model(ids, attention_mask=mask).hidden
        for i, s in enumerate(seqs):
            close(real(hidden, mask, i), model(s[None]).hidden[0])


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("scheme", schemes_with(xfail_dynamic=True))
def test_encoder_padding_invariance(scheme: str, window: int | None) -> None:
    model = build(config("encoder", scheme, attention=AttentionConfig(sliding_window=window)))
    seqs = random_seqs(LENGTHS)
    ids, mask = padded(seqs, "right")
    with torch.no_grad():
        hidden = model(ids, attention_mask=mask).hidden
        for i, s in enumerate(seqs):
            close(real(hidden, mask, i), model(s[None]).hidden[0])


@pytest.mark.parametrize("scheme", schemes_with(xfail_dynamic=True))
def test_encoder_decoder_padding_invariance(scheme: str) -> None:
    """Padded source and padded target together, against each pair run alone."""
    model = build(config("encoder-decoder", scheme), "auto")
    srcs, tgts = random_seqs([5, 8, 3], seed=2), random_seqs(LENGTHS, seed=3)
    src, src_mask = padded(srcs, "right", seed=4)
    tgt, tgt_mask = padded(tgts, "right", seed=5)
    with torch.no_grad():
        out = model(src, tgt, attention_mask=src_mask, decoder_attention_mask=tgt_mask)
        memory = model.encode(src, src_mask)
        for i, (s, t) in enumerate(zip(srcs, tgts, strict=True)):
            alone = model(s[None], t[None])
            close(real(memory, src_mask, i), alone.encoder_hidden[0])
            close(real(out.hidden, tgt_mask, i), alone.hidden[0])
            close(real(out.logits, tgt_mask, i), alone.logits[0])


# --- permutation equivariance --------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["naive", "auto"])
def test_encoder_without_positions_is_permutation_equivariant(kernel: str) -> None:
    model = build(config("encoder", "none"), kernel)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        close(model(ids[:, perm]).hidden, model(ids).hidden[:, perm])


@pytest.mark.parametrize("scheme", ["sinusoidal-interleaved", "t5-relative"])
def test_positions_break_permutation_equivariance(scheme: str) -> None:
    """The same check must fail once positions exist: otherwise it proves nothing."""
    model = build(config("encoder", scheme))
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        delta = (model(ids[:, perm]).hidden - model(ids).hidden[:, perm]).abs().amax()
    assert delta > 1e-2


# --- cached decoding -----------------------------------------------------------------------------


def cached_logits(model, ids: torch.Tensor, mask: torch.Tensor | None, prefill: int):
    """Prefill `prefill` tokens, then one token per step; returns all logits, (B, T, V)."""
    B, T = ids.shape
    cache = model.new_cache(B, T)
    first = mask[:, :prefill] if mask is not None else None
    outs = [model(ids[:, :prefill], attention_mask=first, cache=cache).logits]
    for t in range(prefill, T):
        step_mask = mask[:, t : t + 1] if mask is not None else None
        outs.append(model(ids[:, t : t + 1], attention_mask=step_mask, cache=cache).logits)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("kernel", ["naive", "auto"])
@pytest.mark.parametrize("scheme", schemes_with(xfail_dynamic=True))
def test_cached_decoding_matches_full_forward(scheme: str, kernel: str) -> None:
    model = build(config("decoder", scheme), kernel)
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        close(cached_logits(model, ids, None, prefill=5), model(ids).logits)


@pytest.mark.parametrize("kernel", ["naive", "auto"])
@pytest.mark.parametrize("variant", ["gqa", "mqa", "window", "parallel", "moe"])
def test_cached_decoding_matches_full_forward_variants(variant: str, kernel: str) -> None:
    model = build(config("decoder", **VARIANTS[variant]), kernel)
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        close(cached_logits(model, ids, None, prefill=5), model(ids).logits)


@pytest.mark.parametrize("kernel", ["naive", "auto"])
@pytest.mark.parametrize("scheme", schemes_with(xfail_dynamic=True))
def test_cached_decoding_left_padded_batch(scheme: str, kernel: str) -> None:
    """A left-padded prompt batch, then steps: the full forward over the same padded batch."""
    model = build(config("decoder", scheme, attention=AttentionConfig(sliding_window=4)), kernel)
    prompts, mask = padded(random_seqs(LENGTHS), "left")
    steps = torch.randint(0, V, (3, 4), generator=torch.Generator().manual_seed(9))
    ids = torch.cat([prompts, steps], dim=1)
    mask = torch.cat([mask, torch.ones_like(steps)], dim=1)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        got = cached_logits(model, ids, mask, prefill=prompts.shape[1])
        keep = mask.bool()
        close(got[keep], full[keep])
        for i in range(3):  # and each row as if it had been decoded alone, unpadded
            close(real(got, mask, i), model(ids[i][keep[i]][None]).logits[0])


@pytest.mark.parametrize("scheme", schemes_with(xfail_dynamic=True))
def test_encoder_decoder_cached_decode(scheme: str) -> None:
    model = build(config("encoder-decoder", scheme), "auto")
    srcs = random_seqs([6, 4], seed=2)
    src, src_mask = padded(srcs, "right")
    tgt = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        full = model.decode(tgt, memory, src_mask).logits
        cache = model.new_cache(2, 9)
        outs = [model.decode(tgt[:, :3], memory, src_mask, cache=cache).logits]
        for t in range(3, 9):
            outs.append(model.decode(tgt[:, t : t + 1], memory, src_mask, cache=cache).logits)
    close(torch.cat(outs, dim=1), full)


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_too_short_cache_raises_with_the_sizes(arch: str) -> None:
    model = build(config(arch))
    ids = torch.randint(0, V, (1, 6))
    cache = model.new_cache(1, 7)
    with torch.no_grad():
        if arch == "decoder":
            model(ids, cache=cache)
            model(ids[:, :1], cache=cache)
            with pytest.raises(CacheFullError, match=r"8 positions needed.*7 available"):
                model(ids[:, :1], cache=cache)
        else:
            memory = model.encode(ids)
            model.decode(ids, memory, cache=cache)
            with pytest.raises(CacheFullError, match=r"8 positions needed.*7 available"):
                model.decode(ids[:, :2], memory, cache=cache)


# --- block wiring --------------------------------------------------------------------------------


class Affine(nn.Module):
    """A stand-in norm with its own random scale and shift, so two norms are told apart."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(D)), nn.Parameter(torch.randn(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (D,)) * self.w + self.b


class FakeAttention(nn.Module):
    """Same call signature as attnlab's Attention; tanh(W x) (+ mean of memory for cross)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h, ctx, memory=None, cache=None):
        y = torch.tanh(self.lin(h))
        return (y if memory is None else y + memory.mean(dim=1, keepdim=True)), None


class FakeFFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h):
        return torch.sin(self.lin(h)), h.square().mean()


WIRINGS = {  # (placement, residual, cross) -> the formula, with n_a, n_c, n_f the block's norms
    ("post", "sequential", False): lambda x, A, C, Fn, n_a, n_c, n_f: (lambda x1: n_f(x1 + Fn(x1)))(
        n_a(x + A(x))
    ),
    ("pre", "sequential", False): lambda x, A, C, Fn, n_a, n_c, n_f: (lambda x1: x1 + Fn(n_f(x1)))(
        x + A(n_a(x))
    ),
    ("pre", "parallel", False): lambda x, A, C, Fn, n_a, n_c, n_f: x + A(n_a(x)) + Fn(n_f(x)),
    ("pre", "parallel-shared-norm", False): lambda x, A, C, Fn, n_a, n_c, n_f: (
        x + A(n_a(x)) + Fn(n_a(x))
    ),
    ("post", "sequential", True): lambda x, A, C, Fn, n_a, n_c, n_f: (lambda x2: n_f(x2 + Fn(x2)))(
        (lambda x1: n_c(x1 + C(x1)))(n_a(x + A(x)))
    ),
    ("pre", "sequential", True): lambda x, A, C, Fn, n_a, n_c, n_f: (lambda x2: x2 + Fn(n_f(x2)))(
        (lambda x1: x1 + C(n_c(x1)))(x + A(n_a(x)))
    ),
}


@pytest.mark.parametrize("placement,residual,cross", list(WIRINGS))
def test_block_wiring_matches_the_formula(placement: str, residual: str, cross: bool) -> None:
    torch.manual_seed(0)
    block = Block(
        self_attn=FakeAttention(),
        ffn=FakeFFN(),
        make_norm=Affine,
        placement=placement,
        residual=residual,
        cross_attn=FakeAttention() if cross else None,
    ).eval()
    x, memory = torch.randn(2, 5, D), torch.randn(2, 3, D)
    n_f = block.ffn_norm
    if residual == "parallel-shared-norm":
        assert n_f is None  # one norm feeds both branches
    A = lambda h: block.self_attn(h, None)[0]  # noqa: E731
    C = lambda h: block.cross_attn(h, None, memory)[0]  # noqa: E731
    Fn = lambda h: block.ffn(h)[0]  # noqa: E731
    expected = WIRINGS[placement, residual, cross](
        x, A, C, Fn, block.attn_norm, block.cross_norm, n_f
    )
    with torch.no_grad():
        got, aux = block(x, AttnContext(), memory=memory if cross else None)
    close(got, expected)
    assert aux is not None  # the FFN's aux output is passed up


# --- tied weights and embedding scale ------------------------------------------------------------


def test_tied_logits_are_hidden_times_embedding() -> None:
    model = build(config("decoder", tie_embeddings=True))
    assert model.lm_head is None
    ids = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        out = model(ids)
    close(out.logits, out.hidden @ model.embed_tokens.weight.T)


def test_scale_tied_logits_multiplies_by_inverse_sqrt_d() -> None:
    model = build(config("decoder", scale_tied_logits=True))
    ids = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        out = model(ids)
    close(out.logits, (out.hidden @ model.embed_tokens.weight.T) * D**-0.5)


def test_untied_model_has_its_own_lm_head_and_more_parameters() -> None:
    tied, untied = config("decoder"), config("decoder", tie_embeddings=False)
    model = build(untied)
    assert model.lm_head is not None
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        out = model(ids)
    close(out.logits, out.hidden @ model.lm_head.weight.T)
    assert not torch.allclose(out.logits, out.hidden @ model.embed_tokens.weight.T)
    assert al.count_parameters(untied) - al.count_parameters(tied) == V * D
    assert al.count_parameters(untied) == sum(p.numel() for p in model.parameters())
    assert al.count_parameters(tied) == sum(p.numel() for p in build(tied).parameters())


def test_encoder_decoder_tying_variants() -> None:
    shared = config("encoder-decoder")
    separate = config("encoder-decoder", share_encoder_decoder_embeddings=False)
    untied = config("encoder-decoder", tie_embeddings=False)
    src, tgt = torch.randint(0, V, (2, 5)), torch.randint(0, V, (2, 6))
    with torch.no_grad():
        m = build(shared)
        out = m(src, tgt)
        close(out.logits, out.hidden @ m.embed_tokens.weight.T)
        m = build(separate)
        out = m(src, tgt)  # tied to the target-side table
        close(out.logits, out.hidden @ m.decoder_embed_tokens.weight.T)
        m = build(untied)
        out = m(src, tgt)
        close(out.logits, out.hidden @ m.lm_head.weight.T)
    n = al.count_parameters(shared)
    assert al.count_parameters(separate) - n == V * D
    assert al.count_parameters(untied) - n == V * D


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder-decoder"])
@pytest.mark.parametrize("scale", [False, True])
def test_scale_embeddings_multiplies_by_sqrt_d(arch: str, scale: bool) -> None:
    """What enters the (first) stack is embed_tokens(ids) · sqrt(d_model), or unscaled."""
    model = build(config(arch, "none", scale_embeddings=scale))
    seen = []
    stack = model.encoder if arch != "decoder" else model.decoder
    stack.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    ids = torch.randint(0, V, (2, 5))
    with torch.no_grad():
        model(ids, ids) if arch == "encoder-decoder" else model(ids)
        expected = model.embed_tokens(ids) * (math.sqrt(D) if scale else 1.0)
    close(seen[0], expected)


# --- mixture-of-experts auxiliary loss -----------------------------------------------------------


def switch_loss(router_logits: torch.Tensor, n_experts: int, top_k: int, coef: float):
    """Switch Transformer eq. 4-6, top-k slots counted as in HF Mixtral's load_balancing_loss_func:
    coef · E · Σ_e f_e · P_e, f_e = fraction of tokens that picked e, P_e = mean probability."""
    probs = router_logits.double().softmax(dim=-1)  # (N, E)
    picked = router_logits.topk(top_k, dim=-1).indices
    f = torch.zeros(n_experts, dtype=torch.float64)
    for e in range(n_experts):
        f[e] = (picked == e).any(dim=-1).double().mean()
    return coef * n_experts * (f * probs.mean(dim=0)).sum()


def test_moe_aux_loss_is_returned_and_trains_the_router() -> None:
    moe = MoEFFN(expert=GLUFFN(multiple_of=16), n_experts=4, top_k=2, aux_loss_coef=0.01)
    model = build(config("decoder", ffn=moe))
    routers = [b.ffn.router for b in model.decoder.blocks]
    logits_seen = []
    for r in routers:
        r.register_forward_hook(lambda mod, inp, out: logits_seen.append(out.detach()))
    ids = torch.randint(0, V, (3, 8), generator=torch.Generator().manual_seed(0))
    out = model(ids)
    assert out.aux_loss is not None and out.aux_loss.dim() == 0
    # the mean over layers of each layer's Switch loss (what Stack returns)
    per_layer = [switch_loss(z, 4, 2, 0.01) for z in logits_seen]
    torch.testing.assert_close(
        out.aux_loss.double(), torch.stack(per_layer).mean(), atol=1e-7, rtol=1e-5
    )
    out.aux_loss.backward()
    for r in routers:
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    dense = build(config("decoder"))
    assert dense(ids).aux_loss is None


# --- init schemes --------------------------------------------------------------------------------


def init_model(scheme: str, n_layers: int = 4) -> tuple[nn.Module, ModelConfig]:
    """A layer large enough (256 x 256 = 65k weights) for a ~0.3 % standard error on the std."""
    cfg = ModelConfig(
        arch="decoder", vocab_size=V, d_model=256, n_layers=n_layers, n_heads=4, d_ff=1024,
        positional=NoPositions(), init=scheme,
    )  # fmt: skip
    torch.manual_seed(0)
    return al.build_model(cfg), cfg


def assert_std(w: torch.Tensor, std: float, rel: float = 0.03) -> None:
    assert abs(w.mean().item()) < 3 * std / math.sqrt(w.numel()) + 1e-9
    assert w.std().item() == pytest.approx(std, rel=rel)


def test_gpt2_init_scales_residual_outputs_by_depth() -> None:
    model, cfg = init_model("gpt2")
    residual = 0.02 / math.sqrt(2 * cfg.n_layers)  # Radford et al. 2019, section 2.3
    for block in model.decoder.blocks:
        assert_std(block.self_attn.o_proj.weight, residual)
        assert_std(block.ffn.down_proj.weight, residual)
        assert_std(block.self_attn.q_proj.weight, 0.02)
        assert_std(block.ffn.up_proj.weight, 0.02)
        assert torch.equal(block.attn_norm.weight, torch.ones(256))
        assert torch.equal(block.ffn.up_proj.bias, torch.zeros(1024))
    assert_std(model.embed_tokens.weight, 0.02, rel=0.1)  # 61 x 256: fewer samples


def test_xavier_init_uses_the_glorot_uniform_bound() -> None:
    model, _ = init_model("xavier")
    for name, w in [
        ("q_proj", model.decoder.blocks[0].self_attn.q_proj.weight),
        ("up_proj", model.decoder.blocks[0].ffn.up_proj.weight),
    ]:
        fan_out, fan_in = w.shape
        bound = math.sqrt(6 / (fan_in + fan_out))  # Glorot & Bengio 2010, eq. 16
        assert w.abs().max() <= bound, name
        assert w.abs().max() > 0.99 * bound, name
        assert_std(w, bound / math.sqrt(3))  # uniform(-a, a) has std a / sqrt(3)


def test_t5_init_uses_mesh_tf_fan_in_stds() -> None:
    model, cfg = init_model("t5")
    d, d_kv = cfg.d_model, cfg.attn_head_dim
    attn = model.decoder.blocks[0].self_attn
    assert_std(attn.q_proj.weight, (d * d_kv) ** -0.5)
    assert_std(attn.k_proj.weight, d**-0.5)
    assert_std(attn.o_proj.weight, (cfg.n_heads * d_kv) ** -0.5)
    assert_std(model.decoder.blocks[0].ffn.down_proj.weight, cfg.ffn_dim**-0.5)
    assert_std(model.embed_tokens.weight, 1.0, rel=0.1)
