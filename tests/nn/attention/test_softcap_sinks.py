"""Attention-logit soft-capping (Gemma 2) and attention sinks (GPT-OSS), the two score transforms
of src/attnlab/nn/attention/kernels/base.py, against float64 references written out here:

    s_j   = c · tanh(scale · q·k_j / c) + bias_j          (softcap c; no cap: scale · q·k_j)
    out   = Σ_{j allowed} e^{s_j} v_j / (Σ_{j allowed} e^{s_j} + e^{sink_h})   (no sink: no term)

A query that sees no key outputs mean(v) without sinks and 0 with them (all weight on the sink).

- the naive kernel equals that loop in float64, and transformers' own eager attention of Gemma 2
  (softcap) and GPT-OSS (sinks);
- every kernel that declares a transform equals naive, forward and backward (q, k, v, a T5
  table, the sinks), for every mask of tests/nn/attention/kernels/test_kernels.py (causal, padding,
  windows, cache offsets, a decode step) with small blocks, so the loop and the recomputation run;
  tiled and chunked also pass torch's gradcheck in float64;
- a kernel that does not declare one refuses it by name, and the attention layer then runs the
  chunked kernel (sdpa cannot soft-cap inside torch's fused kernel);
- no kernel (chunked, tiled; sdpa with sinks) builds the (H, T, S) wall for either transform;
- in a model (soft-capped and sinks, alternating sliding / full layers via layer_pattern) cached
  decoding with the static, sliding and paged caches equals recomputation.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab as al
from attnlab.config import AttentionConfig, LayerSpec, ModelConfig
from attnlab.nn.attention import Attention, MaskSpec
from attnlab.nn.attention import kernels as K
from attnlab.nn.attention.kernels import KERNELS, AttnCall, attend, choose
from helpers.attention import MASKS, arange, make_bias
from helpers.memory import LargestTensor
from helpers.tolerance import assert_within_rounding, rounding_tol

F64 = torch.float64
TRANSFORMS = {"softcap": (0.9, False), "sinks": (None, True), "both": (0.9, True)}


def reference(q, k, v, allowed, bias, scale, softcap, sinks):
    """The module docstring's formula, one query row at a time, in float64."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    out = torch.zeros(B, H, T, D, dtype=F64)
    for b in range(B):
        for h in range(H):
            kh, vh = k[b, h // G].to(F64), v[b, h // G].to(F64)  # (S, D)
            for t in range(T):
                s = (kh @ q[b, h, t].to(F64)) * scale  # (S,)
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                if bias is not None:
                    s = s + bias[b if bias.shape[0] > 1 else 0, h, t].to(F64)
                seen = allowed[b, 0, t] if allowed is not None else torch.ones_like(s).bool()
                if not bool(seen.any()):  # a query that sees no key
                    out[b, h, t] = 0 if sinks is not None else vh.mean(0)
                    continue
                e = torch.exp(s[seen] - s[seen].max())
                denominator = e.sum()
                if sinks is not None:
                    denominator = denominator + torch.exp(sinks[h].to(F64) - s[seen].max())
                out[b, h, t] = (e / denominator) @ vh[seen]
    return out


def inputs(mask: str, heads=(4, 2), seed=0, dtype=torch.float32):
    T, S, spec_of = MASKS[mask]
    B, (H, H_kv), D = 2, heads, 8
    g = torch.Generator().manual_seed(seed)
    spec = spec_of(B)
    q = (torch.randn(B, H, T, D, generator=g) * 2).to(dtype).requires_grad_()  # scores ~ ±3
    k = torch.randn(B, H_kv, S, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, H_kv, S, D, generator=g).to(dtype).requires_grad_()
    sinks = torch.randn(H, generator=g).to(dtype).requires_grad_()
    return spec, q, k, v, sinks, g


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("mask", ["causal-padding", "window-causal", "cache-chunk", "bidir-none"])
def test_naive_kernel_is_the_formula_in_float64(mask, transform):
    """The naive kernel (scores in fp32) against the loop in float64, on the same inputs."""
    softcap, with_sinks = TRANSFORMS[transform]
    spec, q, k, v, sinks, g = inputs(mask)
    sinks = sinks if with_sinks else None
    bias = torch.randn(2, 4, q.shape[2], k.shape[2], generator=g)
    call = AttnCall(scale=0.4, mask=spec, bias=bias, softcap=softcap, sinks=sinks)
    out, _ = attend(q, k, v, call, kernel="naive")
    want = reference(q, k, v, spec.dense(), bias, 0.4, softcap, sinks)
    # n: D products, then S exponentials summed twice (denominator, values); scores up to ~6,
    # whose exp() carries their rounding as a relative error of that size (scale 8)
    assert_within_rounding(out.detach(), want, 8 + 2 * 44, dtype=torch.float32, scale=8.0)


def test_naive_kernel_equals_transformers_eager_attention():
    """The same numbers as transformers' Gemma 2 (softcap) and GPT-OSS (sinks) eager attention,
    with their additive masks (0 / dtype min) built from the same MaskSpec."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss

    spec, q, k, v, sinks, _ = inputs("window-causal")
    allowed = spec.dense()  # (B, 1, T, S)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups, module.head_dim, module.sinks = 2, 8, sinks
    module.train(False)
    with torch.no_grad():
        theirs, _ = gemma2(module, q, k, v, additive, scaling=0.4, softcap=0.9)
        ours, _ = attend(q, k, v, AttnCall(scale=0.4, mask=spec, softcap=0.9), kernel="naive")
        torch.testing.assert_close(ours.transpose(1, 2), theirs, **rounding_tol(64))
        theirs, _ = gpt_oss(module, q, k, v, additive, scaling=0.4)
        ours, _ = attend(q, k, v, AttnCall(scale=0.4, mask=spec, sinks=sinks), kernel="naive")
        torch.testing.assert_close(ours.transpose(1, 2), theirs, **rounding_tol(64))


def run(kernel, mask, bias_kind, transform, heads=(4, 2)):
    softcap, with_sinks = TRANSFORMS[transform]
    spec, q, k, v, sinks, g = inputs(mask, heads)
    bias, params = make_bias(bias_kind, spec, heads[0], q.shape[2], k.shape[2], g)
    if with_sinks:
        params = [*params, sinks]
    call = AttnCall(
        scale=0.4, mask=spec, bias=bias, softcap=softcap, sinks=sinks if with_sinks else None
    )
    out, _ = attend(q, k, v, call, kernel=kernel)
    grads = torch.autograd.grad(out, [q, k, v, *params], torch.randn(out.shape, generator=g))
    return out, grads


def declares(kernel: str, transform: str) -> bool:
    caps = KERNELS.get(kernel).caps
    softcap, with_sinks = TRANSFORMS[transform]
    return (softcap is None or caps.softcap) and (not with_sinks or caps.sinks)


# the kernels that train on the CPU under any mask and bias and declare the transforms, and the
# selector's choice; sdpa (sinks on its plain paths) and flex (forward-only on the CPU: its own
# sweep, tests/nn/attention/kernels/test_flex.py) have tests of their own below
GENERAL = ("auto", "chunked", "tiled")
CASES = [(kn, t) for kn in GENERAL for t in TRANSFORMS if kn == "auto" or declares(kn, t)]


@pytest.mark.parametrize("heads", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("bias", ["none", "dense", "t5-causal"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize(("kernel", "transform"), CASES, ids=[f"{k}-{t}" for k, t in CASES])
def test_kernel_equals_naive_with_transforms(kernel, transform, mask, bias, heads, monkeypatch):
    # blocks of 16 rows and every block recomputed in backward; tiles of 8 x 6
    monkeypatch.setattr(K.chunked, "BLOCK_BYTES", 8 * 4 * 2 * 4 * 44)
    monkeypatch.setattr(K.chunked, "SAVE_BYTES", 0)
    monkeypatch.setattr(K.tiled, "TILE_Q", 8)
    monkeypatch.setattr(K.tiled, "TILE_K", 6)
    out, grads = run(kernel, mask, bias, transform, heads)
    ref_out, ref_grads = run("naive", mask, bias, transform, heads)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=2e-5)
    for got, ref in zip(grads, ref_grads, strict=True):  # q, k, v, the T5 table, the sinks
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=5e-5)


def test_the_sweep_covers_each_kernel_and_the_blocks_run(monkeypatch):
    """Every kernel either runs both transforms above or is refused below (the sweep's premise);
    and with the monkeypatched budget the soft-capped chunked kernel does run several blocks."""
    both = {n for n in KERNELS if declares(n, "both")}
    # flex: tests/nn/attention/kernels/test_flex.py; paged-flex (the paged layout only):
    # tests/nn/attention/kernels/test_paged_decode.py, tests/decode/test_paged_flex_step.py
    assert both == {"naive", "chunked", "tiled", "flex", "paged-flex"}
    assert {k for k, t in CASES if t == "both"} == {"auto", "chunked", "tiled"}
    calls = []
    real = K.chunked.capped_block
    monkeypatch.setattr(K.chunked, "BLOCK_BYTES", 8 * 4 * 2 * 4 * 44)
    monkeypatch.setattr(
        K.chunked, "capped_block", lambda q, *a: calls.append(q.shape[2]) or real(q, *a)
    )
    run("chunked", "causal", "none", "softcap")
    assert len(calls) >= 3 and max(calls) <= 16, calls


@pytest.mark.parametrize("kernel", ["tiled", "chunked"])
def test_gradcheck_in_float64(kernel):
    """Analytic gradients (tiled: its own backward through tanh and the sink) against finite
    differences, with a padded, windowed mask and a T5 table."""
    real = torch.ones(2, 9, dtype=torch.bool)
    real[1, :2] = False  # row 1's first two queries see no key: 0 with sinks
    spec = MaskSpec(arange(2, 9), arange(2, 9), True, window=4, key_padding=real)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 3, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(2, 2, 9, 3, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(2, 2, 9, 3, generator=g, dtype=F64, requires_grad=True)
    sinks = torch.randn(4, generator=g, dtype=F64, requires_grad=True)

    def f(q, k, v, sinks):
        call = AttnCall(scale=0.7, mask=spec, softcap=1.3, sinks=sinks)
        return attend(q, k, v, call, kernel=kernel)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


def UNDECLARED_KERNELS() -> list[str]:
    return [n for n in KERNELS if not (KERNELS.get(n).caps.softcap and KERNELS.get(n).caps.sinks)]


@pytest.mark.parametrize("kernel", UNDECLARED_KERNELS())
def test_a_kernel_refuses_what_it_does_not_declare_and_auto_passes_it_over(kernel):
    caps = KERNELS.get(kernel).caps
    spec, q, k, v, sinks, _ = inputs("causal")
    reasons = {"softcap": "cannot soft-cap scores", "sinks": "takes no attention sinks"}
    plain = AttnCall(scale=0.4, mask=spec)
    serves_plain = KERNELS.get(kernel).why_not(q, k, v, plain) is None
    for name, value, declared in (("softcap", 0.9, caps.softcap), ("sinks", sinks, caps.sinks)):
        if declared:
            continue
        call = AttnCall(scale=0.4, mask=spec, **{name: value})
        with pytest.raises(ValueError, match=f"'{kernel}' cannot serve this call: it.*"):
            choose(kernel, q, k, v, call)
        if serves_plain:  # the transform is the reason, not the mask or the layout
            assert reasons[name] in KERNELS.get(kernel).why_not(q, k, v, call)
        # the selector's pick on the CPU: the first of its list that serves the transform
        assert choose("auto", q, k, v, call).name == {"softcap": "chunked", "sinks": "sdpa"}[name]
    if serves_plain:  # no transform: its own call
        assert choose(kernel, q, k, v, plain).name == kernel


@pytest.mark.parametrize("kernel", ["chunked", "tiled", "sdpa"])
def test_no_kernel_builds_the_n_by_n_wall_for_the_transforms(kernel, monkeypatch):
    """T = S = 512, 4 heads: the (1, 4, T, S) score tensor would hold 1M elements; with a 1 MiB
    block budget the kernel's largest tensor stays a block, forward and backward (recomputed).
    sdpa: sinks only (it declares no softcap), as one key of its fused causal call."""
    monkeypatch.setattr(K.chunked, "BLOCK_BYTES", 2**20)
    monkeypatch.setattr(K.chunked, "SAVE_BYTES", 2**20)
    n, H = 512, 4
    pos = arange(1, n)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, n, 8, generator=g, requires_grad=True) for _ in "qkv")
    sinks = torch.zeros(H, requires_grad=True)
    softcap = 2.0 if kernel != "sdpa" else None
    call = AttnCall(
        scale=0.3, mask=MaskSpec(pos, pos, True, aligned=True), sinks=sinks, softcap=softcap
    )
    with LargestTensor() as mode:
        out, _ = attend(q, k, v, call, kernel=kernel)
        out.sum().backward()
    assert sinks.grad is not None
    assert mode.largest < H * n * n // 2, f"{kernel} allocated {mode.largest:,} elements"


# --- in a model -----------------------------------------------------------------------------------


def model_of(**attention) -> torch.nn.Module:
    pattern = attention.pop("pattern", None)
    cfg = ModelConfig(
        arch="decoder", vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
        attention=AttentionConfig(**attention), layer_pattern=pattern,
    )  # fmt: skip
    torch.manual_seed(0)
    model = al.build_model(cfg).eval()
    with torch.no_grad():  # sinks of either sign, so the test sees them
        for m in model.modules():
            if isinstance(m, Attention) and m.sinks is not None:
                m.sinks.normal_(0, 2)
    return model


PATTERN = (LayerSpec(sliding_window=8), LayerSpec())  # GPT-OSS: sliding, full, ...
MODELS = {
    "softcap-pattern": (dict(softcap=1.5, pattern=PATTERN), ("static", "paged")),
    "sinks-pattern": (dict(sinks=True, pattern=PATTERN), ("static", "paged")),
    "both-window": (
        dict(softcap=1.5, sinks=True, sliding_window=8),
        ("static", "sliding", "paged"),
    ),
}


@pytest.mark.parametrize("kernel", ["auto", "chunked", "tiled"])
@pytest.mark.parametrize("name", list(MODELS))
def test_cached_decoding_equals_recomputation(name, kernel):
    """A prompt (row 1 left-padded for static / paged), then one token at a time: the logits
    equal the whole sequence recomputed, past the window, with each cache kind."""
    attention, kinds = MODELS[name]
    model = al.set_kernel(model_of(**dict(attention)), kernel)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, 30), generator=g)
    for kind in kinds:
        mask = torch.ones_like(ids)
        if kind != "sliding":  # the ring refuses padding after a row's first token only
            mask[1, :5] = 0
        with torch.no_grad():
            full = model(ids, attention_mask=mask).logits
            cache = model.new_cache(2, 30, kind=kind)
            parts = [model(ids[:, :12], attention_mask=mask[:, :12], cache=cache).logits]
            for t in range(12, 30):
                parts.append(model(ids[:, t : t + 1], cache=cache).logits)
        got = torch.cat(parts, 1)[mask.bool()]
        # n: 4 layers of 32-wide sums plus 30 keys twice: rounding_tol's forward bound
        torch.testing.assert_close(got, full[mask.bool()], **rounding_tol(4 * (6 * 32 + 60 + 128)))


def test_sinks_are_a_parameter_per_head_and_the_config_says_so():
    model = model_of(sinks=True, softcap=50.0, pattern=PATTERN)
    layer = model.decoder.blocks[0].self_attn
    assert isinstance(layer.sinks, torch.nn.Parameter) and layer.sinks.shape == (4,)
    assert layer.softcap == 50.0 and model_of().decoder.blocks[0].self_attn.sinks is None
    ids = torch.randint(0, 64, (1, 10))
    model.train()
    model(ids).logits.sum().backward()
    assert layer.sinks.grad is not None and bool(layer.sinks.grad.abs().sum() > 0)
    note = AttentionConfig(softcap=50.0, sinks=True)._table_note()
    assert "softcap 50" in note and "sinks" in note
    with pytest.raises(ValueError, match="softcap"):
        AttentionConfig(softcap=0.0)
    assert math.isclose(AttentionConfig(softcap=30).softcap, 30.0)


def test_continuous_batching_equals_each_request_alone():
    """The engine's ragged paged cache (rows joining and leaving, blocks of 4 slots) with a
    soft-capped model whose sliding / full layers have sinks: each request's greedy tokens equal
    the request decoded alone."""
    from attnlab.decode.engine import Engine, Request

    model = model_of(softcap=1.5, sinks=True, pattern=PATTERN)
    g = torch.Generator().manual_seed(5)
    requests = [
        Request(torch.randint(2, 64, (n,), generator=g).tolist(), max_tokens=m, temperature=0.0)
        for n, m in ((3, 14), (17, 6), (9, 12), (1, 10))
    ]
    engine = Engine(model, num_blocks=48, block_size=4, max_batch=3, max_prefill_tokens=20)
    got = {r: [] for r in range(len(requests))}
    rids = {engine.submit(r): i for i, r in enumerate(requests)}
    while engine.has_work:
        for e in engine.step():
            got[rids[e.rid]].append(e.token)
    for i, r in enumerate(requests):
        alone = al.generate(model, torch.tensor([r.prompt]), r.max_tokens)
        assert got[i] == alone[0, len(r.prompt) :].tolist(), i
