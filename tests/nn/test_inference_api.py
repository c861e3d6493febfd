"""The decoding models' inference API (src/attnlab/nn/model.py, `_Decoding`) against forward.

- forward is embed -> run -> logits: the three public steps give forward's logits and hidden
  states to the bit, without a cache and on a cache (decoder-only, encoder-decoder with a
  target-side table of its own).
- logits at chosen positions equal forward's logits at those positions (to fp32 rounding).
- cache_geometry is what new_cache builds from: the cache's shape has its sizes, window, dtype
  and device, and new_cache without a kind is the geometry's kind.
"""

from __future__ import annotations

import pytest
import torch

import attnlab as al
from attnlab.config import AttentionConfig, LearnedPositions, ModelConfig, RoPE

V = 48


TINY = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, init="xavier")


def _model(arch="decoder", **extra):
    torch.manual_seed(0)
    extra.setdefault("positional", RoPE())
    return al.build_model(ModelConfig(arch=arch, **TINY, **extra)).eval()


@torch.no_grad()
def test_forward_is_embed_run_logits():
    model = _model(tie_embeddings=False)
    ids = torch.randint(2, V, (2, 7))
    out = model(ids)
    pos = torch.arange(7).expand(2, 7)
    hidden, _ = model.run(model.embed(ids), pos, aligned=True)
    assert torch.equal(hidden, out.hidden)
    assert torch.equal(model.logits(hidden), out.logits)
    last = torch.tensor([6, 3])
    picked = model.logits(hidden[torch.arange(2), last])  # (B, V): one position per row
    # the same dot products, but a (2, d) matmul blocks differently from a (2, 7, d) one: fp32
    # rounding, not a difference in what is computed
    torch.testing.assert_close(picked, out.logits[torch.arange(2), last])


@torch.no_grad()
def test_run_on_a_cache_is_forward_on_that_cache():
    model = _model()
    ids = torch.randint(2, V, (2, 5))
    ours, theirs = model.new_cache(2, 8), model.new_cache(2, 8)
    want = model(ids, cache=theirs).logits
    pos = torch.arange(5).expand(2, 5)
    got = model.logits(model.run(model.embed(ids), pos, None, ours)[0])
    assert torch.equal(got, want) and torch.equal(ours.next_position, theirs.next_position)


@torch.no_grad()
def test_encoder_decoder_steps_use_the_target_side():
    model = _model("encoder-decoder", share_encoder_decoder_embeddings=False)
    src, tgt = torch.randint(2, V, (2, 6)), torch.randint(2, V, (2, 4))
    memory = model.encode(src)
    out = model.decode(tgt, memory)
    emb = model.embed(tgt)
    assert torch.equal(emb, model.decoder_embed_tokens(tgt) * model.embed_scale)
    pos = torch.arange(4).expand(2, 4)
    hidden, _ = model.run(emb, pos, aligned=True, memory=memory)
    assert torch.equal(model.logits(hidden), out.logits)


@pytest.mark.parametrize("kind", [None, "paged"])
def test_cache_geometry_is_what_new_cache_builds_from(kind):
    model = _model(attention=AttentionConfig(sliding_window=4))
    g = model.cache_geometry()
    assert (g.n_layers, g.n_kv_heads, g.head_dim, g.window) == (2, 2, 8, 4)
    assert (g.kind, g.dtype, g.device) == ("static", torch.float32, torch.device("cpu"))
    cache = model.new_cache(3, 10, kind=kind)
    assert cache.shape == g.shape(3, 10)
    assert type(cache).__name__ == ("StaticKVCache" if kind is None else "PagedKVCache")


def test_max_positions_is_the_learned_table():
    assert _model(positional=LearnedPositions(max_len=32)).max_positions == 32
    assert _model().max_positions is None
