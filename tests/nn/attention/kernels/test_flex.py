"""The flex kernel (FlexAttention from the mask and bias descriptions) against the naive kernel
in float64, on the CPU: forward only (torch compiles flex for inference only there), compiled and
eager, for every mask kind × bias kind × softcap × sinks × MHA/GQA/MQA, padding included; its
BlockMask skips what no query sees, is built once per description, and its refusals name their
reason. CUDA runs the same code with backward (benchmarks/gpu.py)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from attnlab.nn.attention import MaskSpec
from attnlab.nn.attention.bigbird_plan import random_blocks
from attnlab.nn.attention.block_sparse import BlockSparseMask
from attnlab.nn.attention.kernels import AttnCall, attend, choose, flex, flex_buckets
from helpers.attention import BIASES, arange, padding
from helpers.attention import MASKS as KERNEL_MASKS
from helpers.attention import make_bias as bias_and_parameters

F64 = torch.float64


def globals_(B: int, T: int) -> torch.Tensor:
    g = torch.zeros(B, T, dtype=torch.bool)
    g[:, 0] = True
    g[0, 20] = True
    return g


# tests/helpers/attention.py's masks and Longformer's (a window, global tokens and padding at
# once), all longer than one 16 × 16 tile (flex.BLOCK below), so tiles are skipped, full and
# partial; the padded rows' first queries see no key (mean(v), or 0 with sinks)
MASKS = {
    **KERNEL_MASKS,
    "longformer": (
        35,
        35,
        lambda B: MaskSpec(
            arange(B, 35),
            arange(B, 35),
            False,
            window=5,
            key_padding=padding(B, 35),
            q_global=globals_(B, 35),
            k_global=globals_(B, 35),
        ),
    ),
}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def make_bias(kind: str, spec: MaskSpec, H: int, T: int, S: int, g: torch.Generator):
    return bias_and_parameters(kind, spec, H, T, S, g)[0]


def inputs(mask: str, bias: str, heads: str, seed: int = 0, B: int = 2):
    T, S, spec_of = MASKS[mask]
    (H, H_kv), D = HEADS[heads], 8
    g = torch.Generator().manual_seed(seed)
    spec = spec_of(B)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, H_kv, S, D, generator=g)
    v = torch.randn(B, H_kv, S, D, generator=g)
    sinks = torch.randn(H, generator=g) * 2
    return q, k, v, spec, make_bias(bias, spec, H, T, S, g), sinks


def reference(q, k, v, call: AttnCall) -> torch.Tensor:
    """The naive kernel in float64 (its bias and sinks in float64 too)."""
    sinks = call.sinks.to(F64) if call.sinks is not None else None
    with torch.no_grad():
        return attend(q.to(F64), k.to(F64), v.to(F64), _f64(call, sinks), kernel="naive")[0]


def _f64(call: AttnCall, sinks):
    from dataclasses import replace

    return replace(call, sinks=sinks)


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(flex, "BLOCK", 16)


def check(mask, bias, heads, softcap, sinks, compiled, monkeypatch):
    monkeypatch.setattr(flex, "COMPILE", compiled)
    q, k, v, spec, b, s = inputs(mask, bias, heads)
    call = AttnCall(scale=0.4, mask=spec, bias=b, softcap=softcap, sinks=s if sinks else None)
    with torch.no_grad():
        out, _ = attend(q, k, v, call, kernel="flex")
    # fp32 against float64: 8-wide dot products and softmax over at most 45 keys
    torch.testing.assert_close(out.to(F64), reference(q, k, v, call), rtol=2e-5, atol=2e-5)


# eager: every mask × bias × head layout, the four softcap × sinks settings taking turns over them
# (the full product was 4x the cases, ~160 s, for no path this one misses)
CASES = [
    (m, b, h, (None, 1.5)[i % 2], bool((i // 2) % 2))
    for i, (m, b, h) in enumerate(itertools.product(MASKS, BIASES, HEADS))
]


@pytest.mark.parametrize(
    ("mask", "bias", "heads", "softcap", "sinks"),
    CASES,
    ids=[
        f"{m}-{b}-{h}-{'cap' if c else 'nocap'}-{'sinks' if s else 'nosinks'}"
        for m, b, h, c, s in CASES
    ],
)
def test_eager_flex_equals_naive_in_float64(
    mask, bias, heads, softcap, sinks, small_tiles, monkeypatch
):
    check(mask, bias, heads, softcap, sinks, False, monkeypatch)


# compiled: every mask once, the biases, head layouts and softcap × sinks taking turns over
# them, and one mask with all four softcap × sinks settings. Each is a compile of its own, ~5 s
# on 2 cores (lengths padded to buckets: 37 -> 48 with tiles of 16), and compiles the same
# mask_mod and score_mod the eager cases above check over the whole product
COMPILED = [
    (m, BIASES[i % len(BIASES)], list(HEADS)[i % 3], (None, 1.5)[i % 2], bool((i // 2) % 2))
    for i, m in enumerate(MASKS)
] + [("causal-padding", "t5-causal", "gqa", c, s) for c in (None, 1.5) for s in (False, True)]


@pytest.mark.parametrize(("mask", "bias", "heads", "softcap", "sinks"), COMPILED)
def test_compiled_flex_equals_naive_in_float64(
    mask, bias, heads, softcap, sinks, small_tiles, monkeypatch
):
    check(mask, bias, heads, softcap, sinks, True, monkeypatch)


@pytest.mark.parametrize("lse", [True, False], ids=["lse", "extra-key"])
@pytest.mark.parametrize(("mask", "bias", "heads", "softcap", "sinks"), CASES)
def test_flex_over_padded_buckets_equals_naive(
    mask, bias, heads, softcap, sinks, lse, small_tiles, monkeypatch
):
    """What compiled flex runs, eagerly: the call padded to its bucket (flex_buckets.py: 3 rows
    to 4, lengths to whole tiles: padding keys masked, padding queries and rows dropped), through
    the log-sum-exp branch (CUDA's) and the extra-key branch (the CPU's): the real rows equal
    naive's, for every mask × bias × head layout, soft-cap and sinks taking turns."""
    monkeypatch.setattr(flex, "COMPILE", False)
    monkeypatch.setattr(flex, "_returns_lse", lambda device: lse)
    q, k, v, spec, b, s = inputs(mask, bias, heads, B=3)
    call = AttnCall(scale=0.4, mask=spec, bias=b, softcap=softcap, sinks=s if sinks else None)
    T, S = q.shape[2], k.shape[2]
    assert flex_buckets.bucket_shapes(q, k, flex.BLOCK)[0::2] != (3, T, S)  # really padded
    with torch.no_grad():
        out = flex._run(q, k, v, call, pad=True)
    assert out.shape == q.shape
    torch.testing.assert_close(out.to(F64), reference(q, k, v, call), rtol=2e-5, atol=2e-5)


def bigbird(T: int = 100, H: int = 4, b: int = 4, r: int = 2, training: bool = True):
    rand = random_blocks(-(-T // b), b, r, H, 3, training, 512)
    pad = torch.arange(T) < torch.tensor([T, T - 21])[:, None]  # (2, T)
    return BlockSparseMask.bigbird(T, b, torch.from_numpy(np.asarray(rand)), pad)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("training", [False, True], ids=["repeats", "random"])
def test_flex_on_bigbirds_blocks_equals_naive(compiled, training, small_tiles, monkeypatch):
    """BigBird's pattern (mask_mod from its block table) and its key counts (a score_mod):
    the real queries' outputs equal naive's (padding queries see keys of the padded batch's
    global blocks, as in every kernel)."""
    monkeypatch.setattr(flex, "COMPILE", compiled)
    mask = bigbird(training=training)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 100, 16, generator=g) for _ in range(3))
    call = AttnCall(scale=0.25, mask=mask, bias=mask.bias())
    with torch.no_grad():
        out, _ = attend(q, k, v, call, kernel="flex")
    torch.testing.assert_close(out.to(F64), reference(q, k, v, call), rtol=2e-5, atol=2e-5)


def test_block_tables_bound_the_truth():
    """`every` tiles are wholly allowed and tiles outside `some` wholly masked, for every mask
    kind, checked against the dense mask; and the window's tables do skip tiles."""
    for name, (_, _, spec_of) in MASKS.items():
        spec = spec_of(2)
        dense = spec.dense()  # (B, 1, T, S) or None
        if dense is None:
            continue
        some, every = spec.block_tables(16, 16)
        for i, j in itertools.product(range(some.shape[2]), range(some.shape[3])):
            tile = dense[:, :, 16 * i : 16 * (i + 1), 16 * j : 16 * (j + 1)]  # (B, 1, ≤16, ≤16)
            truth_some, truth_every = tile.flatten(2).any(-1), tile.flatten(2).all(-1)
            assert bool((~some[..., i, j] & truth_some).sum() == 0), (name, i, j)  # superset
            assert bool((every[..., i, j] & ~truth_every).sum() == 0), (name, i, j)  # subset
    some, _ = MASKS["window-causal"][2](2).block_tables(16, 16)
    assert not bool(some.all())  # the window skips tiles far below the diagonal
    mask = bigbird(T=256, b=8, r=1)
    some, every = mask.block_tables(16, 16)
    dense = mask.dense()
    for i, j in itertools.product(range(16), range(16)):
        tile = dense[:, :, 16 * i : 16 * (i + 1), 16 * j : 16 * (j + 1)].flatten(2)
        assert bool((~some[..., i, j] & tile.any(-1)).sum() == 0)
        assert bool((every[..., i, j] & ~tile.all(-1)).sum() == 0)
    assert float(some.float().mean()) < 0.6  # sparse stays sparse


def test_one_block_mask_per_description(small_tiles):
    """The layers of one forward pass share the description object: its BlockMask is built once."""
    spec = MASKS["causal-padding"][2](2)
    first = flex.block_mask(spec, 37, 37, False, torch.device("cpu"))
    assert flex.block_mask(spec, 37, 37, False, torch.device("cpu")) is first
    other = MASKS["causal-padding"][2](2)
    assert flex.block_mask(other, 37, 37, False, torch.device("cpu")) is not first


def test_flex_refuses_what_it_cannot_do_with_reasons():
    q, k, v, spec, bias, _ = inputs("causal", "t5-causal", "gqa")
    cases = {
        "it has no attention dropout": AttnCall(scale=0.4, mask=spec, dropout_p=0.1),
        "it does not return attention weights": AttnCall(scale=0.4, mask=spec, need_weights=True),
    }
    for reason, call in cases.items():
        with pytest.raises(ValueError, match=f"'flex' cannot serve this call: {reason}"):
            choose("flex", q, k, v, call)
    q.requires_grad_(True)  # the CPU has no flex backward
    with pytest.raises(ValueError, match="not differentiable on cpu"):
        choose("flex", q, k, v, AttnCall(scale=0.4, mask=spec, bias=bias))


_ISA_PROBE = """
import torch, attnlab
from attnlab.nn.attention import MaskSpec
from attnlab.nn.attention.kernels import AttnCall, attend
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 37, 8, generator=g) for _ in range(3))
pos = torch.arange(37).expand(1, 37)
call = AttnCall(scale=0.4, mask=MaskSpec(pos, pos, True, aligned=True))
with torch.no_grad():
    out = attend(q, k, v, call, kernel="flex")[0]
    ref = attend(q.double(), k.double(), v.double(), call, kernel="naive")[0]
print((out.double() - ref).abs().max().item())
"""


def test_compiled_flex_right_after_a_run_under_another_isa(tmp_path):
    """torch's compile cache does not key on ATEN_CPU_CAPABILITY: a run under avx2 after one
    without it (and the other way round) reused the other's kernel, crashing or off by 2.3 (CI,
    torch 2.13). attnlab gives a process that sets the variable a cache of its own
    (src/attnlab/__init__.py); both orders, in one temporary directory, must stay exact."""
    drop = ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR")
    base = {k: v for k, v in os.environ.items() if k not in drop} | {"TMPDIR": str(tmp_path)}
    for isa in (None, "avx2", None):
        env = dict(base, **({"ATEN_CPU_CAPABILITY": isa} if isa else {}))
        run = subprocess.run(
            [sys.executable, "-c", _ISA_PROBE], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr[-2000:]
        assert float(run.stdout.split()[-1]) < 1e-5, (isa, run.stdout)
