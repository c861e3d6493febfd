"""Decoding (attnlab.decode.generate, attnlab.decode.beam) against obviously correct references.

- Cached greedy decoding equals argmax over a full recomputation of the whole prefix (no cache),
  for every positional scheme × MHA/GQA/MQA × decoder-only/encoder-decoder, and a padded batch
  decodes each row exactly as that prompt alone.
- Sampling: seeded, reproducible; its degenerate settings are greedy; `sample_next` draws from
  the renormalised top-k / nucleus distribution computed in float64.
- EOS: a finished row pads; `stream` yields what `generate` returns; a call plans once.
- Beam search equals a slow beam search written from the rules in `attnlab.decode.beam`'s docstring over
  full recomputation, and (marked `hf`) `transformers`' `generate(num_beams=...)` on the same
  weights through `attnlab.interop.from_hf`.

Models are tiny, seeded, untied and "xavier"-initialised so that logits are far from uniform (with
0.02-std weights every candidate scores about the same and the comparisons would test ties).
"""

from __future__ import annotations

import functools
import re
from types import SimpleNamespace

import pytest
import torch

import attnlab as al
from attnlab.config import (
    ALiBi,
    AttentionConfig,
    DynamicNTKScaling,
    LearnedPositions,
    LinearScaling,
    ModelConfig,
    NoPositions,
    NTKScaling,
    RoPE,
    Sinusoidal,
    T5RelativeBias,
    YaRNScaling,
)
from attnlab.decode.generate import generate, sample_next, stream

V, PAD, START = 48, 1, 0  # vocabulary; pad id; decoder start id (encoder-decoder)
N_NEW = 8

POSITIONAL = {
    "sinusoidal": Sinusoidal(),
    "learned": LearnedPositions(max_len=64),
    "learned-offset": LearnedPositions(max_len=64, offset=2),  # BART's layout
    "rope": RoPE(),
    "rope-interleaved-partial": RoPE(layout="interleaved", fraction=0.5),
    "rope-linear": RoPE(scaling=LinearScaling(factor=2.0)),
    "rope-ntk": RoPE(scaling=NTKScaling(factor=2.0)),
    # dynamic NTK is exact only while the length stays <= original_max_len: past it, cached keys
    # keep the base they were rotated with (as in transformers), a recomputation does not.
    "rope-dynamic-ntk": RoPE(scaling=DynamicNTKScaling(factor=2.0, original_max_len=32)),
    "rope-yarn": RoPE(scaling=YaRNScaling(factor=4.0, original_max_len=8)),
    "alibi": ALiBi(),
    "t5-relative": T5RelativeBias(num_buckets=8, max_distance=16),
    "none": NoPositions(),
}
KV_HEADS = {"mha": None, "gqa": 2, "mqa": 1}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only contend (10-70x slower on a loaded 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(arch="decoder", positional=None, n_kv_heads=None, window=None, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        arch=arch,
        vocab_size=V,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        positional=positional or RoPE(),
        attention=AttentionConfig(sliding_window=window),
        tie_embeddings=False,
        init="xavier",
    )
    return al.build_model(cfg).eval()


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, V, (n,), generator=g) for n in lengths]


def _pad(rows, side):
    """Rows of different lengths -> (ids, mask), padded with PAD on `side`."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(T - len(r), T) if side == "left" else slice(0, len(r))
        ids[i, sl], mask[i, sl] = r, 1
    return ids, mask


def _kw(model):
    return {"decoder_start_token_id": START} if _is_seq2seq(model) else {}


def _is_seq2seq(model):
    return isinstance(model, al.nn.model.EncoderDecoderModel)


@torch.no_grad()
def _full_logits(model, src, seq):
    """Logits after the whole sequence, recomputed from scratch (no cache)."""
    out = model(src, seq) if _is_seq2seq(model) else model(seq)
    return out.logits[:, -1].double()


def _greedy_reference(model, src, n):
    """argmax over a full recomputation at every step; src is the prompt or the source."""
    seq = torch.full((src.shape[0], 1), START) if _is_seq2seq(model) else src
    for _ in range(n):
        seq = torch.cat((seq, _full_logits(model, src, seq).argmax(-1, keepdim=True)), dim=1)
    return seq


# --- cached greedy == full recomputation ---------------------------------------------------------


def _check_greedy(model):
    # an unpadded batch: the same tokens as recomputing the batch
    src = torch.stack(_prompts([5, 5], seed=2))
    torch.testing.assert_close(
        generate(model, src, N_NEW, **_kw(model)),
        _greedy_reference(model, src, N_NEW),
        rtol=0,
        atol=0,
    )
    # a padded batch of different lengths: each row as if decoded alone. Prompts are left-padded;
    # sources right-padded, as encoders number positions from the first slot (as in transformers)
    rows = _prompts([5, 2, 4])
    ids, mask = _pad(rows, "right" if _is_seq2seq(model) else "left")
    got = generate(model, ids, N_NEW, attention_mask=mask, **_kw(model))
    for i, r in enumerate(rows):
        alone = _greedy_reference(model, r[None], N_NEW)[0]
        want = alone if _is_seq2seq(model) else torch.cat((ids[i, : ids.shape[1] - len(r)], alone))
        assert got[i].tolist() == want.tolist(), f"row {i} (length {len(r)})"


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
@pytest.mark.parametrize("kv", KV_HEADS)
@pytest.mark.parametrize("pos", POSITIONAL)
def test_cached_greedy_equals_recomputation(pos, kv, arch):
    _check_greedy(_model(arch, POSITIONAL[pos], KV_HEADS[kv]))


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
@pytest.mark.parametrize("pos", ["rope", "alibi", "t5-relative", "learned"])
def test_cached_greedy_equals_recomputation_sliding_window(pos, arch):
    # window 3 < prompt + new tokens, so the window cuts in both in prefill and decode steps
    _check_greedy(_model(arch, POSITIONAL[pos], n_kv_heads=2, window=3))


# --- sampling -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm():
    return _model("decoder", RoPE(), n_kv_heads=2)


@pytest.fixture(scope="module")
def prompt():
    return torch.stack(_prompts([5, 5, 5], seed=3))


def test_sampling_is_seeded(lm, prompt):
    a = generate(lm, prompt, N_NEW, strategy="sample", seed=0)
    assert torch.equal(a, generate(lm, prompt, N_NEW, strategy="sample", seed=0))
    assert not torch.equal(a, generate(lm, prompt, N_NEW, strategy="sample", seed=1))
    assert not torch.equal(a, generate(lm, prompt, N_NEW))  # it does sample


@pytest.mark.parametrize("setting", [{"top_k": 1}, {"top_p": 1e-6}, {"temperature": 0.0}])
def test_degenerate_sampling_is_greedy(lm, prompt, setting):
    greedy = generate(lm, prompt, N_NEW)
    for seed in (0, 1):
        assert torch.equal(
            generate(lm, prompt, N_NEW, strategy="sample", seed=seed, **setting), greedy
        )


@pytest.mark.parametrize("strategy", ["greedy", "sample", "beam"])
def test_generate_plans_once(lm, prompt, strategy, monkeypatch):
    """One call settles its plan (settings, new-token count, logits rules) once."""
    import attnlab.decode.beam as beam_module
    import attnlab.decode.generate as generate_module

    calls = []

    def counted(plan):
        def wrapper(*args, **kwargs):
            calls.append(1)
            return plan(*args, **kwargs)

        return wrapper

    for module in (generate_module, beam_module):
        monkeypatch.setattr(module, "plan", counted(module.plan))
    generate(lm, prompt, N_NEW, strategy=strategy, repetition_penalty=1.3)
    assert len(calls) == 1


def _nucleus(p: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose probability reaches top_p (Holtzman et al.
    2020, arXiv:1904.09751, eq. 2), by a plain loop in float64."""
    keep, total = set(), 0.0
    for i in p.argsort(descending=True).tolist():
        keep.add(i)
        total += float(p[i])
        if total >= top_p:
            return keep
    return keep


@pytest.mark.parametrize(
    "setting",
    [
        {"temperature": 0.7},
        {"temperature": 1.5, "top_k": 5},
        {"top_p": 0.6},
        {"top_k": 8, "top_p": 0.5, "temperature": 2.0},
    ],
)
def test_sample_next_draws_from_the_truncated_distribution(setting):
    """Empirical frequencies of 40,000 draws vs the float64 target: softmax(logits / T)
    restricted to the top-k, then to the nucleus, renormalised."""
    logits = torch.randn(V, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 2
    p = (logits / setting.get("temperature", 1.0)).softmax(-1)
    allowed = set(range(V))
    if "top_k" in setting:
        allowed = set(p.topk(setting["top_k"]).indices.tolist())
    q = torch.zeros_like(p)
    q[list(allowed)] = p[list(allowed)]
    q = q / q.sum()
    if "top_p" in setting:
        nucleus = _nucleus(q, setting["top_p"])
        q = torch.zeros_like(p)
        q[list(nucleus)] = p[list(nucleus)]
        q = q / q.sum()
    n = 40_000
    g = torch.Generator().manual_seed(0)
    draws = sample_next(logits.float().expand(n, V), generator=g, **setting)
    freq = torch.bincount(draws, minlength=V).double() / n
    drawn, support = set(draws.unique().tolist()), set(q.nonzero().flatten().tolist())
    assert drawn <= support  # nothing outside the top-k / nucleus
    assert {i for i in support if q[i] * n > 30} <= drawn  # and nothing likely left out
    # 5 standard errors of a frequency (at most 0.5/sqrt(n) = 0.0025)
    assert (freq - q).abs().max() < 5 * 0.5 / n**0.5


# --- EOS and stream -----------------------------------------------------------------------------


def _first(row: list[int], token: int) -> int | None:
    return row.index(token) if token in row else None


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_eos_row_pads_and_generation_stops(arch):
    model = _model(arch, RoPE(), n_kv_heads=2)
    src = torch.stack(_prompts([5, 5, 5], seed=5))
    n = 12
    free = generate(model, src, n, **_kw(model))
    P = free.shape[1] - n
    rows = free[:, P:].tolist()
    eos = rows[0][2] if rows[0][2] not in rows[0][:2] else rows[0][3]  # row 0 ends early
    firsts = [_first(r, eos) for r in rows]
    out = generate(model, src, n, eos_token_id=eos, pad_token_id=PAD, **_kw(model))
    ends = n if None in firsts else max(firsts) + 1  # all rows done: generation stops
    assert out.shape[1] == P + ends
    for r, f, got in zip(rows, firsts, out[:, P:].tolist(), strict=True):
        want = r[:ends] if f is None else r[: f + 1] + [PAD] * (ends - f - 1)
        assert got == want
    assert firsts[0] is not None and firsts[0] + 1 < ends  # the test saw a row pad


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
@pytest.mark.parametrize("strategy", ["greedy", "sample"])
def test_stream_yields_what_generate_returns(arch, strategy):
    model = _model(arch, ALiBi(), n_kv_heads=1)
    rows = _prompts([5, 3, 4], seed=6)
    ids, mask = _pad(rows, "right" if arch == "encoder-decoder" else "left")
    kw = dict(
        attention_mask=mask,
        strategy=strategy,
        seed=7,
        eos_token_id=9,
        pad_token_id=PAD,
        **_kw(model),
    )
    full = generate(model, ids, N_NEW, **kw)
    tokens = torch.stack(list(stream(model, ids, N_NEW, **kw)), dim=1)
    P = full.shape[1] - tokens.shape[1]
    assert torch.equal(full[:, P:], tokens)
    assert torch.equal(full[:, :P], ids if arch == "decoder" else torch.full((3, 1), START))


# --- beam search ---------------------------------------------------------------------------------


def _reference_beam(logprobs, n_beams, max_new, alpha, early_stopping, eos, n_return):
    """The rules of attnlab.decode.beam's docstring (the `transformers` ones), one item at a time, with
    Python lists; `logprobs(tokens)` is the next-token log-distribution after the generated
    tokens, recomputed from scratch. Returns the n_return best (score, tokens), best first, how
    many hypotheses ended on EOS before the limit and entered the finished pool, and the number
    of steps (model calls) the search took."""
    running = [(0.0, [])]
    done: list[tuple[float, list[int]]] = []
    early_ends = 0
    for step in range(1, max_new + 1):
        cands = sorted(
            (
                (s + lp, [*toks, v])
                for s, toks in running
                for v, lp in enumerate(logprobs(tuple(toks)))
            ),
            key=lambda c: -c[0],
        )[: 2 * n_beams]  # 2·num_beams candidates, so num_beams unfinished remain

        def finished(c, last=step == max_new):
            return c[1][-1] == eos or last

        if not (early_stopping is True and len(done) == n_beams):
            new = [(s / step**alpha, toks) for s, toks in cands[:n_beams] if finished((s, toks))]
            early_ends += len(new) if step < max_new else 0
            done += new
            done = sorted(done, key=lambda d: -d[0])[:n_beams]
        running = [c for c in cands if not finished(c)][:n_beams]
        if step == max_new or (early_stopping is True and len(done) == n_beams):
            break
        if len(done) == n_beams:  # can the best running beam still beat the worst finished one?
            hoped = max_new if early_stopping == "never" and alpha > 0 else step
            if running[0][0] / hoped**alpha <= done[-1][0]:
                break
    return done[:n_return], early_ends, step


def _beam_reference(model, rows, prefix, max_new, n_beams, alpha, early, eos, n_return=1):
    """Decode each row alone with `_reference_beam`; assemble as transformers does: prefix +
    tokens, cut to the longest returned hypothesis, shorter ones filled with PAD. The batch takes
    as many steps as its slowest item."""
    hyps, early_ends, steps = [], 0, []
    for src in rows:

        @functools.cache
        def logprobs(toks, src=src):
            start = [START] if _is_seq2seq(model) else src.tolist()
            seq = torch.tensor([start + list(toks)])
            return _full_logits(model, src[None], seq)[0].log_softmax(-1).tolist()

        best, ends, n = _reference_beam(logprobs, n_beams, max_new, alpha, early, eos, n_return)
        hyps.append(best)
        early_ends, steps = early_ends + ends, [*steps, n]
    longest = max(len(t) for h in hyps for _, t in h)
    out = [
        prefix[i].tolist() + t + [PAD] * (longest - len(t))
        for i, h in enumerate(hyps)
        for _, t in h
    ]
    lengths = [len(t) for h in hyps for _, t in h]
    return SimpleNamespace(
        ids=torch.tensor(out), early_ends=early_ends, lengths=lengths, steps=steps
    )  # steps per item


def _counting_calls(module, fn):
    """fn() and the number of times `module` ran meanwhile."""
    calls = []
    handle = module.register_forward_hook(lambda *_: calls.append(1))
    try:
        return fn(), len(calls)
    finally:
        handle.remove()


def _liked_token(model, src) -> int:
    """An EOS the model likes: the runner-up after the first greedy token, so that beams
    finish on it early and at various lengths."""
    seq = generate(model, src[:1], 1, **_kw(model))
    return int(_full_logits(model, src[:1], seq)[0].topk(2).indices[1])


@pytest.fixture(scope="module", params=["decoder", "encoder-decoder"])
def beam_case(request):
    """A model, a padded batch and an EOS. The seeds are picked (by a search over a few) so that
    with length_penalty 2, early_stopping False, one item stops while another runs on and could
    still have found a better hypothesis: a closed item must not take more (rule 3)."""
    arch = request.param
    model_seed, prompt_seed = {"decoder": (2, 0), "encoder-decoder": (0, 5)}[arch]
    positional = LearnedPositions(max_len=64, offset=2) if arch == "decoder" else T5RelativeBias()
    model = _model(arch, positional, 2, seed=model_seed)
    rows = _prompts([4, 6, 2], seed=prompt_seed)
    ids, mask = _pad(rows, "right" if arch == "encoder-decoder" else "left")
    prefix = torch.full((3, 1), START) if arch == "encoder-decoder" else ids
    return model, rows, ids, mask, prefix, _liked_token(model, rows[0][None])


@pytest.mark.parametrize("early", [True, False, "never"])
@pytest.mark.parametrize("alpha", [0.6, 1.0, 2.0, -0.5])
def test_beam_search_equals_reference(beam_case, alpha, early):
    model, rows, ids, mask, prefix, eos = beam_case
    n_new, n_return = 7, 2
    kw = dict(length_penalty=alpha, early_stopping=early, eos_token_id=eos, pad_token_id=PAD)
    got, calls = _counting_calls(
        model.decoder,
        lambda: generate(
            model,
            ids,
            n_new,
            strategy="beam",
            num_beams=4,
            attention_mask=mask,
            num_return_sequences=n_return,
            **kw,
            **_kw(model),
        ),
    )
    want = _beam_reference(model, rows, prefix, n_new, 4, alpha, early, eos, n_return)
    assert got.tolist() == want.ids.tolist()
    # it stops when the rules say it may (a prefill + steps - 1 decode steps): the batch with its
    # slowest item, each item alone at its own step
    assert calls == max(want.steps)
    for row, steps in zip(rows, want.steps, strict=True):
        alone = dict(kw, strategy="beam", num_beams=4, num_return_sequences=n_return, **_kw(model))
        run = functools.partial(generate, model, row[None], n_new, **alone)
        assert _counting_calls(model.decoder, run)[1] == steps
    assert want.early_ends > 0  # the case exercises hypotheses finishing on EOS before the limit


def test_beam_search_settings_matter(beam_case):
    """Guard for the test above: the length penalty and early_stopping change the result here,
    so a search that ignored them would fail it."""
    model, rows, ids, mask, prefix, eos = beam_case
    outs = {
        (a, e): generate(
            model,
            ids,
            7,
            strategy="beam",
            length_penalty=a,
            early_stopping=e,
            eos_token_id=eos,
            pad_token_id=PAD,
            attention_mask=mask,
            **_kw(model),
        ).tolist()
        for a in (-0.5, 2.0)
        for e in (True, "never")
    }
    assert outs[(-0.5, "never")] != outs[(2.0, "never")]
    assert outs[(2.0, True)] != outs[(2.0, "never")]
    ref = _beam_reference(model, rows, prefix, 7, 4, -0.5, "never", eos, 2)
    assert min(ref.lengths) < max(ref.lengths)  # shorter rows are filled: padding is tested
    ref = _beam_reference(model, rows, prefix, 7, 4, 1.0, True, eos, 2)
    assert min(ref.steps) < 7  # some item stops before the limit: stopping is tested


def test_one_beam_without_eos_is_greedy(beam_case):
    model, _, ids, mask, *_ = beam_case
    beam = generate(
        model, ids, N_NEW, strategy="beam", num_beams=1, attention_mask=mask, **_kw(model)
    )
    assert torch.equal(beam, generate(model, ids, N_NEW, attention_mask=mask, **_kw(model)))


def _record_cross_k(log: list, module, args) -> None:
    cross_kv = args[3]  # Attention(x, ctx, memory, cache)
    if cross_kv.ready:
        log.append(cross_kv.k.data_ptr())


def test_beam_search_encodes_once():
    """The source is encoded once and each layer's cross-attention K/V computed once, for the B
    sources (not B·num_beams); expanded to the beams once, they are then read in place at every
    step (beams never leave their item, so reordering them would only copy)."""
    model = _model("encoder-decoder", RoPE(), n_kv_heads=2)
    calls = {"encoder": [], "cross_k": []}
    stored = [[] for _ in model.decoder.blocks]  # the cross K buffer each decode step reads
    model.encoder.register_forward_hook(
        lambda m, args, out: calls["encoder"].append(args[0].shape[0])
    )
    for i, block in enumerate(model.decoder.blocks):
        block.cross_attn.k_proj.register_forward_hook(
            lambda m, args, out: calls["cross_k"].append(args[0].shape[0])
        )
        block.cross_attn.register_forward_pre_hook(functools.partial(_record_cross_k, stored[i]))
    src = torch.stack(_prompts([5, 5], seed=9))
    generate(model, src, N_NEW, strategy="beam", num_beams=3, **_kw(model))
    assert calls == {"encoder": [2], "cross_k": [2] * len(model.decoder.blocks)}
    assert all(len(ptrs) == N_NEW - 1 and len(set(ptrs)) == 1 for ptrs in stored)


# --- beam search == transformers ------------------------------------------------------------------


STD = 0.2  # large enough for peaked logits, small enough that T5 (no 1/sqrt(d)) is not stuck


def _hf_model(family: str):
    """A tiny random-weight transformers model; 2-D weights redrawn with std STD so that logits
    are far from uniform (HF's 0.02 init leaves beam scores within float noise of each other)."""
    transformers = pytest.importorskip("transformers")
    from attnlab.interop import CONVERTERS

    if family not in CONVERTERS.names():
        pytest.skip(f"no attnlab.interop converter for {family} yet")
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=V,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,  # in the tiny vocabulary (each test passes its own EOS)
        )
        hf = transformers.GPT2LMHeadModel(cfg)
    elif family == "bart":
        cfg = transformers.BartConfig(
            vocab_size=V,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            forced_eos_token_id=None,  # BART's default forces EOS at max_length: a logits processor
        )
        hf = transformers.BartForConditionalGeneration(cfg)
    else:
        cfg = transformers.T5Config(
            vocab_size=V,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
        )
        hf = transformers.T5ForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0.0, STD)
    hf.eval()
    return hf, al.interop.from_hf(hf).eval()


@pytest.fixture(scope="module", params=["gpt2", "bart", "t5"])
def hf_case(request):
    hf, model = _hf_model(request.param)
    rows = _prompts([4, 6, 2], seed=10)
    ids, mask = _pad(rows, "right" if _is_seq2seq(model) else "left")
    return hf, model, ids, mask, _liked_token(model, rows[0][None])


@pytest.mark.hf
@pytest.mark.parametrize("early", [True, False, "never"])
@pytest.mark.parametrize("alpha", [0.6, 1.0, 2.0])
def test_beam_search_matches_transformers(hf_case, alpha, early):
    hf, model, ids, mask, eos = hf_case
    kw = dict(
        num_beams=4,
        length_penalty=alpha,
        early_stopping=early,
        eos_token_id=eos,
        pad_token_id=PAD,
        attention_mask=mask,
        num_return_sequences=2,
    )
    if _is_seq2seq(model):
        kw["decoder_start_token_id"] = START
    got, calls = _counting_calls(
        model.decoder, lambda: generate(model, ids, 7, strategy="beam", **kw)
    )
    want, hf_calls = _counting_calls(
        hf, lambda: hf.generate(ids, do_sample=False, max_new_tokens=7, **kw)
    )
    assert got.tolist() == want.tolist()
    assert calls == hf_calls  # and stops at the same step


@pytest.mark.hf
def test_transformers_cases_exercise_the_settings(hf_case):
    """Guard for the test above: on each family the length penalty changes the result and some
    returned hypothesis ends on EOS before the limit (so the padding path is compared too)."""
    _, model, ids, mask, eos = hf_case
    kw = dict(
        eos_token_id=eos,
        pad_token_id=PAD,
        attention_mask=mask,
        num_return_sequences=2,
        **_kw(model),
    )
    short = generate(model, ids, 7, strategy="beam", length_penalty=0.6, **kw)
    long = generate(model, ids, 7, strategy="beam", length_penalty=2.0, **kw)
    assert short.tolist() != long.tolist()
    P = short.shape[1] - 7
    assert any(eos in row[P:-1] for row in short.tolist())


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"num_beams": 0}, "num_beams (0)"),
        ({"num_return_sequences": 5}, "num_return_sequences (5)"),
        ({"early_stopping": "sometimes"}, "early_stopping ('sometimes')"),
    ],
)
def test_beam_search_rejects_bad_settings(lm, prompt, bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        generate(lm, prompt, 4, strategy="beam", **{"num_beams": 4, **bad})
