"""The CUDA paths, proven on the CPU (inductor) as a first GPU run takes them, in one long-lived
process: as a server, a notebook or benchmarks/gpu.py decode many models and shapes one after
another. Nothing here resets dynamo or clears a cache between cases; the selector decides as it
does on CUDA (`cuda_choices`: the CUDA preference list over CPU tensors), dynamo's recompile
limit fails loudly (`fail_on_recompile_limit_hit`), and torch's unfused-flex warning is an error
(tests/conftest.py). Found by reading the CUDA paths against torch's source (issue 47): the
compiled step failed from the 9th graph of a process, flex silently ran unfused after ~8 lengths,
flex could not be traced inside the compiled step, bf16 + sinks returned fp32."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

import attnlab as al
from attnlab.decode import batch_step, compiled_step
from attnlab.decode.batch_step import BatchStep
from attnlab.decode.engine import Engine, Request
from attnlab.decode.picker import pick
from attnlab.graphs import compiled_graphs
from attnlab.nn.attention import MaskSpec
from attnlab.nn.attention.kernels import AttnCall, attend, choose, flex, flex_buckets, select
from attnlab.nn.attention.layer import record_choices
from attnlab.nn.model import DecoderOnlyModel


@contextmanager
def cuda_choices():
    """The selector's CUDA list for CPU tensors, and a recompile-limit hit an error."""
    cpu = select.PREFERENCE["cpu"]
    select.PREFERENCE["cpu"] = select.PREFERENCE["cuda"]
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            yield
    finally:
        select.PREFERENCE["cpu"] = cpu


def tiny(name: str, dtype: torch.dtype = torch.float32) -> DecoderOnlyModel:
    torch.manual_seed(0)
    return al.build_model(al.presets.tiny(al.presets.get(name))).to(dtype).eval()


def served_decoders() -> list[str]:
    """Every decoder preset the compiled step serves (compiled_step.py `why_not`)."""
    out = []
    for name in al.presets.names():
        model = tiny(name)
        if isinstance(model, DecoderOnlyModel) and compiled_step.why_not(model) is None:
            out.append(name)
    return out


def alone(model, prompt: list[int], n: int) -> list[int]:
    out = al.generate(model, torch.tensor([prompt]), n, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


def test_one_process_decodes_twenty_presets_on_the_compiled_step_and_the_batch_step():
    """20 presets × 3 prompt lengths in one process: the compiled step (CUDA's default decode,
    `cache_kind="fixed"`) under the CUDA choices, and the engine's batch step with its graph
    captured first; tokens equal to the eager step's on the CPU's own path, and exactly one
    graph per preset for each step (the 9th used to raise FailOnRecompileLimitHit)."""
    names = served_decoders()
    assert len(names) >= 20, names
    names = names[:20]
    steps, batches = compiled_step.compiled("default"), batch_step.compiled("default")
    steps0, batches0 = steps.compiles, batches.compiles
    renewed0 = steps.renewed + batches.renewed
    for name in names:
        model = tiny(name)
        g = torch.Generator().manual_seed(1)
        prompts = [
            torch.randint(1, model.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 14)
        ]
        want = [alone(model, p, 6) for p in prompts]  # the CPU's own path: static cache, eager
        with cuda_choices():
            for p, w in zip(prompts, want, strict=True):
                ids = torch.tensor([p])
                got = al.generate(model, ids, 6, eos_token_id=None, cache_kind="fixed")
                assert got[0, len(p) :].tolist() == w, name
        # the engine's batch step, its graph captured at start (under the CPU's choices: the
        # CUDA choices' one-token prompts would add a paged-flex compile per preset to this
        # test; the CUDA choices inside a batch graph are the 256-request test's and
        # test_flex_traces_whole_inside_the_batch_step's)
        engine = Engine(model, num_blocks=32, block_size=16, max_batch=4)
        engine.runner.step = BatchStep(model, engine.cache)  # CUDA's; the CPU's: eager
        engine.warm_up(rows=[4], widths=[2])
        before = compiled_graphs()
        assert engine.run([Request(p, max_tokens=6) for p in prompts]) == want, name
        assert compiled_graphs() == before, name  # captured at start: none while serving
    # one graph per preset for each step, each its own key, none renewed past the limit
    assert steps.compiles - steps0 == batches.compiles - batches0 == len(names)
    assert steps.renewed + batches.renewed == renewed0


def test_the_engine_captures_its_graphs_then_serves_256_requests_without_compiling():
    """After warm_up (every rows × widths bucket compiled, one progress line each), 256
    requests of mixed lengths arriving over time compile nothing, and each gets its own
    tokens; the server's /metrics reads the count (`compiles_since_start`)."""
    model = tiny("llama3.2-1b")
    # a pool no request waits for (a pre-empted request's recompute would be a prompt of up to
    # 24 tokens, past DENSE_ROWS: flex on CUDA, whose prefill graphs compile when first met)
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=4)
    engine.runner.step = BatchStep(model, engine.cache)
    lines: list[str] = []
    with cuda_choices():
        rows, widths = engine.capture_sizes()  # the defaults: powers of 2 up to the limits
        longest = min(64, -(-(model.max_positions or 10**9) // 4))  # blocks of the longest
        assert rows == [1, 2, 4] and widths == [1 << i for i in range(len(widths))]
        assert widths[-1] >= longest > widths[-1] // 2
        engine.warm_up(rows=[1, 2, 4], widths=[2, 8], say=lines.append)
        assert len(lines) == 3 * 2 + 1 and lines[-1].startswith("decode graphs: 6 compiled in")
        g = torch.Generator().manual_seed(5)
        reqs = [
            Request(torch.randint(1, model.vocab_size, (int(n),), generator=g).tolist(),
                    max_tokens=int(m))
            for n, m in zip(torch.randint(1, 17, (256,), generator=g),
                            torch.randint(1, 9, (256,), generator=g), strict=True)
        ]  # fmt: skip
        out: dict[int, list[int]] = {}
        rids = []
        while len(rids) < len(reqs) or engine.has_work:
            for r in reqs[len(rids) : len(rids) + 3]:  # three arrive before every step
                rids.append(engine.submit(r))
            for e in engine.step():
                out.setdefault(e.rid, []).append(e.token)
        assert engine.compiles_since_start == 0
    for rid, r in list(zip(rids, reqs, strict=True))[::16]:  # a sample: each as if alone
        assert out[rid] == alone(model, r.prompt, r.max_tokens)


def test_fifty_prompt_lengths_compile_flex_a_bounded_number_of_times():
    """50 lengths from 1 to 4,096 of a prefill into a cache (causal, not aligned: CUDA sends it
    to flex, as every padded batch, window, bias and soft-cap) run fused, each equal to the
    chunked kernel, and compile at most one graph per length bucket (`flex_buckets.padded_len`: 15
    buckets up to 4,096) instead of one per length, never running unfused."""
    lengths = [1, 2, 3, 7, 16, 17, 100, 108, 128, 129, 216, 300, 324, 432, 539, 647, 755, 863,
               970, 1000, 1078, 1186, 1294, 1401, 1509, 1617, 1725, 1832, 1940, 2048, 2049, 2156,
               2264, 2371, 2479, 2587, 2695, 2802, 2910, 3018, 3126, 3233, 3341, 3449, 3557, 3664,
               3772, 3880, 3988, 4096]  # fmt: skip
    assert len(lengths) == 50
    g = torch.Generator().manual_seed(0)
    before = flex.graphs().compiles
    for n in lengths:
        pos = torch.arange(n)[None]
        call = AttnCall(scale=0.3, mask=MaskSpec(pos, pos, True))  # aligned=False
        q, k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
        with cuda_choices():
            assert choose("auto", q, k, v, call, device="cuda").name == (
                "flex" if n > 16 else "sdpa"
            )
            with torch.no_grad():
                out, _ = attend(q, k, v, call, kernel="flex")
        want, _ = attend(q, k, v, call, kernel="chunked")
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    buckets = {flex_buckets.padded_len(n) for n in lengths}
    assert len(buckets) <= 15
    assert flex.graphs().compiles - before <= len(buckets)


@pytest.mark.parametrize("name", ["bloom-560m", "mpt-7b", "gemma2-2b"])
def test_flex_traces_inside_the_compiled_step_in_bf16(name, monkeypatch):
    """On CUDA a bf16 step with ALiBi (sdpa refuses a bf16 bias) or soft-capping goes to flex:
    inside the compiled step it is traced in place (its BlockMask in the pass's mask
    description, no module-level table), bf16 in and out, the eager step's logits (the eager
    side under the CPU's choices: one compile per model here, the step's). (Sinks go to sdpa as
    one extra key: GPT-OSS's bf16 flex path is in the sweep below.)"""
    model = tiny(name, torch.bfloat16)
    ids = torch.randint(1, model.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        eager, comp = (model.new_cache(2, 32, kind="fixed") for _ in range(2))
        token = model(ids, cache=eager).logits[:, -1].argmax(-1)
        model(ids, cache=comp)
        with cuda_choices(), monkeypatch.context() as m:  # the step's calls, run eagerly once
            m.setattr(flex, "COMPILE", False)
            layers = record_choices(model)
            comp.reserve(1)
            compiled_step._forward(model, token, comp.graph_view())
            record_choices(model, on=False)
        assert {c.name for _, cs in layers for c in cs} >= {"flex"}, layers
        comp.length -= 1
        comp.cursor.sub_(1)  # that step undone: its slot is rewritten by the compiled one
        comp.next_position.sub_(1)
        step = pick(model, comp).step
        assert step is not None
        for _ in range(3):
            with cuda_choices():
                got = step(token, comp)
            want = model(token[:, None], cache=eager).logits[:, -1].float()  # the CPU's choices
            torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
            token = want.argmax(-1)
    assert compiled_step.why_not(model) is None  # it compiled: no fallback recorded


def test_flex_traces_whole_inside_the_batch_step():
    """The engine's batch graph with Gemma 2's soft-capped paged-flex in it, under the CUDA
    choices: dynamo traces it whole (fullgraph; AOT autograd's "aot_eager" backend here,
    inductor in tests/decode/test_paged_flex_step.py), and its logits are the eager step's,
    which reads the pool in place through paged-flex too (soft-capping mapped through the block
    table)."""
    model = tiny("gemma2-2b")
    engine = Engine(model, num_blocks=16, block_size=16, max_batch=4)
    g = torch.Generator().manual_seed(3)
    for n in (3, 6, 5):
        engine.submit(
            Request(torch.randint(1, model.vocab_size, (n,), generator=g).tolist(), max_tokens=4)
        )
    engine.step()
    seqs = list(engine.running)
    step = BatchStep(model, engine.cache)
    step.fn = batch_step.Graphs(batch_step._forward, fullgraph=True, backend="aot_eager")
    with torch.inference_mode(), cuda_choices():
        for s in seqs:
            engine.cache.reserve(s.rid, 1)
        lengths = dict(engine.cache.row_lengths)
        layers = record_choices(model)
        want = engine.runner.decode(seqs)  # eager
        record_choices(model, on=False)
        engine.cache.row_lengths.update(lengths)
        got = step(seqs)
    assert {c.name for _, cs in layers for c in cs} == {"paged-flex"}, layers  # soft-capping
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


def _compare(out, ref) -> None:
    """bf16 out, within bf16's rounding of the fp32 reference (relative to its scale)."""
    for got, want in ((out.logits, ref.logits), (out.hidden, ref.hidden)):
        if want is None:
            continue
        assert got.dtype == torch.bfloat16, got.dtype
        err = (got.float() - want).norm() / want.norm()
        assert err < 0.03, float(err)


@pytest.mark.parametrize("name", al.presets.names())
def test_every_preset_in_bf16_through_every_kernel_that_serves_it(name, monkeypatch):
    """Pure bf16 inference (weights and activations) through each dense-layout kernel that
    serves every call of the model (flex uncompiled: its log-sum-exp branch, the one CUDA's
    compiled flex takes), against the fp32 model through the naive kernel."""
    from helpers.inputs import inputs_for

    monkeypatch.setattr(flex, "COMPILE", False)
    cfg = al.presets.tiny(al.presets.get(name))
    torch.manual_seed(0)
    model = al.build_model(cfg).eval()
    args, kwargs, _ = inputs_for(cfg)
    with torch.no_grad():
        ref = al.set_kernel(model, "naive")(*args, **kwargs)
        model.to(torch.bfloat16)
        half = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in kwargs.items()}
        served, refused = [], {}
        for kernel in ("auto", *select.PREFERENCE["cuda"], "tiled"):
            if kernel.startswith("paged"):
                # the engine's pool layout: tests/nn/attention/kernels/test_paged_decode.py
                continue
            try:
                out = al.set_kernel(model, kernel)(*args, **half)
            except select.NoKernelError as err:
                refused[kernel] = str(err)
                continue
            _compare(out, ref)
            served.append(kernel)
    assert "auto" in served and "naive" in served, served
    # flex serves every model whose masks and biases are pointwise (all but Transformer-XL's)
    assert "flex" in served or "offers no" in refused["flex"], refused.get("flex")


@pytest.mark.parametrize("name", ["qwen3-0.6b", "olmo2-1b", "gemma3-1b"])
def test_qk_norm_keeps_the_projections_dtype_under_autocast(name):
    """Under bf16 autocast (training on CUDA) the projections are bf16 and the norm weights
    fp32: qk-norm returned fp32 q and k beside a bf16 v, which a kernel refuses or runs in fp32
    (flex on torch 2.11). q, k and v now share the projections' dtype."""
    model = tiny(name)
    attn = model.decoder.blocks[0].self_attn
    assert attn.q_norm is not None
    x = torch.randn(2, 5, attn.q_proj.in_features)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = attn.project(x, None)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16, (q.dtype, k.dtype, v.dtype)
