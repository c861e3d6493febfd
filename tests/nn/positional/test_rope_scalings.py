"""RoPE's scalings of issue 19 (src/attnlab/nn/positional/scaling.py): llama3, longrope,
proportional and YaRN's truncate, and the rope_type translation
(src/attnlab/interop/rope_params.py) for every entry of transformers' ROPE_INIT_FUNCTIONS.

- float64 formulas written from the sources: Meta's Llama 3.1 `apply_scaling` (a loop over
  frequencies, its three bands), LongRoPE's θ_i / λ_i with Phi-3's attention factor
  sqrt(1 + ln s / ln L), p-RoPE's zeroed low frequencies, YaRN's unrounded ramp;
- every transformers rope_type, read from a config dict as from_hf reads it, gives transformers'
  inverse frequencies and attention factor (ROPE_INIT_FUNCTIONS, fp32 there, so a few ulps),
  whole and partial heads, and the same cos/sin as transformers' rotary module (its dynamic
  update included: dynamic NTK's growth, longrope's switch to the long factors) at positions up
  to 8x the original length;
- GPT-OSS's default YaRN (truncate false) converts exactly;
- config rules and test sizes (longrope's factor count, llama3's band), writing every scaling
  back as a config.json that reads the same, and refusals naming the key.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import attnlab as al
from attnlab.config import ConfigError, ModelConfig, RoPE
from attnlab.config.scaling import Llama3Scaling, LongRoPEScaling, ProportionalScaling
from attnlab.interop import CONVERTERS, ConversionError
from attnlab.interop.hf_config import HFConfig
from attnlab.interop.rope_params import ROPE_TYPES, rope_from_hf
from attnlab.nn.positional.rope import RotaryEmbedding
from attnlab.nn.positional.scaling import ROPE_SCALINGS

F64 = torch.float64
ORIG = 16  # the original length of the test configs; positions run to 8x it
HEAD_DIM = 32
SHORT = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)]
LONG = [1.0 + 0.9 * i for i in range(HEAD_DIM // 2)]

# --- float64 formulas from the sources ----------------------------------------------------------


def plain(rot_dim: int, base: float) -> list[float]:
    return [base ** (-2 * i / rot_dim) for i in range(rot_dim // 2)]


def meta_apply_scaling(freqs, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Llama 3.1's `apply_scaling` (meta-llama/llama-models, models/llama3/reference_impl),
    as a loop in Python floats."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out, bands = [], []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
            bands.append("kept")
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
            bands.append("divided")
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            out.append((1 - smooth) * freq / factor + smooth * freq)
            bands.append("blend")
    return out, bands


def test_llama3_matches_metas_reference_in_float64():
    """Llama 3.1 8B's own numbers: 128 rotary channels, base 500000, factor 8, 1, 4, 8192."""
    rot, base = 128, 500000.0
    ours = ROPE_SCALINGS.get("llama3")(
        factor=8.0, original_max_len=8192, low_freq_factor=1.0, high_freq_factor=4.0
    ).inv_freq(rot, base)
    ref, bands = meta_apply_scaling(plain(rot, base), 8.0, 1.0, 4.0, 8192)
    assert set(bands) == {"kept", "divided", "blend"}  # every band is exercised
    torch.testing.assert_close(ours, torch.tensor(ref, dtype=F64), rtol=1e-14, atol=0)


def test_longrope_matches_the_papers_rescaled_frequencies_in_float64():
    """LongRoPE (arXiv:2402.13753, eq. 3): pair i rotates at θ_i / λ_i, λ the searched factors;
    the short set up to the original length, the long set past it; Phi-3's attention factor
    sqrt(1 + ln(s) / ln(L)) (Phi-3-mini-128k: s = 131072 / 4096)."""
    rot, base, L = 96, 10000.0, 4096
    short = [1.0 + 0.01 * i for i in range(rot // 2)]
    long = [1.0 + 0.5 * i for i in range(rot // 2)]
    s = ROPE_SCALINGS.get("longrope")(
        short_factor=short, long_factor=long, original_max_len=L, factor=131072 / L
    )
    theta = plain(rot, base)
    want_short = torch.tensor([t / f for t, f in zip(theta, short, strict=True)], dtype=F64)
    want_long = torch.tensor([t / f for t, f in zip(theta, long, strict=True)], dtype=F64)
    torch.testing.assert_close(s.inv_freq(rot, base), want_short, rtol=1e-15, atol=0)
    assert s.at_length(L, rot, base) is None  # a pass within the original length: short
    torch.testing.assert_close(s.at_length(L + 1, rot, base), want_long, rtol=1e-15, atol=0)
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(L)), 1e-15)
    explicit = ROPE_SCALINGS.get("longrope")(
        short_factor=short, long_factor=long, original_max_len=L, factor=1.0
    )
    assert explicit.attention_factor == 1.0  # no extension: no temperature


def test_proportional_and_unrounded_yarn_match_their_formulas_in_float64():
    rot, base = 32, 10000.0
    p = ROPE_SCALINGS.get("proportional")(fraction=0.25, factor=2.0).inv_freq(rot, base)
    theta = plain(rot, base)
    want = [t / 2.0 if i < 4 else 0.0 for i, t in enumerate(theta)]  # int(0.25 · 32 // 2) = 4
    torch.testing.assert_close(p, torch.tensor(want, dtype=F64), rtol=1e-15, atol=0)
    # YaRN without truncation: the ramp runs between the real-valued correction dims
    factor, orig = 8.0, 4096

    def dim_for(turns: float) -> float:
        return rot * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(dim_for(32.0), 0.0), min(dim_for(1.0), rot - 1)
    assert lo != math.floor(lo) and hi != math.ceil(hi)  # rounding would change them
    ramp = [min(max((i - lo) / (hi - lo), 0.0), 1.0) for i in range(rot // 2)]
    want = [t * (1 - r) + t / factor * r for t, r in zip(theta, ramp, strict=True)]
    y = ROPE_SCALINGS.get("yarn")(factor=factor, original_max_len=orig, truncate=False)
    torch.testing.assert_close(
        y.inv_freq(rot, base), torch.tensor(want, dtype=F64), rtol=1e-14, atol=0
    )
    rounded = ROPE_SCALINGS.get("yarn")(factor=factor, original_max_len=orig)
    assert not torch.allclose(rounded.inv_freq(rot, base), y.inv_freq(rot, base), rtol=1e-6)


# --- every transformers rope_type against ROPE_INIT_FUNCTIONS -----------------------------------

# name -> (rope_parameters without rope_theta / partial_rotary_factor, max_position_embeddings)
HF_CASES = {
    "linear": (dict(rope_type="linear", factor=3.0), 64),
    "dynamic": (dict(rope_type="dynamic", factor=2.0), ORIG),
    "yarn": (dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=ORIG), 8 * ORIG),
    "yarn-untruncated-betas": (
        dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=ORIG, truncate=False,
             beta_fast=16.0, beta_slow=2.0),
        8 * ORIG,
    ),
    "yarn-attention-factor": (
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIG, attention_factor=0.8),
        4 * ORIG,
    ),
    "yarn-mscale": (
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIG, mscale=0.707,
             mscale_all_dim=1.0),
        4 * ORIG,
    ),
    "yarn-factor-from-lengths": (
        dict(rope_type="yarn", factor=None, original_max_position_embeddings=ORIG), 4 * ORIG
    ),
    "llama3": (
        dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=ORIG),
        8 * ORIG,
    ),
    "longrope": (
        dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG,
             original_max_position_embeddings=ORIG),
        4 * ORIG,
    ),
    "longrope-factor-attention": (
        dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG, factor=6.0,
             attention_factor=1.3, original_max_position_embeddings=ORIG),
        4 * ORIG,
    ),
    "proportional": (dict(rope_type="proportional", factor=2.0), 64),
}  # fmt: skip
BASE = 500.0


def test_every_transformers_rope_type_has_a_case_and_a_reader():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_INIT_FUNCTIONS) | {"default"} == set(ROPE_TYPES)
    assert {p["rope_type"] for p, _ in HF_CASES.values()} == set(ROPE_INIT_FUNCTIONS)


def _hf_config(case: str, fraction: float):
    from transformers import LlamaConfig

    params, max_pos = HF_CASES[case]
    n = int(HEAD_DIM * fraction) // 2 if params["rope_type"] != "proportional" else HEAD_DIM // 2
    params = {k: (v[:n] if k.endswith("_factor") and isinstance(v, list) else v)
              for k, v in params.items()}  # fmt: skip
    params = dict(params, rope_theta=BASE, partial_rotary_factor=fraction)
    return (
        LlamaConfig(
            hidden_size=64,
            num_attention_heads=2,
            head_dim=HEAD_DIM,
            max_position_embeddings=max_pos,
            rope_parameters=dict(params),
        ),
        params,
        max_pos,
    )


def _ours(params: dict, max_pos: int) -> tuple[RoPE, RotaryEmbedding]:
    hf = HFConfig("llama", {"rope_parameters": params, "max_position_embeddings": max_pos}, {})
    rope = rope_from_hf(hf, partial_ok=True)
    hf.done()
    scaling = rope.scaling.to_dict() if rope.scaling is not None else None
    module = RotaryEmbedding(rotary_dim=rope.rotary_dim(HEAD_DIM), base=rope.base, scaling=scaling)
    return rope, module


@pytest.mark.hf
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("case", list(HF_CASES))
def test_inverse_frequencies_and_attention_factor_equal_transformers(case, fraction):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config, params, max_pos = _hf_config(case, fraction)
    rope, module = _ours(params, max_pos)
    init = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    lengths = (None,) if not module.scaling.dynamic else (ORIG // 2, ORIG, ORIG + 1, 8 * ORIG)
    for length in lengths:
        theirs, their_factor = init(config, None, seq_len=length)
        ours = module.inv_freq
        if length is not None:  # what a forward pass of this length uses
            grown = module.scaling.at_length(length, module.rot_dim, module.base)
            ours = ours if grown is None else grown.float()
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
        assert module.attention_factor == pytest.approx(their_factor, rel=1e-12)
    if params["rope_type"] == "proportional":  # the fraction is the scaling's, every pair kept
        assert rope.fraction == 1.0 and module.inv_freq.numel() == HEAD_DIM // 2
        assert (module.inv_freq == 0).sum() == HEAD_DIM // 2 - int(fraction * HEAD_DIM // 2)


@pytest.mark.hf
@pytest.mark.parametrize("case", list(HF_CASES))
def test_cos_sin_equal_transformers_rotary_module_up_to_8x_the_original_length(case):
    """transformers' LlamaRotaryEmbedding (with its dynamic update) against our rotation, one
    fresh module per pass as each pass starts a generation: within, at and past the original
    length, to 8x it."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config, params, max_pos = _hf_config(case, 1.0)
    _, module = _ours(params, max_pos)
    for length in (ORIG // 2, ORIG, ORIG + 1, 8 * ORIG):
        positions = torch.arange(length)[None]  # (1, T)
        cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
        rot = module.rotation(positions)
        half = module.rot_dim // 2
        # fp32 angles position·θ: θ may differ by ulps, so the angle by up to T·θ_max·2^-21
        atol = length * float(module.inv_freq.max()) * 2**-21 + 2**-22
        torch.testing.assert_close(rot.cos, cos[0, :, :half][None], rtol=0, atol=atol)
        torch.testing.assert_close(rot.sin, sin[0, :, :half][None], rtol=0, atol=atol)


@pytest.mark.hf
def test_gpt_oss_default_yarn_converts_exactly():
    """GptOssConfig's own rope_parameters (yarn, factor 32, truncate false): our frequencies and
    attention factor equal transformers', and differ from the truncated ramp."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = GptOssConfig()
    assert config.rope_parameters["truncate"] is False
    hf = HFConfig("gpt_oss", config.to_dict(), {})
    rope = rope_from_hf(hf, 150000.0)
    hf.done()
    assert rope.scaling.kind == "yarn" and rope.scaling.truncate is False
    rot = rope.rotary_dim(config.head_dim)
    module = RotaryEmbedding(rotary_dim=rot, base=rope.base, scaling=rope.scaling.to_dict())
    theirs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    torch.testing.assert_close(module.inv_freq, theirs.float(), rtol=1e-6, atol=0)
    assert module.attention_factor == pytest.approx(their_factor, rel=1e-12)
    truncated = rope.scaling.merged(truncate=True).to_dict()
    other = RotaryEmbedding(rotary_dim=rot, base=rope.base, scaling=truncated)
    assert not torch.allclose(other.inv_freq, theirs.float(), rtol=1e-4)


# --- config rules, test sizes, writing back -----------------------------------------------------

_MODEL = dict(arch="decoder", vocab_size=32, d_model=64, n_layers=1, n_heads=2)


def test_longrope_needs_one_factor_per_rotated_pair():
    bad = LongRoPEScaling(
        short_factor=[1.0] * 5, long_factor=[2.0] * 5, original_max_len=8, factor=4
    )
    with pytest.raises(ConfigError) as err:
        ModelConfig(**_MODEL, positional=RoPE(fraction=0.5, scaling=bad))
    (problem,) = err.value.problems
    for part in ("positional.scaling.short_factor", "(5 entries)", "8, (16 rotary", "give 8"):
        assert part.replace(",", "") in problem.replace(",", ""), problem
    good = bad.merged(short_factor=[1.0] * 8, long_factor=[2.0] * 8)
    ModelConfig(**_MODEL, positional=RoPE(fraction=0.5, scaling=good))
    with pytest.raises(ConfigError, match="one entry per rotated pair"):
        LongRoPEScaling(short_factor=[1.0] * 4, long_factor=[2.0] * 5, original_max_len=8, factor=4)
    with pytest.raises(ConfigError, match=re.escape("short_factor (0.0) must be > 0")):
        LongRoPEScaling(short_factor=[0.0], long_factor=[2.0], original_max_len=8, factor=4)


def test_llama3_band_must_be_ordered():
    with pytest.raises(ConfigError, match=r"high_freq_factor \(1\.0\) must exceed low_freq_factor"):
        Llama3Scaling(factor=8, original_max_len=8192, low_freq_factor=1.0, high_freq_factor=1.0)


def test_tiny_keeps_longrope_consistent_with_the_smaller_head():
    """Phi-4-mini's shape: 48 factors for 0.75 of 128 channels; at test size (head_dim 16,
    12 rotary channels) 6, sampled evenly, the first and last kept; the model builds."""
    short = [1.0 + i for i in range(48)]
    big = ModelConfig(
        arch="decoder", vocab_size=256, d_model=3072, n_layers=2, n_heads=24, n_kv_heads=8,
        positional=RoPE(fraction=0.75, scaling=LongRoPEScaling(
            short_factor=short, long_factor=[2.0] * 48, original_max_len=4096, factor=32)),
    )  # fmt: skip
    small = al.presets.tiny(big)
    s = small.positional.scaling
    assert len(s.short_factor) == small.rotary_dim // 2 == 6
    assert s.short_factor[0] == 1.0 and s.short_factor[-1] == 48.0
    assert list(s.short_factor) == sorted(s.short_factor) and s.original_max_len == 32
    al.build_model(small)


SCALED = {
    "llama3": Llama3Scaling(factor=8.0, original_max_len=16),
    "longrope": LongRoPEScaling(short_factor=[1.0 + i / 8 for i in range(8)], long_factor=[2.0 + i for i in range(8)],
                                original_max_len=16, factor=4.0),
    "longrope-attention": LongRoPEScaling(short_factor=[1.0] * 8, long_factor=[3.0] * 8, original_max_len=16,
                                          factor=4.0, attention_factor=1.5),
    "proportional": ProportionalScaling(fraction=0.5, factor=2.0),
    "yarn-untruncated": {"kind": "yarn", "factor": 4.0, "original_max_len": 16, "truncate": False,
                         "attention_factor": 0.9},
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCALED))
def test_every_scaling_is_written_as_a_config_json_that_reads_the_same(name):
    """config_to_hf then config_from_hf (llama's converter checks it itself: `confirmed`), and
    transformers' LlamaConfig accepts what is written."""
    conv = CONVERTERS.get("llama")
    cfg = al.presets.tiny(al.presets.get("llama2-7b")).merged(positional={"scaling": SCALED[name]})
    data = conv.config_to_hf(cfg)
    assert conv.config_from_hf(data).positional == cfg.positional
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**data)
    assert config.rope_parameters["rope_type"] == data["rope_parameters"]["rope_type"]


REFUSED = [  # (rope_parameters, what the message must name)
    (dict(rope_type="mrope"), "supported RoPE scalings: linear, dynamic, yarn, longrope, llama3, proportional"),
    (dict(rope_type="llama3", factor=8.0, high_freq_factor=4.0), "rope_parameters.low_freq_factor"),
    (dict(rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=2.0), "high_freq_factor"),
    (dict(rope_type="longrope", long_factor=[1.0]), "rope_parameters.short_factor"),
    (dict(rope_type="longrope", short_factor=[1.0], long_factor=[1.0, 2.0]), "rope_parameters.long_factor"),
    (dict(rope_type="yarn", factor=4.0, truncate="no"), "rope_parameters.truncate"),
    (dict(rope_type="linear"), "rope_parameters.factor"),
]  # fmt: skip


@pytest.mark.parametrize(("params", "field"), REFUSED)
def test_unreadable_rope_parameters_are_refused_by_name(params, field):
    with pytest.raises(ConversionError, match=re.escape(field)):
        CONVERTERS.get("llama").config_from_hf({"rope_parameters": params})


def test_proportional_with_a_partial_rope_has_no_transformers_form():
    cfg = al.presets.tiny(al.presets.get("llama2-7b")).merged(
        positional={"fraction": 0.5, "scaling": ProportionalScaling(fraction=0.5)}
    )
    with pytest.raises(ConversionError, match=re.escape("positional.fraction")):
        CONVERTERS.get("llama").config_to_hf(cfg)
