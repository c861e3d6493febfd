"""Transformer-XL (Dai et al. 2019, arXiv:1901.02860) against the paper's equations.

`reference` writes section 3.3's score out in float64 for one attention layer:

    A_ij = (q_i + u)·k_j + (q_i + v)·W_R R_{i−j},   softmax_j(A_ij / sqrt(d_head)) over j <= i

over the keys of [SG(h_mem); h] (section 3.2: the memory's hidden states concatenated under a
stop-gradient before the key and value projections), with the relative shift done by hand: a loop
over every (i, j) that builds R_{i−j} from its offset. attnlab's layer, fed the memory through its
memory cache, must match it in float32 (1e-5) and float64 (1e-10), outputs and gradients (u, v,
W_R, q/k/v/o, the input), with memory and without. Then, through whole models: every registered
kernel equals the naive one; no gradient reaches the memory; the memory is the last mem_len
positions; decoding token by token through the memory equals the whole segment recomputed with
the same memory; no kernel but naive builds a (T, S) tensor; bad input raises a ValueError.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import attnlab as al
from attnlab.cache import CacheShape, MemoryKVCache
from attnlab.config import ConfigError, ModelConfig, XLAttentionConfig, XLRelative
from attnlab.nn.attention import KERNELS, AttnContext, MaskSpec, XLAttention
from attnlab.nn.attention import kernels as K
from attnlab.nn.positional.xl_relative import XLRelativePositions
from helpers.memory import LargestTensor
from helpers.tolerance import assert_within_rounding, forward_terms

F64 = torch.float64
d, H, D = 16, 2, 8  # d_model, heads, head dim of the layer tests


def layer_and_scheme(per_layer_uv: bool = False, layer_index: int = 0, seed: int = 0):
    """An XL attention layer and its scheme with every weight random (u, v included)."""
    torch.manual_seed(seed)
    layer = XLAttention(d_model=d, n_heads=H, mem_len=0, layer_index=layer_index)
    scheme = XLRelativePositions(
        d_model=d, n_heads=H, head_dim=D, n_layers=2, causal=True, per_layer_uv=per_layer_uv
    )
    with torch.no_grad():
        for p in [*layer.parameters(), *scheme.parameters()]:
            p.normal_(std=0.4)
    return layer, scheme


def reference(h: torch.Tensor, h_mem: torch.Tensor, layer, scheme, layer_index: int = 0):
    """Section 3.3 in float64, loops over (i, j): h (B, T, d) the segment, h_mem (B, M, d) the
    memory (M may be 0). Weights from `layer` (W_q, W_k, W_v, W_o, W_R) and `scheme` (u, v)."""
    Wq, Wk, Wv, Wo, Wr = (
        getattr(layer, n).weight.double() for n in ("q_proj", "k_proj", "v_proj", "o_proj", "r_proj")
    )  # fmt: skip
    u, v = scheme.u.double(), scheme.v.double()
    if u.dim() == 3:  # one pair per layer
        u, v = u[layer_index], v[layer_index]
    B, T, M = h.shape[0], h.shape[1], h_mem.shape[1]
    h_tilde = torch.cat([h_mem.detach(), h], dim=1).double()  # [SG(h_mem) ∘ h]
    q = (h.double() @ Wq.T).view(B, T, H, D)
    k = (h_tilde @ Wk.T).view(B, M + T, H, D)
    val = (h_tilde @ Wv.T).view(B, M + T, H, D)
    inv_freq = 1 / 10000 ** (torch.arange(0, d, 2, dtype=F64) / d)
    rows = []
    for i in range(T):
        scores = []
        for j in range(M + T):
            offset = (M + i) - j  # query i stands after the M memory slots
            if offset < 0:  # a future key
                scores.append(torch.full((B, H), -math.inf, dtype=F64))
                continue
            R = torch.cat([torch.sin(offset * inv_freq), torch.cos(offset * inv_freq)])  # (d,)
            r = (Wr @ R).view(H, D)  # W_R R_{i−j}
            a = ((q[:, i] + u) * k[:, j]).sum(-1) + ((q[:, i] + v) * r).sum(-1)  # (B, H)
            scores.append(a / math.sqrt(D))
        p = torch.stack(scores, dim=-1).softmax(dim=-1)  # (B, H, M + T)
        rows.append(torch.einsum("bhj,bjhd->bhd", p, val).reshape(B, H * D))
    return torch.stack(rows, dim=1) @ Wo.T  # (B, T, d)


def ours(layer, scheme, h: torch.Tensor, h_mem: torch.Tensor, mem_len: int | None):
    """The layer over two segments, h_mem then h, through a memory cache (the stack's steps:
    append, then the mask and the scheme's positions); mem_len None: h alone, no cache."""
    if mem_len is None:
        pos = torch.arange(h.shape[1]).expand(h.shape[0], -1)
        ctx = AttnContext(
            MaskSpec(pos, pos, causal=True, aligned=True), scheme.score_bias(pos, pos)
        )
        return layer(h, ctx)[0]
    cache = MemoryKVCache(CacheShape(1, h.shape[0], 0, H, D, h.dtype), mem_len=mem_len)
    for x in (h_mem, h):
        pos = cache.next_position[:, None] + torch.arange(x.shape[1])  # positions keep counting
        k_pos, _ = cache.append(pos, torch.ones_like(pos, dtype=torch.bool))
        ctx = AttnContext(MaskSpec(pos, k_pos, causal=True), scheme.score_bias(pos, k_pos))
        out, _ = layer(x, ctx, cache=cache.layers[0])
    return out


CASES = {  # (memory tokens run first, mem_len kept; None: no memory, no cache)
    "no-memory": (0, None),
    "memory": (5, 5),
    "memory-truncated": (9, 4),  # only the last 4 of the 9 earlier positions are kept
}


@pytest.mark.parametrize("per_layer_uv", [False, True], ids=["shared-uv", "per-layer-uv"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_layer_equals_the_paper_equations(case, dtype, per_layer_uv):
    n_mem, mem_len = CASES[case]
    layer, scheme = layer_and_scheme(per_layer_uv, layer_index=1)
    layer, scheme = layer.to(dtype), scheme.to(dtype)
    ref_layer, ref_scheme = copy.deepcopy(layer).double(), copy.deepcopy(scheme).double()
    g = torch.Generator().manual_seed(1)
    h_mem = torch.randn(2, n_mem, d, generator=g, dtype=F64)
    h = torch.randn(2, 6, d, generator=g, dtype=F64, requires_grad=True)
    kept = h_mem[:, h_mem.shape[1] - (mem_len or 0) :]  # what the memory holds
    want = reference(h, kept, ref_layer, ref_scheme, layer_index=1)
    h_ours = h.detach().to(dtype).requires_grad_()
    got = ours(layer, scheme, h_ours, h_mem.to(dtype), mem_len)
    # one layer over at most 15 keys, forward then backward (twice its chain, plus the weight
    # gradients' sums over 2·6 rows): rounding alone (tests/helpers/tolerance.py) separates the two
    n = 2 * forward_terms(n_layers=1, d_model=d, d_ff=0, keys=15) + 12

    def close(a, b, scale, msg=None):  # scale: the size of the summed terms
        if dtype == F64:
            torch.testing.assert_close(a.double(), b, rtol=1e-10, atol=1e-10, msg=msg)
        else:
            assert_within_rounding(a, b, n, scale=scale, msg=msg)

    close(got, want, float(want.detach().abs().max()))
    grad_out = torch.randn(want.shape, generator=g, dtype=F64)
    (want * grad_out).sum().backward()
    (got * grad_out.to(dtype)).sum().backward()
    named = [*layer.named_parameters(), *scheme.named_parameters()]
    refs = dict([*ref_layer.named_parameters(), *ref_scheme.named_parameters()])
    assert {n for n, _ in named} == {"q_proj.weight", "k_proj.weight", "v_proj.weight",
                                      "o_proj.weight", "r_proj.weight", "u", "v"}  # fmt: skip
    close(h_ours.grad, h.grad, float(h.grad.abs().max()))  # each gradient at its own size
    for name, p in named:
        close(p.grad, refs[name].grad, float(refs[name].grad.abs().max()), msg=name)
    if per_layer_uv:  # layer 1 read its own pair only
        assert scheme.u.grad[0].abs().max() == 0 and scheme.u.grad[1].abs().max() > 0


def test_the_position_term_matters():
    """Guards the oracle test's premise: without W_R R the layer computes something else."""
    layer, scheme = layer_and_scheme()
    h = torch.randn(2, 6, d, generator=torch.Generator().manual_seed(1))
    before = ours(layer, scheme, h, h[:, :0], None)
    with torch.no_grad():
        layer.r_proj.weight.zero_()
        scheme.v.zero_()
    assert (ours(layer, scheme, h, h[:, :0], None) - before).abs().max() > 1e-2


# --- whole models ---------------------------------------------------------------------------------

V = 40


def xl_model(n_layers: int = 2, mem_len: int = 12, segment_len: int | None = None, **changes):
    cfg = ModelConfig(
        arch="decoder", vocab_size=V, d_model=32, n_layers=n_layers, n_heads=4, d_ff=64,
        positional=XLRelative(), attention=XLAttentionConfig(mem_len=mem_len, segment_len=segment_len),
        norm_placement="post", final_norm=False, init="normal", **changes,
    )  # fmt: skip
    torch.manual_seed(0)
    model = al.build_model(cfg)
    with torch.no_grad():  # u, v and W_R large enough that positions matter
        for name, p in model.named_parameters():
            if name.endswith(("positional.u", "positional.v", "r_proj.weight")):
                p.normal_(std=0.3)
    return model


def segments(model, ids: torch.Tensor, T: int, cache=None):
    """Logits of each T-token segment of ids, in order, carrying the memory (a fresh cache
    of the model's kind unless one is given)."""
    cache = cache if cache is not None else model.new_cache(ids.shape[0], ids.shape[1])
    return [model(ids[:, s : s + T], cache=cache).logits for s in range(0, ids.shape[1], T)]


def run_segments(kernel: str, ids: torch.Tensor, g: torch.Generator):
    model = al.set_kernel(xl_model(), kernel)
    logits = torch.cat(segments(model, ids, 20), dim=1)
    grad_out = torch.randn(logits.shape, generator=g)
    (logits * grad_out).sum().backward()
    return logits, {n: p.grad for n, p in model.named_parameters()}


# segments of 20 over a memory of 12: at most 32 keys (tests/helpers/tolerance.py)
SEGMENT_TERMS = forward_terms(n_layers=2, d_model=32, d_ff=64, keys=32)


# the kernels that take any bias (XL's is bound per layer, not pointwise: flex refuses it) and
# the selector; the single-structure kernels refuse it (test_sweep.py,
# tests/nn/attention/kernels/test_flex.py)
@pytest.mark.parametrize("kernel", ["auto", "chunked", "tiled"])
def test_every_kernel_equals_naive_with_memory(kernel, monkeypatch):
    """Three segments of 20 with a memory of 12 (the first folds whole, the second is cut), small
    blocks so that the kernels' loops, key ranges and recomputation in backward all run."""
    monkeypatch.setattr(K.chunked, "BLOCK_BYTES", 4 * 2 * 4 * 32 * 8)  # 8 rows of 32 keys
    monkeypatch.setattr(K.chunked, "SAVE_BYTES", 0)
    monkeypatch.setattr(K.tiled, "TILE_Q", 8)
    monkeypatch.setattr(K.tiled, "TILE_K", 6)
    ids = torch.randint(0, V, (2, 60), generator=torch.Generator().manual_seed(0))
    if kernel != "auto" and not KERNELS.get(kernel).caps.backward:
        with torch.no_grad():
            got = torch.cat(segments(al.set_kernel(xl_model(), kernel), ids, 20), 1)
            want = torch.cat(segments(al.set_kernel(xl_model(), "naive"), ids, 20), 1)
        assert_within_rounding(got, want, SEGMENT_TERMS)
        return
    got, grads = run_segments(kernel, ids, torch.Generator().manual_seed(1))
    want, ref_grads = run_segments("naive", ids, torch.Generator().manual_seed(1))
    assert_within_rounding(got, want, SEGMENT_TERMS)
    # backward: twice the forward's chain, plus each weight gradient's sum over 2·60 rows
    for name, ref in ref_grads.items():
        assert_within_rounding(grads[name], ref, 2 * SEGMENT_TERMS + 120, msg=name)


def test_no_gradient_reaches_the_memory():
    """The first segment's computation gets no gradient from the second's loss (SG), and what
    the cache keeps for later segments carries no graph."""
    layer, scheme = layer_and_scheme()
    g = torch.Generator().manual_seed(1)
    h_mem = torch.randn(2, 5, d, generator=g, requires_grad=True)
    h = torch.randn(2, 6, d, generator=g, requires_grad=True)
    out = ours(layer, scheme, h, h_mem, mem_len=5)
    g_mem, g_h = torch.autograd.grad(out.sum(), [h_mem, h], allow_unused=True)
    assert g_mem is None and g_h.abs().max() > 0
    model = xl_model()
    cache = model.new_cache(2, 40)
    segments(model, torch.randint(0, V, (2, 40), generator=g), 20, cache)
    assert all(not t.requires_grad for t in [*cache.k, *cache.v])


def test_stored_memory_equals_the_memory_recomputed_from_its_inputs():
    """With gradients the XL layer recomputes the memory's K/V from the stored layer inputs
    (the paper's W_k·SG(h_mem)); without, it reads the stored K/V: the same values."""
    model = xl_model().eval()
    ids = torch.randint(0, V, (2, 60), generator=torch.Generator().manual_seed(0))
    recomputed = torch.cat(segments(model, ids, 20), dim=1)
    assert recomputed.requires_grad
    with torch.no_grad():
        stored = torch.cat(segments(model, ids, 20), dim=1)
    torch.testing.assert_close(stored, recomputed.detach(), rtol=1e-5, atol=1e-6)


def test_the_memory_is_the_last_mem_len_positions():
    """One layer: the third segment's logits ignore a token older than its memory and not one
    inside it; the cache holds exactly the last mem_len positions; positions keep counting."""
    model = xl_model(n_layers=1, mem_len=12).eval()
    ids = torch.randint(0, V, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = segments(model, ids, 20)[2]
        old, recent = ids.clone(), ids.clone()
        old[0, 27] = (ids[0, 27] + 1) % V  # position 27 < 40 - 12: outside the memory
        recent[0, 28] = (ids[0, 28] + 1) % V  # 28 >= 40 - 12: the memory's first position
        torch.testing.assert_close(segments(model, old, 20)[2], base, rtol=0, atol=0)
        assert (segments(model, recent, 20)[2] - base).abs().max() > 1e-4
        cache = model.new_cache(1, 60)
        segments(model, ids, 20, cache)
        model(ids[:, :1], cache=cache)  # a fourth segment folds the third
    assert cache.positions[0].tolist() == [*range(48, 60), 60]
    assert cache.n_memory == 12 and int(cache.next_position[0]) == 61


def test_more_layers_see_further_than_the_memory():
    """Section 3.2: the context grows by about mem_len per layer. Two layers: the same old token,
    outside one layer's memory, now changes the third segment; one two memories back does not."""
    model = xl_model(n_layers=2, mem_len=12).eval()
    with torch.no_grad():  # sharper attention, so that a two-hop influence is well above noise
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                p.normal_(std=0.3)
    ids = torch.randint(0, V, (1, 60), generator=torch.Generator().manual_seed(0))
    old, older = ids.clone(), ids.clone()
    old[0, 27] = (ids[0, 27] + 1) % V
    older[0, 5] = (ids[0, 5] + 1) % V  # before layer 0's memory of segment 2 (8 .. 19)
    with torch.no_grad():
        base = segments(model, ids, 20)[2]
        assert (segments(model, old, 20)[2] - base).abs().max() > 1e-4
        torch.testing.assert_close(segments(model, older, 20)[2], base, rtol=0, atol=0)


def test_positions_enter_only_as_offsets():
    model = xl_model().eval()
    ids = torch.randint(0, V, (2, 15), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(15).expand(2, -1)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, positions=pos + 1000).logits, model(ids, positions=pos).logits
        )


def test_decoding_token_by_token_equals_the_whole_segment_with_the_same_memory():
    """A first segment makes the memory; then the second segment token by token through the
    memory cache (segment_len 16) gives the logits of the whole segment run at once with that
    memory, and greedy decoding from it the tokens that recomputation gives."""
    model = xl_model(mem_len=12, segment_len=16).eval()
    ids = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model.new_cache(2, 32)
        model(ids[:, :16], cache=cache)
        whole = model(ids[:, 16:], cache=cache).logits
        cache = model.new_cache(2, 32)
        model(ids[:, :16], cache=cache)
        steps = torch.cat([model(ids[:, t : t + 1], cache=cache).logits for t in range(16, 32)], 1)
        torch.testing.assert_close(steps, whole, rtol=1e-5, atol=1e-5)

        cache = model.new_cache(2, 32)  # greedy: 10 tokens after the memory and one token
        model(ids[:, :16], cache=cache)
        seq, logits = ids[:, 16:17], []
        for _ in range(10):
            logits.append(model(seq[:, -1:], cache=cache).logits[:, -1])
            seq = torch.cat([seq, logits[-1].argmax(-1, keepdim=True)], dim=1)
        for t in range(10):  # recompute: memory from the first segment, then seq[: t + 1] whole
            fresh = model.new_cache(2, 32)
            model(ids[:, :16], cache=fresh)
            again = model(seq[:, : t + 1], cache=fresh).logits[:, -1]
            torch.testing.assert_close(logits[t], again, rtol=1e-5, atol=1e-5)
            assert torch.equal(again.argmax(-1), seq[:, t + 1])


def test_generate_uses_the_memory_cache():
    """generate's default cache is the model's memory (mem_len, segment_len from the config):
    greedy tokens equal a manual loop over model.new_cache."""
    model = xl_model(mem_len=6, segment_len=8).eval()
    prompt = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(0))
    out = al.generate(model, prompt, max_new_tokens=12, strategy="greedy")
    cache = model.new_cache(1, 17)
    assert isinstance(cache, MemoryKVCache) and (cache.mem_len, cache.segment_len) == (6, 8)
    seq = prompt
    with torch.no_grad():
        logits = model(prompt, cache=cache).logits[:, -1]
        for _ in range(12):
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
            logits = model(seq[:, -1:], cache=cache).logits[:, -1]
    assert torch.equal(out, seq)


@pytest.mark.parametrize("kernel", ["auto", "chunked", "tiled", "naive"])
def test_no_kernel_but_naive_builds_the_n_by_n_wall(kernel):
    """A memory of 512 and a segment of 2,048 with 8 heads: a (1, 8, T, S) score or bias tensor
    would hold 8·2048·2560 = 41.9M elements; forward and backward stay below it."""
    cfg = ModelConfig(
        arch="decoder", vocab_size=V, d_model=64, n_layers=1, n_heads=8,
        positional=XLRelative(), attention=XLAttentionConfig(mem_len=512),
    )  # fmt: skip
    torch.manual_seed(0)
    model = al.set_kernel(al.build_model(cfg), kernel)
    ids = torch.randint(0, V, (1, 2560), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(1, 2560)
    with torch.no_grad():
        model(ids[:, :512], cache=cache)
    with LargestTensor() as mode:
        model(ids[:, 512:], cache=cache).logits.sum().backward()
    wall = 8 * 2048 * 2560
    if kernel == "naive":
        assert mode.largest >= wall  # the oracle builds it: the guard can see the wall
    else:
        assert mode.largest < wall, f"{kernel} allocated {mode.largest:,} elements"


# --- bad input ------------------------------------------------------------------------------------

BASE = dict(arch="decoder", vocab_size=V, d_model=32, n_layers=2, n_heads=4)


XL = dict(positional=XLRelative(), attention={"kind": "xl", "mem_len": 4})
BAD_CONFIGS = {
    "mem_len<0": ({**XL, "attention": {"kind": "xl", "mem_len": -1}}, r"mem_len"),
    "segment_len=0": ({**XL, "attention": {"kind": "xl", "mem_len": 4, "segment_len": 0}},
                      r"segment_len"),
    "scheme-alone": (dict(positional=XLRelative()), r"'xl-relative' needs attention.kind 'xl'"),
    "attention-alone": (dict(attention=XL["attention"]), r"'xl' needs positional 'xl-relative'"),
    "encoder": ({**XL, "arch": "encoder"}, r"needs arch 'decoder'"),
    "odd-d": ({**XL, "d_model": 33, "n_heads": 3}, r"d_model \(33\) must be even"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_configs_name_the_problem(case):
    changes, match = BAD_CONFIGS[case]
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**BASE, **changes})


def test_bad_runtime_input_names_the_problem():
    model = xl_model()
    with pytest.raises(ValueError, match=r"mem_len \(-1\) must be an integer >= 0"):
        model.new_cache(1, 8, mem_len=-1)
    with pytest.raises(ValueError, match=r"segment_len \(0\) must be an integer >= 1"):
        model.new_cache(1, 8, segment_len=0)
    plain = al.build_model(ModelConfig(**BASE))
    with pytest.raises(ValueError, match=r"kind 'memory' needs mem_len"):
        plain.new_cache(1, 8, kind="memory")
    with pytest.raises(ValueError, match=r"mem_len \(-2\) must be >= 0"):
        XLAttention(d_model=d, n_heads=H, mem_len=-2)
    layer, scheme = layer_and_scheme()
    pos = torch.arange(4)[None]
    plain_ctx = AttnContext(MaskSpec(pos, pos, causal=True))
    with pytest.raises(ValueError, match=r"needs the 'xl-relative' positional scheme"):
        layer(torch.randn(1, 4, d), plain_ctx)
    from attnlab.nn.attention import Attention  # a softmax layer handed the unbound positions

    ctx = AttnContext(MaskSpec(pos, pos, causal=True), scheme.score_bias(pos, pos))
    with pytest.raises(ValueError, match=r"use attention kind 'xl'"):
        al.set_kernel(Attention(d_model=d, n_heads=H), "naive")(torch.randn(1, 4, d), ctx)
