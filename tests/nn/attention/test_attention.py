"""Attention kernels, masks and the layer against explicit references.

The oracle is `attention_ref`: a float64 loop over (batch, head, query) that softmaxes over the
keys the mask allows, written from the definitions in masks.py (causal k <= q; sliding window
q - k < w, or |q - k| < w when bidirectional; key padding) and kernels.py (a query with no
allowed key averages every value uniformly). The naive kernel must equal it; sdpa must equal
naive; the layer must equal torch.nn.MultiheadAttention with copied weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from attnlab.nn.attention import KERNELS, Attention, AttnContext, MaskSpec, set_kernel
from attnlab.nn.attention.kernels import AttnCall, attend
from attnlab.nn.positional.rope import RotaryEmbedding
from attnlab.registry import UnknownNameError
from helpers.tolerance import assert_within_rounding

F64 = torch.float64
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def allowed_ref(spec: MaskSpec | None, b: int, t: int, s: int) -> bool:
    """Whether query t of row b may see key s, straight from MaskSpec's field definitions."""
    if spec is None:
        return True
    qp, kp = int(spec.q_positions[b, t]), int(spec.k_positions[b, s])
    ok = True
    if spec.causal:
        ok = ok and kp <= qp
    if spec.window is not None:
        ok = ok and ((qp - kp) if spec.causal else abs(qp - kp)) < spec.window
    if spec.key_padding is not None:
        ok = ok and bool(spec.key_padding[b, s])
    return ok


def attention_ref(q, k, v, spec, bias, scale):
    """Float64 loop: out[b, h, t] = Σ_s softmax_s(q·k·scale + bias over allowed s) v[b, h//g, s]."""
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    B, H, T, _ = q.shape
    S, group = k.shape[2], H // k.shape[1]
    out = torch.zeros(B, H, T, v.shape[-1], dtype=F64)
    weights = torch.zeros(B, H, T, S, dtype=F64)
    for b in range(B):
        for h in range(H):
            kv = h // group  # GQA: consecutive query heads share one K/V head
            for t in range(T):
                keys = [s for s in range(S) if allowed_ref(spec, b, t, s)]
                if not keys:  # documented: a query that sees nothing averages every value
                    w = torch.full((S,), 1.0 / S, dtype=F64)
                else:
                    scores = torch.stack([q[b, h, t] @ k[b, kv, s] * scale for s in keys])
                    if bias is not None:
                        scores = scores + bias[b, h, t, keys].to(F64)
                    w = torch.zeros(S, dtype=F64)
                    w[keys] = scores.softmax(dim=0)
                weights[b, h, t] = w
                out[b, h, t] = w @ v[b, kv]
    return out, weights


@dataclass
class Case:
    T: int
    S: int
    spec: object  # callable (B) -> MaskSpec | None


def _arange(B: int, n: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n).expand(B, n).clone()


def _left_padding(B: int, S: int) -> torch.Tensor:
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, :2] = False  # row 1 is left-padded by two tokens
    return pad


MASKS = {
    "none": Case(5, 5, lambda B: None),
    "empty-spec": Case(5, 7, lambda B: MaskSpec(_arange(B, 5), _arange(B, 7))),
    "causal-aligned": Case(
        6, 6, lambda B: MaskSpec(_arange(B, 6), _arange(B, 6), True, aligned=True)
    ),
    "causal-unaligned": Case(6, 6, lambda B: MaskSpec(_arange(B, 6), _arange(B, 6), True)),
    "causal-padding": Case(
        6,
        6,
        lambda B: MaskSpec(_arange(B, 6), _arange(B, 6), True, key_padding=_left_padding(B, 6)),
    ),
    "bidir-padding": Case(
        5,
        6,
        lambda B: MaskSpec(_arange(B, 5), _arange(B, 6), False, key_padding=_left_padding(B, 6)),
    ),
    "window-causal": Case(8, 8, lambda B: MaskSpec(_arange(B, 8), _arange(B, 8), True, window=3)),
    "window-bidir": Case(7, 7, lambda B: MaskSpec(_arange(B, 7), _arange(B, 7), False, window=2)),
    "decode-step": Case(1, 7, lambda B: MaskSpec(_arange(B, 1, 6), _arange(B, 7), True)),
    "decode-step-padding": Case(
        1,
        6,
        lambda B: MaskSpec(_arange(B, 1, 5), _arange(B, 6), True, key_padding=_left_padding(B, 6)),
    ),
    "query-offset-chunk": Case(3, 8, lambda B: MaskSpec(_arange(B, 3, 5), _arange(B, 8), True)),
    "query-offset-window": Case(
        3, 8, lambda B: MaskSpec(_arange(B, 3, 5), _arange(B, 8), True, window=4)
    ),
}


def make_inputs(case: Case, heads: str, with_bias: bool, seed: int = 0, B: int = 2):
    H, H_kv = HEADS[heads]
    D = 8
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, case.T, D, generator=g)
    k = torch.randn(B, H_kv, case.S, D, generator=g)
    v = torch.randn(B, H_kv, case.S, D, generator=g)
    bias = torch.randn(B, H, case.T, case.S, generator=g) if with_bias else None
    return q, k, v, case.spec(B), bias


def run(kernel, q, k, v, spec, bias, scale, need_weights=False):
    """One kernel call through the selector (`kernel` a name or "auto")."""
    call = AttnCall(scale=scale, mask=spec, bias=bias, need_weights=need_weights)
    return attend(q, k, v, call, kernel=kernel)


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("mask", list(MASKS))
def test_naive_kernel_matches_float64_loop(mask, heads, with_bias):
    q, k, v, spec, bias = make_inputs(MASKS[mask], heads, with_bias)
    scale = 0.37  # not 1/sqrt(D): the scale argument must be the one applied
    out, weights = run("naive", q, k, v, spec, bias, scale, need_weights=True)
    ref_out, ref_weights = attention_ref(q, k, v, spec, bias, scale)
    torch.testing.assert_close(out.to(F64), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights.to(F64), ref_weights, rtol=1e-5, atol=1e-6)


def has_key(spec: MaskSpec | None, shape: torch.Size) -> torch.Tensor:
    """(B, 1, T, 1) float: 1 where the query may see at least one key."""
    dense = spec.dense() if spec is not None else None
    if dense is None:
        return torch.ones(shape[0], 1, shape[2], 1)
    return dense.any(-1, keepdim=True).float()


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("mask", list(MASKS))
def test_sdpa_matches_naive_with_gradients(mask, heads, with_bias):
    inputs = make_inputs(MASKS[mask], heads, with_bias, seed=1)
    results = []
    for kernel in ("naive", "auto"):
        q, k, v, spec, bias = (
            t.clone().requires_grad_(True) if isinstance(t, torch.Tensor) else t for t in inputs
        )
        out, _ = run(kernel, q, k, v, spec, bias, 0.5)
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
        # a query with no allowed key (a padding query) is ignored downstream, so it gets no
        # upstream gradient; naive's masked_fill cuts its gradient while sdpa's additive mask lets
        # a gradient through, so the two differ only for such rows (see
        # test_fully_masked_rows_gradient_differs_between_kernels)
        upstream = upstream * has_key(spec, out.shape)
        (out * upstream).sum().backward()
        grads = [t.grad for t in (q, k, v, bias) if t is not None]
        results.append((out.detach(), grads))
    (out_n, grads_n), (out_s, grads_s) = results
    # forward: scores (D 8), normaliser and weighted sum (S <= 7 keys); backward: dP = dO·vᵀ and
    # the row sums of dO·O (D each), dq = dS·k (S), dk and dv (T <= S), after the forward's D:
    # the two kernels may round apart by this much alone (tests/helpers/tolerance.py)
    n = 4 * 8 + 4 * 7
    assert_within_rounding(out_s, out_n, n)
    for g_s, g_n in zip(grads_s, grads_n, strict=True):
        assert_within_rounding(g_s, g_n, n)


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("kernel", ["naive", "auto"])
def test_fully_masked_rows_are_finite_and_agree(kernel, with_bias):
    B, H, T, S, D = 2, 2, 3, 4, 8
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (T, S, S))
    bias = torch.randn(B, H, T, S, generator=g) * 5 if with_bias else None
    padding = torch.ones(B, S, dtype=torch.bool)
    padding[1] = False  # every key of row 1 is padding
    spec = MaskSpec(_arange(B, T, 1), _arange(B, S), True, key_padding=padding)
    out, _ = run(kernel, q, k, v, spec, bias, 0.5)
    naive, _ = run("naive", q, k, v, spec, bias, 0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, naive, rtol=0, atol=1e-5)
    # kernels.py: such a row gets the uniform average of the values
    torch.testing.assert_close(out[1], v[1].mean(dim=1, keepdim=True).expand(H, T, D))


def test_fully_masked_rows_get_no_gradient_in_either_kernel():
    B, H, T, S, D = 2, 2, 3, 4, 8
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, n, D, generator=g).requires_grad_(True) for n in (T, S, S))
    padding = torch.ones(B, S, dtype=torch.bool)
    padding[1] = False  # every key of row 1 is padding: its output is v[1].mean()
    spec = MaskSpec(_arange(B, T, 1), _arange(B, S), True, key_padding=padding)
    grads = []
    for kernel in ("naive", "auto"):
        out, _ = run(kernel, q, k, v, spec, None, 0.5)
        grads.append(torch.autograd.grad(out[1].sum(), (q, k)))
    # the true derivative of mean(v) with respect to q and k is zero; naive gets it right
    assert (grads[0][0] == 0).all() and (grads[0][1] == 0).all()
    for g_sdpa, g_naive in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g_sdpa, g_naive, rtol=0, atol=1e-5)


def test_naive_weights_rows_sum_to_one_and_sdpa_refuses_weights():
    q, k, v, spec, bias = make_inputs(MASKS["causal-padding"], "gqa", True)
    _, weights = run("naive", q, k, v, spec, bias, 0.5, need_weights=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    seen = spec.dense().expand_as(weights)
    rows = seen.any(-1, keepdim=True).expand_as(weights)  # queries with at least one key
    assert (weights[rows & ~seen] == 0).all()
    assert (rows & ~seen).any()  # the case does mask keys of such queries
    assert run("naive", q, k, v, spec, bias, 0.5)[1] is None
    for kernel in ("sdpa", "chunked", "flex"):
        with pytest.raises(ValueError, match=f"'{kernel}' cannot.*attention weights.*'naive'"):
            run(kernel, q, k, v, spec, bias, 0.5, need_weights=True)
    assert KERNELS.get("naive").caps.weights and not KERNELS.get("sdpa").caps.weights


# --- the layer ----------------------------------------------------------------------------------


def causal_ctx(B: int, T: int) -> AttnContext:
    return AttnContext(mask=MaskSpec(_arange(B, T), _arange(B, T), True, aligned=True))


@pytest.mark.parametrize("kernel", ["naive", "auto"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_equals_torch_multihead_attention(causal, kernel):
    torch.manual_seed(0)
    d, H, B, T = 16, 4, 2, 5
    attn = Attention(
        d_model=d, n_heads=H, n_kv_heads=H, head_dim=d // H, qkv_bias=True, o_bias=True
    )
    for p in attn.parameters():  # non-zero biases, so a dropped bias is visible
        nn.init.normal_(p, std=0.3)
    mha = nn.MultiheadAttention(d, H, bias=True, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        )
        mha.in_proj_bias.copy_(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
        mha.out_proj.weight.copy_(attn.o_proj.weight)
        mha.out_proj.bias.copy_(attn.o_proj.bias)
    x = torch.randn(B, T, d)
    blocked = torch.ones(T, T, dtype=torch.bool).triu(1) if causal else None  # True = masked
    ref, ref_weights = mha(
        x, x, x, attn_mask=blocked, need_weights=True, average_attn_weights=False
    )
    set_kernel(attn, kernel)
    ctx = causal_ctx(B, T) if causal else AttnContext()
    out, weights = attn(x, ctx, need_weights=kernel == "naive")
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    if kernel == "naive":
        torch.testing.assert_close(weights, ref_weights, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kernel", ["naive", "auto"])
@pytest.mark.parametrize("n_kv_heads", [2, 1])
def test_gqa_equals_mha_with_repeated_kv_weights(n_kv_heads, kernel):
    torch.manual_seed(1)
    d, H, D, B, T = 24, 4, 6, 2, 7
    group = H // n_kv_heads
    gqa = Attention(
        d_model=d, n_heads=H, n_kv_heads=n_kv_heads, head_dim=D, qkv_bias=True, o_bias=True
    )
    mha = Attention(d_model=d, n_heads=H, n_kv_heads=H, head_dim=D, qkv_bias=True, o_bias=True)
    for p in gqa.parameters():
        nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        for name in ("q_proj", "o_proj"):
            getattr(mha, name).load_state_dict(getattr(gqa, name).state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(gqa, name), getattr(mha, name)
            # (H_kv·D, d) -> each K/V head repeated for the `group` query heads that share it
            dst.weight.copy_(
                src.weight.view(n_kv_heads, D, d).repeat_interleave(group, 0).reshape(H * D, d)
            )
            dst.bias.copy_(src.bias.view(n_kv_heads, D).repeat_interleave(group, 0).reshape(H * D))
    positions = _arange(B, T)
    ctx = AttnContext(
        mask=MaskSpec(positions, positions, True, aligned=True),
        bias=torch.randn(B, H, T, T),
        rotation=RotaryEmbedding(rotary_dim=D, base=10000.0).rotation(positions),
    )
    x = torch.randn(B, T, d)
    set_kernel(gqa, kernel)
    set_kernel(mha, kernel)
    out_gqa, _ = gqa(x, ctx)
    out_mha, _ = mha(x, ctx)
    # projections (d), scores (D), T keys twice, the output projection (H·D): rounding only
    assert_within_rounding(out_gqa, out_mha, d + D + 2 * T + H * D)
    assert gqa.k_proj.weight.shape == (n_kv_heads * D, d)  # it really has fewer K/V heads


def test_attention_layer_matches_explicit_float64_forward():
    """Projections, head split, rotation of q and k (not v), bias, mask, GQA, o_proj."""
    torch.manual_seed(3)
    d, H, H_kv, D, B, T = 16, 4, 2, 4, 2, 6
    attn = Attention(d_model=d, n_heads=H, n_kv_heads=H_kv, head_dim=D, qkv_bias=True, o_bias=True)
    for p in attn.parameters():
        nn.init.normal_(p, std=0.3)
    positions = torch.stack([torch.arange(T), torch.arange(T) + 3])
    rotation = RotaryEmbedding(rotary_dim=D, base=100.0).rotation(positions)
    spec = MaskSpec(positions, positions, True, key_padding=_left_padding(B, T))
    ctx = AttnContext(mask=spec, bias=torch.randn(B, H, T, T), rotation=rotation)
    x = torch.randn(B, T, d)
    w = {
        n: (getattr(attn, n).weight.to(F64), getattr(attn, n).bias.to(F64))
        for n in ("q_proj", "k_proj", "v_proj", "o_proj")
    }

    def heads(name: str, n: int) -> torch.Tensor:
        y = x.to(F64) @ w[name][0].T + w[name][1]  # (B, T, n·D)
        return y.view(B, T, n, D).transpose(1, 2)  # (B, n, T, D)

    # RoPE "half" in float64, written out: channel i turns with i + D/2 by position·θ_i
    theta = 100.0 ** (-torch.arange(0, D, 2, dtype=F64) / D)
    angle = positions[:, None, :, None].to(F64) * theta  # (B, 1, T, D/2)

    def rotate(y: torch.Tensor) -> torch.Tensor:
        y1, y2 = y[..., : D // 2], y[..., D // 2 :]
        return torch.cat(
            (y1 * angle.cos() - y2 * angle.sin(), y2 * angle.cos() + y1 * angle.sin()), -1
        )

    q, k, v = rotate(heads("q_proj", H)), rotate(heads("k_proj", H_kv)), heads("v_proj", H_kv)
    mixed, _ = attention_ref(q, k, v, spec, ctx.bias, D**-0.5)
    ref = mixed.transpose(1, 2).reshape(B, T, H * D) @ w["o_proj"][0].T + w["o_proj"][1]
    for kernel in ("naive", "auto"):
        set_kernel(attn, kernel)
        out, _ = attn(x, ctx)
        torch.testing.assert_close(out.to(F64), ref, rtol=0, atol=2e-5)


def test_attention_layer_need_weights():
    torch.manual_seed(2)
    attn = Attention(d_model=16, n_heads=4, n_kv_heads=2, head_dim=4)
    x = torch.randn(2, 5, 16)
    set_kernel(attn, "naive")
    _, weights = attn(x, causal_ctx(2, 5), need_weights=True)
    assert weights.shape == (2, 4, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 5))
    assert (weights.triu(1) == 0).all()  # causal: nothing above the diagonal
    set_kernel(attn, "sdpa")
    with pytest.raises(ValueError, match="naive"):
        attn(x, causal_ctx(2, 5), need_weights=True)
    set_kernel(attn, "auto")  # the selector takes the one kernel that returns weights
    torch.testing.assert_close(attn(x, causal_ctx(2, 5), need_weights=True)[1], weights)


def test_set_kernel_switches_every_layer_and_rejects_typos_helpfully():
    model = nn.Sequential(
        Attention(d_model=8, n_heads=2, n_kv_heads=2, head_dim=4),
        nn.Sequential(Attention(d_model=8, n_heads=2, n_kv_heads=1, head_dim=4)),
    )
    set_kernel(model, "naive")
    assert [m.kernel for m in model.modules() if isinstance(m, Attention)] == ["naive", "naive"]
    with pytest.raises(UnknownNameError) as info:
        set_kernel(model, "sdap")
    message = str(info.value)
    assert "'sdap'" in message and "Did you mean 'sdpa'" in message
    assert all(name in message for name in KERNELS.names())
    assert [m.kernel for m in model.modules() if isinstance(m, Attention)] == ["naive", "naive"]


# --- MaskSpec -----------------------------------------------------------------------------------

SPECS = {
    "causal": dict(causal=True),
    "window-causal": dict(causal=True, window=2),
    "window-bidir": dict(window=3),
    "padding": dict(padding=True),
    "causal-padding-window": dict(causal=True, window=3, padding=True),
}


@pytest.mark.parametrize("offset", [0, 4], ids=["aligned", "query-offset"])
@pytest.mark.parametrize("fields", list(SPECS))
def test_maskspec_dense_matches_loop(fields, offset):
    B, T, S = 2, 4, 9
    opts = SPECS[fields]
    g = torch.Generator().manual_seed(3)
    padding = torch.rand(B, S, generator=g) > 0.3 if opts.get("padding") else None
    # arbitrary per-row positions too: row 1's keys are a shuffled, gapped set
    k_pos = torch.stack([torch.arange(S), torch.randperm(S, generator=g) * 2])
    q_pos = torch.stack([torch.arange(T) + offset, torch.arange(T) * 3 + offset])
    spec = MaskSpec(q_pos, k_pos, opts.get("causal", False), opts.get("window"), padding)
    dense = spec.dense()
    assert dense.shape == (B, 1, T, S) and dense.dtype == torch.bool
    ref = torch.tensor(
        [[[allowed_ref(spec, b, t, s) for s in range(S)] for t in range(T)] for b in range(B)]
    )
    assert torch.equal(dense[:, 0], ref)
    assert not dense.all()  # the case masks something


def test_maskspec_empty_and_plain_causal():
    pos = _arange(2, 4)
    assert MaskSpec(pos, pos).dense() is None and MaskSpec(pos, pos).is_empty
    plain = MaskSpec(pos, pos, True, aligned=True)
    assert plain.is_plain_causal and not plain.is_empty
    assert torch.equal(
        plain.dense()[:, 0], torch.ones(4, 4, dtype=torch.bool).tril().expand(2, 4, 4)
    )
    assert not MaskSpec(pos, pos, True).is_plain_causal  # not known to be aligned
    assert not MaskSpec(pos, pos, True, window=2, aligned=True).is_plain_causal
    padding = torch.ones(2, 4, dtype=torch.bool)
    assert not MaskSpec(pos, pos, True, key_padding=padding, aligned=True).is_plain_causal
    assert not MaskSpec(pos, pos, key_padding=padding).is_empty
