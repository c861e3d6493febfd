"""Positional schemes against float64 formulas, pure-Python references and transformers.

References are written here, independently of attnlab: the sinusoidal table of Vaswani et al.
(2017, section 3.5), the ALiBi slopes of Press et al. (arXiv:2108.12409, section 3 and its
reference code), Mesh-TF's T5 bucketing (transformer_layers.py, `_relative_position_bucket`), and
the RoPE frequency formulas of each scaling (rope.py cites the papers). Invariants: RoPE's
relative-position property, layout equivalence, norm preservation, partial rotary.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.nn.positional.alibi import ALiBi, alibi_slopes
from attnlab.nn.positional.base import Rotation
from attnlab.nn.positional.learned import LearnedPositions, PositionOutOfRangeError
from attnlab.nn.positional.relative import T5RelativeBias, t5_bucket
from attnlab.nn.positional.rope import RotaryEmbedding
from attnlab.nn.positional.sinusoidal import SinusoidalPositions

F64 = torch.float64

# --- sinusoidal ---------------------------------------------------------------------------------


def sinusoid_ref(positions: torch.Tensor, d: int, base: float, layout: str) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(...), in float64."""
    out = torch.empty(*positions.shape, d, dtype=F64)
    for i in range(d // 2):
        angle = positions.to(F64) / base ** (2 * i / d)
        if layout == "interleaved":
            out[..., 2 * i], out[..., 2 * i + 1] = angle.sin(), angle.cos()
        else:  # split: all sines, then all cosines
            out[..., i], out[..., d // 2 + i] = angle.sin(), angle.cos()
    return out


def sinusoid_angles(positions: torch.Tensor, d: int, base: float, layout: str) -> torch.Tensor:
    """The angle behind each channel of sinusoid_ref (for an fp32 error bound)."""
    inv = base ** (-2 * torch.arange(d // 2, dtype=F64) / d)
    angle = positions.to(F64)[..., None] * inv
    if layout == "interleaved":
        return angle.repeat_interleave(2, dim=-1)
    return torch.cat((angle, angle), dim=-1)


@pytest.mark.parametrize("layout", ["interleaved", "split"])
@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_sinusoidal_matches_float64_formula(layout, base):
    d = 32
    small = torch.arange(0, 64).reshape(2, 32)
    large = torch.tensor([[0, 1, 511, 4097, 65535, 123456, 1_000_000, 7]])
    module = SinusoidalPositions(d_model=d, base=base, layout=layout)
    for positions in (small, large):
        got = module.embed(positions).to(F64)
        ref = sinusoid_ref(positions, d, base, layout)
        assert got.shape == ref.shape
        # attnlab computes the angle pos·inv_freq in fp32: two roundings of 2^-24 relative each,
        # so |error| <= angle·2^-23 (we allow 2^-22) plus ~1 fp32 ulp from sin/cos themselves.
        bound = sinusoid_angles(positions, d, base, layout) * 2.0**-22 + 1e-6
        assert ((got - ref).abs() <= bound).all(), (got - ref).abs().max()
    # position 0 is sin 0 = 0 / cos 0 = 1 exactly, on the channels the layout puts them
    zero = module.embed(torch.zeros(1, 1, dtype=torch.long))[0, 0]
    sin_idx = slice(0, d, 2) if layout == "interleaved" else slice(0, d // 2)
    cos_idx = slice(1, d, 2) if layout == "interleaved" else slice(d // 2, d)
    assert (zero[sin_idx] == 0).all() and (zero[cos_idx] == 1).all()


# --- ALiBi --------------------------------------------------------------------------------------


def alibi_slopes_ref(n: int) -> list[float]:
    """Press et al. 2022: m_h = 2^(-8h/n) for n a power of two; otherwise the slopes of the
    largest power of two p < n, then the odd-numbered slopes 2^(-8h/(2p)), h = 1, 3, 5, ... of 2p."""

    def geometric(n: int, hs) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in hs]

    p = 1 << (n.bit_length() - 1)
    if p == n:
        return geometric(n, range(1, n + 1))
    return geometric(p, range(1, p + 1)) + geometric(2 * p, range(1, 2 * (n - p), 2))


@pytest.mark.parametrize("n", [1, 2, 4, 8, 12, 16, 24, 71])
def test_alibi_slopes_match_paper(n):
    ref = torch.tensor(alibi_slopes_ref(n), dtype=F64)
    got = torch.tensor(alibi_slopes(n), dtype=F64)
    assert got.shape == (n,)
    torch.testing.assert_close(got, ref, rtol=1e-14, atol=0)
    module = ALiBi(n_heads=n, causal=True)  # the buffer the model uses, stored in fp32
    torch.testing.assert_close(module.slopes.to(F64), ref, rtol=2**-24, atol=0)


def test_alibi_slopes_for_8_heads_are_the_papers_powers_of_two():
    # paper, section 3: "For models with 8 heads, our slopes are 1/2^1, 1/2^2, ..., 1/2^8"
    assert alibi_slopes(8) == [1 / 2**h for h in range(1, 9)]


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_score_bias(causal):
    n_heads, B, T, S = 6, 2, 3, 7
    g = torch.Generator().manual_seed(0)
    q_pos = torch.randint(0, 50, (B, T), generator=g)
    k_pos = torch.randint(0, 50, (B, S), generator=g)
    bias = ALiBi(n_heads=n_heads, causal=causal).score_bias(q_pos, k_pos).dense()
    assert bias.shape == (B, n_heads, T, S)
    slopes = alibi_slopes_ref(n_heads)
    ref = torch.empty(B, n_heads, T, S, dtype=F64)
    for b in range(B):
        for h in range(n_heads):
            for t in range(T):
                for s in range(S):
                    rel = int(k_pos[b, s]) - int(q_pos[b, t])
                    ref[b, h, t, s] = slopes[h] * (rel if causal else -abs(rel))
    torch.testing.assert_close(bias.to(F64), ref, rtol=1e-6, atol=1e-6)


# --- T5 relative buckets ------------------------------------------------------------------------


def mesh_tf_bucket(
    relative_position: int, bidirectional: bool, num_buckets: int, max_distance: int
):
    """Scalar transcription of Mesh-TF `_relative_position_bucket` (the T5 reference)."""
    ret = 0
    n = -relative_position
    if bidirectional:
        num_buckets //= 2
        ret += int(n < 0) * num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    val_if_large = max_exact + int(
        math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    )
    return ret + min(val_if_large, num_buckets - 1)


BUCKET_CASES = [(32, 128), (16, 64), (8, 20), (128, 1000)]


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), BUCKET_CASES)
def test_t5_bucket_matches_mesh_tf(bidirectional, num_buckets, max_distance):
    rel = torch.arange(-3 * max_distance, 3 * max_distance + 1)
    got = t5_bucket(rel, bidirectional, num_buckets, max_distance)
    ref = [mesh_tf_bucket(int(r), bidirectional, num_buckets, max_distance) for r in rel]
    assert got.tolist() == ref
    assert got.min() >= 0 and got.max() < num_buckets


@pytest.mark.hf
@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), BUCKET_CASES)
def test_t5_bucket_matches_transformers(bidirectional, num_buckets, max_distance):
    pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-3 * max_distance, 3 * max_distance + 1)[:, None] + torch.arange(3)[None]
    ref = T5Attention._relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    assert torch.equal(t5_bucket(rel, bidirectional, num_buckets, max_distance), ref)


@pytest.mark.parametrize("causal", [True, False])
def test_t5_score_bias_looks_up_bucket_of_k_minus_q(causal):
    module = T5RelativeBias(n_heads=3, causal=causal, num_buckets=8, max_distance=20)
    q_pos = torch.tensor([[0, 5, 30]])
    k_pos = torch.tensor([[0, 1, 2, 10, 40]])
    bias = module.score_bias(q_pos, k_pos).dense()
    table = module.relative_attention_bias.weight  # (buckets, H)
    for t in range(3):
        for s in range(5):
            rel = int(k_pos[0, s] - q_pos[0, t])
            bucket = mesh_tf_bucket(rel, not causal, 8, 20)
            torch.testing.assert_close(bias[0, :, t, s], table[bucket])


# --- RoPE ---------------------------------------------------------------------------------------

SCALINGS = {
    "none": None,
    "linear": {"kind": "linear", "factor": 4.0},
    "ntk": {"kind": "ntk", "factor": 4.0},
    "dynamic-ntk": {"kind": "dynamic-ntk", "factor": 4.0, "original_max_len": 16},
    "yarn": {
        "kind": "yarn",
        "factor": 4.0,
        "original_max_len": 2048,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
}


def inv_freq_ref(rot_dim: int, base: float, scaling: dict | None, length: int = 0):
    """Float64 inverse frequencies θ_i for each scaling kind (formulas in rope.py's docstring)."""
    i = torch.arange(rot_dim // 2, dtype=F64)

    def plain(b: float) -> torch.Tensor:
        return b ** (-2 * i / rot_dim)

    kind = scaling["kind"] if scaling else None
    if kind is None:
        return plain(base)
    if kind == "linear":  # position interpolation: positions / factor, i.e. θ / factor
        return plain(base) / scaling["factor"]
    if kind == "ntk":
        return plain(base * scaling["factor"] ** (rot_dim / (rot_dim - 2)))
    if kind == "dynamic-ntk":
        orig, factor = scaling["original_max_len"], scaling["factor"]
        if length <= orig:
            return plain(base)
        return plain(base * (factor * length / orig - (factor - 1)) ** (rot_dim / (rot_dim - 2)))
    # YaRN, as in the authors' reference code (jquesnelle/yarn, which transformers follows): the
    # ramp is linear in the pair index between the pairs that turn beta_fast and beta_slow times
    # over the original context.
    factor, orig = scaling["factor"], scaling["original_max_len"]

    def pair_turning(n_turns: float) -> float:  # solve orig·θ_d = 2π·n_turns for d
        return rot_dim * math.log(orig / (n_turns * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(pair_turning(scaling["beta_fast"])), 0)
    hi = min(math.ceil(pair_turning(scaling["beta_slow"])), rot_dim - 1)
    ramp = ((i - lo) / (hi - lo if hi != lo else 0.001)).clamp(0, 1)
    theta = plain(base)
    return theta * (1 - ramp) + theta / factor * ramp


def yarn_attention_factor(factor: float) -> float:
    return 0.1 * math.log(factor) + 1.0  # YaRN eq. 22, sqrt(1/t) = 0.1 ln(s) + 1


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rope_inv_freq_matches_formula(kind):
    rot_dim, base = 32, 10000.0
    module = RotaryEmbedding(rotary_dim=rot_dim, base=base, layout="half", scaling=SCALINGS[kind])
    ref = inv_freq_ref(rot_dim, base, SCALINGS[kind])
    torch.testing.assert_close(module.inv_freq.to(F64), ref, rtol=2**-23, atol=0)
    if kind == "yarn":  # the ramp really mixes: some pairs kept, some divided, some in between
        theta = inv_freq_ref(rot_dim, base, None)
        kept, divided = ref == theta, torch.isclose(ref, theta / 4, rtol=1e-12, atol=0)
        assert kept.any() and divided.any() and (~kept & ~divided).any()
    # ...and the rotation uses them: cos/sin of position·θ (times YaRN's attention factor)
    positions = torch.arange(0, 12).reshape(1, 12)
    rot = module.rotation(positions)
    scale = yarn_attention_factor(4.0) if kind == "yarn" else 1.0
    angle = positions[..., None].to(F64) * ref
    torch.testing.assert_close(rot.cos.to(F64), angle.cos() * scale, rtol=0, atol=2e-6)
    torch.testing.assert_close(rot.sin.to(F64), angle.sin() * scale, rtol=0, atol=2e-6)


def test_dynamic_ntk_unchanged_below_original_length_and_grows_above():
    rot_dim, base, scaling = 16, 10000.0, SCALINGS["dynamic-ntk"]
    orig = scaling["original_max_len"]
    dynamic = RotaryEmbedding(rotary_dim=rot_dim, base=base, layout="half", scaling=scaling)
    plain = RotaryEmbedding(rotary_dim=rot_dim, base=base, layout="half", scaling=None)
    short = torch.arange(orig).reshape(1, orig)  # max position orig-1: length == orig
    assert torch.equal(dynamic.rotation(short).cos, plain.rotation(short).cos)
    assert torch.equal(dynamic.rotation(short).sin, plain.rotation(short).sin)
    length = 3 * orig
    long = torch.arange(length).reshape(1, length)
    rot = dynamic.rotation(long)
    ref = inv_freq_ref(rot_dim, base, scaling, length)
    assert (ref[1:] < inv_freq_ref(rot_dim, base, None)[1:]).all()  # a larger base: slower
    angle = long[..., None].to(F64) * ref
    torch.testing.assert_close(rot.cos.to(F64), angle.cos(), rtol=0, atol=1e-5)
    torch.testing.assert_close(rot.sin.to(F64), angle.sin(), rtol=0, atol=1e-5)
    # the first positions now differ from the unscaled rotation (channel pairs i >= 1)
    assert not torch.allclose(rot.cos[:, :orig], plain.rotation(short).cos, atol=1e-4)


@pytest.mark.hf
@pytest.mark.parametrize("kind", ["linear", "dynamic-ntk", "yarn"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rope_inv_freq_matches_transformers(kind, fraction):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, base = 32, 10000.0
    rot_dim = int(head_dim * fraction)
    scaling = SCALINGS[kind]
    params = {"rope_theta": base, "factor": scaling["factor"], "partial_rotary_factor": fraction}
    max_pos = 64
    if kind == "linear":
        params["rope_type"] = "linear"
    elif kind == "dynamic-ntk":  # transformers: the original length is max_position_embeddings
        params["rope_type"] = "dynamic"
        max_pos = scaling["original_max_len"]
    else:
        params.update(
            rope_type="yarn",
            original_max_position_embeddings=scaling["original_max_len"],
            beta_fast=scaling["beta_fast"],
            beta_slow=scaling["beta_slow"],
        )
        max_pos = 4 * scaling["original_max_len"]
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=params,
    )
    init = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    module = RotaryEmbedding(rotary_dim=rot_dim, base=base, layout="half", scaling=scaling)
    if kind != "dynamic-ntk":
        hf_inv, hf_factor = init(config, None)
        torch.testing.assert_close(module.inv_freq, hf_inv.float(), rtol=1e-6, atol=0)
        assert module.attention_factor == pytest.approx(hf_factor, rel=1e-12)
        return
    for length in (8, 16, 40):  # at and below the original length, then above it
        hf_inv, _ = init(config, None, seq_len=length)
        positions = torch.arange(length).reshape(1, length)
        rot = module.rotation(positions)
        angle = positions[..., None].to(F64) * hf_inv.to(F64)
        torch.testing.assert_close(rot.cos.to(F64), angle.cos(), rtol=0, atol=1e-5)
        torch.testing.assert_close(rot.sin.to(F64), angle.sin(), rtol=0, atol=1e-5)


def rope_scores(module: RotaryEmbedding, head_dim: int, length: int, dtype=F64):
    """S[m, n] = rot(q)_m · rot(k)_n for one fixed random q and k placed at every position."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, head_dim, generator=g, dtype=dtype)
    positions = torch.arange(length).reshape(1, length)
    rot = module.rotation(positions)  # one rotation per forward pass, shared by q and k
    q_rot = rot(q.expand(1, 1, length, head_dim))[0, 0]  # (L, D)
    k_rot = rot(k.expand(1, 1, length, head_dim))[0, 0]
    return q_rot @ k_rot.T, q, k


def assert_scores_depend_on_offset_only(scores: torch.Tensor, atol: float):
    length = scores.shape[0]
    for offset in range(-length + 1, length):
        diagonal = torch.diagonal(scores, offset)
        assert (diagonal - diagonal[0]).abs().max() <= atol, offset


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rope_relative_property(layout, fraction, kind):
    head_dim, length = 32, 40  # 40 > dynamic-ntk's original 16: the grown base is used
    module = RotaryEmbedding(
        rotary_dim=int(head_dim * fraction), base=10000.0, layout=layout, scaling=SCALINGS[kind]
    )
    scores, q, k = rope_scores(module, head_dim, length)
    # cos/sin come in fp32 (angles up to 40 rad, error ~40·2^-23): not fp64-exact
    assert_scores_depend_on_offset_only(scores, atol=1e-5 * float(q.norm() * k.norm()))
    # not vacuous: the score really changes with the offset
    assert (scores[0] - scores[0, 0]).abs().max() > 0.1


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_relative_property_fp64(layout):
    """With fp64 cos/sin, the Rotation itself keeps q_m · k_n a function of m - n to 1e-12."""
    rot_dim, head_dim, length = 16, 24, 300
    inv = inv_freq_ref(rot_dim, 10000.0, None)
    angle = torch.arange(length, dtype=F64)[None, :, None] * inv  # (1, L, R/2)
    rot = Rotation(angle.cos(), angle.sin(), layout)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, head_dim, generator=g, dtype=F64)
    q_rot = rot(q.expand(1, 1, length, head_dim))[0, 0]
    k_rot = rot(k.expand(1, 1, length, head_dim))[0, 0]
    assert_scores_depend_on_offset_only(q_rot @ k_rot.T, atol=1e-12 * float(q.norm() * k.norm()))


def half_from_interleaved(rot_dim: int, head_dim: int) -> torch.Tensor:
    """Channel permutation: half channel i <- interleaved 2i, half channel i + R/2 <- 2i + 1."""
    idx = list(range(0, rot_dim, 2)) + list(range(1, rot_dim, 2)) + list(range(rot_dim, head_dim))
    return torch.tensor(idx)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rope_layouts_are_equivalent_under_channel_permutation(fraction):
    head_dim = 16
    rot_dim = int(head_dim * fraction)
    half = RotaryEmbedding(rotary_dim=rot_dim, base=10000.0, layout="half")
    inter = RotaryEmbedding(rotary_dim=rot_dim, base=10000.0, layout="interleaved")
    positions = torch.tensor([[0, 3, 17, 250], [5, 6, 7, 1000]])
    x = torch.randn(2, 3, 4, head_dim, generator=torch.Generator().manual_seed(3), dtype=F64)
    perm = half_from_interleaved(rot_dim, head_dim)
    out_inter = inter.rotation(positions)(x)
    out_half = half.rotation(positions)(x[..., perm])
    torch.testing.assert_close(out_half, out_inter[..., perm], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out_inter, x)  # something rotated


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rope_preserves_norms_and_passes_unrotated_channels(layout, kind):
    head_dim, rot_dim = 24, 16
    module = RotaryEmbedding(
        rotary_dim=rot_dim, base=10000.0, layout=layout, scaling=SCALINGS[kind]
    )
    positions = torch.tensor([[0, 1, 9, 33, 500, 4000]])
    x = torch.randn(1, 2, 6, head_dim, generator=torch.Generator().manual_seed(4), dtype=F64)
    out = module.rotation(positions)(x)
    # partial rotary: channels past R are passed through bit for bit
    assert torch.equal(out[..., rot_dim:], x[..., rot_dim:])
    # each (cos, sin) pair is a rotation, scaled by YaRN's attention factor (cos²+sin² in fp32)
    scale = yarn_attention_factor(4.0) if kind == "yarn" else 1.0
    torch.testing.assert_close(
        out[..., :rot_dim].norm(dim=-1), scale * x[..., :rot_dim].norm(dim=-1), rtol=1e-6, atol=0
    )


# --- learned positions --------------------------------------------------------------------------


def test_learned_positions_lookup_with_offset():
    module = LearnedPositions(d_model=8, max_len=10, offset=2)
    assert module.max_positions == 8
    positions = torch.tensor([[0, 1, 7], [3, 3, 0]])
    got = module.embed(positions)
    assert torch.equal(got, module.weight[positions + 2])  # BART: position p reads row p + 2


@pytest.mark.parametrize("offset", [0, 2])
def test_learned_positions_beyond_table_raise_helpfully(offset):
    module = LearnedPositions(d_model=8, max_len=10, offset=offset)
    limit = 10 - offset
    module.embed(torch.tensor([[limit - 1]]))  # the last row is fine
    with pytest.raises(PositionOutOfRangeError) as info:
        module.embed(torch.tensor([[0, limit]]))
    message = str(info.value)
    assert str(limit) in message and str(limit - 1) in message
    assert "rope" in message and "alibi" in message
    assert isinstance(info.value, ValueError)
