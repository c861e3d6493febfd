"""KV-cache kinds (attnlab.cache: static, sliding, paged) against full recomputation.

- Every kind: cached greedy tokens equal argmax over a full recomputation of the whole prefix
  (no cache), for several positional schemes × MHA/GQA/MQA × decoder-only/encoder-decoder ×
  unpadded/padded batches (a padded row decodes exactly as that prompt alone); prompts fed in
  chunks of any size, longer than the window or a block, give the full forward's logits.
- Sliding: the ring holds `window` slots whatever max_len is, never fills up, and refuses what
  would make it inexact (no window; padding after a real token).
- Paged: blocks are taken on demand, returned on finish/free (and by generate on EOS), stats
  count them, beams share blocks (copy-on-write), and an exhausted pool fails before writing.
- Memory: bytes per token are 2·L·H_kv·D·4 (float32), so MHA : GQA : MQA = H : H_kv : 1.

Models are tiny, seeded, untied and "xavier"-initialised so that logits are far from uniform.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab as al
from attnlab.cache import CacheFullError
from attnlab.cache.paged import PagedKVCache
from attnlab.config import (
    ALiBi,
    AttentionConfig,
    LearnedPositions,
    ModelConfig,
    RoPE,
    Sinusoidal,
    T5RelativeBias,
)
from attnlab.decode.beam import beam_search
from attnlab.decode.generate import generate
from attnlab.registry import UnknownNameError
from helpers.tolerance import assert_within_rounding, forward_terms

V, PAD, START = 48, 1, 0  # vocabulary; pad id; decoder start id (encoder-decoder)
N_LAYERS, N_HEADS, D_MODEL = 2, 4, 32
HEAD_DIM = D_MODEL // N_HEADS
N_NEW = 9
WINDOW, BLOCK = 3, 3  # small, so that prompts and decoding cross them several times

POSITIONAL = {
    "rope": RoPE(),
    "alibi": ALiBi(),
    "t5-relative": T5RelativeBias(num_buckets=8, max_distance=16),
    "learned": LearnedPositions(max_len=64),
    "sinusoidal": Sinusoidal(),
}
KV_HEADS = {"mha": N_HEADS, "gqa": 2, "mqa": 1}
KINDS = {  # kind -> (model window, options)
    "static": (None, {}),
    "sliding": (WINDOW, {}),
    "paged": (None, {"block_size": BLOCK}),
}


def _model(arch="decoder", positional=None, n_kv_heads=2, window=None, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        arch=arch,
        vocab_size=V,
        d_model=D_MODEL,
        n_layers=N_LAYERS,
        n_heads=N_HEADS,
        n_kv_heads=n_kv_heads,
        positional=positional or RoPE(),
        attention=AttentionConfig(sliding_window=window),
        tie_embeddings=False,
        init="xavier",
    )
    return al.build_model(cfg).eval()


def _seq2seq(model) -> bool:
    return isinstance(model, al.nn.model.EncoderDecoderModel)


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, V, (n,), generator=g) for n in lengths]


def _pad(rows, side):
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(T - len(r), T) if side == "left" else slice(0, len(r))
        ids[i, sl], mask[i, sl] = r, 1
    return ids, mask


@torch.no_grad()
def _reference(model, src, n):
    """Greedy by argmax over a full recomputation (no cache) at every step."""
    seq = torch.full((src.shape[0], 1), START) if _seq2seq(model) else src
    for _ in range(n):
        logits = model(src, seq).logits if _seq2seq(model) else model(seq).logits
        seq = torch.cat((seq, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return seq


@torch.no_grad()
def _cached(model, src, mask, n, kind, max_len=None, **options):
    """Greedy through an explicit cache of `kind`: prefill once, then one token per step."""
    B = src.shape[0]
    if _seq2seq(model):
        cache = model.new_cache(B, max_len or n + 1, kind=kind, **options)
        memory = model.encode(src, mask)
        seq = torch.full((B, 1), START)
        step = lambda ids: model.decode(ids, memory, mask, cache=cache).logits  # noqa: E731
        logits = step(seq)
    else:
        cache = model.new_cache(B, max_len or src.shape[1] + n, kind=kind, **options)
        seq = src
        step = lambda ids: model(ids, cache=cache).logits  # noqa: E731
        logits = model(src, attention_mask=mask, cache=cache).logits
    for _ in range(n):
        token = logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat((seq, token), dim=1)
        logits = step(token)
    return seq, cache


def _check_greedy(model, kind):
    options = KINDS[kind][1]
    src = torch.stack(_prompts([7, 7], seed=2))  # unpadded: the batch recomputed
    got, _ = _cached(model, src, None, N_NEW, kind, **options)
    assert got.tolist() == _reference(model, src, N_NEW).tolist()
    # padded: each row as if decoded alone (prompts left-padded; sources right-padded)
    rows = _prompts([7, 2, 5])
    ids, mask = _pad(rows, "right" if _seq2seq(model) else "left")
    got, _ = _cached(model, ids, mask, N_NEW, kind, **options)
    for i, r in enumerate(rows):
        alone = _reference(model, r[None], N_NEW)[0]
        want = alone if _seq2seq(model) else torch.cat((ids[i, : ids.shape[1] - len(r)], alone))
        assert got[i].tolist() == want.tolist(), f"row {i} (length {len(r)})"


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
@pytest.mark.parametrize("kv", KV_HEADS)
@pytest.mark.parametrize("pos", ["rope", "alibi", "t5-relative", "learned"])
@pytest.mark.parametrize("kind", KINDS)
def test_cached_greedy_equals_recomputation(kind, pos, kv, arch):
    window = KINDS[kind][0]
    _check_greedy(_model(arch, POSITIONAL[pos], KV_HEADS[kv], window), kind)


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_cached_greedy_with_a_window_model(kind):
    """The other kinds serve sliding-window models too (the mask cuts, the cache keeps all)."""
    _check_greedy(_model("decoder", POSITIONAL["sinusoidal"], 1, WINDOW), kind)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_and_beam_search_take_the_cache_kind(kind):
    """The same tokens through generate / beam_search as with the static cache (the paged cache
    shares blocks between beams and copies a block only when a beam writes into a shared one)."""
    model = _model("decoder", RoPE(), 2, KINDS[kind][0])
    ids, mask = _pad(_prompts([6, 3, 5], seed=4), "left")
    greedy = generate(model, ids, N_NEW, attention_mask=mask)
    assert torch.equal(generate(model, ids, N_NEW, attention_mask=mask, cache_kind=kind), greedy)
    beams = beam_search(model, ids, N_NEW, num_beams=3, attention_mask=mask)
    got = beam_search(model, ids, N_NEW, num_beams=3, attention_mask=mask, cache_kind=kind)
    assert torch.equal(got, beams)


# --- chunked prefill: a chunk longer than the window / a block -----------------------------------


@pytest.mark.parametrize("chunks", [[11], [7, 1, 4], [1, 1, 5, 2, 1, 1], [2, 9]])
@pytest.mark.parametrize("kind", KINDS)
def test_chunks_of_any_size_give_the_full_forward(kind, chunks):
    """A prompt fed in chunks (one longer than the window, chunks after the ring is full)
    gives, chunk after chunk, the logits of one forward over the whole left-padded batch."""
    window, options = KINDS[kind]
    model = _model("decoder", ALiBi(), 2, window)
    ids, mask = _pad(_prompts([11, 8], seed=5), "left")
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = model.new_cache(2, 11, kind=kind, **options)
        got, t = [], 0
        for n in chunks:
            got.append(model(ids[:, t : t + n], mask[:, t : t + n], cache=cache).logits)
            t += n
    keep = mask.bool()
    n = forward_terms(n_layers=N_LAYERS, d_model=D_MODEL, d_ff=4 * D_MODEL, keys=11)
    assert_within_rounding(torch.cat(got, 1)[keep], full[keep], n)  # other sums' order only


# --- sliding window ------------------------------------------------------------------------------


def test_sliding_ring_is_window_sized_and_never_fills():
    """Memory O(window): a cache for 5 tokens (or 500) holds 3 slots and decodes 20 tokens."""
    model = _model("decoder", RoPE(), 2, WINDOW)
    small = model.new_cache(2, 5, kind="sliding")
    big = model.new_cache(2, 500, kind="sliding")
    assert small.k.shape == big.k.shape == (N_LAYERS, 2, 2, WINDOW, HEAD_DIM)
    src = torch.stack(_prompts([7, 7], seed=6))  # prompt 7 > window 3; 7 + 20 > max_len 5
    seq, cache = _cached(model, src, None, 20, "sliding", max_len=5)
    assert seq.tolist() == _reference(model, src, 20).tolist()
    assert cache.length == 27
    allocated = 2 * WINDOW * cache.bytes_per_token()  # rows x window slots
    assert cache.stats()["allocated_bytes"] == small.stats()["allocated_bytes"] == allocated
    with pytest.raises(CacheFullError, match=r"7 positions needed.*5 available"):  # static: no
        _cached(model, src, None, 20, "static", max_len=5)


def test_sliding_needs_a_window_model():
    with pytest.raises(ValueError, match=r"sliding_window.*kind='static'"):
        _model("decoder", RoPE()).new_cache(1, 8, kind="sliding")
    with pytest.raises(ValueError, match=r"window \(2\) is smaller.*sliding_window \(3\)"):
        _model("decoder", RoPE(), window=WINDOW).new_cache(1, 8, kind="sliding", window=2)
    with pytest.raises(
        UnknownNameError, match="Known: fixed, latent, memory, paged, recurrent, sliding, static"
    ):
        _model("decoder", RoPE()).new_cache(1, 8, kind="ring")


def test_sliding_refuses_padding_after_a_real_token():
    model = _model("decoder", RoPE(), 2, WINDOW)
    ids, mask = torch.full((2, 4), 5), torch.tensor([[0, 1, 1, 1], [1, 1, 0, 1]])
    with pytest.raises(ValueError, match="left-pad"):
        model(ids, mask, cache=model.new_cache(2, 8, kind="sliding"))
    cache = model.new_cache(2, 8, kind="sliding")
    model(ids, torch.tensor([[0, 1, 1, 1], [0, 0, 0, 1]]), cache=cache)  # left padding: fine
    with pytest.raises(ValueError, match="left-pad"):  # a padded token once a row has started
        model(ids[:, :1], torch.tensor([[1], [0]]), cache=cache)


# --- paged -------------------------------------------------------------------------------------


def _block_bytes(cache) -> int:
    return BLOCK * cache.bytes_per_token()


def test_paged_blocks_are_taken_on_demand_and_counted():
    model = _model("decoder", RoPE(), 2)
    cache = model.new_cache(2, 40, kind="paged", block_size=BLOCK)
    assert cache.stats()["blocks_free"] == 2 * math.ceil(40 / BLOCK)  # default: room for max_len
    ids = torch.randint(2, V, (2, 5))
    with torch.no_grad():
        model(ids, cache=cache)
        for n in range(5, 14):
            s = cache.stats()
            blocks = 2 * math.ceil(n / BLOCK)  # exactly the blocks n tokens need, per row
            assert (s["blocks_used"], cache.length) == (blocks, n)
            assert s["allocated_bytes"] == blocks * _block_bytes(cache)
            assert s["used_bytes"] == 2 * n * cache.bytes_per_token()
            assert s["waste_bytes"] == s["allocated_bytes"] - s["used_bytes"]
            assert s["blocks_free"] == 2 * math.ceil(40 / BLOCK) - blocks
            model(ids[:, :1], cache=cache)
    rows = [set(t) for t in cache.tables]
    assert not rows[0] & rows[1] and 0 not in rows[0] | rows[1]  # own blocks, never scratch


def test_paged_finish_frees_rows_and_the_rest_decode_on():
    model = _model("decoder", RoPE(), 2)
    src = torch.stack(_prompts([5, 5, 5], seed=7))
    with torch.no_grad():
        cache = model.new_cache(3, 20, kind="paged", block_size=BLOCK)
        logits = model(src, cache=cache).logits
        before = cache.stats()
        cache.finish(torch.tensor([False, True, False]))
        after = cache.stats()
        assert after["blocks_used"] == before["blocks_used"] - math.ceil(5 / BLOCK)
        assert after["blocks_free"] == before["blocks_free"] + math.ceil(5 / BLOCK)
        cache.free(1)  # freeing twice is harmless
        assert cache.stats() == after
        seq = src
        for _ in range(6):  # freed rows take no more blocks; the others still decode exactly
            token = logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat((seq, token), 1)
            logits = model(token, cache=cache).logits
    assert cache.stats()["blocks_used"] == 2 * math.ceil(11 / BLOCK)
    want = _reference(model, src, 6)
    assert seq[[0, 2]].tolist() == want[[0, 2]].tolist()


def test_generate_frees_finished_rows(monkeypatch):
    """On EOS (with a pad id) generate hands the finished rows to cache.finish, once each, and
    the output is the static cache's."""
    model = _model("decoder", RoPE(), 2)
    src = torch.stack(_prompts([5, 5, 5], seed=10))
    free = generate(model, src, 12)[:, 5:].tolist()
    eos = free[1][1]  # row 1 ends at its second token
    ends = [r.index(eos) if eos in r else None for r in free]
    steps = sorted({e for e in ends if e is not None})
    expected = [[i for i, e in enumerate(ends) if e == step] for step in steps]
    assert len(expected) >= 2 and None in ends  # rows end at different steps, one never
    calls = []
    original = PagedKVCache.finish
    monkeypatch.setattr(
        PagedKVCache,
        "finish",
        lambda self, done: (calls.append(done.nonzero().flatten().tolist()), original(self, done)),
    )
    kw = {"eos_token_id": eos, "pad_token_id": PAD}
    got = generate(model, src, 12, cache_kind="paged", **kw)
    assert torch.equal(got, generate(model, src, 12, **kw))
    assert calls == expected
    calls.clear()  # without a pad id finished rows go on decoding, so nothing may be freed
    got = generate(model, src, 12, cache_kind="paged", eos_token_id=eos)
    assert torch.equal(got, generate(model, src, 12, eos_token_id=eos)) and not calls


def test_paged_beams_share_blocks():
    """Expanding one row to 4 beams copies block tables, not blocks; writing into a shared,
    partly filled block gives each beam its own copy first (copy-on-write)."""
    model = _model("decoder", RoPE(), 2)
    with torch.no_grad():
        cache = model.new_cache(1, 20, kind="paged", block_size=BLOCK)
        model(torch.randint(2, V, (1, 7)), cache=cache)  # 3 blocks, the last one partly filled
        one = cache.stats()
        cache.reorder(torch.zeros(4, dtype=torch.long))
        shared = cache.stats()
        assert (shared["blocks_used"], shared["used_bytes"]) == (3, one["used_bytes"])
        model(torch.randint(2, V, (4, 1)), cache=cache)  # each beam writes into block 3
        assert cache.stats()["blocks_used"] == 2 + 4  # 2 full blocks shared, 4 private copies
        cache.reorder(torch.tensor([1, 1, 1, 1]))  # beams 0, 2, 3 die: their copies go back
        assert cache.stats()["blocks_used"] == 3


def test_paged_pool_exhaustion_is_a_clear_error():
    model = _model("decoder", RoPE(), 2)
    cache = model.new_cache(2, 40, kind="paged", block_size=BLOCK, num_blocks=5)
    ids = torch.randint(2, V, (2, 6))
    with torch.no_grad():
        model(ids, cache=cache)  # 2 rows x 2 blocks
        before = ([list(t) for t in cache.tables], cache.length, cache.stats())
        with pytest.raises(CacheFullError, match=r"2 blocks of 3 tokens needed.*1 free of 5"):
            model(ids[:, :1], cache=cache)
        assert ([list(t) for t in cache.tables], cache.length, cache.stats()) == before
        cache.free(0)  # a finished row makes room for the other
        model(ids[1:, :1].expand(2, 1), cache=cache)
    assert cache.stats()["blocks_used"] == 3


# --- memory: GQA/MQA caches hold n_kv_heads ------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_bytes_per_token_follow_the_kv_heads(kind):
    window, options = KINDS[kind]
    per_token, allocated = {}, {}
    for name, kv in KV_HEADS.items():
        cache = _model("decoder", RoPE(), kv, window).new_cache(2, 12, kind=kind, **options)
        per_token[name] = cache.bytes_per_token()
        k_bytes = cache.k.numel() * cache.k.element_size()  # what the buffers really hold
        allocated[name] = k_bytes + cache.v.numel() * cache.v.element_size()
        assert per_token[name] == 2 * N_LAYERS * kv * HEAD_DIM * 4  # K and V, float32
    assert per_token["mha"] / per_token["mqa"] == N_HEADS
    assert per_token["gqa"] / per_token["mqa"] == KV_HEADS["gqa"]
    assert allocated["mha"] / allocated["mqa"] == N_HEADS
    assert allocated["gqa"] / allocated["mqa"] == KV_HEADS["gqa"]
