"""The efficient kernels against the naive oracle, block by block, and the memory they promise.

Every non-naive kernel computes the naive kernel's function: outputs and gradients (of q, k, v and
of a learnable bias table) for every bias description (none, a dense tensor, causal and
bidirectional ALiBi, causal and bidirectional T5 buckets) and mask (causal, padding, windows,
query offsets of a cache, GQA), with blocks small enough that the loop, the key-range skipping and
the recomputation in backward all run. Then: no kernel but the naive one allocates a tensor of
T·S·H elements (the n×n wall) at a length where that tensor would be large.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnlab as al
from attnlab.config import ALiBi, ModelConfig, T5RelativeBias
from attnlab.nn.attention import LinearBias, MaskSpec
from attnlab.nn.attention import kernels as K
from attnlab.nn.attention.bias import ScoreBias
from attnlab.nn.attention.kernels import AttnCall, attend
from attnlab.nn.positional.alibi import alibi_slopes
from attnlab.nn.positional.relative import T5RelativeBias as T5Scheme
from helpers.attention import BIASES, MASKS, arange, make_bias
from helpers.memory import LargestTensor
from helpers.tolerance import rounding_tol

F64 = torch.float64
FAST = ["auto", "chunked", "alibi-sdpa", "tiled"]  # "auto": the CPU selector's choice
# the kernels that serve only one structure (kernels/select.py): where else they refuse
SERVES = {"alibi-sdpa": lambda mask, bias: bias == "alibi-causal"}


def serves(kernel: str, mask: str, bias: str) -> bool:
    return SERVES.get(kernel, lambda m, b: True)(mask, bias)


def run(kernel: str, mask: str, bias_kind: str, heads: tuple[int, int], monkeypatch=None):
    T, S, spec_of = MASKS[mask]
    B, (H, H_kv), D = 2, heads, 8
    g = torch.Generator().manual_seed(0)
    spec = spec_of(B)
    q = torch.randn(B, H, T, D, generator=g, requires_grad=True)
    k = torch.randn(B, H_kv, S, D, generator=g, requires_grad=True)
    v = torch.randn(B, H_kv, S, D, generator=g, requires_grad=True)
    bias, params = make_bias(bias_kind, spec, H, T, S, g)
    out, _ = attend(q, k, v, AttnCall(scale=0.4, mask=spec, bias=bias), kernel=kernel)
    grad_out = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, [q, k, v, *params], grad_out)
    return out, grads


BLOCK_CASES = [
    (kernel, mask, bias)
    for kernel in FAST
    for mask in MASKS
    for bias in BIASES
    if serves(kernel, mask, bias)
]


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize(("kernel", "mask", "bias"), BLOCK_CASES)
def test_kernel_equals_naive_block_by_block(kernel, mask, bias, heads, monkeypatch):
    # blocks of 16 rows (the smallest), and every block recomputed in backward: the whole machinery runs
    monkeypatch.setattr(K.base, "BLOCK_BYTES", 8 * 4 * 2 * 4 * 44)
    monkeypatch.setattr(K.chunked, "BLOCK_BYTES", 8 * 4 * 2 * 4 * 44)
    monkeypatch.setattr(K.chunked, "SAVE_BYTES", 0)
    monkeypatch.setattr(K.tiled, "TILE_Q", 8)  # tiles of 8 queries x 6 keys, ragged at the edges
    monkeypatch.setattr(K.tiled, "TILE_K", 6)
    out, grads = run(kernel, mask, bias, heads)
    ref_out, ref_grads = run("naive", mask, bias, heads)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=2e-5)
    for got, ref in zip(grads, ref_grads, strict=True):  # q, k, v, then the T5 table
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("mask", ["causal", "causal-padding"])
def test_blocks_are_really_blocks(monkeypatch, mask):
    """The monkeypatched budget above does split the rows (guards the test's own premise), on
    both paths: the relative bias as offsets (aligned causal) and block by block (padding)."""
    calls = []
    monkeypatch.setattr(K.chunked, "BLOCK_BYTES", 8 * 4 * 2 * 4 * 44)

    def spy(name):
        real = getattr(K.chunked, name)
        return lambda q, *a, **kw: calls.append((name, q.shape[2])) or real(q, *a, **kw)

    for name in ("masked_sdpa", "offset_attention"):
        monkeypatch.setattr(K.chunked, name, spy(name))
    run("chunked", mask, "t5-causal", (4, 4))
    paths = {path for path, _ in calls}
    assert paths == {"offset_attention" if mask == "causal" else "masked_sdpa"}, paths
    assert len(calls) >= 3 and max(t for _, t in calls) <= 16, calls  # 16: the smallest block


def test_relative_bias_offsets_are_its_blocks():
    """`offsets` (one value per offset k − q) and its Toeplitz blocks equal the bias evaluated
    entry by entry, for T5 (both directions) and ALiBi, at consecutive positions with an
    offset (a cache) and without; non-consecutive positions take the entry-by-entry path."""
    from attnlab.nn.attention.bias import block_offsets, toeplitz

    g = torch.Generator().manual_seed(0)
    H, T, S = 3, 9, 21
    qpos, kpos = arange(2, T, 12), arange(2, S)
    for causal in (True, False):
        scheme = T5Scheme(n_heads=H, causal=causal, num_buckets=8, max_distance=20)
        with torch.no_grad():
            scheme.relative_attention_bias.weight.normal_(generator=g)
        slopes = torch.tensor(alibi_slopes(H))
        for bias in (scheme.score_bias(qpos, kpos), LinearBias(slopes, qpos, kpos, causal)):
            rows, keys = slice(2, 7), slice(4, 17)
            rel = kpos[:, None, keys] - qpos[:, rows, None]  # (B, tq, tk)
            lo, tq, tk = block_offsets(qpos, kpos, rows, keys)
            assert (lo, tq, tk) == (int(rel.min()), 5, 13)
            want = bias.offsets(lo, lo + tq + tk - 2)[:, rel[0] - lo]  # (H, tq, tk) by index
            torch.testing.assert_close(toeplitz(bias.offsets(lo, lo + tq + tk - 2), tq, tk), want)
            got = bias.block(rows, keys).expand(2, -1, -1, -1)  # (B | 1, H, tq, tk)
            torch.testing.assert_close(got, want[None].expand(2, -1, -1, -1))
    shuffled = kpos[:, torch.randperm(S, generator=g)]
    assert block_offsets(qpos, shuffled, slice(None), slice(None)) is None


@pytest.mark.parametrize("n_heads", [8, 12])
def test_alibi_channel_trick_holds_fp32_accuracy_at_length(n_heads):
    """Long causal ALiBi through sdpa vs the float64 formula on the rows where the added term is
    largest (the last ones): centring per block keeps the error at the 1e-4 the issue asks for."""
    B, D, n = 1, 16, 3072
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, n_heads, n, D, generator=g) for _ in range(3))
    pos = arange(B, n)
    slopes = torch.tensor(alibi_slopes(n_heads))
    bias = LinearBias(slopes, pos, pos, True)
    spec = MaskSpec(pos, pos, True, aligned=True)
    out, _ = attend(q, k, v, AttnCall(scale=D**-0.5, mask=spec, bias=bias), kernel="alibi-sdpa")
    rows = torch.arange(n - 48, n)
    rel = torch.arange(n)[None, :] - rows[:, None]  # (rows, S)
    s = q[:, :, rows].to(F64) @ k.to(F64).transpose(-1, -2) * D**-0.5
    s = (s + slopes.to(F64)[:, None, None] * rel).masked_fill(rel > 0, -math.inf)
    ref = s.softmax(-1) @ v.to(F64)
    assert (out[:, :, rows].to(F64) - ref).abs().max() < 1e-4


# --- the tiled kernel: the online softmax really rescales, tiles really skip, bias gradients ----


def test_tiled_rescales_when_later_tiles_have_larger_scores(monkeypatch):
    """Scores 100 + 2·j + noise along the keys j: each tile of 5 keys raises every row's max by
    about 10, so each step rescales what came before (e^(m_old − m_new) ≈ e^-10), and exp of
    scores not reduced by the running max would overflow fp32 (beyond 88). Outputs and gradients
    still equal the oracle's."""
    monkeypatch.setattr(K.tiled, "TILE_Q", 4)
    monkeypatch.setattr(K.tiled, "TILE_K", 5)
    B, H, T, S, D = 2, 2, 8, 30, 4
    g = torch.Generator().manual_seed(3)
    q = 0.1 * torch.randn(B, H, T, D, generator=g)
    k = 0.1 * torch.randn(B, H, S, D, generator=g)
    q[..., 0], k[..., 0] = 1.0, 100.0 + 2.0 * torch.arange(S)  # score ≈ 100 + 2·j (scale 1)
    v = torch.randn(B, H, S, D, generator=g)
    tile_max = (q @ k.transpose(-1, -2)).unflatten(-1, (S // 5, 5)).amax(-1)  # (B, H, T, 6)
    assert bool((tile_max.diff(dim=-1) > 5).all())  # the premise: every tile raises the max
    results = []
    for kernel in ("tiled", "naive"):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = attend(*qkv, AttnCall(scale=1.0), kernel=kernel)
        grads = torch.autograd.grad(out, qkv, torch.ones_like(out))
        results.append((out, grads))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5)
    # the scores are ~100 + 2·j, rounded at 160·u each: their sums (D, S keys twice forward, S
    # more in backward) at that scale bound the gradients' difference (tests/helpers/tolerance.py)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **rounding_tol(D + 3 * S, scale=160.0))


def test_tiled_skips_tiles_outside_the_causal_edge(monkeypatch):
    """A tile is scored only if some (query, key) pair of it is allowed: under a causal mask, the
    tiles whose first key lies beyond their last query are never computed, in forward or in
    backward."""
    monkeypatch.setattr(K.tiled, "TILE_Q", 8)
    monkeypatch.setattr(K.tiled, "TILE_K", 6)
    calls = []
    real = K.tiled.scores
    monkeypatch.setattr(K.tiled, "scores", lambda *a: calls.append(1) or real(*a))
    run("tiled", "causal", "none", (4, 2))  # T = S = 37, forward and backward
    rows, keys = K.tiled.tiles(37, 8), K.tiled.tiles(37, 6)
    needed = sum(ks.start <= rs.stop - 1 for rs in rows for ks in keys)
    assert len(calls) == 2 * needed and needed < len(rows) * len(keys)  # 22 of 35 tiles


def test_tiled_t5_table_gradient_equals_naive(monkeypatch):
    """T5's table is shared by all layers of a stack and reached only through the bias tiles that
    backward recomputes: its gradient (and every other one) through a two-layer encoder-decoder
    with padding equals the naive kernel's."""
    monkeypatch.setattr(K.tiled, "TILE_Q", 4)
    monkeypatch.setattr(K.tiled, "TILE_K", 3)
    cfg = ModelConfig(
        arch="encoder-decoder",
        vocab_size=40,
        d_model=32,
        n_layers=2,
        n_heads=4,
        positional=T5RelativeBias(num_buckets=8, max_distance=16),
    )
    g = torch.Generator().manual_seed(0)
    src, tgt = torch.randint(0, 40, (2, 11), generator=g), torch.randint(0, 40, (2, 9), generator=g)
    src_mask = torch.ones_like(src)
    src_mask[1, 7:] = 0
    grads = {}
    for kernel in ("tiled", "naive"):
        torch.manual_seed(0)
        model = al.set_kernel(al.build_model(cfg), kernel)
        out = model(src, al.shift_right(tgt, 0), attention_mask=src_mask)
        torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tgt.flatten()).backward()
        grads[kernel] = {n: p.grad for n, p in model.named_parameters()}
    tables = [n for n in grads["naive"] if "relative_attention_bias" in n]
    assert len(tables) == 2 and all(grads["tiled"][n].abs().sum() > 0 for n in tables)
    for name, ref in grads["naive"].items():
        torch.testing.assert_close(grads["tiled"][name], ref, rtol=1e-4, atol=1e-5, msg=name)


def test_tiled_backward_matches_finite_differences(monkeypatch):
    """Independent of the oracle: torch's gradcheck in float64, padding and GQA, small tiles."""
    monkeypatch.setattr(K.tiled, "TILE_Q", 3)
    monkeypatch.setattr(K.tiled, "TILE_K", 4)
    B, H, H_kv, T, D = 2, 4, 2, 9, 3
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g, dtype=F64, requires_grad=True)
    k, v = (torch.randn(B, H_kv, T, D, generator=g, dtype=F64, requires_grad=True) for _ in "kv")
    pad = torch.ones(B, T, dtype=torch.bool)
    pad[1, :4] = False  # row 1's first four queries see no key: they output mean(v)
    spec = MaskSpec(arange(B, T), arange(B, T), True, key_padding=pad)
    call = AttnCall(scale=0.7, mask=spec)
    assert torch.autograd.gradcheck(lambda *t: attend(*t, call, kernel="tiled")[0], (q, k, v))


@dataclass(frozen=True)
class HeadMask:
    """A mask that differs by head, (B, H, T, S), as BigBird's (nn/attention/block_sparse.py)."""

    allowed: torch.Tensor
    causal = False
    window = None

    def block(self, q: slice, k: slice, padding: bool = True) -> torch.Tensor:
        return self.allowed[:, :, q, k]

    def dense(self) -> torch.Tensor:
        return self.allowed


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_tiled_takes_a_mask_per_head(heads, monkeypatch):
    """Masks with one plane per head (B, H, tq, tk), with GQA, a key-free row in one head only,
    and whole tiles empty in some heads: outputs and gradients equal the oracle's."""
    monkeypatch.setattr(K.tiled, "TILE_Q", 4)
    monkeypatch.setattr(K.tiled, "TILE_K", 5)
    (H, H_kv), B, T, D = heads, 2, 13, 8
    g = torch.Generator().manual_seed(2)
    allowed = torch.rand(B, H, T, T, generator=g) < 0.3
    allowed[0, 1, 3] = False  # query 3 of head 1 sees no key: mean(v)
    allowed[1, 2, :4, :5] = False  # a whole tile of head 2 is empty
    results = []
    for kernel in ("tiled", "naive"):
        h = torch.Generator().manual_seed(0)
        q = torch.randn(B, H, T, D, generator=h, requires_grad=True)
        k, v = (torch.randn(B, H_kv, T, D, generator=h, requires_grad=True) for _ in "kv")
        out, _ = attend(q, k, v, AttnCall(scale=0.4, mask=HeadMask(allowed)), kernel=kernel)
        results.append((out, torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)


def test_tiled_refuses_what_it_cannot_do():
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(
        ValueError, match=r"'tiled' cannot serve this call: it has no attention dropout"
    ):
        attend(q, k, v, AttnCall(scale=0.3, dropout_p=0.1), kernel="tiled")

    @dataclass(frozen=True)
    class Hidden(ScoreBias):  # its parameter lives in a closure, out of the kernel's sight
        fn: object

        def block(self, q, k):
            return self.fn(q, k)

    weight = torch.nn.Parameter(torch.ones(()))
    bias = Hidden(lambda q, k: weight * torch.ones(1, 2, 4, 4)[:, :, q, k])
    with pytest.raises(ValueError, match=r"cannot find the tensors.*'chunked'"):
        attend(q, k, v, AttnCall(scale=0.3, bias=bias), kernel="tiled")


# --- the n×n wall: no kernel but the naive one builds it ----------------------------------------


def wall_model(positional) -> torch.nn.Module:
    cfg = ModelConfig(
        arch="decoder", vocab_size=64, d_model=64, n_layers=1, n_heads=8, positional=positional
    )
    torch.manual_seed(0)
    return al.build_model(cfg)


WALL_CASES = [
    (kernel, positional)
    for kernel in [*FAST, "naive"]
    for positional in (ALiBi(), T5RelativeBias())
    # alibi-sdpa serves causal ALiBi only
    if not (kernel == "alibi-sdpa" and isinstance(positional, T5RelativeBias))
]


@pytest.mark.parametrize(
    ("kernel", "positional"), WALL_CASES, ids=[f"{k}-{p.kind}" for k, p in WALL_CASES]
)
def test_no_kernel_but_naive_builds_the_n_by_n_wall(kernel, positional):
    """T = 2,048 with 8 heads: the (1, 8, T, T) bias or score tensor would hold 33.6M elements;
    a block is at most BLOCK_BYTES (16.8M fp32). Forward and backward through a real model."""
    n = 2048
    model = al.set_kernel(wall_model(positional), kernel)
    ids = torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(0))
    with LargestTensor() as mode:
        model(ids).logits.sum().backward()
    wall = 8 * n * n
    if kernel == "naive":
        assert mode.largest >= wall  # the oracle does build it: the test can see the wall
    else:
        assert mode.largest < wall, f"{kernel} allocated {mode.largest:,} elements"


GATHERED = [(k, b) for k in ("chunked", "alibi-sdpa") for b in BIASES if serves(k, "causal", b)]


@pytest.mark.parametrize(("kernel", "bias"), GATHERED)
def test_blocks_over_gathered_keys_equal_naive(kernel, bias, monkeypatch):
    """A pattern with gaps (global tokens, block-sparse layouts) hands the loop key indices, not
    a range: the same blocks over gathered keys give the naive result, gradients included."""
    real = MaskSpec.visible_keys

    def as_indices(self, rows):
        ks = real(self, rows)
        S = self.k_positions.shape[1]
        return torch.arange(S)[ks] if isinstance(ks, slice) else ks

    monkeypatch.setattr(MaskSpec, "visible_keys", as_indices)
    monkeypatch.setattr(K.chunked, "BLOCK_BYTES", 8 * 4 * 2 * 4 * 44)
    monkeypatch.setattr(K.chunked, "SAVE_BYTES", 0)
    for mask in ("causal-padding", "window-causal", "cache-chunk"):
        out, grads = run(kernel, mask, bias, (4, 2))
        ref_out, ref_grads = run("naive", mask, bias, (4, 2))
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=2e-5)
        for got, ref in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=5e-5)


CACHED = [
    (k, p)
    for k in FAST
    for p in (ALiBi(), T5RelativeBias(num_buckets=8, max_distance=16))
    if serves(k, "causal", "alibi-causal" if p.kind == "alibi" else "t5-causal")
]


@pytest.mark.parametrize(("kernel", "positional"), CACHED, ids=[f"{k}-{p.kind}" for k, p in CACHED])
def test_cached_decoding_equals_recomputation_with_each_kernel(kernel, positional, monkeypatch):
    """Prefill a left-padded batch, then one token at a time through the cache: the logits equal
    the whole sequence recomputed, with every kernel (small blocks, so the loop runs)."""
    monkeypatch.setattr(K.chunked, "BLOCK_BYTES", 8 * 4 * 2 * 4 * 44)
    cfg = ModelConfig(
        arch="decoder", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
        positional=positional,
    )  # fmt: skip
    torch.manual_seed(0)
    model = al.set_kernel(al.build_model(cfg), kernel).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # row 1 left-padded
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = model.new_cache(2, 40)
        parts = [model(ids[:, :30], attention_mask=mask[:, :30], cache=cache).logits]
        for t in range(30, 40):
            parts.append(model(ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(
        torch.cat(parts, 1)[mask.bool()], full[mask.bool()], atol=2e-5, rtol=1e-5
    )


class FullSizeTensors(TorchDispatchMode):
    """Counts the tensors ops create with at least `numel` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, tuple | list) else (out,):
            self.count += isinstance(o, torch.Tensor) and o.numel() >= self.numel
        return out


@pytest.mark.parametrize("bias", [None, "t5"])
def test_the_block_loop_allocates_each_input_gradient_once(bias):
    """Backward through the blocks builds q's, k's and v's gradient once each, not once per block
    (a sliced view's own backward allocates a zero tensor of the input's full size: 8 blocks of a
    sliding window made 49 full-size tensors, 44 % of the pass's time at n 8,192). The count does
    not grow with the number of blocks, and the gradients equal naive's."""
    T, H, D = 256, 2, 8
    pos = arange(1, T)
    scheme = T5Scheme(n_heads=H, causal=True, num_buckets=8, max_distance=32)
    counts, grads = [], []
    for kernel, rows in (("chunked", 32), ("chunked", 16), ("naive", None)):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, H, T, D, generator=g, requires_grad=True) for _ in "qkv")
        mask = MaskSpec(pos, pos, True, window=16)
        b = scheme.score_bias(pos, pos) if bias else None
        if kernel == "naive":
            out, _ = attend(q, k, v, AttnCall(scale=0.3, mask=mask, bias=b), kernel="naive")
        else:
            out, _ = K.chunked.chunked_attention(
                q, k, v, AttnCall(scale=0.3, mask=mask, bias=b), rows=rows
            )
        with FullSizeTensors(q.numel()) as mode:
            out.backward(torch.ones_like(out))
        counts.append(mode.count)
        grads.append((q.grad, k.grad, v.grad))
    assert counts[0] == counts[1] <= 9, counts  # 8 and 16 blocks alike
    for got, want in zip(grads[0], grads[2], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)
