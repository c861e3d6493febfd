"""Gemma 2 and Gemma 3 (text) converters (src/attnlab/interop/gemma2.py) proven equal to
transformers, with tiny random-weight models built from configs (no downloads), fp32, eval mode:

- from_hf: logits within 1e-4 at the real tokens of a right-padded batch five times the sliding
  window long; Gemma 2 with both soft-caps and a query_pre_attn_scalar that is not head_dim,
  Gemma 3 with its per-layer-type RoPE (local base 10k, global 1M with linear scaling ×4) at 4×
  max_position_embeddings, its 5:1 pattern and qk-norm;
- to_hf(from_hf(m)) reproduces the state dict exactly and reads back to the same config;
- cached greedy generation (attnlab's cache, left padding) equals transformers' generate, past
  the window;
- the released config.json keys (Gemma 3's rope_theta / rope_local_base_freq / rope_scaling /
  sliding_window_pattern) and transformers' defaults read as transformers reads them;
- what the families cannot express is refused, naming the field.
"""

from __future__ import annotations

import re

import pytest
import torch

import attnlab as al
from attnlab.config import LayerSpec, RoPE
from attnlab.interop import CONVERTERS, ConversionError, from_hf, to_hf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf
transformers.logging.set_verbosity_error()

TOL = 1e-4
WINDOW = 8
_T = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          intermediate_size=96, vocab_size=128, sliding_window=WINDOW)  # fmt: skip
CASES = {
    "gemma2": ("gemma2", dict(_T, num_hidden_layers=4, attn_logit_softcapping=5.0,
                              final_logit_softcapping=3.0, query_pre_attn_scalar=24)),
    "gemma2-mqa-untied": ("gemma2", dict(_T, num_hidden_layers=3, num_key_value_heads=1,
                                         attention_bias=True, tie_word_embeddings=False,
                                         layer_types=["full_attention", "sliding_attention",
                                                      "sliding_attention"])),
    "gemma3": ("gemma3_text", dict(_T, num_hidden_layers=7, query_pre_attn_scalar=16,
                                   max_position_embeddings=16, rope_parameters={
                                       "sliding_attention": {"rope_type": "default",
                                                             "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                          "rope_theta": 1_000_000.0}})),
    # transformers' Gemma3Attention ignores attn_logit_softcapping: the converter must too
    "gemma3-softcap-same-rope": ("gemma3_text", dict(_T, num_hidden_layers=3,
                                                     attn_logit_softcapping=4.0,
                                                     final_logit_softcapping=6.0,
                                                     rope_local_base_freq=1_000_000.0,
                                                     sliding_window_pattern=3)),
}  # fmt: skip
_BUILT: dict[str, torch.nn.Module] = {}


def hf_model(case: str) -> torch.nn.Module:
    """The case's transformers model, every parameter random and far from its init."""
    if case not in _BUILT:
        model_type, kwargs = CASES[case]
        config = transformers.AutoConfig.for_model(model_type, **kwargs, pad_token_id=0)
        torch.manual_seed(0)
        # eager: the written-out formula, soft-capped where the family caps (Gemma 2)
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        g = torch.Generator().manual_seed(list(CASES).index(case))
        with torch.no_grad():  # peaked logits (no near-ties for greedy), norm weights off 0
            for p in hf.parameters():
                noise = torch.randn(p.shape, generator=g)
                p.add_(noise * 0.2) if p.dim() == 1 else p.copy_(noise * 0.3)
        _BUILT[case] = hf.eval()
    return _BUILT[case]


@pytest.mark.parametrize("case", CASES)
def test_from_hf_matches_transformers_past_the_window_on_a_padded_batch(case):
    hf = hf_model(case)
    n = 5 * WINDOW if case != "gemma3" else 4 * 16  # Gemma 3: 4x max_position_embeddings
    ids = torch.randint(1, 128, (3, n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, n - 9 :], mask[2, n // 3 :] = 0, 0  # right padding (positions from 0 in both)
    real = mask.bool()
    ours = from_hf(hf).eval()
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    assert theirs[real].abs().amax() > 1.0  # logits far from zero: 1e-4 means something
    assert (got - theirs)[real].abs().max().item() < TOL


def test_the_cases_exercise_what_they_claim():
    """Gemma 2: sandwich norms, both soft-caps, an explicit scale, sliding / full layers;
    Gemma 3: qk-norm, the local RoPE on the 5 sliding layers of 6, the global one scaled."""
    cfg2 = CONVERTERS.get("gemma2").config_from_hf(hf_model("gemma2").config.to_dict())
    assert cfg2.norm_placement == "sandwich" and cfg2.final_logit_softcap == 3.0
    assert cfg2.attention.softcap == 5.0 and cfg2.attention.scale == 24**-0.5
    assert cfg2.layer_pattern == (LayerSpec(sliding_window=WINDOW), LayerSpec())
    cfg3 = CONVERTERS.get("gemma3_text").config_from_hf(hf_model("gemma3").config.to_dict())
    assert cfg3.attention.qk_norm and cfg3.attention.softcap is None
    local = RoPE(base=10000.0)
    assert cfg3.layer_pattern == (*[LayerSpec(sliding_window=WINDOW, positional=local)] * 5,
                                  LayerSpec())  # fmt: skip
    assert cfg3.positional.base == 1e6 and cfg3.positional.scaling.factor == 4.0
    same = CONVERTERS.get("gemma3_text").config_from_hf(
        hf_model("gemma3-softcap-same-rope").config.to_dict()
    )
    assert same.layer_pattern == (LayerSpec(sliding_window=WINDOW),) * 2 + (LayerSpec(),)
    assert same.attention.softcap is None and same.final_logit_softcap == 6.0


@pytest.mark.parametrize("case", CASES)
def test_to_hf_reproduces_the_transformers_model(case):
    hf = hf_model(case)
    conv = CONVERTERS.get(hf.config.model_type)
    ours = from_hf(hf)
    back = to_hf(ours)
    assert type(back) is type(hf)
    a, b = hf.state_dict(), back.state_dict()
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert conv.config_from_hf(back.config.to_dict()) == conv.config_from_hf(hf.config.to_dict())


@pytest.mark.parametrize("case", ["gemma2", "gemma3", "gemma3-softcap-same-rope"])
def test_cached_greedy_generation_equals_transformers(case):
    hf = hf_model(case)
    ours = from_hf(hf).eval()
    pad = 0
    rows = [
        torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 5, 2)
    ]
    ids = torch.full((3, 9), pad)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for i, r in enumerate(rows):  # left padding: generation's layout
        ids[i, 9 - len(r) :], mask[i, 9 - len(r) :] = r, 1
    kw = dict(attention_mask=mask, pad_token_id=pad, eos_token_id=None)
    want = hf.generate(ids, do_sample=False, max_new_tokens=3 * WINDOW, **kw)
    got = al.generate(ours, ids, 3 * WINDOW, **kw)
    assert got.tolist() == want.tolist()
    assert len({tuple(r) for r in got[:, 9:].tolist()}) > 1  # rows differ: not one stuck token


# --- config.json ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_defaults_match_transformers(model_type):
    """A config.json with sizes only reads as transformers' config class fills it in."""
    sizes = dict(model_type=model_type, num_hidden_layers=8)
    conv = CONVERTERS.get(model_type)
    theirs = transformers.AutoConfig.for_model(**sizes).to_dict()
    assert conv.config_from_hf(sizes) == conv.config_from_hf(theirs)


def test_released_gemma3_config_keys_read_like_transformers():
    """gemma-3-4b's style: rope_theta, rope_local_base_freq, rope_scaling (global layers only),
    sliding_window_pattern instead of layer_types."""
    old = dict(model_type="gemma3_text", num_hidden_layers=8, rope_theta=500000.0,
               rope_local_base_freq=20000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window_pattern=4, sliding_window=64)  # fmt: skip
    conv = CONVERTERS.get("gemma3_text")
    ours = conv.config_from_hf(old)
    theirs = conv.config_from_hf(transformers.AutoConfig.for_model(**old).to_dict())
    assert ours == theirs
    assert ours.positional == RoPE(base=500000.0, scaling={"kind": "linear", "factor": 8.0})
    assert ours.layer_pattern[0].positional == RoPE(base=20000.0)
    assert [s.sliding_window for s in ours.layer_pattern] == [64, 64, 64, None]


@pytest.mark.parametrize(
    ("model_type", "data", "field"),
    [
        ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        ("gemma2", dict(num_hidden_layers=2, layer_types=["full_attention"]), "layer_types"),
        ("gemma2", dict(sliding_window=None), "sliding_window"),
        ("gemma3_text", dict(rope_parameters={"rope_type": "default"}), "rope_parameters"),
        ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "nope"}}),
         "full_attention: rope_parameters.rope_type"),
    ],
)  # fmt: skip
def test_unmodelled_features_are_refused(model_type, data, field):
    with pytest.raises(ConversionError, match=field):
        CONVERTERS.get(model_type).config_from_hf(dict(model_type=model_type, **data))


def test_config_to_hf_refuses_what_the_family_cannot_express():
    conv2 = CONVERTERS.get("gemma2")
    cfg = conv2.config_from_hf(hf_model("gemma2").config.to_dict())
    local = (LayerSpec(sliding_window=WINDOW, positional=RoPE(base=10.0)), LayerSpec())
    bad = {
        "attention.scale": cfg.replace(attention=cfg.attention.merged(scale=0.3)),
        "layer_pattern.positional": cfg.replace(layer_pattern=local),
        "norm_placement": cfg.replace(norm_placement="pre"),
        "attention.qk_norm": cfg.replace(attention=cfg.attention.merged(qk_norm=True)),
        "layer_pattern": cfg.replace(
            layer_pattern=(LayerSpec(sliding_window=4), LayerSpec(sliding_window=8))
        ),
    }
    for field, wrong in bad.items():
        with pytest.raises(ConversionError, match=field):
            conv2.config_to_hf(wrong)
    conv3 = CONVERTERS.get("gemma3_text")
    cfg3 = conv3.config_from_hf(hf_model("gemma3").config.to_dict())
    global_own = (LayerSpec(positional=RoPE(base=10.0)),)
    with pytest.raises(ConversionError, match=re.escape("layer_pattern.0.positional")):
        conv3.config_to_hf(cfg3.replace(layer_pattern=global_own))
    for field, change in (
        ("attention.qk_norm", dict(qk_norm=False)),
        ("attention.softcap", dict(softcap=50.0)),
    ):
        with pytest.raises(ConversionError, match=field):
            conv3.config_to_hf(cfg3.replace(attention=cfg3.attention.merged(**change)))


def test_a_uniform_window_writes_every_layer_sliding():
    """attention.sliding_window instead of a pattern: every layer slides, and it reads back as
    the one-entry pattern (one spelling of the architecture per direction)."""
    conv = CONVERTERS.get("gemma2")
    cfg = conv.config_from_hf(hf_model("gemma2").config.to_dict())
    uniform = cfg.replace(layer_pattern=None, attention=cfg.attention.merged(sliding_window=8))
    with pytest.raises(ConversionError, match="layer_pattern"):  # read back as a pattern
        conv.config_to_hf(uniform)
    one = cfg.replace(layer_pattern=(LayerSpec(sliding_window=8),))
    assert conv.config_to_hf(one)["layer_types"] == ["sliding_attention"] * 4
