"""Linear attention (src/attnlab/nn/attention/linear.py) and its recurrent cache
(src/attnlab/cache/recurrent.py).

The oracle is the definition written plainly in float64: every (query, key) pair's weight
φ(q)·φ(k), masked (causal, padding), summed and normalised — Katharopoulos et al. 2020,
arXiv:2006.16236, eq. 2 with sim(q, k) = φ(q)·φ(k). Against it:

- the non-causal and the chunked causal forms (chunk sizes that divide n and ones that do not),
  with padding and MHA / GQA / MQA, and their gradients; a state carried between calls;
- the layer (projections, RoPE before φ, GQA) and whole models: cached decoding through the
  recurrent state — one token at a time, prefill then steps, chunks of any size, padded rows —
  equals recomputation; generate (greedy, beam) uses it by default;
- the recurrent cache's memory does not grow with the tokens appended;
- no tensor of n×n or n×D×D elements is created by the causal path (checked op by op);
- a tiny linear-attention LM learns a copy task.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attnlab as al
from attnlab.cache import RecurrentCache, StaticKVCache
from attnlab.config import (
    ALiBi,
    ConfigError,
    LearnedPositions,
    LinearAttentionConfig,
    ModelConfig,
    NoPositions,
    RoPE,
    Sinusoidal,
    T5RelativeBias,
)
from attnlab.decode.beam import beam_search
from attnlab.decode.generate import generate
from attnlab.interop.converter import CONVERTERS, ConversionError
from attnlab.nn.attention import AttnContext, LinearAttention, MaskSpec
from attnlab.nn.attention.linear import (
    EPS,
    FEATURE_MAPS,
    causal_linear_attention,
    linear_attention,
)
from attnlab.nn.positional.rope import RotaryEmbedding
from attnlab.registry import UnknownNameError
from helpers.memory import LargestTensor
from helpers.tolerance import assert_within_rounding, forward_terms

V, PAD, START = 48, 1, 0
N_LAYERS, N_HEADS, D_MODEL = 2, 4, 32
HEAD_DIM = D_MODEL // N_HEADS
KV_HEADS = {"mha": N_HEADS, "gqa": 2, "mqa": 1}
MAPS = list(FEATURE_MAPS)
# the longest chain of rounded sums of a forward over at most 13 positions
# (tests/helpers/tolerance.py)
LM_TERMS = forward_terms(n_layers=N_LAYERS, d_model=D_MODEL, d_ff=4 * D_MODEL, keys=13)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- the oracle ----------------------------------------------------------------------------------


def quadratic(q, k, v, allowed, eps=EPS):
    """The definition: weights φ(q_i)·φ(k_j) for every pair, zero where not `allowed`
    (B, 1, T, S), normalised by their sum (+ eps, as the layer). q = φ(q) (B, H, T, D),
    k = φ(k) and v (B, H_kv, S, D)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    w = torch.einsum("bhid,bhjd->bhij", q, k) * allowed  # (B, H, T, S)
    return torch.einsum("bhij,bhjd->bhid", w, v) / (w.sum(-1, keepdim=True) + eps)


def allowed_of(real, causal):
    """(B, 1, T, T) bool from key validity `real` (B, T) and causality."""
    T = real.shape[1]
    ok = real[:, None, None, :].expand(-1, 1, T, T)
    return ok & torch.ones(T, T, dtype=torch.bool).tril() if causal else ok


def qkv(B=2, H=4, H_kv=2, T=37, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, T, D, generator=g, dtype=dtype),
        torch.randn(B, H_kv, T, D, generator=g, dtype=dtype),
        torch.randn(B, H_kv, T, D, generator=g, dtype=dtype),
    )


def left_padding(B, T, seed=0):
    """(B, T) bool, True = real: row 0 whole, the others with a left-padded start."""
    g = torch.Generator().manual_seed(seed)
    starts = [0, *torch.randint(1, T // 2, (B - 1,), generator=g).tolist()]
    return torch.arange(T)[None, :] >= torch.tensor(starts)[:, None]


# --- the functional forms against the definition ------------------------------------------------


@pytest.mark.parametrize("fmap", MAPS)
@pytest.mark.parametrize("kv", KV_HEADS)
def test_non_causal_equals_the_definition(fmap, kv):
    phi = FEATURE_MAPS.get(fmap)
    q, k, v = qkv(H=N_HEADS, H_kv=KV_HEADS[kv], T=23)
    real = left_padding(2, 23)
    want = quadratic(phi(q), phi(k), v, allowed_of(real, causal=False))
    got = linear_attention(phi(q), phi(k) * real[:, None, :, None], v)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # the fp32 computation of the layer, against the float64 definition
    got32 = linear_attention(phi(q.float()), phi(k.float()) * real[:, None, :, None], v.float())
    torch.testing.assert_close(got32.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 5, 8, 16, 36, 37, 64])  # 37 tokens: most do not divide
@pytest.mark.parametrize("fmap", MAPS)
@pytest.mark.parametrize("kv", KV_HEADS)
def test_chunked_causal_equals_the_masked_definition(chunk, fmap, kv):
    phi = FEATURE_MAPS.get(fmap)
    q, k, v = qkv(H=N_HEADS, H_kv=KV_HEADS[kv], T=37)
    real = left_padding(2, 37)
    want = quadratic(phi(q), phi(k), v, allowed_of(real, causal=True))
    got, (s, z) = causal_linear_attention(phi(q), phi(k) * real[:, None, :, None], v, None, chunk)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    fk = phi(k) * real[:, None, :, None]  # the final state is the sums over every real key
    torch.testing.assert_close(s, fk.transpose(-1, -2) @ v, rtol=0, atol=1e-12)
    torch.testing.assert_close(z, fk.sum(2), rtol=0, atol=1e-12)
    q32, k32, v32 = phi(q.float()), phi(k.float()) * real[:, None, :, None], v.float()
    got32, _ = causal_linear_attention(q32, k32, v32, None, chunk)
    torch.testing.assert_close(got32.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("split", [1, 10, 36])
def test_a_carried_state_continues_the_sequence(split):
    """Two calls, the second starting from the first's state, give the one call's outputs."""
    phi = FEATURE_MAPS.get("elu+1")
    q, k, v = (phi(t) if i < 2 else t for i, t in enumerate(qkv(T=37)))
    whole, state = causal_linear_attention(q, k, v, None, 8)
    first, mid = causal_linear_attention(q[:, :, :split], k[:, :, :split], v[:, :, :split], None, 8)
    second, end = causal_linear_attention(q[:, :, split:], k[:, :, split:], v[:, :, split:], mid, 5)
    torch.testing.assert_close(torch.cat((first, second), 2), whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(end, state, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fmap", MAPS)
def test_gradients_equal_the_definitions(causal, fmap):
    phi = FEATURE_MAPS.get(fmap)
    real = left_padding(2, 19)
    grads = []
    for form in ("definition", "layer"):
        q, k, v = (t.requires_grad_() for t in qkv(H=4, H_kv=2, T=19, seed=3))
        fq, fk = phi(q), phi(k)
        if form == "definition":
            out = quadratic(fq, fk, v, allowed_of(real, causal))
        elif causal:
            out, _ = causal_linear_attention(fq, fk * real[:, None, :, None], v, None, 6)
        else:
            out = linear_attention(fq, fk * real[:, None, :, None], v)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=out.dtype)
        grads.append(torch.autograd.grad((out * weight).sum(), (q, k, v)))
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


# --- the layer: projections, RoPE before φ, GQA ---------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_layer_equals_the_definition_with_rope_and_gqa(causal):
    torch.manual_seed(0)
    layer = LinearAttention(d_model=D_MODEL, n_heads=4, n_kv_heads=2, chunk_size=4).double()
    B, T = 2, 11
    x = torch.randn(B, T, D_MODEL, dtype=torch.float64)
    real = left_padding(B, T)
    pos = (real.long().cumsum(1) - 1).clamp(min=0)
    rotation = RotaryEmbedding(rotary_dim=HEAD_DIM).rotation(pos)
    ctx = AttnContext(MaskSpec(pos, pos, causal, key_padding=real), rotation=rotation)
    got, weights = layer(x, ctx)
    heads = lambda proj, n: proj(x).view(B, T, n, HEAD_DIM).transpose(1, 2)  # noqa: E731
    q = F.elu(rotation(heads(layer.q_proj, 4))) + 1  # rotated, then φ
    k = F.elu(rotation(heads(layer.k_proj, 2))) + 1
    out = quadratic(q, k, heads(layer.v_proj, 2), allowed_of(real, causal))
    want = layer.o_proj(out.transpose(1, 2).reshape(B, T, D_MODEL))
    assert weights is None
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_layer_refuses_what_it_cannot_compute():
    layer = LinearAttention(d_model=16, n_heads=2)
    x = torch.randn(1, 3, 16)
    pos = torch.arange(3)[None]
    with pytest.raises(ValueError, match=r"never forms the .* weights"):
        layer(x, AttnContext(MaskSpec(pos, pos, True)), need_weights=True)
    with pytest.raises(ValueError, match="score bias"):
        layer(x, AttnContext(MaskSpec(pos, pos, True), bias=torch.zeros(1, 2, 3, 3)))
    with pytest.raises(ValueError, match="no sliding window"):
        layer(x, AttnContext(MaskSpec(pos, pos, True, window=2)))
    with pytest.raises(UnknownNameError, match="'elu\\+1'"):
        LinearAttention(d_model=16, n_heads=2, feature_map="elu")
    with pytest.raises(ValueError, match="chunk_size"):
        LinearAttention(d_model=16, n_heads=2, chunk_size=0)


def test_half_precision_sums_in_fp32():
    torch.manual_seed(0)
    layer = LinearAttention(d_model=D_MODEL, n_heads=4, n_kv_heads=2)
    x = torch.randn(2, 40, D_MODEL)
    pos = torch.arange(40).expand(2, -1)
    ctx = AttnContext(MaskSpec(pos, pos, True, aligned=True))
    want, _ = layer(x, ctx)
    got, _ = layer.to(torch.bfloat16)(x.bfloat16(), ctx)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)


# --- models: config, build, cached decoding ------------------------------------------------------


def _model(arch="decoder", positional=None, n_kv_heads=2, fmap="elu+1", seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        arch=arch,
        vocab_size=V,
        d_model=D_MODEL,
        n_layers=N_LAYERS,
        n_heads=N_HEADS,
        n_kv_heads=n_kv_heads,
        positional=positional or RoPE(),
        attention=LinearAttentionConfig(feature_map=fmap),
        tie_embeddings=False,
        init="xavier",
    )
    model = al.build_model(cfg).eval()
    for block in model.decoder.blocks if arch != "encoder" else model.encoder.blocks:
        block.self_attn.chunk_size = 3  # prompts of several chunks, some partial
    return model


def test_config_chooses_the_layer_and_the_cache():
    model = _model(fmap="relu")
    attn = model.decoder.blocks[0].self_attn
    assert type(attn) is LinearAttention and attn.feature_map == "relu"
    assert isinstance(model.new_cache(2, 8), RecurrentCache)  # the default for this model
    softmax = al.build_model(model.config.replace(attention={}))  # no kind: softmax
    assert type(softmax.decoder.blocks[0].self_attn) is al.nn.attention.Attention
    assert isinstance(softmax.new_cache(2, 8), StaticKVCache)
    cfg = model.config
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert cfg.merged(attention={"kind": "softmax"}).attention.kind == "softmax"


def test_config_refuses_what_linear_attention_cannot_use():
    with pytest.raises(ConfigError) as info:
        LinearAttentionConfig(dropout=0.1, sliding_window=4)
    assert len(info.value.problems) == 2
    assert all("softmax attention only" in p and "remove it" in p for p in info.value.problems)
    for pos in (ALiBi(), T5RelativeBias()):
        with pytest.raises(ConfigError, match=r"attention\.kind 'linear' never forms.*'rope'"):
            _model(positional=pos)


@torch.no_grad()
def _reference(model, src, n):
    seq = torch.full((src.shape[0], 1), START) if _seq2seq(model) else src
    for _ in range(n):
        logits = model(src, seq).logits if _seq2seq(model) else model(seq).logits
        seq = torch.cat((seq, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return seq


def _seq2seq(model) -> bool:
    return isinstance(model, al.nn.model.EncoderDecoderModel)


POSITIONS = {
    "rope": RoPE(),
    "sinusoidal": Sinusoidal(),
    "learned": LearnedPositions(max_len=64),
    "none": NoPositions(),
}


@pytest.mark.parametrize("fmap", MAPS)
@pytest.mark.parametrize("kv", KV_HEADS)
@pytest.mark.parametrize("pos", POSITIONS)
def test_one_token_at_a_time_equals_the_full_forward(pos, kv, fmap):
    model = _model(positional=POSITIONS[pos], n_kv_heads=KV_HEADS[kv], fmap=fmap)
    ids = torch.randint(2, V, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(2, 13)
        steps = torch.cat([model(ids[:, i : i + 1], cache=cache).logits for i in range(13)], 1)
    # the recurrent and the chunked form sum in different orders: rounding alone may differ
    assert_within_rounding(steps, full, LM_TERMS)


@pytest.mark.parametrize("chunks", [[11], [7, 1, 3], [1, 1, 5, 2, 1, 1], [2, 9]])
def test_chunks_of_any_size_give_the_full_forward(chunks):
    """A left-padded prompt fed in chunks (prefill, then more chunks or single steps) gives the
    full forward's logits at every real token."""
    model = _model()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, V, (2, 11), generator=g)
    mask = left_padding(2, 11, seed=5).long()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = model.new_cache(2, 11)
        got, t = [], 0
        for n in chunks:
            got.append(model(ids[:, t : t + n], mask[:, t : t + n], cache=cache).logits)
            t += n
    keep = mask.bool()
    assert_within_rounding(torch.cat(got, 1)[keep], full[keep], LM_TERMS)


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_cached_greedy_equals_recomputation_and_padded_rows_decode_alone(arch):
    model = _model(arch)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(2, V, (n,), generator=g) for n in (7, 2, 5)]
    T = max(len(r) for r in rows)
    ids, mask = torch.full((3, T), PAD), torch.zeros(3, T, dtype=torch.long)
    for i, r in enumerate(rows):  # prompts left-padded, sources right-padded
        sl = slice(0, len(r)) if arch == "encoder-decoder" else slice(T - len(r), T)
        ids[i, sl], mask[i, sl] = r, 1
    got = generate(model, ids, 9, attention_mask=mask, decoder_start_token_id=START)
    for i, r in enumerate(rows):
        alone = _reference(model, r[None], 9)[0]
        want = alone if arch == "encoder-decoder" else torch.cat((ids[i, : T - len(r)], alone))
        assert got[i].tolist() == want.tolist(), f"row {i}"


def test_beam_search_uses_the_recurrent_state():
    """One beam is greedy; a padded batch gives each item's beams as if searched alone (the
    states follow their beams through every reorder)."""
    model = _model()
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(2, V, (n,), generator=g) for n in (6, 3, 5)]
    ids, mask = torch.full((3, 6), PAD), torch.zeros(3, 6, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 6 - len(r) :], mask[i, 6 - len(r) :] = r, 1
    one = beam_search(model, ids, 8, num_beams=1, attention_mask=mask)
    assert torch.equal(one, generate(model, ids, 8, attention_mask=mask))
    beams = beam_search(model, ids, 8, num_beams=3, attention_mask=mask)
    for i, r in enumerate(rows):
        alone = beam_search(model, r[None], 8, num_beams=3)[0]
        assert beams[i, 6 - len(r) :].tolist() == alone.tolist(), f"row {i}"


def test_reorder_moves_the_states_with_their_rows():
    model = _model()
    ids = torch.randint(2, V, (2, 5), generator=torch.Generator().manual_seed(6))
    step = torch.randint(2, V, (3, 1), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        cache = model.new_cache(2, 6)
        model(ids, cache=cache)
        cache.reorder(torch.tensor([1, 0, 0]))
        got = model(step, cache=cache).logits
        fresh = model.new_cache(3, 6)
        model(ids[[1, 0, 0]], cache=fresh)
        want = model(step, cache=fresh).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_wrong_cache_kind_is_a_clear_error():
    ids = torch.randint(2, V, (1, 4))
    linear = _model()
    with pytest.raises(ValueError, match="kind='recurrent'"):
        linear(ids, cache=linear.new_cache(1, 8, kind="static"))
    softmax = al.build_model(linear.config.replace(attention={}))
    with pytest.raises(ValueError, match="softmax-attention model decodes with kind 'static'"):
        softmax(ids, cache=softmax.new_cache(1, 8, kind="recurrent"))


def test_encoder_padding_does_not_leak():
    """Bidirectional (non-causal) linear attention: a right-padded row's real positions are
    those of the row alone."""
    model = _model("encoder", Sinusoidal())
    ids = torch.randint(2, V, (2, 9), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        both = model(ids, attention_mask=mask).hidden
        alone = model(ids[1:, :5]).hidden
    torch.testing.assert_close(both[1, :5], alone[0], rtol=1e-5, atol=1e-5)


def test_no_transformers_family_takes_linear_attention():
    cfg = _model().config
    for name in CONVERTERS.names():
        with pytest.raises(ConversionError, match="linear attention"):
            CONVERTERS.get(name).config_to_hf(cfg)


# --- memory --------------------------------------------------------------------------------------


def test_recurrent_state_does_not_grow_with_length():
    """Decoding 60 tokens: the cache holds L·B·H_kv·(D² + D) fp32 values from the start."""
    model = _model(n_kv_heads=2)
    cache = model.new_cache(2, 4)  # max_len is informational: the state never fills
    expected = N_LAYERS * 2 * 2 * (HEAD_DIM**2 + HEAD_DIM) * 4
    held = lambda: sum(t.numel() * t.element_size() for t in (*cache.s, *cache.z))  # noqa: E731
    sizes = set()
    with torch.no_grad():
        model(torch.randint(2, V, (2, 7)), cache=cache)
        for _ in range(60):
            model(torch.randint(2, V, (2, 1)), cache=cache)
            sizes.add((held(), cache.stats()["allocated_bytes"], cache.state_bytes()))
    assert cache.length == 67 and sizes == {(expected, expected, expected)}
    assert cache.bytes_per_token() == 0


def test_causal_path_forms_no_n_by_n_or_n_by_d_by_d_tensor():
    """Forward and backward of the layer at n = 1024: no op creates a tensor larger than the
    layer's own input (n·d_model), far below n² and n·D²; the definition trips the guard."""
    torch.manual_seed(0)
    B, n, H, D, d_model = 1, 1024, 2, 16, 32
    layer = LinearAttention(d_model=d_model, n_heads=H, head_dim=D, chunk_size=32)
    x = torch.randn(B, n, d_model, requires_grad=True)
    pos = torch.arange(n)[None]
    ctx = AttnContext(
        MaskSpec(pos, pos, True, aligned=True), rotation=RotaryEmbedding(rotary_dim=D).rotation(pos)
    )
    limit = B * n * d_model
    assert limit * D // 2 <= n * D * D and limit < n * n  # the guard is far below both
    with LargestTensor() as forward:
        out, _ = layer(x, ctx)
    with LargestTensor() as backward:
        out.square().sum().backward()
    assert 0 < forward.largest <= limit, forward.largest
    assert 0 < backward.largest <= limit, backward.largest
    assert x.grad is not None and torch.isfinite(x.grad).all()
    with LargestTensor() as definition:  # the guard can fail: the quadratic form trips it
        q, k, v = (t[:, :, :n] for t in qkv(B, H, H, n, D, torch.float32))
        quadratic(q, k, v, allowed_of(torch.ones(B, n, dtype=torch.bool), True))
    assert definition.largest >= n * n


# --- learning ------------------------------------------------------------------------------------

CV, CN = 16, 5  # copy task: vocabulary, copied length (as tests/test_sweep.py)


def _copy_batch(g, b):
    x = torch.randint(0, CV, (b, CN), generator=g)
    return torch.cat([x, x], dim=1)


def _copy_loss(model, ids):
    logits = model(ids).logits[:, CN : 2 * CN - 1]
    return F.cross_entropy(logits.reshape(-1, CV), ids[:, CN + 1 :].reshape(-1))


def test_a_tiny_linear_attention_lm_learns_to_copy():
    """x x: predict the second copy from its second token on. ln V is the best loss without
    looking back N - 1 tokens; the held-out loss must fall below 0.7 x min(initial, ln V)."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch="decoder",
        vocab_size=CV,
        d_model=64,
        n_layers=2,
        n_heads=4,
        positional=RoPE(),
        attention=LinearAttentionConfig(),
        norm={"kind": "rmsnorm"},
    )
    model = al.build_model(cfg)
    g = torch.Generator().manual_seed(1)
    held_out = _copy_batch(g, 64)
    with torch.no_grad():
        initial = _copy_loss(model.eval(), held_out).item()
    target = 0.7 * min(initial, math.log(CV))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    final = initial
    for step in range(1, 601):
        model.train()
        loss = _copy_loss(model, _copy_batch(g, 32))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0:
            with torch.no_grad():
                final = _copy_loss(model.eval(), held_out).item()
            if final < target:
                break
    assert final < target, f"held-out loss {initial:.3f} -> {final:.3f}, needed < {target:.3f}"
