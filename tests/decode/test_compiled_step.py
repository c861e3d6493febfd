"""The compiled decode step (src/attnlab/decode/compiled_step.py) on the fixed-shape cache
(src/attnlab/cache/fixed.py), with inductor on the CPU: its logits equal the eager step's for
every decoder preset it serves (the others say why), 64 steps after the first compile neither
recompile nor break the graph, the loops give the tokens the static cache gives, and the stop
test read every few steps (as on a GPU) yields exactly the tokens read every step."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import attnlab as al
from attnlab.cache import CacheFullError, FixedKVCache
from attnlab.decode import generate as gen
from attnlab.decode.compiled_step import BUCKET, CompiledStep, why_not
from attnlab.decode.picker import pick
from attnlab.nn.model import DecoderOnlyModel

DECODERS = [
    n
    for n in al.presets.names()
    if isinstance(al.build_model(al.presets.tiny(al.presets.get(n))), DecoderOnlyModel)
]
# what the compiled step leaves to the eager one, and the reason it gives
REFUSED = {
    "transformer-xl-enwik8-12l": "XLAttention keeps a cache of its own kind",
    "deepseek-v2-lite": "MultiHeadLatentAttention keeps a cache of its own kind",
    "deepseek-v3": "MultiHeadLatentAttention keeps a cache of its own kind",
    "phi4-mini": "LongRoPE reruns the prompt",
}


def tiny(name: str) -> DecoderOnlyModel:
    torch.manual_seed(0)
    return al.build_model(al.presets.tiny(al.presets.get(name))).eval()


def prompt(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second row left-padded
    return ids, mask


def test_every_decoder_preset_is_served_or_refused_with_its_reason():
    assert set(REFUSED) <= set(DECODERS)
    for name in DECODERS:
        reason = why_not(tiny(name))
        if name in REFUSED:
            assert reason is not None and REFUSED[name] in reason, (name, reason)
        else:
            assert reason is None, (name, reason)


@pytest.mark.parametrize("name", [n for n in DECODERS if n not in REFUSED])
def test_compiled_step_equals_the_eager_step(name):
    """Prefill a left-padded batch into two fixed caches, then 4 steps: the eager forward on
    one, the compiled step on the other, fed the eager greedy tokens."""
    torch._dynamo.reset()
    model = tiny(name)
    ids, mask = prompt(model.vocab_size)
    with torch.no_grad():
        eager, comp = (model.new_cache(2, 16, kind="fixed") for _ in range(2))
        logits = model(ids, attention_mask=mask, cache=eager).logits[:, -1]
        model(ids, attention_mask=mask, cache=comp)
        step = pick(model, comp).step
        assert isinstance(step, CompiledStep)
        token = logits.argmax(-1)
        for _ in range(4):
            want = model(token[:, None], cache=eager).logits[:, -1].float()
            got = step(token, comp)
            # the same fp32 ops, fused: rounding and summation order only
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
            token = want.argmax(-1)
    assert comp.length == eager.length == 11


def test_64_steps_after_the_first_neither_recompile_nor_break_the_graph():
    torch._dynamo.reset()
    model = tiny("llama3.2-1b")
    ids, mask = prompt(model.vocab_size)
    with torch.no_grad():
        cache = model.new_cache(2, 80, kind="fixed")
        token = model(ids, attention_mask=mask, cache=cache).logits[:, -1].argmax(-1)
        step = pick(model, cache).step
        token = step(token, cache).argmax(-1)  # the compile
        counters.clear()
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(64):
                token = step(token, cache).argmax(-1)
            # a second cache of the same shape (a later generate call) reuses the graph
            again = model.new_cache(2, 80, kind="fixed")
            model(ids, attention_mask=mask, cache=again)
            pick(model, again).step(token, again)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
    assert cache.length == 7 + 65
    with pytest.raises(CacheFullError, match=r"81 positions needed \(80 stored \+ 1 new\)"):
        for _ in range(9):
            step(token, cache)


@pytest.mark.parametrize("name", ["llama3.2-1b", "gemma2-2b", "gpt2-small"])
def test_generate_on_the_compiled_step_gives_the_static_caches_tokens(name):
    """Greedy and seeded sampling through `generate`, cache_kind="fixed" (the compiled step
    on the CPU) against the default static cache (the eager or native step)."""
    model = tiny(name)
    ids, mask = prompt(model.vocab_size)
    for kw in ({}, {"strategy": "sample", "seed": 3, "top_k": 20, "temperature": 0.8}):
        want = al.generate(model, ids, 12, attention_mask=mask, eos_token_id=None, **kw)
        got = al.generate(
            model, ids, 12, attention_mask=mask, eos_token_id=None, cache_kind="fixed", **kw
        )
        assert torch.equal(got, want), kw


def test_the_loops_take_the_compiled_step_only_on_a_fixed_cache():
    model = tiny("llama3.2-1b")
    assert pick(model, model.new_cache(1, 8, kind="fixed")).name == "compiled"
    assert pick(model, model.new_cache(2, 8)).step is None  # static, two rows: eager
    assert "needs kind 'fixed'" in why_not(model, model.new_cache(2, 8))
    assert gen.check_every(torch.device("cpu")) == 1
    assert gen.check_every(torch.device("cuda")) == gen.GPU_CHECK_EVERY > 1


@pytest.mark.parametrize("every", [2, 3, 8])
def test_the_stop_test_read_every_few_steps_yields_what_every_step_does(every, monkeypatch):
    """A GPU reads the stop test every few steps: the tokens yielded (finished rows' fill
    included) are those of a check after every token, and none past the last row's EOS."""
    model = tiny("llama3.2-1b")
    ids, mask = prompt(model.vocab_size)
    pick = {"strategy": "sample", "seed": 0}  # a tiny model's greedy rows repeat one token
    new = al.generate(model, ids, 10, attention_mask=mask, eos_token_id=None, **pick)
    new = new[:, 7:].tolist()

    def ends(eos):  # the step each row emits one of `eos` at (10: never)
        return [next((i for i, t in enumerate(row) if t in eos), 10) for row in new]

    # EOS ids that end the rows at two different steps, the last of them at least the 4th
    eos = next(
        [a, b]
        for a in sorted(set(new[0]))
        for b in sorted(set(new[1]))
        if len(set(ends([a, b]))) == 2 and 3 <= max(ends([a, b])) < 10
    )

    def run():
        out = gen.stream(model, ids, 10, attention_mask=mask, eos_token_id=eos, **pick)
        return [t.clone() for t in out]

    want = run()
    monkeypatch.setattr(gen, "check_every", lambda device: every)
    got = run()
    assert len(want) == max(ends(eos)) + 1 and len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_decode_step_on_a_fixed_cache_reads_nothing_from_the_device(device_reads):
    """The compiled step's function run eagerly over its view of a fixed cache: no tensor
    becomes a Python number (the stack's host shortcuts are skipped, sdpa takes the mask dense),
    which is what lets it compile whole."""
    from attnlab.decode.compiled_step import _forward
    from attnlab.nn.inputs import checked

    model = tiny("llama3.2-1b")
    ids, mask = prompt(model.vocab_size)
    with torch.no_grad():
        cache = model.new_cache(2, 16, kind="fixed")
        token = model(ids, attention_mask=mask, cache=cache).logits[:, -1].argmax(-1)
        view = cache.graph_view()
        cache.reserve(1)
        with checked(), device_reads:
            logits = _forward(model, token, view)
    assert device_reads.names == [], device_reads.names
    assert torch.isfinite(logits).all() and cache.length == 8


def test_fixed_cache_errors_and_in_place_reorder():
    model = tiny("llama3.2-1b")
    cache = model.new_cache(2, 4, kind="fixed")
    assert isinstance(cache, FixedKVCache)
    with pytest.raises(CacheFullError, match=r"create it with model\.new_cache"):
        model(torch.zeros(2, 5, dtype=torch.long), cache=cache)
    cache = model.new_cache(2, 4, kind="fixed")
    with torch.no_grad():
        model(torch.tensor([[1, 2], [3, 4]]), cache=cache)
    k0, row1 = cache.k.data_ptr(), cache.k[:, 1].clone()
    cache.reorder(torch.tensor([1, 1]))  # same size: in place, the addresses a graph captured
    assert cache.k.data_ptr() == k0 and torch.equal(cache.k[:, 0], row1)
    cache.reorder(torch.tensor([0, 0, 1, 1]))  # beam search's first expansion: new buffers
    assert cache.batch_size == 4 and cache.k.shape[1] == 4
    from attnlab.decode.compiled_step import bucket

    assert bucket(1) == bucket(BUCKET) == BUCKET and bucket(BUCKET + 1) == 2 * BUCKET


def test_beam_search_on_the_compiled_step_gives_the_static_caches_beams():
    """Beam search reorders the cache every step: the fixed cache copies rows in place (the
    compiled graph's buffers stay), after its first reorder has expanded B to B · beams."""
    model = tiny("qwen3-0.6b")
    ids, mask = prompt(model.vocab_size)
    kw = dict(strategy="beam", num_beams=3, attention_mask=mask, eos_token_id=None)
    want = al.generate(model, ids, 6, **kw)
    got = al.generate(model, ids, 6, cache_kind="fixed", **kw)
    assert torch.equal(got, want)


def test_a_step_that_cannot_compile_warns_once_and_decodes_eagerly(monkeypatch):
    """A model torch.compile cannot trace (here: a stand-in that raises as dynamo does) decodes on
    with the eager forward on the same cache, the same tokens, after one warning."""
    from attnlab.decode import compiled_step
    from attnlab.decode.compiled_step import _forward
    from attnlab.graphs import Graphs

    class Refuse(Graphs):  # a Graphs (src/attnlab/graphs.py) whose every compile fails
        def __init__(self):
            super().__init__(_forward)

        def __call__(self, key, model, token, view):
            raise torch._dynamo.exc.Unsupported("data-dependent branch (a stand-in)")

    monkeypatch.setattr(compiled_step, "compiled", lambda mode: Refuse())
    model = tiny("llama3.2-1b")
    ids, mask = prompt(model.vocab_size)
    want = al.generate(model, ids, 6, attention_mask=mask, eos_token_id=None)
    with pytest.warns(RuntimeWarning, match="could not be built .*Unsupported.*stand-in"):
        got = al.generate(model, ids, 6, attention_mask=mask, eos_token_id=None, cache_kind="fixed")
    assert torch.equal(got, want)
    assert "could not build its step before" in why_not(model)  # later loops: eager, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = al.generate(
            model, ids, 6, attention_mask=mask, eos_token_id=None, cache_kind="fixed"
        )
    assert torch.equal(again, want)


def test_a_models_loops_reuse_one_fixed_cache_unless_one_is_running():
    """Two generate calls of one shape decode on the same buffers (a captured CUDA graph's), one
    of another shape or while another loop holds the cache on new ones; tokens unchanged."""
    from attnlab.decode.compiled_step import _CACHES

    model = tiny("llama3.2-1b")
    ids, mask = prompt(model.vocab_size)
    want = al.generate(model, ids, 5, attention_mask=mask, eos_token_id=None)
    kw = dict(attention_mask=mask, eos_token_id=None, cache_kind="fixed")
    assert torch.equal(al.generate(model, ids, 5, **kw), want)
    first = _CACHES[model]
    assert not first.in_use
    assert torch.equal(al.generate(model, ids, 5, **kw), want)
    assert _CACHES[model] is first  # reused, emptied
    a = gen.stream(model, ids, 5, **kw)
    b = gen.stream(model, ids, 5, **kw)
    got_a, got_b = [], []
    for ta, tb in zip(a, b, strict=True):  # interleaved: each loop on its own cache
        got_a.append(ta.clone())
        got_b.append(tb.clone())
    assert torch.equal(torch.stack(got_a, 1), want[:, 7:])
    assert torch.equal(torch.stack(got_b, 1), want[:, 7:])
