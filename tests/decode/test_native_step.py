"""The native decode step (src/attnlab/decode/native_step.py, csrc/step.cpp) against the eager step.

- every decoder preset (tiny): either `why_not` names what the step lacks and `decode_step` runs the
  eager forward, or the native step runs and its logits equal the eager step's within fp32 rounding
  for 12 greedy tokens (equal tokens), its K/V written to the cache as the eager step writes them;
- each weight kind the step reads (fp32 separate and fused, int8 rows, 4-bit blocks with K padded,
  4-bit and Q8_0 with int8 activations against the eager model with the same activations), tied
  and untied heads, RoPE "half" and "interleaved", partial rotation, MHA / GQA / MQA, q/k/v biases,
  Granite's multipliers, GeGLU;
- any thread count gives the same bits (rows and heads are split, never a sum);
- a cache filled by native steps continues under the eager step (and back) as if eager throughout;
- the eager step where the step does not apply: two rows, a left-padded prompt, a sliding cache,
  ATTNLAB_KERNELS=0, encoder-decoder models; `generate` through the native step equals the eager
  loop;
- the engine's rows (a slot table into the paged pool): a scattered cache read through its table
  gives a contiguous cache's bits and the new K/V lands in table[slot]; the engine decodes up to
  NATIVE_ROWS rows natively with every request's tokens equal to `generate` alone (greedy and
  seeded sampling, chunked prefill with prefix caching, pre-emption).

The tolerance: logits within 1e-4 · max|logit| + 1e-5 (fp32 sums in another order through two
layers; measured differences ~1e-6).
"""

from __future__ import annotations

import copy

import pytest
import torch

import attnlab as al
from attnlab.decode import native_step, picker, steps
from attnlab.nn import matvec
from attnlab.nn.model import DecoderOnlyModel
from attnlab.nn.quant_blocks import int8_activations

STEPS = 12


@pytest.fixture(scope="module")
def built():
    if not matvec.ready():
        pytest.skip("the matvec kernels are off or cannot be built here (src/attnlab/nn/matvec.py)")


def _tiny(preset: str, seed: int = 0, **sizes) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = al.presets.tiny(al.presets.get(preset), **sizes).replace(init="xavier")
    return al.build_model(cfg).eval()


def _decode(model, ids: torch.Tensor, native: bool, steps_: int = STEPS):
    """Greedy decoding by hand: (logits per step, tokens, the state), native or eager steps."""
    with torch.inference_mode():
        _seq, logits, state = steps.prefill(model, ids, steps_ + 1)
        if not native:
            state.step = False
        out, toks = [], []
        for _ in range(steps_):
            tok = logits.argmax(-1)
            toks.append(tok)
            logits = steps.decode_step(model, tok, state)
            out.append(logits)
    return torch.stack(out), torch.stack(toks), state


def _decode_given(model, ids: torch.Tensor, toks: torch.Tensor) -> torch.Tensor:
    """Native steps fed the given tokens (T, 1): the logits of each step."""
    with torch.inference_mode():
        _, _, state = steps.prefill(model, ids, len(toks) + 1)
        return torch.stack([steps.decode_step(model, t, state) for t in toks])


def _ids(model, t: int = 7, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.vocab_size, (1, t), generator=g)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()) + 1e-5)


def _close_x8(got: torch.Tensor, want: torch.Tensor) -> None:
    """int8 activations on both sides: an fp32 rounding difference in x may move an element of x
    to the next step of its block's grid (dx = max|x|/127), so the two differ by a few such steps
    carried through the layers, not by fp32 rounding: each logit within 5 % of max|logit|, on
    average within 2 % of the mean |logit| (measured: up to 1.1 % on these random models under
    AVX2; a wrong layout or scale is off by O(1))."""
    err, scale = (got - want).abs(), want.abs()
    assert float(err.max()) <= 0.05 * float(scale.max()), float(err.max())
    assert float(err.mean()) <= 0.02 * float(scale.mean()), float(err.mean())


def _assert_native_equals_eager(model, x8: bool = False) -> steps.DecodeState:
    ids = _ids(model)
    want, want_toks, eager = _decode(model, ids, native=False)
    got, toks, state = _decode(model, ids, native=True)
    assert isinstance(state.step, native_step.NativeStep)
    assert eager.step is False
    if x8:  # the next tokens differ where the logits do: feed both the eager tokens instead
        got = _decode_given(model, ids, want_toks)
        _close_x8(got, want)
        return state
    _close(got, want)
    assert torch.equal(toks, want_toks)
    c, e = state.cache, eager.cache
    assert c.length == e.length and torch.equal(c.next_position, e.next_position)
    assert torch.equal(c.positions, e.positions) and torch.equal(c.valid, e.valid)
    for mine, theirs in ((c.k, e.k), (c.v, e.v)):
        _close(mine[:, :, :, : c.length], theirs[:, :, :, : e.length])
    return state


@pytest.mark.parametrize("preset", al.presets.names())
def test_every_decoder_preset_is_native_or_says_why_not(built, preset):
    model = _tiny(preset)
    if not isinstance(model, DecoderOnlyModel):
        assert native_step.why_not(model) is not None
        return
    why = native_step.why_not(model)
    if why is None:
        _assert_native_equals_eager(model)
    else:
        _, _, state = _decode(model, _ids(model), native=True, steps_=2)
        assert state.step is False, why


NATIVE = ["llama2-7b", "qwen2-7b", "qwen3-0.6b", "llama3.2-1b", "granite-3.1-2b"]


def test_the_common_families_are_native(built):
    for preset in NATIVE:
        assert native_step.why_not(_tiny(preset)) is None, preset


@pytest.mark.parametrize("preset", NATIVE)
@pytest.mark.parametrize("form", ["fused", "int8", "int4", "int4-x8"])
def test_each_weight_kind_matches_its_eager_model(built, preset, form):
    model = al.fuse(_tiny(preset))
    if form != "fused":
        model = al.quantize(model, form.split("-")[0], head=True)
    if form.endswith("x8"):
        int8_activations(model)  # both steps multiply with int8 activation blocks
    _assert_native_equals_eager(model, x8=form.endswith("x8"))


def _q8_halves(model: torch.nn.Module) -> torch.nn.Module:
    """Every Linear map as 8-bit blocks with a scale per 16 elements (Q6_K's form, d (N, 2G)),
    scaled from each 16's largest magnitude."""
    import torch.nn.functional as F

    from attnlab.nn.quant_blocks import BlockInt8Linear

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, torch.nn.Linear):
                continue
            w = child.weight.detach()
            halves = F.pad(w, (0, -w.shape[1] % 32)).view(w.shape[0], -1, 2, 16)
            d = halves.abs().amax(-1) / 31
            q = torch.round(halves / torch.where(d == 0, 1, d)[..., None]).clamp(-32, 31)
            mod = BlockInt8Linear.__new__(BlockInt8Linear)
            mod.take_shape(child, False)
            mod.set_blocks(q.view(w.shape[0], -1, 32).to(torch.int8), d.flatten(1))
            setattr(parent, name, mod)
    return model


@pytest.mark.parametrize("x8", [False, True], ids=["fp32", "x8"])
def test_8_bit_blocks_with_a_scale_per_16_match_the_eager_model(built, x8):
    """Q6_K's form through the native step (step.cpp's Q8 / Q8_X8 kinds with H = 2), d_model 48:
    blocks padded past K."""
    model = _q8_halves(al.fuse(_tiny("llama2-7b", d_model=48)))
    assert all(
        m.d.shape[1] == 2 * m.qweight.shape[1] for m in model.modules() if hasattr(m, "qweight")
    )
    if x8:
        int8_activations(model)
    _assert_native_equals_eager(model, x8=x8)


def test_odd_sizes_padded_blocks_partial_interleaved_rope_mqa_geglu(built):
    """d_model 48 (4-bit blocks padded to 64), head_dim 12 with 8 rotated channels interleaved,
    one KV head, GeGLU, an untied head, q/k/v biases."""
    torch.manual_seed(3)
    base = al.presets.get("llama2-7b")
    cfg = al.presets.tiny(base, d_model=48).replace(
        init="xavier", tie_embeddings=False, n_kv_heads=1
    )
    cfg = cfg.replace(
        attention=cfg.attention.replace(qkv_bias=True),
        positional=cfg.positional.replace(fraction=0.67, layout="interleaved"),  # 8 of 12
        ffn=cfg.ffn.replace(activation="gelu-tanh"),
    )
    model = al.build_model(cfg).eval()
    assert model.decoder.positional.rot_dim == 8 and native_step.why_not(model) is None
    _assert_native_equals_eager(model)
    _assert_native_equals_eager(al.quantize(copy.deepcopy(model), "int4", head=True))


def test_thread_count_changes_no_bit(built):
    model = al.quantize(al.fuse(_tiny("qwen2-7b")), "int4", head=True)
    ids, before = _ids(model), torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(_decode(model, ids, native=True)[0])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


def test_native_and_eager_steps_share_one_cache(built):
    model = _tiny("llama2-7b")
    ids = _ids(model)
    want, _, _ = _decode(model, ids, native=False)
    with torch.inference_mode():
        _, logits, state = steps.prefill(model, ids, STEPS + 1)
        got = []
        for i in range(STEPS):
            state.step = None if i % 4 < 2 else False  # two native steps, two eager, ...
            logits = steps.decode_step(model, logits.argmax(-1), state)
            got.append(logits)
    _close(torch.stack(got), want)


def test_generate_through_the_native_step_equals_the_eager_loop(built, monkeypatch):
    model = al.fuse(_tiny("llama3.2-1b"))
    ids = _ids(model, t=5)
    native = al.generate(model, ids, 10)
    monkeypatch.setattr(
        picker, "PROVIDERS", tuple(p for p in picker.PROVIDERS if p.name != "native")
    )
    assert torch.equal(native, al.generate(model, ids, 10))


@pytest.mark.parametrize("case", ["two rows", "left padding", "sliding cache", "kernels off"])
def test_eager_step_where_native_does_not_apply(built, monkeypatch, case):
    model = _tiny("llama2-7b")
    ids, mask, kind = _ids(model), None, None
    if case == "two rows":
        ids = torch.cat([ids, ids.flip(1)])
    elif case == "left padding":
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
    elif case == "sliding cache":
        kind = "paged"
    else:
        monkeypatch.setenv("ATTNLAB_KERNELS", "0")
    with torch.inference_mode():
        _, logits, state = steps.prefill(model, ids, 3, mask, cache_kind=kind)
        steps.decode_step(model, logits.argmax(-1), state)
    assert state.step is False


def _olmo():
    """OLMo 2 with pre-norm blocks: its qk-norm over the whole projection is what remains."""
    model = _tiny("olmo2-1b")
    for block in model.decoder.blocks:
        block.placement = "pre"
    return model


def test_why_not_names_the_feature():
    assert "qk-norm" in native_step.why_not(_olmo())
    assert "MoE" in native_step.why_not(_tiny("mixtral-8x7b"))
    assert "soft-capping" in native_step.why_not(_tiny("gemma2-2b"))
    model = _tiny("llama2-7b").train()
    assert "training" in native_step.why_not(model)


# --- the engine's rows: the paged pool through a slot table -----------------------------------


def test_a_slot_table_reads_and_writes_scattered_slots_as_a_contiguous_cache(built):
    """Step.forward with a table (logical slot j -> cache slot table[j]) over a cache whose
    slots are a permutation of a contiguous one's gives the same bits and writes the new K/V to
    table[slot]."""
    model = al.quantize(al.fuse(_tiny("qwen3-0.6b")), "int4", head=True)
    ids = _ids(model)
    with torch.inference_mode():
        _, logits, state = steps.prefill(model, ids, 4)
        cache = state.cache
        step = native_step.NativeStep(model, matvec.extension())
        n = cache.length  # the next token's logical slot
        S = cache.k.shape[3]
        perm = torch.randperm(S, generator=torch.Generator().manual_seed(0))
        k2, v2 = torch.empty_like(cache.k), torch.empty_like(cache.v)
        k2[:, :, :, perm] = cache.k  # logical slot j lives at perm[j]
        v2[:, :, :, perm] = cache.v
        x = model.embed(logits.argmax(-1)[:, None]).reshape(-1).contiguous()
        rot = model.decoder.positional.rotation(torch.tensor([[n]]))
        cos, sin = rot.cos.reshape(-1).contiguous(), rot.sin.reshape(-1).contiguous()
        want = step.step.forward(x, cos, sin, cache.k, cache.v, n)
        got = step.step.forward(x, cos, sin, k2, v2, n, perm)
    assert torch.equal(got, want)
    assert torch.equal(k2[:, :, :, perm[n]], cache.k[:, :, :, n])
    assert torch.equal(v2[:, :, :, perm[n]], cache.v[:, :, :, n])
    with pytest.raises(RuntimeError, match="outside the cache"):
        step.step.forward(x, cos, sin, k2, v2, n, torch.full((S,), S))
    with pytest.raises(RuntimeError, match="slot table"):
        step.step.forward(x, cos, sin, k2, v2, n, perm[:n])


@pytest.mark.parametrize("options", ["plain", "chunked+prefix", "pre-emption"])
def test_the_engine_decodes_few_rows_natively_with_each_requests_own_tokens(
    built, monkeypatch, options
):
    """Up to NATIVE_ROWS rows decode row by row through the native step (spied), with the
    tokens of `generate` on each request alone (greedy, and seeded sampling), including
    prefix-cached blocks and requests pre-empted and recomputed."""
    import random

    from attnlab.decode import engine as engine_module
    from attnlab.decode.engine import Engine, Request

    model = al.quantize(al.fuse(_tiny("llama3.2-1b", seed=2)), "int4", head=True)
    rows = []
    real = native_step.NativeStep.paged
    monkeypatch.setattr(
        native_step.NativeStep, "paged", lambda self, t, c: rows.append(1) or real(self, t, c)
    )
    rng = random.Random(5)
    system = [rng.randrange(2, model.vocab_size) for _ in range(9)]
    reqs = []
    for i in range(9):
        prompt = system + [rng.randrange(2, model.vocab_size) for _ in range(rng.randint(1, 12))]
        sampled = i % 3 == 1
        reqs.append(
            Request(
                prompt,
                max_tokens=rng.randint(2, 12),
                temperature=0.8 if sampled else 0.0,
                seed=i if sampled else None,
            )
        )
    kw = {"num_blocks": 64, "block_size": 4, "max_batch": 5}
    if options == "chunked+prefix":
        kw.update(step_tokens=16, prefix_caching=True)
    if options == "pre-emption":
        kw.update(num_blocks=14)
    engine = Engine(model, **kw)
    assert engine.decode_step.name == "native" and kw["max_batch"] <= engine_module.NATIVE_ROWS
    got = engine.run(reqs)
    assert rows
    if options == "pre-emption":
        assert engine.preemptions > 0
    for r, tokens in zip(reqs, got, strict=True):
        kw = dict(temperature=r.temperature, seed=r.seed) if r.temperature > 0 else {}
        strategy = "sample" if r.temperature > 0 else "greedy"
        alone = al.generate(model, torch.tensor([list(r.prompt)]), r.max_tokens, strategy, **kw)
        assert tokens == alone[0, len(r.prompt) :].tolist()
