"""Longformer (Beltagy et al. 2020, arXiv:2004.05150): global tokens in the mask description, the
attention layer with global projections, and the converter, against their oracles.

- MaskSpec with global tokens against the rule written out pair by pair; the blocked kernels
  against the naive one (outputs and gradients) on global masks, and the blocks they run stay
  sparse (global rows apart, local rows over window ∪ global keys).
- transformers' LongformerModel / LongformerForMaskedLM (tiny random weights from a config, no
  download, fp32, eval): padded batches, global tokens at different positions per sequence, a
  window shorter than the sequence (transformers pads to a multiple of it inside), every kernel;
  outputs compared at real tokens. Round trips both ways.
- No kernel but the naive one builds a T × S tensor with global tokens present.
"""

from __future__ import annotations

import pytest
import torch

import attnlab as al
from attnlab.config import ConfigError, LearnedPositions, LongformerAttentionConfig, ModelConfig
from attnlab.nn.attention import GlobalRows, MaskSpec
from attnlab.nn.attention import kernels as K
from attnlab.nn.attention.kernels import AttnCall, attend
from attnlab.nn.positional.relative import T5RelativeBias as T5Scheme
from helpers.memory import LargestTensor
from helpers.tolerance import assert_within_rounding, forward_terms

FAST = ["auto", "chunked", "tiled"]  # the kernels that serve global tokens, and the selector
TOL = 1e-4


def arange(B: int, n: int) -> torch.Tensor:
    return torch.arange(n).expand(B, n).clone()


def flags(B: int, n: int, where: dict[int, list[int]]) -> torch.Tensor:
    out = torch.zeros(B, n, dtype=torch.bool)
    for b, rows in where.items():
        out[b, rows] = True
    return out


def global_spec(B: int = 2, T: int = 37, window: int = 4, padded: bool = True) -> MaskSpec:
    """Row 0: globals at 0 and 20; row 1: at 5, 6 and 30, left part padded (30 is padding)."""
    g = flags(B, T, {0: [0, 20], 1: [5, 6, 30]})
    pad = None
    if padded:
        pad = torch.ones(B, T, dtype=torch.bool)
        pad[1, 28:] = False
    return MaskSpec(arange(B, T), arange(B, T), False, window, pad, q_global=g, k_global=g)


# --- the mask description -----------------------------------------------------------------------


def test_global_mask_is_the_rule_pair_by_pair() -> None:
    spec = global_spec()
    dense = spec.dense()[:, 0]  # (B, T, S)
    B, T, S = dense.shape
    for b in range(B):
        for q in range(T):
            for k in range(S):
                local = abs(q - k) < spec.window
                glob = bool(spec.q_global[b, q] or spec.k_global[b, k])
                want = (local or glob) and bool(spec.key_padding[b, k])
                assert bool(dense[b, q, k]) == want, (b, q, k)


def test_visible_keys_and_row_runs_cover_what_each_block_sees() -> None:
    spec = global_spec(padded=False)
    T = spec.q_positions.shape[1]
    for start in range(0, T, 8):
        block = slice(start, min(T, start + 8))
        runs = spec.row_runs(block)
        assert [r for s in runs for r in range(T)[s]] == list(range(T)[block])  # a partition
        for run in runs:
            is_global = spec.q_global[:, run].any(dim=0)
            assert bool(is_global.all()) or not bool(is_global.any())  # all global or all local
            ks = spec.visible_keys(run)
            seen = torch.zeros(T, dtype=torch.bool)
            seen[ks] = True
            needed = spec.block(run, slice(None), padding=False)[:, 0].any(dim=(0, 1))
            assert bool((seen | ~needed).all())  # every key some row needs is visible
            if not bool(is_global.any()):  # local rows: window plus the global keys only
                assert int(seen.sum()) <= len(range(T)[run]) + 2 * (spec.window - 1) + 5


def test_global_tokens_need_a_bidirectional_mask() -> None:
    pos, g = arange(1, 4), torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="bidirectional"):
        MaskSpec(pos, pos, True, 2, q_global=g, k_global=g)


def test_global_rows_pack_and_unpack() -> None:
    g = flags(3, 6, {0: [1, 4], 2: [0]})
    rows = GlobalRows.of(g)
    x = torch.arange(18.0).view(3, 6, 1)
    packed = rows.gather(x)  # (3, 2, 1)
    assert packed[:, :, 0].tolist() == [[1.0, 4.0], [0.0, 0.0], [12.0, 0.0]]
    assert rows.valid.tolist() == [[True, True], [False, False], [True, False]]
    back = rows.scatter(torch.zeros_like(x), packed)
    assert torch.equal(back, torch.where(g[..., None], x, 0.0))


# --- the kernels on global masks ----------------------------------------------------------------


def run(kernel: str, bias_kind: str, heads: tuple[int, int]):
    spec = global_spec()
    B, T = spec.q_positions.shape
    (H, H_kv), D = heads, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g, requires_grad=True)
    k = torch.randn(B, H_kv, T, D, generator=g, requires_grad=True)
    v = torch.randn(B, H_kv, T, D, generator=g, requires_grad=True)
    bias, params = None, []
    if bias_kind == "t5":
        scheme = T5Scheme(n_heads=H, causal=False, num_buckets=8, max_distance=20)
        with torch.no_grad():
            scheme.relative_attention_bias.weight.normal_(generator=g)
        bias = scheme.score_bias(spec.q_positions, spec.k_positions)
        params = list(scheme.parameters())
    out, _ = attend(q, k, v, AttnCall(scale=0.4, mask=spec, bias=bias), kernel=kernel)
    grad_out = torch.randn(out.shape, generator=g) * spec.key_padding[:, None, :, None]
    return out, torch.autograd.grad(out, [q, k, v, *params], grad_out)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("bias", ["none", "t5"])
@pytest.mark.parametrize("kernel", FAST)
def test_kernels_equal_naive_on_global_masks(kernel, bias, heads, monkeypatch) -> None:
    monkeypatch.setattr(K.chunked, "BLOCK_BYTES", 8 * 4 * 2 * 4 * 44)  # blocks of 16 rows
    monkeypatch.setattr(K.chunked, "SAVE_BYTES", 0)  # and recomputed in backward
    out, grads = run(kernel, bias, heads)
    ref_out, ref_grads = run("naive", bias, heads)
    real = global_spec().key_padding[:, None, :, None]  # padding query rows are free
    torch.testing.assert_close(out * real, ref_out * real, rtol=1e-5, atol=2e-5)
    for got, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=5e-5)


def test_blocked_kernel_keeps_local_blocks_sparse(monkeypatch) -> None:
    """Each sdpa call of the chunked loop: global rows alone (few rows, all keys), local rows
    over window ∪ global keys (far fewer than S)."""
    calls = []
    real = K.chunked.masked_sdpa
    monkeypatch.setattr(
        K.chunked,
        "masked_sdpa",
        lambda q, k, *a, **kw: calls.append((q.shape[2], k.shape[2])) or real(q, k, *a, **kw),
    )
    spec, T = global_spec(B=2, T=200, window=5, padded=False), 200
    q = k = v = torch.randn(2, 2, T, 8)
    K.chunked.chunked_attention(q, k, v, AttnCall(scale=0.3, mask=spec), rows=32)
    local = [(r, s) for r, s in calls if s < T]
    full = [(r, s) for r, s in calls if s == T]
    assert sum(r for r, _ in full) == 5  # the five global rows of global_spec, and only them
    assert all(s <= r + 2 * 4 + 5 for r, s in local)  # rows + window on both sides + globals
    assert sum(r for r, _ in local) + 5 == T


# --- the layer in a model -----------------------------------------------------------------------


def tiny_longformer(window: int = 4, **kw) -> ModelConfig:
    return ModelConfig(
        arch="encoder",
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        positional=LearnedPositions(max_len=64),
        attention=LongformerAttentionConfig(attention_window=window),
        norm_placement="post",
        final_norm=False,
        **kw,
    )


def inputs(B: int = 3, T: int = 21, vocab: int = 128, pad: int = 1):
    """Right-padded ids (no real token is `pad`), their mask, and global tokens at different
    places per sequence (one on a padding position: transformers ignores it, so must we)."""
    g = torch.Generator().manual_seed(2)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T - 6 :] = 0
    mask[2, 7:] = 0
    ids = torch.randint(0, vocab - 1, (B, T), generator=g)
    ids = (ids + (ids >= pad).long()).masked_fill(mask == 0, pad)
    glob = torch.zeros(B, T, dtype=torch.long)
    glob[0, 0] = 1
    glob[1, [3, T // 2, T - 4]] = 1  # the last one is padding
    glob[2, 2] = 1
    return ids, mask, glob


@pytest.mark.parametrize("kernel", FAST)
def test_layer_kernels_equal_naive_with_gradients(kernel) -> None:
    torch.manual_seed(0)
    model = al.build_model(tiny_longformer())
    ids, mask, glob = inputs(vocab=64)
    res = {}
    for name in ("naive", kernel):
        al.set_kernel(model, name)
        model.zero_grad()
        hidden = model(ids, mask, global_attention_mask=glob).hidden
        # a fixed random upstream gradient: the sum of squares of a post-norm output would be
        # constant (d_model per token), leaving every gradient below the last norm rounding noise
        upstream = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(7))
        (hidden * mask[..., None] * upstream).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        res[name] = (hidden[mask.bool()], grads)
    (h0, g0), (h1, g1) = res["naive"], res[kernel]
    # two layers of d_model 32 (d_ff 128) over the whole row for global tokens; backward doubles
    # the chain and sums each weight gradient over the batch's rows (tests/helpers/tolerance.py)
    n = forward_terms(n_layers=2, d_model=32, d_ff=128, keys=ids.shape[1])
    assert_within_rounding(h1, h0, n)
    assert any("global_q_proj" in n and g.abs().sum() > 0 for n, g in g0.items())
    for name in g0:
        # each gradient at its own size; a bias's with its weight's too: softmax cancels q·b_k,
        # so k_proj.bias's (and global_k_proj.bias's) is rounding noise of the weight's terms
        twin = g0.get(name.removesuffix("bias") + "weight", g0[name])
        scale = max(float(g0[name].abs().max()), float(twin.abs().max()))
        assert_within_rounding(g1[name], g0[name], 2 * n + ids.numel(), scale=scale, msg=name)


def test_layer_refuses_what_global_rows_cannot_have() -> None:
    model = al.build_model(tiny_longformer())
    _, _, glob = inputs(vocab=64)
    al.set_kernel(model, "naive")
    layer = model.encoder.blocks[0].self_attn
    x = torch.randn(3, 21, 32)
    spec = MaskSpec(arange(3, 21), arange(3, 21), False, 3, q_global=glob.bool(), k_global=None)
    with pytest.raises(ValueError, match="need_weights"):
        layer(x, al.nn.attention.AttnContext(spec), need_weights=True)


def test_config_rules() -> None:
    with pytest.raises(ConfigError, match=r"attention_window \(5\) must be even.*use 4 or 6"):
        LongformerAttentionConfig(attention_window=5)
    assert LongformerAttentionConfig(attention_window=512).sliding_window == 257
    small = al.presets.tiny(al.presets.get("longformer-base-4096"))
    assert small.attention.kind == "longformer" and small.attention.attention_window == 12


# --- the n×n wall -------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", [*FAST, "naive"])
def test_no_kernel_but_naive_builds_the_n_by_n_wall(kernel) -> None:
    """n = 2,048, 8 heads, window 256 (|q − k| <= 128), four global tokens: the (1, 8, n, n)
    score tensor would hold 33.6M elements. Forward and backward through a real model."""
    n = 2048
    cfg = tiny_longformer(window=256).replace(
        d_model=64, n_heads=8, n_layers=1, positional=LearnedPositions(max_len=n)
    )
    torch.manual_seed(0)
    model = al.set_kernel(al.build_model(cfg), kernel)
    ids = torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(0))
    glob = torch.zeros(1, n, dtype=torch.long)
    glob[0, [0, 1, 700, 2047]] = 1
    with LargestTensor() as mode:
        model(ids, global_attention_mask=glob).hidden.sum().backward()
    wall = 8 * n * n
    if kernel == "naive":
        assert mode.largest >= wall  # the oracle does build it: the test can see the wall
    else:
        assert mode.largest < wall // 8, f"{kernel} allocated {mode.largest:,} elements"


# --- transformers -------------------------------------------------------------------------------

HF_SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=66,
    type_vocab_size=1,
    layer_norm_eps=1e-5,
    pad_token_id=1,
)


def hf_longformer(model_class: str, window: int):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LongformerConfig(**HF_SIZES, attention_window=window)
    model = getattr(transformers, model_class)(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial norms and biases (they start at 1 and 0)
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b)[mask.bool()].abs().max().item()


@pytest.mark.hf
@pytest.mark.parametrize("kernel", ["naive", "auto", "chunked"])
@pytest.mark.parametrize(
    ("model_class", "window", "T"),
    [("LongformerModel", 4, 21), ("LongformerForMaskedLM", 8, 37), ("LongformerModel", 8, 8)],
)
def test_equals_transformers(model_class: str, window: int, T: int, kernel: str) -> None:
    hf = hf_longformer(model_class, window)
    ours = al.set_kernel(al.interop.from_hf(hf), kernel)
    ids, mask, glob = inputs(T=T)
    with torch.no_grad():
        for g in (None, glob):
            ref = hf(input_ids=ids, attention_mask=mask, global_attention_mask=g)
            out = ours(ids, mask, global_attention_mask=g)
            ref_hidden = ref.last_hidden_state if out.logits is None else None
            if ref_hidden is not None:
                assert max_diff(ref_hidden, out.hidden, mask) <= TOL
            else:
                assert max_diff(ref.logits, out.logits, mask) <= TOL
        # the global tokens change the outputs (so the comparison above sees them)
        plain = ours(ids, mask).hidden
        assert max_diff(plain, out.hidden, mask) > 1e-3


@pytest.mark.hf
@pytest.mark.parametrize("model_class", ["LongformerModel", "LongformerForMaskedLM"])
def test_round_trips(model_class: str) -> None:
    hf = hf_longformer(model_class, 4)
    ours = al.interop.from_hf(hf)
    back = al.interop.to_hf(ours)
    assert type(back).__name__ == model_class
    want, got = hf.state_dict(), back.state_dict()
    assert set(want) == set(got)
    for k in want:
        if not k.startswith("pooler."):  # dropped on import, written as zeros (bert.py)
            assert torch.equal(want[k], got[k]), k
    ids, mask, glob = inputs()
    again = al.interop.from_hf(back)
    with torch.no_grad():
        a = ours(ids, mask, global_attention_mask=glob).hidden
        b = again(ids, mask, global_attention_mask=glob).hidden
    assert torch.equal(a, b)


@pytest.mark.hf
def test_converter_refuses_what_it_cannot_express() -> None:
    conv = al.interop.CONVERTERS.get("longformer")
    with pytest.raises(al.interop.ConversionError, match=r"attention_window.*one window per"):
        conv.config_from_hf({**HF_SIZES, "attention_window": [4, 8]})
    with pytest.raises(al.interop.ConversionError, match="architectures"):
        conv.config_from_hf({**HF_SIZES, "architectures": ["LongformerForSequenceClassification"]})
    softmax = al.presets.tiny(al.presets.get("roberta-base"))
    with pytest.raises(al.interop.ConversionError, match=r"attention\.kind"):
        conv.config_to_hf(softmax)


@pytest.mark.hf
def test_preset_converts_to_the_model_card_config() -> None:
    cfg = al.presets.get("longformer-base-4096")
    hf = al.interop.CONVERTERS.get("longformer").config_to_hf(cfg)
    assert hf["attention_window"] == [512] * 12 and hf["max_position_embeddings"] == 4098
