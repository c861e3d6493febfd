"""OLMo 2 (post-sublayer norms, qk-norm over the whole projection), Granite (embedding,
residual, attention and logits multipliers) and Cohere / Command R (parallel block with one
bias-free fp32 LayerNorm, interleaved rotary pairs, logit scale) proven equal to `transformers`.

The references are tiny random-weight transformers models built from configs (no downloads),
fp32, eval mode, every parameter randomised (tests/helpers/parity.py's `randomise`).
Checked through the functions users call:

- from_hf(hf): logits and last hidden state within 1e-4 at the real tokens of a right-padded
  batch whose full row runs to 4x max_position_embeddings (with a RoPE scaling in one case per
  family, whose original length it passes 4x);
- to_hf(from_hf(hf)) reproduces the transformers state dict exactly, and its logits;
- attnlab configs of each family -> to_hf give equal outputs (the config_to_hf direction), and
  checkpoint folders round-trip through save_pretrained / load_pretrained and transformers;
- cached greedy decoding through attnlab's cache equals transformers' `generate` on a
  left-padded batch;
- config defaults as transformers fills them, and refusals naming the key or field.
"""

from __future__ import annotations

import pytest
import torch

import attnlab as al
from attnlab.interop import (
    CONVERTERS,
    ConversionError,
    from_hf,
    load_pretrained,
    save_pretrained,
    to_hf,
)
from attnlab.interop.granite import divisor_of
from helpers.parity import max_diffs, randomise, state_dicts_equal

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf
transformers.logging.set_verbosity_error()

TOL = 1e-4
FAMILIES = ("olmo2", "granite", "cohere")
_L = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=96, vocab_size=128, max_position_embeddings=16)  # fmt: skip
_GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
                logits_scaling=8.0)  # granite-3.1-2b's multipliers  # fmt: skip
# case -> (model_type, transformers config kwargs); every full row runs to 64 tokens (4 x 16)
CASES = {
    "olmo2": ("olmo2", dict(_L)),
    "olmo2-mha-bias-yarn": ("olmo2", dict(_L, num_key_value_heads=4, attention_bias=True,
        rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=100.0,
                             original_max_position_embeddings=16))),
    "granite-tied": ("granite", dict(_L, **_GRANITE, tie_word_embeddings=True)),
    "granite-bias-odd-scaling-linear": ("granite", dict(_L, embedding_multiplier=3.0,
        residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=3.0, attention_bias=True,
        mlp_bias=True, rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=1000.0))),
    "cohere-tied": ("cohere", dict(_L, logit_scale=0.25)),
    "cohere-untied-bias-linear": ("cohere", dict(_L, logit_scale=0.5, tie_word_embeddings=False,
        attention_bias=True, layer_norm_eps=1e-3,
        rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=1000.0))),
}  # fmt: skip
LENGTH = 64
_BUILT: dict[str, torch.nn.Module] = {}


def hf_model(case: str) -> torch.nn.Module:
    if case not in _BUILT:
        model_type, kwargs = CASES[case]
        config = transformers.AutoConfig.for_model(
            model_type, **kwargs, bos_token_id=0, eos_token_id=0, pad_token_id=None
        )
        model = transformers.AutoModelForCausalLM.from_config(config)
        _BUILT[case] = randomise(model, seed=list(CASES).index(case))
    return _BUILT[case]


def long_batch(vocab: int, length: int = LENGTH) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, length) ids, right padding: row 0 full, rows 1-2 a quarter and a half padded."""
    ids = torch.randint(0, vocab, (3, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 3 * length // 4 :], mask[2, length // 2 :] = 0, 0
    return ids, mask


# --- from_hf / to_hf ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_from_hf_matches_transformers_on_a_long_padded_batch(case):
    hf = hf_model(case)
    ours = from_hf(hf).eval()
    ids, mask = long_batch(hf.config.vocab_size)
    assert max(max_diffs(hf, ours, ids, mask)) < TOL


def test_each_family_reads_as_its_components():
    """What makes each family differ from Llama arrives as the components named in the
    converters' docstrings (a converter reading Llama's layout would pass none of them)."""
    olmo = from_hf(hf_model("olmo2"))
    assert olmo.config.norm_placement == "post-sublayer"
    attn = olmo.decoder.blocks[0].self_attn
    assert attn.qk_norm_scope == "projection"
    assert attn.q_norm.weight.shape == (64,) and attn.k_norm.weight.shape == (32,)
    granite = from_hf(hf_model("granite-tied")).config
    assert (granite.embedding_multiplier, granite.residual_multiplier) == (12.0, 0.22)
    assert (granite.attention.scale, granite.logit_multiplier) == (0.0625, 0.125)
    cohere = from_hf(hf_model("cohere-tied")).config
    assert cohere.residual == "parallel-shared-norm" and cohere.positional.layout == "interleaved"
    assert (cohere.norm.bias, cohere.norm.upcast, cohere.logit_multiplier) == (False, True, 0.25)


@pytest.mark.parametrize("case", CASES)
def test_to_hf_reproduces_the_transformers_state_dict(case):
    hf = hf_model(case)
    back = to_hf(from_hf(hf))
    assert type(back) is type(hf)
    state_dicts_equal(hf.state_dict(), back.state_dict())
    ids, mask = long_batch(hf.config.vocab_size)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).logits
        assert torch.equal(back(ids, attention_mask=mask).logits, want)


def _config(family: str) -> al.ModelConfig:
    """A tiny attnlab config of the family, written directly (not read from transformers)."""
    base = dict(arch="decoder", vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                d_ff=96, positional={"kind": "rope", "base": 1000.0}, ffn={"kind": "glu"},
                norm={"kind": "rmsnorm", "eps": 1e-5}, tie_embeddings=False)  # fmt: skip
    family_fields = {
        "olmo2": dict(norm_placement="post-sublayer",
                      attention={"qk_norm": True, "qk_norm_scope": "projection"}),
        "granite": dict(embedding_multiplier=6.0, residual_multiplier=0.3, logit_multiplier=0.2,
                        attention={"scale": 0.05}, tie_embeddings=True),
        "cohere": dict(residual="parallel-shared-norm", logit_multiplier=0.5,
                       norm={"kind": "layernorm", "bias": False, "upcast": True},
                       positional={"kind": "rope", "base": 1000.0, "layout": "interleaved"}),
    }[family]  # fmt: skip
    return al.ModelConfig(**{**base, **family_fields})


@pytest.mark.parametrize("family", FAMILIES)
def test_attnlab_configs_to_hf_match(family):
    model = randomise(al.build_model(_config(family)), seed=3)
    hf = to_hf(model, family)
    ids, mask = long_batch(128)
    assert max(max_diffs(hf, model, ids, mask)) < TOL


@pytest.mark.parametrize("case", ["olmo2", "granite-tied", "cohere-untied-bias-linear"])
def test_checkpoint_folders_round_trip(case, tmp_path):
    hf = hf_model(case)
    ours = from_hf(hf).eval()
    save_pretrained(ours, tmp_path / "ours")
    loaded = load_pretrained(tmp_path / "ours")
    state_dicts_equal(ours.state_dict(), loaded.state_dict())
    ids, mask = long_batch(hf.config.vocab_size, 24)
    hf_again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert max(max_diffs(hf_again, loaded, ids, mask)) < TOL
    hf.save_pretrained(tmp_path / "theirs")
    state_dicts_equal(ours.state_dict(), load_pretrained(tmp_path / "theirs").state_dict())


# --- cached greedy generation -------------------------------------------------------------------


def _peaked(case: str) -> torch.nn.Module:
    """The case's model with larger weights: peaked logits, no near-ties for greedy."""
    model_type, kwargs = CASES[case]
    config = transformers.AutoConfig.for_model(
        model_type, **kwargs, bos_token_id=0, eos_token_id=0, pad_token_id=None
    )
    hf = transformers.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.add_(noise * 0.2) if p.dim() == 1 else p.copy_(noise * 0.3)
    return hf.eval()


def _left_padded(lengths: tuple[int, ...], vocab: int, pad: int = 1):
    T = max(lengths)
    ids, mask = torch.full((len(lengths), T), pad), torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        row = torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(n))
        ids[i, T - n :], mask[i, T - n :] = row, 1
    return ids, mask


@pytest.mark.parametrize("case", ["olmo2-mha-bias-yarn", "granite-tied", "cohere-tied"])
def test_cached_greedy_generation_equals_transformers(case):
    hf = _peaked(case)
    ours = from_hf(hf).eval()
    ids, mask = _left_padded((14, 9, 4), hf.config.vocab_size)
    kw = dict(attention_mask=mask, pad_token_id=1, eos_token_id=None)
    want = hf.generate(ids, do_sample=False, max_new_tokens=12, **kw)
    got = al.generate(ours, ids, 12, **kw)
    assert got.tolist() == want.tolist()
    assert len({tuple(r) for r in got[:, ids.shape[1] :].tolist()}) > 1  # rows differ


# --- configs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", FAMILIES)
def test_defaults_match_transformers(model_type):
    """A config.json with only model_type reads as what transformers fills in (CohereConfig's
    rope base 500,000, GraniteConfig's multipliers of 1.0, OLMo 2's eps 1e-5)."""
    full = transformers.AutoConfig.for_model(model_type).to_dict()
    conv = CONVERTERS.get(model_type)
    assert conv.config_from_hf({"model_type": model_type}) == conv.config_from_hf(full)


@pytest.mark.parametrize("case", CASES)
def test_partial_config_json_reads_like_transformers(case):
    model_type, kwargs = CASES[case]
    conv = CONVERTERS.get(model_type)
    ours = conv.config_from_hf(dict(kwargs, pad_token_id=None))  # hf_model sets no padding id
    assert ours == conv.config_from_hf(hf_model(case).config.to_dict())


def test_granite_scales_round_trip_bit_for_bit():
    """A scale of exactly 1/sqrt(head_dim) reads as attnlab's default; every multiplier's
    logits_scaling is the float whose reciprocal is it."""
    conv = CONVERTERS.get("granite")
    cfg = conv.config_from_hf(dict(_L, attention_multiplier=16**-0.5))
    assert cfg.attention.scale is None
    assert conv.config_to_hf(cfg)["attention_multiplier"] == 16**-0.5
    for m in (1 / 3, 0.1, 0.7, 1 / 49, 0.125):
        assert 1.0 / divisor_of(m) == m
    odd = _config("granite").replace(logit_multiplier=0.1)
    assert conv.config_from_hf(conv.config_to_hf(odd)).logit_multiplier == 0.1


@pytest.mark.parametrize(
    ("model_type", "data", "key"),
    [
        ("cohere", dict(use_qk_norm=True), "use_qk_norm"),
        ("cohere", dict(logit_scale=None), "logit_scale"),
        ("cohere", dict(hidden_act="tanh"), "hidden_act"),
        ("granite", dict(logits_scaling=0.0), "logits_scaling"),
        ("granite", dict(attention_multiplier=-1.0), "attention_multiplier"),
        (
            "olmo2",
            dict(rope_parameters=dict(rope_type="default", partial_rotary_factor=0.5)),
            "partial_rotary_factor",
        ),
    ],
)
def test_unmodelled_features_are_refused(model_type, data, key):
    with pytest.raises(ConversionError, match=key):
        CONVERTERS.get(model_type).config_from_hf(data)


@pytest.mark.parametrize(
    ("family", "change", "field"),
    [
        ("olmo2", dict(attention={"qk_norm_scope": "head"}), "attention.qk_norm_scope"),
        ("olmo2", dict(norm_placement="pre"), "norm_placement"),
        ("olmo2", dict(final_logit_softcap=30.0), "final_logit_softcap"),
        ("granite", dict(final_logit_softcap=30.0), "final_logit_softcap"),
        ("granite", dict(norm_placement="sandwich"), "norm_placement"),
        ("cohere", dict(positional={"layout": "half"}), "positional.layout"),
        ("cohere", dict(norm={"upcast": False}), "norm.upcast"),
        ("cohere", dict(residual="parallel"), "residual"),
        ("cohere", dict(residual_multiplier=0.5), "residual_multiplier"),
    ],
)
def test_config_to_hf_refuses_what_the_family_cannot_express(family, change, field):
    cfg = _config(family).merged(**change)
    with pytest.raises(ConversionError, match=field.replace(".", r"\.")):
        CONVERTERS.get(family).config_to_hf(cfg)


def test_upcast_layernorm_is_coheres_in_bf16():
    """`upcast` computes a bf16 LayerNorm in fp32 and rounds once, as CohereLayerNorm does:
    equal to it up to one bf16 rounding of values that agree to fp32 rounding; fp32 inputs take
    the very same path with and without it."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    from attnlab.nn.norms import LayerNorm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * 3 + 1
    theirs = CohereLayerNorm(256, eps=1e-5)
    ours = LayerNorm(dim=256, bias=False, upcast=True)
    with torch.no_grad():
        theirs.weight.copy_(1 + 0.1 * torch.randn(256, generator=g))
        ours.weight.copy_(theirs.weight)
        theirs.bfloat16(), ours.bfloat16()
        got, want = ours(x.bfloat16()), theirs(x.bfloat16())
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-8, atol=0)
        assert (got == want).float().mean() > 0.99
        plain = LayerNorm(dim=256, bias=False).float()
        plain.weight.copy_(ours.weight.float())
        assert torch.equal(plain(x), ours.float()(x))
