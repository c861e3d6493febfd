"""Llama 3.x (rope_type llama3), Phi-3 / Phi-4-mini (phi3: fused qkv_proj and gate_up_proj,
longrope, partial rotary, sliding window) and SmolLM3 (NoPE layers) proven equal to
`transformers`, past the original context.

The references are tiny random-weight transformers models built from configs (no downloads),
fp32, eval mode, every parameter randomised (tests/helpers/parity.py's `randomise`).
Checked through the functions users call:

- from_hf(hf): logits and last hidden state within 1e-4 at the real tokens of a right-padded
  batch whose full row runs to 8x the original length for llama3 with factor 8 (4x for longrope,
  llama3 with factor 32 and the rest): the long-context regime where a wrong scaling shows;
- to_hf(from_hf(hf)) reproduces the transformers state dict exactly;
- tiny(preset) -> to_hf gives equal outputs (llama3.2-1b, llama3.1-8b, phi3-mini-4k, phi4-mini,
  smollm3-3b), so the presets are what the converters read;
- cached greedy decoding through attnlab's cache equals transformers' `generate` on a
  left-padded batch, with a longrope generation whose positions cross
  original_max_position_embeddings: both switch to the long factors for the new tokens only
  (the keys already cached keep their short-factor rotation), which is why, past that point,
  cached decoding and recomputing the whole sequence differ for longrope (checked too, with
  equality below the threshold);
- config defaults as transformers fills them, and refusals naming the key.
"""

from __future__ import annotations

import re

import pytest
import torch

import attnlab as al
from attnlab.config import LayerSpec, NoPositions
from attnlab.interop import CONVERTERS, ConversionError, from_hf, to_hf
from helpers.parity import max_diffs, randomise, state_dicts_equal

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf
transformers.logging.set_verbosity_error()

TOL = 1e-4
_L = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=96, vocab_size=128)  # fmt: skip
_LLAMA3 = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, rope_theta=500.0)
SHORT6, LONG6 = [1.0, 1.1, 1.25, 1.4, 1.6, 1.8], [1.0, 1.5, 2.5, 4.0, 6.0, 8.0]
SHORT8, LONG8 = [1.0 + 0.1 * i for i in range(8)], [1.0 + i for i in range(8)]
# case -> (model_type, transformers config kwargs, length of the full row)
CASES = {
    "llama3.1": ("llama", dict(_L, max_position_embeddings=256, rope_parameters=dict(
        _LLAMA3, factor=8.0, original_max_position_embeddings=32)), 256),
    "llama3.2-tied-head-dim": ("llama", dict(_L, head_dim=32, tie_word_embeddings=True,
        max_position_embeddings=512, rope_parameters=dict(
            _LLAMA3, factor=32.0, original_max_position_embeddings=16)), 64),
    "phi4-mini-like": ("phi3", dict(_L, partial_rotary_factor=0.75, tie_word_embeddings=True,
        max_position_embeddings=64, original_max_position_embeddings=16, rope_parameters=dict(
            rope_type="longrope", short_factor=SHORT6, long_factor=LONG6)), 64),
    "phi3-128k-like-old-keys": ("phi3", dict(_L, num_key_value_heads=4,
        max_position_embeddings=64, original_max_position_embeddings=16, rope_scaling=dict(
            type="longrope", short_factor=SHORT8, long_factor=LONG8)), 64),
    "phi3-mini-4k-like": ("phi3", dict(_L, num_key_value_heads=4, sliding_window=8,
        max_position_embeddings=16, original_max_position_embeddings=16), 48),
    "smollm3": ("smollm3", dict(_L, num_hidden_layers=4, rope_parameters=dict(
        rope_type="default", rope_theta=100.0)), 48),
    "smollm3-window-yarn-untied": ("smollm3", dict(_L, num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0],
        use_sliding_window=True, sliding_window=8, tie_word_embeddings=False,
        max_position_embeddings=64, rope_parameters=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=100.0)), 64),
}  # fmt: skip
_BUILT: dict[str, torch.nn.Module] = {}


def hf_model(case: str) -> torch.nn.Module:
    if case not in _BUILT:
        model_type, kwargs, _ = CASES[case]
        config = transformers.AutoConfig.for_model(
            model_type, **kwargs, bos_token_id=0, eos_token_id=0, pad_token_id=None
        )
        model = transformers.AutoModelForCausalLM.from_config(config)
        _BUILT[case] = randomise(model, seed=list(CASES).index(case))
    return _BUILT[case]


def long_batch(vocab: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, length) ids, right padding: row 0 full (the pass's length), rows 1-2 a quarter and a
    half padded."""
    ids = torch.randint(0, vocab, (3, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 3 * length // 4 :], mask[2, length // 2 :] = 0, 0
    return ids, mask


# --- from_hf / to_hf ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_from_hf_matches_transformers_past_the_original_length(case):
    hf = hf_model(case)
    ours = from_hf(hf).eval()
    ids, mask = long_batch(hf.config.vocab_size, CASES[case][2])
    assert max(max_diffs(hf, ours, ids, mask)) < TOL


def test_the_long_cases_really_scale():
    """llama3's three bands all occur, longrope's long factors are in use at the tested length,
    SmolLM3's NoPE layers are the pattern's."""
    from attnlab.nn.positional.scaling import plain_inv_freq

    pos = from_hf(hf_model("llama3.1")).decoder.positional
    theta = plain_inv_freq(pos.rot_dim, pos.base).float()
    kept, divided = pos.inv_freq == theta, torch.isclose(pos.inv_freq, theta / 8, rtol=1e-6)
    assert kept.any() and divided.any() and (~kept & ~divided).any()
    pos = from_hf(hf_model("phi4-mini-like")).decoder.positional
    assert pos.rot_dim == 12 and pos.scaling.at_length(64, 12, pos.base) is not None
    cfg = CONVERTERS.get("smollm3").config_from_hf(hf_model("smollm3").config.to_dict())
    assert cfg.layer_pattern == (LayerSpec(),) * 3 + (LayerSpec(positional=NoPositions()),)


@pytest.mark.parametrize("case", CASES)
def test_to_hf_reproduces_the_transformers_state_dict(case):
    hf = hf_model(case)
    back = to_hf(from_hf(hf))
    assert type(back) is type(hf)
    state_dicts_equal(hf.state_dict(), back.state_dict())
    ids, mask = long_batch(hf.config.vocab_size, CASES[case][2])
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).logits
        assert torch.equal(back(ids, attention_mask=mask).logits, want)


PRESETS = {"llama3.2-1b": "llama", "llama3.1-8b": "llama", "phi3-mini-4k": "phi3",
           "phi4-mini": "phi3", "smollm3-3b": "smollm3"}  # fmt: skip


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_to_hf_matches(preset):
    """tiny(preset) -> to_hf: the config_to_hf direction, at the preset's own architecture, to
    4x its (test-size) original length where it scales RoPE (8x for llama3's factor 8)."""
    cfg = al.presets.tiny(al.presets.get(preset)).replace(dropout=0.0)
    if PRESETS[preset] == "phi3":  # Phi3Config knows no head_dim: heads of d_model / n_heads
        cfg = cfg.replace(d_model=cfg.n_heads * cfg.attn_head_dim, head_dim=None)
    model = randomise(al.build_model(cfg), seed=1)
    hf = to_hf(model, PRESETS[preset])
    s = cfg.positional.scaling
    length = 64 if s is None else s.original_max_len * (8 if s.kind == "llama3" else 4)
    ids, mask = long_batch(cfg.vocab_size, length)
    assert max(max_diffs(hf, model, ids, mask)) < TOL


# --- cached greedy generation -------------------------------------------------------------------


def _peaked(case: str) -> torch.nn.Module:
    """The case's model with larger weights: peaked logits, no near-ties for greedy."""
    model_type, kwargs, _ = CASES[case]
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


# transformers' Phi-3 generate reruns the sequence once it crosses the original length; so does
# al.generate (src/attnlab/decode/generate.py, at model.reprefill_after)
GENERATION = {  # case -> (prompt lengths, new tokens)
    "llama3.1": ((20, 13, 6), 16),
    "phi4-mini-like": ((12, 9, 4), 10),  # positions 0..21 cross the original 16
    "phi3-128k-like-old-keys": ((20, 5, 3), 6),  # a prompt already past it: long throughout
    "phi3-mini-4k-like": ((10, 7, 3), 8),  # past the window of 8
    "smollm3-window-yarn-untied": ((12, 9, 4), 10),
}


@pytest.mark.parametrize("case", list(GENERATION))
def test_cached_greedy_generation_equals_transformers(case):
    hf = _peaked(case)
    ours = from_hf(hf).eval()
    lengths, new = GENERATION[case]
    ids, mask = _left_padded(lengths, hf.config.vocab_size)
    kw = dict(attention_mask=mask, pad_token_id=1, eos_token_id=None)
    want = hf.generate(ids, do_sample=False, max_new_tokens=new, **kw)
    got = al.generate(ours, ids, new, **kw)
    assert got.tolist() == want.tolist()
    assert len({tuple(r) for r in got[:, ids.shape[1] :].tolist()}) > 1  # rows differ


@torch.no_grad()
def greedy_with_rerun(model, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding through attnlab's cache that reruns the whole sequence on a fresh cache
    when it grows past the scheme's `reprefill_after` from a cache filled below it."""
    after = model.decoder.positional.reprefill_after
    B, P = ids.shape
    cache = model.new_cache(B, P + n)
    logits = model(ids, attention_mask=mask, cache=cache).logits[:, -1]
    seq, filled = ids, P
    for i in range(n):
        token = logits.argmax(dim=-1)
        seq, mask = torch.cat((seq, token[:, None]), 1), torch.cat((mask, mask[:, -1:]), 1)
        if i + 1 == n:
            break
        if after is not None and filled <= after < seq.shape[1]:
            cache = model.new_cache(B, P + n)
            logits = model(seq, attention_mask=mask, cache=cache).logits[:, -1]
        else:
            logits = model(token[:, None], cache=cache).logits[:, -1]
        filled = seq.shape[1]
    return seq


def test_longrope_generation_rerun_equals_transformers():
    """transformers' Phi-3 generate reruns the sequence once it reaches
    original_max_position_embeddings + 1 tokens; attnlab's model decoding the same way (rerun at
    RotaryEmbedding.reprefill_after) gives its tokens, and decoding on through the cache would
    not (the keys cached before the switch keep their short-factor rotation); al.generate does
    that rerun."""
    hf = _peaked("phi4-mini-like")
    ours = from_hf(hf).eval()
    assert ours.decoder.positional.reprefill_after == 16
    lengths, new = GENERATION["phi4-mini-like"]
    ids, mask = _left_padded(lengths, hf.config.vocab_size)
    want = hf.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=new, pad_token_id=1,
        eos_token_id=None,
    )  # fmt: skip
    assert greedy_with_rerun(ours, ids, mask, new).tolist() == want.tolist()
    assert (
        al.generate(ours, ids, new, attention_mask=mask, pad_token_id=1, eos_token_id=None).tolist()
        == want.tolist()
    )


@torch.no_grad()
def test_longrope_cached_step_equals_transformers_model_on_a_cache():
    """One step across the threshold on a cache, both libraries' models called directly (no
    generate): the new token rotates with the long factors, the cached keys keep their short
    rotation, in both."""
    hf = _peaked("phi4-mini-like")
    ours = from_hf(hf).eval()
    ids = torch.randint(2, 128, (2, 17), generator=torch.Generator().manual_seed(3))
    theirs_cache = transformers.DynamicCache(config=hf.config)
    hf(ids[:, :16], cache=theirs_cache, use_cache=True)
    theirs = hf(ids[:, 16:], cache=theirs_cache, use_cache=True).logits[:, -1]
    cache = ours.new_cache(2, 17)
    ours(ids[:, :16], cache=cache)
    assert (ours(ids[:, 16:], cache=cache).logits[:, -1] - theirs).abs().max() < TOL
    assert (hf(ids).logits[:, -1] - theirs).abs().max() > 1e-2  # not the recomputed logits


@torch.no_grad()
def _cached_vs_recomputed(model, ids: torch.Tensor, n_new: int) -> float:
    """Feed ids token by token after a prefill of its first n - n_new tokens through the
    cache; the largest |difference| of the last step's logits against one pass over all."""
    prompt = ids[:, : ids.shape[1] - n_new]
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    model(prompt, cache=cache)
    for t in range(prompt.shape[1], ids.shape[1]):
        step = model(ids[:, t : t + 1], cache=cache).logits[:, -1]
    return (step - model(ids).logits[:, -1]).abs().max().item()


def test_longrope_cached_decoding_keeps_the_short_rotation_of_cached_keys():
    """As transformers: below original_max_position_embeddings (16) cached steps equal a
    recomputation; once a step reaches past it, the new token rotates with the long factors
    while the cached keys keep their short ones, so recomputing everything with the long
    factors gives other logits (the difference the generation test above shares with
    transformers)."""
    ours = from_hf(_peaked("phi4-mini-like")).eval()
    ids = torch.randint(2, 128, (2, 24), generator=torch.Generator().manual_seed(5))
    assert _cached_vs_recomputed(ours, ids[:, :16], 6) < TOL  # positions 0..15
    assert _cached_vs_recomputed(ours, ids, 10) > 1e-2  # a 14-token prefill, then to 23


# --- configs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["phi3", "smollm3"])
def test_defaults_match_transformers(model_type):
    full = transformers.AutoConfig.for_model(model_type).to_dict()
    conv = CONVERTERS.get(model_type)
    assert conv.config_from_hf({"model_type": model_type}) == conv.config_from_hf(full)


@pytest.mark.parametrize("case", CASES)
def test_partial_config_json_reads_like_transformers(case):
    model_type, kwargs, _ = CASES[case]
    conv = CONVERTERS.get(model_type)
    assert conv.config_from_hf(kwargs) == conv.config_from_hf(hf_model(case).config.to_dict())


def test_phi3_old_rope_type_names_and_its_own_original_length():
    """Phi3Config maps rope_type "yarn" to longrope, and its top-level
    original_max_position_embeddings wins over the one in rope_parameters."""
    rope = dict(short_factor=SHORT8, long_factor=LONG8, original_max_position_embeddings=70)
    data = dict(_L, num_key_value_heads=4, max_position_embeddings=64,
                original_max_position_embeddings=16, rope_scaling=dict(rope, type="yarn"))  # fmt: skip
    cfg = CONVERTERS.get("phi3").config_from_hf(data)
    s = cfg.positional.scaling
    theirs = transformers.Phi3Config(**data).rope_parameters
    assert s.kind == "longrope" and theirs["rope_type"] == "longrope"
    assert s.original_max_len == theirs["original_max_position_embeddings"] == 16


REFUSED = [  # (model_type, config.json, the field the message must name)
    ("phi3", dict(_L, rope_parameters=dict(rope_type="longrope", short_factor=[1.0] * 5,
                                            long_factor=[1.0] * 5)), "short_factor"),
    ("phi3", dict(_L, resid_pdrop=0.1, embd_pdrop=0.0), "embd_pdrop"),
    ("smollm3", dict(_L, layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    ("smollm3", dict(_L, no_rope_layers=[1, 0, 1]), "no_rope_layers"),
]  # fmt: skip


@pytest.mark.parametrize(("model_type", "data", "field"), REFUSED)
def test_unmodelled_features_are_refused(model_type, data, field):
    with pytest.raises(ConversionError, match=re.escape(field)):
        CONVERTERS.get(model_type).config_from_hf(data)


def test_config_to_hf_refuses_what_the_family_cannot_express():
    smol = al.presets.tiny(al.presets.get("smollm3-3b"))
    with pytest.raises(ConversionError, match=re.escape("layer_pattern")):
        CONVERTERS.get("llama").config_to_hf(smol)  # Llama has no NoPE layers
    alibi = smol.replace(
        layer_pattern=[{}, {"positional": {"kind": "alibi"}}], positional={"kind": "rope"}
    )
    with pytest.raises(ConversionError, match=re.escape("layer_pattern.1.positional.kind")):
        CONVERTERS.get("smollm3").config_to_hf(alibi)
    phi = al.presets.tiny(al.presets.get("phi3-mini-4k")).merged(attention={"qkv_bias": True})
    with pytest.raises(ConversionError, match=re.escape("attention.qkv_bias")):
        CONVERTERS.get("phi3").config_to_hf(phi)


# --- the model cards ----------------------------------------------------------------------------

_L3 = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
           original_max_position_embeddings=8192)  # fmt: skip
_COMMON = dict(attention_dropout=0.0, hidden_act="silu", rms_norm_eps=1e-5)
CARDS = {  # preset -> (model_type, the config.json keys of its Hub card that shape it)
    # huggingface.co/meta-llama/Llama-3.2-1B
    "llama3.2-1b": ("llama", dict(_COMMON, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=dict(_L3, factor=32.0),
        tie_word_embeddings=True, vocab_size=128256, bos_token_id=128000, eos_token_id=128001)),
    # huggingface.co/meta-llama/Llama-3.1-8B
    "llama3.1-8b": ("llama", dict(_COMMON, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=dict(_L3, factor=8.0),
        tie_word_embeddings=False, vocab_size=128256, bos_token_id=128000, eos_token_id=128001)),
    # huggingface.co/microsoft/Phi-3-mini-4k-instruct
    "phi3-mini-4k": ("phi3", dict(_COMMON, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=4096, original_max_position_embeddings=4096, rope_scaling=None,
        rope_theta=10000.0, sliding_window=2047, embd_pdrop=0.0, resid_pdrop=0.0,
        tie_word_embeddings=False, vocab_size=32064, bos_token_id=1, eos_token_id=32000,
        pad_token_id=32000)),
    # huggingface.co/microsoft/Phi-4-mini-instruct (its long_factor: presets/llama_variants.py)
    "phi4-mini": ("phi3", dict(_COMMON, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        partial_rotary_factor=0.75, rope_theta=10000.0, rope_scaling=dict(
            type="longrope", short_factor=[1.0] * 48, long_factor=None),
        sliding_window=262144, embd_pdrop=0.0, resid_pdrop=0.0, tie_word_embeddings=True,
        vocab_size=200064, bos_token_id=199999, eos_token_id=199999, pad_token_id=199999)),
    # huggingface.co/HuggingFaceTB/SmolLM3-3B
    "smollm3-3b": ("smollm3", dict(_COMMON, rms_norm_eps=1e-6, hidden_size=2048,
        intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=65536, rope_theta=5000000.0,
        rope_scaling=None, no_rope_layer_interval=4,
        no_rope_layers=[int((i + 1) % 4 != 0) for i in range(36)], use_sliding_window=False,
        sliding_window=None, tie_word_embeddings=True, vocab_size=128256, bos_token_id=None,
        eos_token_id=128012, pad_token_id=128004)),
}  # fmt: skip


@pytest.mark.parametrize("preset", CARDS)
def test_model_cards_read_as_the_presets(preset):
    """Each card's config.json through config_from_hf is the preset, but for Phi-4-mini's
    sliding_window of 262,144, which the converter keeps (transformers masks with it) and the
    preset drops (it exceeds the 131,072 positions, so it excludes no key there)."""
    from attnlab.interop.hf_config import _comparable
    from attnlab.presets.llama_variants import _PHI4_MINI_LONG

    model_type, data = CARDS[preset]
    if preset == "phi4-mini":
        data = dict(
            data, rope_scaling=dict(data["rope_scaling"], long_factor=list(_PHI4_MINI_LONG))
        )
    ours, want = (
        _comparable(CONVERTERS.get(model_type).config_from_hf(data)),
        _comparable(al.presets.get(preset)),
    )
    differ = {
        k: (ours.get(k), want.get(k)) for k in set(ours) | set(want) if ours.get(k) != want.get(k)
    }
    assert differ == ({"attention.sliding_window": (262144, None)} if preset == "phi4-mini" else {})
