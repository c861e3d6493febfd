"""Decode attention over the engine's paged pool, read in place (src/attnlab/nn/csrc/paged.cpp,
src/attnlab/nn/attention/kernels/paged.py; FlexAttention with a BlockMask from the block tables,
src/attnlab/nn/attention/kernels/paged_flex.py, CUDA's, run here eager and compiled).

- The kernel against softmax attention in float64 over each row's slots gathered by hand: GQA and
  MQA, rows of 1 to 70 keys scattered over a shuffled pool, a row whose scores are 1e4 apart
  (the maximum is subtracted), within fp32 rounding; 1 and 3 threads give the same bits.
- The model: a decode step on the ragged cache takes the kernel (spied) and gives the logits of
  the gathered path (the kernel switched off) within fp32 rounding; prefills, windows, ALiBi and
  attention weights take the usual path, and so does everything with ATTNLAB_KERNELS=0.
- The engine with it serves every request the tokens of `attnlab.generate` alone
  (tests/decode/test_engine.py covers more schemes; this checks the kernel is what ran).
- Bad arguments raise RuntimeError naming the problem (a slot outside the pool, a row without
  keys, a wrong dtype).
"""

from __future__ import annotations

import random

import pytest
import torch

import attnlab as al
from attnlab.cache.ragged import RaggedPagedCache
from attnlab.config import AttentionConfig, ModelConfig, RoPE
from attnlab.decode.engine import Engine, Request
from attnlab.nn import matvec
from attnlab.nn.attention import Attention, MaskSpec
from attnlab.nn.attention.kernels import AttnCall, PagedKV, attend, flex, select


@pytest.fixture(scope="module")
def ext():
    if not matvec.ready():
        pytest.skip("the native kernels are off or cannot be built here (src/attnlab/nn/matvec.py)")
    return matvec.extension()


def _pool_case(B=5, H=6, H_kv=2, D=24, P=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g)
    k = torch.randn(H_kv, P, D, generator=g)
    v = torch.randn(H_kv, P, D, generator=g)
    lengths = torch.tensor([1, 70, 33, 16, 5][:B])
    S = int(lengths.max()) + 3  # padded table, as the cache's read_slots
    slots = torch.randperm(P, generator=g)[: B * S].reshape(B, S)  # scattered, disjoint
    return q, k, v, slots, lengths


def _reference(q, k, v, slots, lengths, scale):
    """float64 softmax attention of each row over its first n_b slots, gathered by indexing."""
    B, H, D = q.shape
    group = H // k.shape[0]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        s = slots[b, : lengths[b]]
        for h in range(H):
            kk, vv = k[h // group, s].double(), v[h // group, s].double()
            w = torch.softmax(kk @ q[b, h].double() * scale, dim=0)
            out[b, h] = w @ vv
    return out


@pytest.mark.parametrize("heads", [(6, 2), (6, 6), (4, 1)])  # GQA, MHA, MQA
def test_kernel_is_softmax_attention_over_each_rows_slots(ext, heads):
    H, H_kv = heads
    q, k, v, slots, lengths = _pool_case(H=H, H_kv=H_kv)
    q[3] *= 40.0  # scores ~1e4 apart: exp overflows unless the maximum is subtracted
    scale = 24**-0.5
    y = ext.paged_decode(q, k, v, slots, lengths, scale)
    ref = _reference(q, k, v, slots, lengths, scale)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert torch.isfinite(y).all()
    err = (y.double() - ref).abs().max().item()
    assert err < 1e-5, err
    # the check can fail: another row's slots give other values
    wrong = _reference(q, k, v, slots.roll(1, 0), lengths, scale)
    assert (y.double() - wrong).abs().max().item() > 1e-2


def test_threads_change_no_bit(ext):
    q, k, v, slots, lengths = _pool_case(seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.paged_decode(q, k, v, slots, lengths, 0.2)
        torch.set_num_threads(3)
        three = ext.paged_decode(q, k, v, slots, lengths, 0.2)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, three)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(slots=a["slots"].clone().fill_(10_000)), "outside the pool"),
        (lambda a: a.update(lengths=torch.tensor([0, 1, 1, 1, 1])), "keys, outside"),
        (lambda a: a.update(lengths=torch.tensor([1, 1, 1, 1, 99])), "keys, outside"),
        (lambda a: a.update(q=a["q"].double()), "contiguous fp32"),
        (lambda a: a.update(k=a["k"][:1]), "multiple of H_kv"),
        (lambda a: a.update(slots=a["slots"].int()), "int64"),
    ],
)
def test_bad_arguments_raise_naming_the_problem(ext, change, message):
    q, k, v, slots, lengths = _pool_case()
    args = dict(q=q, k=k, v=v, slots=slots, lengths=lengths)
    change(args)
    with pytest.raises(RuntimeError, match=message):
        ext.paged_decode(args["q"], args["k"], args["v"], args["slots"], args["lengths"], 0.2)


# --- in the model ---------------------------------------------------------------------------------


def _model(seed=0, attention=None, positional=None):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        arch="decoder",
        vocab_size=64,
        d_model=48,
        n_layers=2,
        n_heads=6,
        n_kv_heads=2,
        positional=positional or RoPE(),
        attention=attention or AttentionConfig(),
        tie_embeddings=False,
        init="xavier",
    )
    return al.build_model(cfg).eval()


@pytest.fixture
def calls(monkeypatch):
    """How many layer calls took the paged kernel."""
    seen = []
    real = Attention.finish

    def spy(self, q, choice, *args, **kwargs):
        seen.append(choice.name == "paged")
        return real(self, q, choice, *args, **kwargs)

    monkeypatch.setattr(Attention, "finish", spy)
    return seen


def without_paged(monkeypatch):
    """The selector without the paged kernel: every step gathers its rows (the dense layout)."""
    cpu = tuple(n for n in select.PREFERENCE["cpu"] if n != "paged")
    monkeypatch.setitem(select.PREFERENCE, "cpu", cpu)


def _ragged_steps(model, prompts, steps=4):
    """Prefill each prompt (rows of different lengths, blocks of 4), then `steps` one-token
    steps of all rows: the logits of every step."""
    geometry = model.cache_geometry()
    cache = RaggedPagedCache(geometry.shape(0, 0), block_size=4, num_blocks=64)
    out = []
    with torch.inference_mode():
        for rid, p in enumerate(prompts):
            cache.add(rid)
            cache.reserve(rid, len(p) + steps)
            cache.select([rid])
            ids = torch.tensor([p])
            h, _ = model.run(
                model.embed(ids), cache.next_position[:, None] + torch.arange(len(p)), None, cache
            )
        rids = list(range(len(prompts)))
        nxt = torch.tensor([[p[-1]] for p in prompts])
        for _ in range(steps):
            cache.select(rids)
            h, _ = model.run(model.embed(nxt), cache.next_position[:, None], None, cache)
            logits = model.logits(h[:, -1])
            out.append(logits)
            nxt = logits.argmax(-1, keepdim=True)
    return torch.stack(out)


PROMPTS = [[5, 9, 2], list(range(1, 18)), [7] * 9]


def test_a_decode_step_takes_the_kernel_and_gives_the_gathered_paths_logits(
    ext, calls, monkeypatch
):
    model = _model()
    fast = _ragged_steps(model, PROMPTS)
    took = list(calls)
    # prefills (one row, T > 1) take the usual path; each decode step's 2 layers the kernel
    assert took.count(True) == 4 * 2 and took.count(False) == len(PROMPTS) * 2
    without_paged(monkeypatch)
    slow = _ragged_steps(model, PROMPTS)
    assert (fast - slow).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "why",
    ["window", "alibi", "kernels off"],
)
def test_other_steps_take_the_usual_path(ext, calls, monkeypatch, why):
    if why == "window":
        model = _model(attention=AttentionConfig(sliding_window=6))
    elif why == "alibi":
        model = _model(positional=al.config.ALiBi())
    else:
        monkeypatch.setenv("ATTNLAB_KERNELS", "0")
        model = _model()
    _ragged_steps(model, PROMPTS, steps=2)
    assert calls and not any(calls)


def test_the_engine_serves_each_requests_own_tokens_through_the_kernel(ext, calls):
    model = _model(seed=1)
    rng = random.Random(0)
    reqs = [
        Request(
            [rng.randrange(2, 64) for _ in range(rng.randint(1, 19))], max_tokens=rng.randint(1, 12)
        )
        for _ in range(7)
    ]
    got = Engine(model, num_blocks=64, block_size=4, max_batch=4).run(reqs)
    assert any(calls)
    for r, tokens in zip(reqs, got, strict=True):
        alone = al.generate(model, torch.tensor([list(r.prompt)]), max_new_tokens=r.max_tokens)
        assert tokens == alone[0, len(r.prompt) :].tolist()


# --- paged-flex: the GPU's kernel for the same step --------------------------------------------


def _block_case(bs=4, n_blocks=64, B=5, H=6, H_kv=2, D=24, seed=0):
    """A pool of n_blocks blocks of bs slots, each row's blocks scattered over it (disjoint),
    its slot table as the cache builds it (logical slot j in block table[j // bs])."""
    g = torch.Generator().manual_seed(seed)
    P = n_blocks * bs
    q = torch.randn(B, H, D, generator=g)
    k = torch.randn(H_kv, P, D, generator=g)
    v = torch.randn(H_kv, P, D, generator=g)
    lengths = torch.tensor([1, 30, 13, 16, 5][:B])
    width = -(-int(lengths.max()) // bs) + 1  # a padded table, as read_slots
    table = torch.randperm(n_blocks, generator=g)[: B * width].reshape(B, width)
    j = torch.arange(width * bs)
    slots = table[:, j // bs] * bs + j % bs  # (B, width · bs)
    return q, k, v, slots, lengths


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("heads", [(6, 2), (6, 6), (4, 1)])  # GQA, MHA, MQA
def test_paged_flex_is_softmax_attention_over_each_rows_slots(heads, compiled, monkeypatch):
    monkeypatch.setattr(flex, "COMPILE", compiled)
    H, H_kv = heads
    q, k, v, slots, lengths = _block_case(H=H, H_kv=H_kv)
    B, S = slots.shape
    scale = 24**-0.5
    call = AttnCall(
        scale=scale,
        mask=MaskSpec(lengths[:, None] - 1, torch.arange(S).expand(B, S), True),
        layout="paged",
        pages=PagedKV(k, v, slots, lengths, 4),
    )
    with torch.no_grad():
        y, _ = attend(q[:, :, None], q[:, :1, None], q[:, :1, None], call, kernel="paged-flex")
    ref = _reference(q, k, v, slots, lengths, scale)
    err = (y[:, :, 0].double() - ref).abs().max().item()
    assert err < 1e-5, err
    wrong = _reference(q, k, v, slots.roll(1, 0), lengths, scale)  # the check can fail
    assert (y[:, :, 0].double() - wrong).abs().max().item() > 1e-2


def _transformed_reference(q, k, v, slots, lengths, scale, window, cap, slopes, sinks):
    """float64: row b's query at position n_b − 1 over its keys j < n_b at positions j in slot
    order, those within `window`; scores soft-capped, then ALiBi's slope_h · (j − q); one more
    softmax term per head, the sink, whose value is 0."""
    B, H, D = q.shape
    group = H // k.shape[0]
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        j = torch.arange(n)
        seen = j[(n - 1 - j) < window]
        s = slots[b, seen]
        for h in range(H):
            kk, vv = k[h // group, s].double(), v[h // group, s].double()
            z = kk @ q[b, h].double() * scale
            z = cap * torch.tanh(z / cap) + slopes[h].double() * (seen - (n - 1)).double()
            w = torch.softmax(torch.cat([z, sinks[h].double().reshape(1)]), dim=0)[:-1]
            out[b, h] = w @ vv
    return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_paged_flex_maps_window_softcap_alibi_and_sinks_through_the_table(compiled, monkeypatch):
    """The call's mask (causal, a window of 7), soft-cap, ALiBi bias and sinks, described over
    each row's keys in logical order, as paged-flex reads them from the pool in place (the
    functions mapped through the block table; the sink on the scratch block's SPARE slot) —
    against float64 softmax attention over each row's slots gathered by hand."""
    from attnlab.cache.blocks import SPARE
    from attnlab.nn.attention.bias import LinearBias

    monkeypatch.setattr(flex, "COMPILE", compiled)
    q, k, v, slots, lengths = _block_case(seed=3)
    k[:, SPARE], v[:, SPARE] = 0.0, 0.0  # never written in a real pool
    slots = torch.where(slots // 4 == 0, slots + 4 * 63, slots)  # no row holds the scratch block
    B, S = slots.shape
    H, scale, window, cap = q.shape[1], 24**-0.5, 7, 2.0
    g = torch.Generator().manual_seed(4)
    slopes, sinks = torch.rand(H, generator=g), torch.randn(H, generator=g)
    q_pos, k_pos = lengths[:, None] - 1, torch.arange(S).expand(B, S)
    call = AttnCall(
        scale=scale,
        mask=MaskSpec(q_pos, k_pos, True, window=window),
        bias=LinearBias(slopes, q_pos, k_pos, True),
        softcap=cap,
        sinks=sinks,
        layout="paged",
        pages=PagedKV(k, v, slots, lengths, 4),
    )
    with torch.no_grad():
        y, _ = attend(q[:, :, None], q[:, :1, None], q[:, :1, None], call, kernel="paged-flex")
    ref = _transformed_reference(q, k, v, slots, lengths, scale, window, cap, slopes, sinks)
    err = (y[:, :, 0].double() - ref).abs().max().item()
    assert err < 1e-5, err
    plain = _transformed_reference(q, k, v, slots, lengths, scale, 10**6, cap, slopes, sinks)
    assert (y[:, :, 0].double() - plain).abs().max().item() > 1e-2  # the window mattered


def flex_paged(monkeypatch):
    """The CPU selector with paged-flex for the paged layout (CUDA's choice) instead of paged."""
    cpu = ("paged-flex", *(n for n in select.PREFERENCE["cpu"] if n != "paged"))
    monkeypatch.setitem(select.PREFERENCE, "cpu", cpu)


def _choices(monkeypatch) -> list[str]:
    """The kernel of every layer call from here on."""
    seen = []
    real = Attention.finish

    def spy(self, q, choice, *args, **kwargs):
        seen.append(choice.name)
        return real(self, q, choice, *args, **kwargs)

    monkeypatch.setattr(Attention, "finish", spy)
    return seen


def test_paged_flex_steps_give_the_gathered_paths_logits(monkeypatch):
    model = _model()
    seen = _choices(monkeypatch)
    flex_paged(monkeypatch)
    fast = _ragged_steps(model, PROMPTS)
    assert seen.count("paged-flex") == 4 * 2  # each decode step's 2 layers
    without_paged(monkeypatch)
    monkeypatch.setitem(
        select.PREFERENCE, "cpu", tuple(n for n in select.PREFERENCE["cpu"] if n != "paged-flex")
    )
    slow = _ragged_steps(model, PROMPTS)
    assert (fast - slow).abs().max().item() < 1e-5


def test_the_engine_serves_each_requests_own_tokens_through_paged_flex(monkeypatch):
    monkeypatch.setenv("ATTNLAB_KERNELS", "0")  # no native rows: every decode step batched
    seen = _choices(monkeypatch)
    flex_paged(monkeypatch)
    model = _model(seed=2)
    rng = random.Random(1)
    reqs = [
        Request([rng.randrange(2, 64) for _ in range(rng.randint(1, 19))], max_tokens=8)
        for _ in range(6)
    ]
    got = Engine(model, num_blocks=64, block_size=4, max_batch=4).run(reqs)
    assert "paged-flex" in seen
    for r, tokens in zip(reqs, got, strict=True):
        alone = al.generate(model, torch.tensor([list(r.prompt)]), max_new_tokens=r.max_tokens)
        assert tokens == alone[0, len(r.prompt) :].tolist()


def test_a_one_token_steps_update_gathers_only_when_unpacked(monkeypatch):
    """The pooled cache's update on a one-token step returns a KVView: a kernel that reads the
    pool (paged-flex here) leaves it ungathered; the dense layout unpacks it, which gathers."""
    from attnlab.cache.blocks import BlockPool

    gathers = []
    real = BlockPool.gather
    monkeypatch.setattr(BlockPool, "gather", lambda self, *a: gathers.append(1) or real(self, *a))
    model = _model()
    flex_paged(monkeypatch)
    _ragged_steps(model, PROMPTS, steps=2)
    assert gathers == [1] * (len(PROMPTS) * 2)  # the prefills' (one row each, 2 layers) only
    gathers.clear()
    monkeypatch.setitem(select.PREFERENCE, "cpu", ("sdpa", "chunked", "naive"))
    _ragged_steps(model, PROMPTS, steps=2)
    assert len(gathers) == len(PROMPTS) * 2 + 2 * 2  # and each decode step's 2 layers


def test_paged_flex_builds_one_block_mask_per_step(monkeypatch):
    """The layers of one decode step share the BlockMask the first of them built (kept in the
    step's PagedKV.step, renewed by the cache every forward pass)."""
    from attnlab.nn.attention.kernels import paged_flex

    built = []
    real = paged_flex.block_mask
    monkeypatch.setattr(paged_flex, "block_mask", lambda *a: built.append(1) or real(*a))
    flex_paged(monkeypatch)
    _ragged_steps(_model(), PROMPTS, steps=3)
    assert len(built) == 3  # one per decode step, for its 2 layers


def _torch_flex_tiles() -> set[tuple[int, int]]:
    """Every (BLOCK_M, BLOCK_N) torch's CUDA heuristics may give flex's forward and decoding
    kernels (torch/_inductor/template_heuristics/triton.py: the default tables per GPU, the
    autotune and exhaustive lists), read without a GPU."""
    from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic

    h, tiles = CUDAConfigHeuristic(), set()
    for name, value in vars(h).items():
        if "flex" in name and "bwd" not in name:
            for c in value.values() if isinstance(value, dict) else value:
                # FlexDecodeConfig has no BLOCK_M: the decoding kernel derives it (below)
                tiles.add((vars(c).get("block_m", 16), c.block_n))
    return tiles


def test_paged_flex_tiles_satisfy_torchs_rule_for_every_gqa_ratio():
    """torch's flex kernels (inductor/kernel/flex/flex_attention.py, flex_decoding.py) require
    Q_BLOCK % BLOCK_M == 0 and KV_BLOCK % BLOCK_N == 0, and raise with one config otherwise.
    Its decoding kernel (one query, H / H_kv a power of 2) clamps BLOCK_N to the page and uses
    BLOCK_M = max(next_pow2(ratio), 16); any other ratio (SmolLM2's 3, Qwen2-7B's 7) takes the
    main kernel with its config's tiles, BLOCK_N 32 to 128: over pages of 16 it raised. With
    paged_flex.kernel_options every config passes, for every ratio 1-8 and page 16-128."""
    from attnlab.nn.attention.kernels.paged_flex import Q_BLOCK, kernel_options

    tiles = _torch_flex_tiles()
    assert {m for m, _ in tiles} <= {16, 32, 64, 128} and max(n for _, n in tiles) >= 64

    def accepts(ratio: int, page: int, options: dict[str, int]) -> bool:
        if ratio & (ratio - 1) == 0:  # the decoding kernel
            block_m = max(1 << (ratio - 1).bit_length(), 16)
            return all(
                Q_BLOCK % block_m == 0 and page % options.get("BLOCK_N", min(n, page)) == 0
                for _, n in tiles
            )
        return all(
            Q_BLOCK % options.get("BLOCK_M", m) == 0 and page % options.get("BLOCK_N", n) == 0
            for m, n in tiles
        )

    assert not accepts(3, 16, {})  # the defect: without options, pages of 16 and 3 : 1 GQA
    for ratio in range(1, 9):
        for page in (16, 32, 48, 64, 128):
            assert accepts(ratio, page, kernel_options(page)), (ratio, page)
