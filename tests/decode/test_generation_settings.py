"""A model's own generation settings (attnlab.decode.settings) and the logits rules they switch on
(attnlab.decode.processors), against `transformers`.

- Each rule equals transformers' own logits processor on the same scores and sequences.
- `al.generate(from_hf(m), ...)` equals `m.generate(...)` token for token, greedy and beam, with
  nothing passed but the length and the mask: a default `BartConfig` (forced EOS on, decoder start
  = EOS), a T5 and a GPT-2, tiny and random. Then each rule set in the checkpoint's generation
  config, alone and together, in a whole generate call on a decoder-only and an encoder-decoder
  model; a guard shows that each rule changed the tokens (so the comparison is not vacuous).
- The settings travel: from_hf / to_hf, load_pretrained / save_pretrained (generation_config.json
  or, for old checkpoints, config.json), and explicit keywords override them.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

import attnlab as al
from attnlab.decode import processors as P
from attnlab.decode.settings import GenerationSettings, resolve

try:
    import transformers
except ImportError:  # the tests that compare with it are skipped; the others run
    transformers = None
needs_hf = pytest.mark.skipif(transformers is None, reason="needs transformers (the hf extra)")
logging.getLogger("transformers").setLevel(logging.ERROR)  # length / padding advice

V = 40
N = 8  # new tokens
PAD = 1  # BART's pad id; also used to pad GPT-2 prompts (masked)


# --- the settings record ----------------------------------------------------------------------


def test_unknown_setting_is_refused_with_a_did_you_mean():
    with pytest.raises(ValueError, match=r"num_beam: unknown field.*Did you mean 'num_beams'"):
        GenerationSettings(num_beam=4)
    with pytest.raises(ValueError, match="repetition_penalty"):
        GenerationSettings(repetition_penalty=0.0)
    with pytest.raises(ValueError, match="early_stopping"):
        GenerationSettings(early_stopping="sometimes")


def test_hf_dict_round_trip_keeps_set_fields_only():
    hf = {"eos_token_id": [2, 3], "num_beams": 4, "temperature": 0.7, "suppress_tokens": [5]}
    s = GenerationSettings.from_hf(hf)
    assert s.eos_token_id == (2, 3) and s.suppress_tokens == (5,) and s.num_beams == 4
    assert s.to_hf() == {"eos_token_id": [2, 3], "num_beams": 4, "suppress_tokens": [5]}
    assert repr(GenerationSettings(eos_token_id=2)) == "GenerationSettings(eos_token_id=2)"


def test_a_checkpoints_invalid_value_is_dropped_with_a_warning():
    with pytest.warns(UserWarning, match="pad_token_id=-1"):
        s = GenerationSettings.from_hf({"pad_token_id": -1, "eos_token_id": 2})
    assert s == GenerationSettings(eos_token_id=2)


def test_lengths_count_as_transformers_counts_them():
    assert GenerationSettings().new_tokens(5) == 50  # attnlab's default
    assert GenerationSettings(max_length=20).new_tokens(5) == 15  # the prompt counts
    assert GenerationSettings(max_length=20, max_new_tokens=3).new_tokens(5) == 3  # wins
    with pytest.raises(ValueError, match=r"max_length \(5\) leaves no room"):
        GenerationSettings(max_length=5).new_tokens(5)


def test_explicit_keywords_override_the_models_none_included():
    model = torch.nn.Linear(1, 1)
    model.generation = GenerationSettings(eos_token_id=2, forced_eos_token_id=2)
    s = resolve(model, forced_eos_token_id=None, pad_token_id=0)
    assert s == GenerationSettings(eos_token_id=2, pad_token_id=0)
    model.generation = {"eos_token_id": 2}
    with pytest.raises(TypeError, match="GenerationSettings or None"):
        resolve(model)


# --- each rule == transformers' logits processor ---------------------------------------------


def _scores_and_seq(seed: int, R: int = 6, L: int = 7):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(R, 20, generator=g, dtype=torch.float64) * 3
    seq = torch.randint(0, 6, (R, L), generator=g)  # few distinct tokens: rules bite
    return scores, seq


def _cases():
    lp = transformers.generation.logits_process
    skip = torch.tensor([0, 2, 1, 0, 3, 0])
    return {
        "repetition": (P.RepetitionPenalty(1.7), lp.RepetitionPenaltyLogitsProcessor(1.7), 7),
        "repetition-below-1": (
            P.RepetitionPenalty(0.6),
            lp.RepetitionPenaltyLogitsProcessor(0.6),
            7,
        ),
        "repetition-skip-padding": (
            P.RepetitionPenalty(1.7, skip),
            lp.RepetitionPenaltyLogitsProcessor(1.7, prompt_ignore_length=skip),
            7,
        ),
        "no-repeat-1": (P.NoRepeatNGram(1), lp.NoRepeatNGramLogitsProcessor(1), 7),
        "no-repeat-2": (P.NoRepeatNGram(2), lp.NoRepeatNGramLogitsProcessor(2), 7),
        "no-repeat-3": (P.NoRepeatNGram(3), lp.NoRepeatNGramLogitsProcessor(3), 12),
        "min-length": (P.MinLength(8, (2, 3)), lp.MinLengthLogitsProcessor(8, [2, 3]), 7),
        "min-new-tokens": (
            P.MinNewTokens(4, 4, (2,)),
            lp.MinNewTokensLengthLogitsProcessor(4, 4, 2),
            7,
        ),
        "forced-bos": (P.ForcedBOS(4), lp.ForcedBOSTokenLogitsProcessor(4), 1),
        "forced-eos": (P.ForcedEOS(8, (2,)), lp.ForcedEOSTokenLogitsProcessor(8, 2), 7),
        "forced-eos-list": (
            P.ForcedEOS(8, (2, 5)),
            lp.ForcedEOSTokenLogitsProcessor(8, [2, 5]),
            7,
        ),
        "suppress": (P.Suppress((1, 4, 9)), lp.SuppressTokensLogitsProcessor([1, 4, 9]), 7),
        "suppress-at-begin": (
            P.SuppressAtBegin((1, 4), 7),
            lp.SuppressTokensAtBeginLogitsProcessor([1, 4], 7),
            7,
        ),
    }


@pytest.mark.hf
@needs_hf
@pytest.mark.parametrize(
    "name",
    [
        "repetition",
        "repetition-below-1",
        "repetition-skip-padding",
        "no-repeat-1",
        "no-repeat-2",
        "no-repeat-3",
        "min-length",
        "min-new-tokens",
        "forced-bos",
        "forced-eos",
        "forced-eos-list",
        "suppress",
        "suppress-at-begin",
    ],
)
def test_rule_equals_transformers_processor(name):
    ours, theirs, L = _cases()[name]
    for seed in range(3):
        scores, seq = _scores_and_seq(seed, L=L)
        got = ours(seq, scores.clone())
        want = theirs(seq, scores.clone())
        assert torch.equal(got, want)
        assert not torch.equal(got, scores)  # the rule applies at this length
        # one token longer (or shorter): the length-triggered rules stay off, as theirs
        longer = torch.cat((seq, seq[:, :1]), dim=1)
        assert torch.equal(ours(longer, scores.clone()), theirs(longer, scores.clone()))


# --- whole generate calls == transformers' generate -----------------------------------------


def _hf(family: str, std: float = 0.2, seed: int = 0, **config):
    """A tiny random-weight transformers model; 2-D weights redrawn with std `std` so that the
    logits are far from uniform (HF's 0.02 leaves candidates within float noise of each other)."""
    torch.manual_seed(seed)
    if family == "bart":  # BartConfig's defaults otherwise: forced EOS, decoder start = EOS
        cfg = transformers.BartConfig(
            vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=64, **config,
        )  # fmt: skip
        hf = transformers.BartForConditionalGeneration(cfg)
    elif family == "t5":  # T5 checkpoints start the decoder with the pad id, 0
        cfg = transformers.T5Config(
            vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16,
            decoder_start_token_id=0, **config,
        )  # fmt: skip
        hf = transformers.T5ForConditionalGeneration(cfg)
    else:
        cfg = transformers.GPT2Config(
            vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4,
            bos_token_id=3, eos_token_id=3, **config,
        )  # fmt: skip
        hf = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
    return hf.eval()


def _batch(family: str, seed: int = 3):
    """Three prompts of lengths 6, 4, 3: right-padded sources (encoder-decoder), left-padded
    prompts (decoder-only)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(4, V, (n,), generator=g) for n in (6, 4, 3)]
    ids = torch.full((3, 6), PAD)
    mask = torch.zeros(3, 6, dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(0, len(r)) if family != "gpt2" else slice(6 - len(r), 6)
        ids[i, sl], mask[i, sl] = r, 1
    return ids, mask


def _both(hf, ids, mask, **kw):
    """(attnlab's tokens, transformers' tokens), each library reading the model's settings."""
    got = al.generate(al.interop.from_hf(hf), ids, N, attention_mask=mask, **kw)
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=N, **kw)
    return got.tolist(), want.tolist()


@pytest.mark.hf
@needs_hf
@pytest.mark.parametrize("family", ["bart", "t5", "gpt2"])
@pytest.mark.parametrize("beams", [1, 4])
def test_default_settings_decode_as_transformers(family, beams):
    hf = _hf(family)
    ids, mask = _batch(family)
    kw = {"num_beams": beams, "num_return_sequences": 2} if beams > 1 else {}
    got, want = _both(hf, ids, mask, **kw)
    assert got == want
    if family == "bart":  # what used to need passing by hand: the start token, forced EOS
        assert all(row[0] == 2 and row[-1] == 2 for row in got)
        model = al.interop.from_hf(hf)
        without = al.generate(model, ids, N, attention_mask=mask, forced_eos_token_id=None, **kw)
        assert without.tolist() != got  # forced EOS changed the result


@pytest.mark.hf
@needs_hf
def test_finished_rows_fill_with_the_first_eos_without_a_pad_id():
    """GPT-2 has no pad id: transformers fills a finished row with its (first) EOS."""
    hf = _hf("gpt2", std=0.5, seed=1)
    ids, mask = _batch("gpt2")
    plain = al.generate(al.interop.from_hf(hf), ids, N, attention_mask=mask)[:, 6:]
    eos = int(plain[0, 1])
    hf.generation_config.update(eos_token_id=[eos, 3])
    got, want = _both(hf, ids, mask)
    assert got == want
    rows = [row[6:] for row in got]
    early = [r for r in rows if eos in r[:-1]]  # ended before the last step, others went on
    assert early and all(r[r.index(eos) :] == [eos] * (len(r) - r.index(eos)) for r in early)


@pytest.mark.hf
@needs_hf
def test_default_bart_beam_settings_from_the_checkpoint():
    """num_beams / length_penalty / early_stopping / no_repeat_ngram_size of a summarisation
    checkpoint (bart-large-cnn's generation config) are the defaults: no keyword at all."""
    hf = _hf("bart", std=0.5)
    hf.generation_config.update(
        num_beams=4, length_penalty=2.0, early_stopping=True, no_repeat_ngram_size=3,
        min_length=3, max_length=9,
    )  # fmt: skip
    ids, mask = _batch("bart")
    model = al.interop.from_hf(hf)
    got = al.generate(model, ids, attention_mask=mask)
    assert got.tolist() == hf.generate(ids, attention_mask=mask).tolist()
    assert got.tolist() != al.generate(model, ids, attention_mask=mask, num_beams=1).tolist()


def _rules(new: torch.Tensor, P_len: int) -> dict[str, tuple[dict, str]]:
    """Per rule: the settings to give the checkpoint, and the key the guard removes to show the
    rule mattered. `new` (B, N): the tokens generated without rules; P_len: prompt length."""
    first = sorted(set(new[:, 0].tolist()))
    early = int(new[0, 1])  # made EOS: a row ends early unless a minimum length holds it
    fresh = next(t for t in range(4, V) if t not in new[:, -1].tolist() and t not in first)
    together = {
        "repetition_penalty": 1.3, "no_repeat_ngram_size": 3, "min_new_tokens": 2,
        "eos_token_id": [early, fresh], "forced_eos_token_id": [fresh, early],
        "suppress_tokens": first[:1], "begin_suppress_tokens": first[1:2],
    }  # fmt: skip
    return {
        "repetition_penalty": ({"repetition_penalty": 1.5}, "repetition_penalty"),
        "no_repeat_ngram_size": ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size"),
        "min_new_tokens": ({"eos_token_id": early, "min_new_tokens": 5}, "min_new_tokens"),
        "min_length": ({"eos_token_id": early, "min_length": P_len + 5}, "min_length"),
        "forced_bos_token_id": ({"forced_bos_token_id": fresh}, "forced_bos_token_id"),
        "forced_eos_token_id": ({"forced_eos_token_id": fresh}, "forced_eos_token_id"),
        "suppress_tokens": ({"suppress_tokens": first}, "suppress_tokens"),
        "begin_suppress_tokens": ({"begin_suppress_tokens": first}, "begin_suppress_tokens"),
        "all-together": (together, "repetition_penalty"),
    }


RULES = list(_rules(torch.tensor([[4, 5, 6], [7, 8, 9]]), 1))


@pytest.mark.hf
@needs_hf
@pytest.mark.parametrize("family", ["bart", "gpt2"])
@pytest.mark.parametrize("beams", [1, 3])
@pytest.mark.parametrize("rule", RULES)
def test_rule_in_a_whole_generate_call(family, beams, rule):
    hf = _hf(family, std=0.5, seed=1)
    hf.generation_config.update(forced_eos_token_id=None)  # each rule on its own
    ids, mask = _batch(family)
    plain = al.generate(al.interop.from_hf(hf), ids, N, attention_mask=mask)
    P_len = 1 if family == "bart" else ids.shape[1]
    settings, key = _rules(plain[:, P_len:], P_len)[rule]
    kw = {"num_beams": beams, "num_return_sequences": 2} if beams > 1 else {}
    hf.generation_config.update(**settings)
    got, want = _both(hf, ids, mask, **kw)
    assert got == want
    if family == "gpt2" and rule == "forced_bos_token_id":
        return  # forced BOS acts at sequence length 1 only: a no-op after a prompt (as theirs)
    hf.generation_config.update(**{key: None})
    without, _ = _both(hf, ids, mask, **kw)
    assert got != without  # the rule changed the tokens


@pytest.mark.hf
@needs_hf
@pytest.mark.parametrize("beams", [1, 3])
def test_repetition_penalty_ignores_left_padding(beams):
    """transformers skips each prompt's left padding (read off the attention mask): padding with
    a token the model likes, or with another one, gives the same tokens."""
    hf = _hf("gpt2", std=0.5, seed=1)
    ids, mask = _batch("gpt2")
    liked = al.generate(al.interop.from_hf(hf), ids, 1, attention_mask=mask)[:, -1].tolist()
    hf.generation_config.update(repetition_penalty=3.0)
    kw = {"num_beams": beams} if beams > 1 else {}
    results = []
    for pad in (liked[1], 4 if liked[1] != 4 else 5):  # row 1 has left padding
        padded = ids.masked_fill(mask == 0, pad)
        got, want = _both(hf, padded, mask, **kw)
        assert got == want
        results.append([row[6:] for row in got])
    assert results[0] == results[1]


@pytest.mark.hf
@needs_hf
@pytest.mark.parametrize("beams", [1, 3])
def test_whisper_style_suppression_with_forced_bos(beams):
    """Suppressed tokens, and begin-suppressed ones at the first free step (the second when a
    forced BOS takes the first), as Whisper's generation config asks; greedy and beam."""
    hf = _hf("bart", std=0.5, seed=2)
    ids, mask = _batch("bart")
    plain = al.generate(al.interop.from_hf(hf), ids, N, attention_mask=mask)
    hf.generation_config.update(
        forced_bos_token_id=5,
        suppress_tokens=[int(plain[0, 3])],
        begin_suppress_tokens=sorted(set(plain[:, 1].tolist()) | {2}),
    )
    got, want = _both(hf, ids, mask, num_beams=beams)
    assert got == want
    assert all(row[1] == 5 and row[2] not in (2, *plain[:, 1].tolist()) for row in got)


@pytest.mark.hf
@needs_hf
def test_explicit_keywords_override_the_checkpoint():
    hf = _hf("bart", std=0.5)
    hf.generation_config.update(num_beams=4, repetition_penalty=1.5)
    model = al.interop.from_hf(hf)
    ids, mask = _batch("bart")
    kw = dict(num_beams=1, repetition_penalty=None, forced_eos_token_id=None, pad_token_id=0)
    got = al.generate(model, ids, N, attention_mask=mask, **kw)
    hf_kw = dict(num_beams=1, repetition_penalty=1.0, forced_eos_token_id=None, pad_token_id=0)
    assert got.tolist() == hf.generate(ids, attention_mask=mask, max_new_tokens=N, **hf_kw).tolist()
    with pytest.raises(TypeError, match="Did you mean 'repetition_penalty'"):
        al.generate(model, ids, N, repetition_penality=1.2)
    with pytest.raises(ValueError, match=re.escape("strategy 'greedy' with num_beams=4")):
        al.generate(model, ids, N, strategy="greedy", num_beams=4)


# --- the settings travel ----------------------------------------------------------------------


@pytest.mark.hf
@needs_hf
def test_settings_travel_through_to_hf_and_folders(tmp_path):
    hf = _hf("bart")
    hf.generation_config.update(num_beams=3, no_repeat_ngram_size=2, eos_token_id=[2, 7])
    model = al.interop.from_hf(hf)
    expected = GenerationSettings(
        decoder_start_token_id=2, bos_token_id=0, eos_token_id=(2, 7), pad_token_id=1,
        forced_eos_token_id=2, num_beams=3, no_repeat_ngram_size=2,
    )  # fmt: skip
    assert model.generation == expected
    back = al.interop.to_hf(model)
    assert GenerationSettings.from_hf(back.generation_config.to_dict()) == expected

    al.interop.save_pretrained(model, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "generation_config.json").read_text())["num_beams"] == 3
    theirs = transformers.BartForConditionalGeneration.from_pretrained(tmp_path / "ours")
    assert GenerationSettings.from_hf(theirs.generation_config.to_dict()) == expected
    hf.save_pretrained(tmp_path / "hf")
    assert al.interop.load_pretrained(tmp_path / "hf").generation == expected

    # an old checkpoint: no generation_config.json, its generation keys in config.json
    (tmp_path / "hf" / "generation_config.json").unlink()
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.update(num_beams=4, length_penalty=2.0)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    old = al.interop.load_pretrained(tmp_path / "hf").generation
    assert old.num_beams == 4 and old.length_penalty == 2.0 and old.decoder_start_token_id == 2


@pytest.mark.hf
@needs_hf
def test_encoders_carry_no_generation_settings():
    cfg = transformers.BertConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32,
    )  # fmt: skip
    assert getattr(al.interop.from_hf(transformers.BertModel(cfg)), "generation", None) is None


# --- without transformers: a native model, a Python reference, the command line --------------


def _native():
    cfg = al.presets.tiny(al.presets.get("llama2-7b"))
    torch.manual_seed(0)
    return al.build_model(cfg.replace(vocab_size=V, init="xavier")).eval()


def _reference_greedy(model, ids, n, eos, ngram, suppress, min_new, forced_eos):
    """Greedy decoding of one unpadded prompt, recomputing the whole prefix each step, with the
    rules written as Python over lists (the definitions in src/attnlab/decode/processors.py)."""
    seq = ids[0].tolist()
    P_len = len(seq)
    for step in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1].double().tolist()
        banned = set(suppress)
        for i in range(len(seq) - ngram + 1):  # every n-gram so far whose head is the tail
            if seq[i : i + ngram - 1] == seq[len(seq) - ngram + 1 :]:
                banned.add(seq[i + ngram - 1])
        if len(seq) - P_len < min_new:
            banned.add(eos)
        if step == n - 1:  # the last token: forced EOS
            banned |= set(range(V)) - {forced_eos}
        allowed = [t for t in range(V) if t not in banned]
        seq.append(max(allowed, key=lambda t: logits[t]))
        if seq[-1] == eos:
            break
    return seq


def test_native_model_settings_equal_a_python_reference():
    model = _native()
    ids = torch.randint(4, V, (1, 5), generator=torch.Generator().manual_seed(4))
    plain = al.generate(model, ids, N)[0, 5:].tolist()
    eos, suppress = plain[0], [plain[1]]  # both would be chosen without the rules
    rules = dict(eos=eos, ngram=2, suppress=suppress, min_new=3, forced_eos=7)
    model.generation = GenerationSettings(
        eos_token_id=eos, no_repeat_ngram_size=2, suppress_tokens=suppress, min_new_tokens=3,
        forced_eos_token_id=7, max_new_tokens=N,
    )  # fmt: skip
    got = al.generate(model, ids)[0].tolist()
    assert got == _reference_greedy(model, ids, N, **rules)
    assert got[5:] != plain


def test_generate_cli_uses_the_checkpoints_settings(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    import argparse

    from attnlab.cli import generate as textgen
    from attnlab.data import train_tokenizer

    tok = train_tokenizer("char", ["to be or not to be, that is the question"], 0,
                          cache_dir=tmp_path / "c")  # fmt: skip
    cfg = al.presets.tiny(al.presets.get("llama2-7b"), vocab_size=tok.get_vocab_size())
    torch.manual_seed(0)
    model = al.build_model(cfg.replace(init="xavier")).eval()
    ids = torch.tensor([tok.encode("to be", add_special_tokens=False).ids])
    plain = al.generate(model, ids, 12)[0, ids.shape[1] :].tolist()
    model.generation = GenerationSettings(
        no_repeat_ngram_size=1, eos_token_id=plain[4], max_new_tokens=9
    )
    al.interop.save_pretrained(model, tmp_path / "m", "llama")
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    args = argparse.Namespace(target=str(tmp_path / "m"), prompt="to be", max_new_tokens=None,
                              temperature=0.0, top_k=None, top_p=None, seed=0)  # fmt: skip
    assert textgen.run(args) == 0
    want = al.generate(model, ids)[0, ids.shape[1] :].tolist()
    assert len(want) <= 9 and len(set(want)) == len(want)  # the settings held
    want = want[: want.index(plain[4])] if plain[4] in want else want
    assert want != plain[: len(want)] and want
    assert capsys.readouterr().out == "to be" + tok.decode(want) + "\n"
