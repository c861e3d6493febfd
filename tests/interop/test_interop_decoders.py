"""Decoder-only converters (gpt2, llama, qwen2, qwen3, gemma, mistral, mixtral, bloom, mpt,
gpt_neox, falcon) proven equal to `transformers`.

The references are tiny random-weight `transformers` models built from configs (no downloads),
fp32, eval mode, with every parameter randomised (LayerNorm weights and biases included, so a
swapped norm or a dropped bias shows). Checked through the functions users call:

- from_hf(hf): last hidden state (after the final norm) and logits within 1e-4 at the real tokens
  of a right-padded batch (transformers does not derive positions from the mask, so left padding
  would compare different things), and on an unpadded batch for the ALiBi families;
- to_hf(from_hf(hf)) reproduces the HF state dict exactly (same keys, torch.equal);
- save_pretrained -> load_pretrained equals, and the folder loads in transformers with the same
  outputs; a folder written by transformers' own save_pretrained (Hub layouts such as Mixtral's
  per-expert tensors) loads with load_pretrained, also with transformers unimportable;
- tiny(preset) -> to_hf(model, model_type) gives equal outputs (the config_to_hf direction);
- config_from_hf applies each family's defaults as transformers does (plain dicts, old keys);
- features attnlab does not model exactly, and unknown model types, raise ConversionError.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

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
from helpers.parity import max_diffs, randomise, state_dicts_equal

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf
transformers.logging.set_verbosity_error()

TOL = 1e-4
FAMILIES = ("gpt2", "llama", "qwen2", "qwen3", "gemma", "mistral", "mixtral", "bloom", "mpt",
            "gpt_neox", "falcon")  # fmt: skip
_L = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=96, vocab_size=128)  # fmt: skip
_N = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
# case -> (model_type, transformers config kwargs): every layout, bias and scaling variant
CASES = {
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32)),
    "gpt2-untied-unscaled": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32,
                                          n_inner=96, scale_attn_weights=False, tie_word_embeddings=False,
                                          activation_function="relu")),
    "llama-bias-tied": ("llama", dict(_L, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "llama-head-dim": ("llama", dict(_L, num_attention_heads=8, head_dim=16, rms_norm_eps=1e-5)),
    "llama-rope-linear": ("llama", dict(_L, rope_parameters=dict(rope_type="linear", factor=3.0, rope_theta=500.0))),
    "llama-rope-dynamic": ("llama", dict(_L, max_position_embeddings=6,
                                         rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=100.0))),
    "llama-rope-yarn": ("llama", dict(_L, rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=100.0,
                                                                original_max_position_embeddings=64))),
    "qwen2-window": ("qwen2", dict(_L, use_sliding_window=True, sliding_window=4, max_window_layers=0)),
    "qwen3-head-dim": ("qwen3", dict(_L, head_dim=24)),  # 24 != 64 / 4; qk-norm over 24 channels
    "qwen3-bias-tied-window": ("qwen3", dict(_L, attention_bias=True, tie_word_embeddings=True,
                                              use_sliding_window=True, sliding_window=4, max_window_layers=0)),
    "gemma-mqa-head-dim": ("gemma", dict(_L, num_key_value_heads=1, head_dim=32)),
    "gemma-legacy-gelu-untied": ("gemma", dict(_L, hidden_act="gelu", tie_word_embeddings=False,
                                                attention_bias=True)),
    "mistral-window": ("mistral", dict(_L, sliding_window=4)),
    "mixtral": ("mixtral", dict(_L, num_local_experts=4, num_experts_per_tok=2)),
    "bloom": ("bloom", dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=128)),
    "bloom-6-heads-untied": ("bloom", dict(hidden_size=72, n_layer=2, n_head=6, vocab_size=128,
                                           tie_word_embeddings=False)),
    "mpt": ("mpt", dict(d_model=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=32)),
    "mpt-6-heads-scale": ("mpt", dict(d_model=96, n_layers=2, n_heads=6, vocab_size=128, max_seq_len=32,
                                      attn_config=dict(softmax_scale=0.2))),
    "gpt_neox": ("gpt_neox", dict(_N, intermediate_size=96)),
    "gpt_neox-sequential-nobias": ("gpt_neox", dict(_N, intermediate_size=96, use_parallel_residual=False,
                                                    attention_bias=False, rope_parameters=dict(
                                                        rope_type="default", rope_theta=500.0,
                                                        partial_rotary_factor=0.5))),
    "falcon-mqa": ("falcon", dict(_N)),
    "falcon-mha-bias": ("falcon", dict(_N, multi_query=False, bias=True)),
    "falcon-sequential": ("falcon", dict(_N, parallel_attn=False, tie_word_embeddings=False)),
    "falcon-gqa-2-norms": ("falcon", dict(_N, new_decoder_architecture=True, num_kv_heads=2)),
    "falcon-gqa-1-norm": ("falcon", dict(_N, new_decoder_architecture=True, num_kv_heads=2,
                                         num_ln_in_parallel_attn=1, ffn_hidden_size=96)),
}  # fmt: skip
ALIBI_CASES = ("bloom", "bloom-6-heads-untied", "mpt", "mpt-6-heads-scale")
FOLDER_CASES = (
    "gpt2",
    "llama-bias-tied",
    "qwen2-window",
    "qwen3-head-dim",
    "gemma-mqa-head-dim",
    "mistral-window",
    "mixtral",
    "bloom-6-heads-untied",
    "mpt",
    "gpt_neox",
    "falcon-mqa",
    "falcon-gqa-2-norms",
)  # one or two per family: slower
PRESET_FAMILY = {
    "gpt2-small": "gpt2", "llama2-7b": "llama", "llama2-70b": "llama", "qwen2-7b": "qwen2",
    "qwen3-0.6b": "qwen3", "gemma-2b": "gemma", "mistral-7b": "mistral", "mixtral-8x7b": "mixtral", "bloom-560m": "bloom", "mpt-7b": "mpt",
    "gpt-neox-20b": "gpt_neox", "falcon-7b": "falcon",
}  # fmt: skip
_BUILT: dict[str, torch.nn.Module] = {}


def hf_model(case: str) -> torch.nn.Module:
    if case not in _BUILT:
        model_type, kwargs = CASES[case]
        config = transformers.AutoConfig.for_model(
            model_type, **kwargs, bos_token_id=0, eos_token_id=0
        )
        _BUILT[case] = randomise(
            transformers.AutoModelForCausalLM.from_config(config), seed=list(CASES).index(case)
        )
    return _BUILT[case]


def batch(vocab: int, padded: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(3, 12) ids; right padding of 0, 3 and 7 tokens (row 0 full: the dynamic-NTK length)."""
    ids = torch.randint(0, vocab, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:], mask[2, 5:] = 0, 0
    return ids, (mask if padded else None)


@torch.no_grad()
# --- from_hf / to_hf ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_from_hf_matches_transformers_on_padded_batch(case):
    hf = hf_model(case)
    ids, mask = batch(hf.config.vocab_size)
    assert max(max_diffs(hf, from_hf(hf).eval(), ids, mask)) < TOL


@pytest.mark.parametrize("case", ALIBI_CASES)
def test_alibi_families_match_without_a_mask(case):
    hf = hf_model(case)
    ids, _ = batch(hf.config.vocab_size)
    assert max(max_diffs(hf, from_hf(hf).eval(), ids, None)) < TOL


@pytest.mark.parametrize("case", CASES)
def test_to_hf_reproduces_the_transformers_state_dict(case):
    hf = hf_model(case)
    back = to_hf(from_hf(hf))
    assert type(back) is type(hf)
    state_dicts_equal(hf.state_dict(), back.state_dict())


@pytest.mark.parametrize("preset", PRESET_FAMILY)
def test_preset_to_hf_matches(preset):
    """tiny(preset) -> to_hf: the config_to_hf direction, at the preset's own architecture."""
    cfg = al.presets.tiny(al.presets.get(preset)).replace(dropout=0.0)
    model = randomise(al.build_model(cfg), seed=1)
    hf = to_hf(model, PRESET_FAMILY[preset])
    ids, mask = batch(cfg.vocab_size)
    assert max(max_diffs(hf, model, ids, mask)) < TOL


# --- checkpoint folders -------------------------------------------------------------------------


@pytest.mark.parametrize("case", FOLDER_CASES)
def test_checkpoint_folders_round_trip(case, tmp_path):
    hf = hf_model(case)
    ours = from_hf(hf).eval()
    save_pretrained(ours, tmp_path / "ours")
    loaded = load_pretrained(tmp_path / "ours")
    state_dicts_equal(ours.state_dict(), loaded.state_dict())
    ids, mask = batch(hf.config.vocab_size)
    assert max(max_diffs(hf, loaded, ids, mask)) < TOL
    # the folder is a transformers checkpoint too, and transformers' own folders load here
    hf_again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert max(max_diffs(hf_again, loaded, ids, mask)) < TOL
    hf.save_pretrained(tmp_path / "theirs")
    state_dicts_equal(ours.state_dict(), load_pretrained(tmp_path / "theirs").state_dict())


def test_load_pretrained_needs_no_transformers(tmp_path):
    """Folders written by transformers (Mixtral's Hub per-expert layout, GPT-NeoX, Falcon GQA)
    load in a process where `import transformers` fails, with the same weights."""
    cases = ("mixtral", "gpt_neox", "falcon-gqa-2-norms", "gpt2")
    for case in cases:
        hf_model(case).save_pretrained(tmp_path / case)
        torch.save(from_hf(hf_model(case)).state_dict(), tmp_path / f"{case}.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        sys.modules["transformers"] = None  # any import of it now raises ImportError
        from attnlab.interop import load_pretrained
        for case in {cases!r}:
            got = load_pretrained({str(tmp_path)!r} + "/" + case).state_dict()
            want = torch.load({str(tmp_path)!r} + "/" + case + ".pt")
            assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), case
        print("ok")
    """)
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.stdout.strip() == "ok", run.stderr[-2000:]


# --- configs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", FAMILIES)
def test_defaults_match_transformers(model_type):
    """A config.json with only model_type means transformers' defaults: reading it plainly gives
    the same attnlab config as reading what transformers fills in (every default checked)."""
    full = transformers.AutoConfig.for_model(model_type).to_dict()
    conv = CONVERTERS.get(model_type)
    assert conv.config_from_hf({"model_type": model_type}) == conv.config_from_hf(full)


@pytest.mark.parametrize("case", CASES)
def test_partial_config_json_reads_like_transformers(case):
    model_type, kwargs = CASES[case]
    conv = CONVERTERS.get(model_type)
    assert conv.config_from_hf(kwargs) == conv.config_from_hf(hf_model(case).config.to_dict())


@pytest.mark.parametrize(
    ("model_type", "old"),
    [
        ("llama", dict(rope_theta=5e5, rope_scaling=dict(type="linear", factor=2.0))),
        (
            "llama",
            dict(
                rope_theta=100.0,
                rope_scaling=dict(type="dynamic", factor=2.0),
                max_position_embeddings=64,
            ),
        ),
        (
            "mistral",
            dict(rope_theta=1e6, rope_scaling=dict(rope_type="yarn", factor=8.0, beta_fast=16)),
        ),
        ("gpt_neox", dict(rotary_pct=0.5, rotary_emb_base=500)),
        ("llama", dict(rope_theta=5e5, rope_parameters=dict(rope_type="default", rope_theta=1e4))),
        ("bloom", dict(n_embed=96, num_attention_heads=4)),
    ],
)
def test_older_config_keys_read_like_transformers(model_type, old):
    """Pre-transformers-5 keys (rope_theta/rope_scaling, rotary_pct, n_embed) mean what
    transformers makes of them, with its precedence (rope_parameters over rope_theta)."""
    conv = CONVERTERS.get(model_type)
    assert conv.config_from_hf(old) == conv.config_from_hf(
        transformers.AutoConfig.for_model(model_type, **old).to_dict()
    )


REFUSED = [  # (model_type, config.json, the field the message must name)
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ("gpt2", dict(activation_function="gelu_10"), "activation_function"),
    ("llama", dict(rope_parameters=dict(rope_type="llama3", factor=8.0)), "rope_type"),
    ("llama", dict(rope_parameters=dict(rope_type="longrope", factor=8.0)), "rope_type"),
    ("llama", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("qwen2", dict(num_hidden_layers=2, use_sliding_window=True, max_window_layers=1), "layer_types"),
    ("qwen3", dict(num_hidden_layers=2, use_sliding_window=True, max_window_layers=1), "layer_types"),
    ("gemma", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("bloom", dict(apply_residual_connection_post_layernorm=True), "apply_residual_connection_post_layernorm"),
    ("mpt", dict(attn_config=dict(clip_qkv=8.0)), "clip_qkv"),
    ("mpt", dict(attn_config=dict(qk_ln=True)), "qk_ln"),
    ("mpt", dict(attn_config=dict(alibi_bias_max=16)), "alibi_bias_max"),
    ("mpt", dict(attn_config=dict(alibi=False)), "alibi"),
    ("mpt", dict(no_bias=False), "no_bias"),
    ("mpt", dict(logit_scale="inv_sqrt_d_model"), "logit_scale"),
    ("falcon", dict(alibi=True), "alibi"),
    ("falcon", dict(new_decoder_architecture=True, parallel_attn=False), "parallel_attn"),
]  # fmt: skip


@pytest.mark.parametrize(("model_type", "data", "field"), REFUSED)
def test_unmodelled_features_are_refused(model_type, data, field):
    with pytest.raises(ConversionError, match=re.escape(field)):
        CONVERTERS.get(model_type).config_from_hf(data)


def test_every_refusal_is_reported_at_once():
    with pytest.raises(ConversionError) as err:
        CONVERTERS.get("mpt").config_from_hf(
            dict(no_bias=False, attn_config=dict(clip_qkv=6, qk_ln=True))
        )
    assert all(f in str(err.value) for f in ("no_bias", "clip_qkv", "qk_ln"))


@pytest.mark.parametrize(
    ("preset", "model_type", "fields"),
    [
        ("llama2-7b", "gpt2", ("positional.kind", "norm.kind", "ffn.kind")),
        ("gpt2-small", "llama", ("positional.kind", "norm.kind", "ffn.kind")),
        ("mistral-7b", "llama", ("attention.sliding_window",)),
        ("llama2-70b", "mixtral", ("ffn.kind",)),
        ("falcon-7b", "bloom", ("kv_heads", "positional.kind")),
        ("gpt-neox-20b", "falcon", ("positional.fraction",)),
        ("bloom-560m", "mpt", ("norm.bias", "embedding_norm")),
        ("qwen2-7b", "qwen3", ("attention.qk_norm", "attention.o_bias")),
        ("qwen3-0.6b", "llama", ("attention.qk_norm",)),
        ("llama2-7b", "gemma", ("norm.kind", "scale_embeddings", "round_embed_scale")),
        ("gemma-2b", "llama", ("norm.kind", "scale_embeddings")),
    ],
)
def test_config_to_hf_refuses_what_the_family_cannot_express(preset, model_type, fields):
    with pytest.raises(ConversionError) as err:
        CONVERTERS.get(model_type).config_to_hf(al.presets.tiny(al.presets.get(preset)))
    assert all(f in str(err.value) for f in fields), str(err.value)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (
            dict(positional=dict(kind="rope", scaling=dict(kind="ntk", factor=2.0))),
            "positional.scaling.kind",
        ),
        (dict(positional=dict(kind="rope", layout="interleaved")), "positional.layout"),
    ],
)
def test_rope_without_a_transformers_form_is_refused(change, field):
    cfg = al.presets.tiny(al.presets.get("llama2-7b")).replace(**change)
    with pytest.raises(ConversionError, match=re.escape(field)):
        CONVERTERS.get("llama").config_to_hf(cfg)


def test_written_config_is_checked_by_reading_it_back():
    """The last guard of every config_to_hf: a config.json that reads back as another
    architecture (here a forgotten norm eps) is refused, naming the field."""
    from attnlab.interop.hf_config import confirmed

    conv = CONVERTERS.get("llama")
    cfg = al.presets.tiny(al.presets.get("llama2-7b"))
    good = conv.config_to_hf(cfg)
    assert confirmed(conv, cfg, good) == good
    with pytest.raises(ConversionError, match=r"norm\.eps"):
        confirmed(conv, cfg, {**good, "rms_norm_eps": cfg.norm.eps * 10})


def test_unsupported_model_type_lists_the_supported_ones(tmp_path):
    model = al.build_model(al.presets.tiny(al.presets.get("llama2-7b")))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "opt"}))
    for call in (lambda: to_hf(model, "opt"), lambda: load_pretrained(tmp_path)):
        with pytest.raises(ConversionError, match="'opt' is not supported") as err:
            call()
        assert all(name in str(err.value) for name in FAMILIES)


def test_from_hf_keeps_the_eval_mode():
    hf = hf_model("gpt2")  # resid/attn dropout 0.1
    assert not from_hf(hf).training
