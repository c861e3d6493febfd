"""The engine's compiled decode step (src/attnlab/decode/batch_step.py), with inductor on the
CPU (CUDA records the same graphs as CUDA graphs): its logits equal the eager runner's step
for a few families, the engine on it serves every request the tokens `generate` gives it alone
(greedy and seeded sampling, rows joining and leaving, a pool small enough to pre-empt), steps
within one size bucket neither recompile nor break the graph, and the step reads nothing back
from the device."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import attnlab as al
from attnlab.decode import batch_step
from attnlab.decode.batch_step import BatchStep, _forward, bucket
from attnlab.decode.engine import Engine, Request
from attnlab.graphs import Graphs
from attnlab.nn.inputs import checked
from attnlab.nn.model import DecoderOnlyModel


def tiny(name: str) -> DecoderOnlyModel:
    torch.manual_seed(0)
    return al.build_model(al.presets.tiny(al.presets.get(name))).eval()


def compiled_engine(model, **kw) -> Engine:
    engine = Engine(model, **kw)
    assert engine.decode_step.name != "cuda-graphs"  # not on the CPU by default ...
    engine.runner.step = BatchStep(model, engine.cache)  # ... but it runs there
    return engine


def _alone(model, r: Request) -> list[int]:
    kw = dict(temperature=r.temperature, seed=r.seed) if r.temperature > 0 else {}
    ids = torch.tensor([r.prompt])
    out = al.generate(model, ids, r.max_tokens, strategy="sample" if kw else "greedy",
                      eos_token_id=None, **kw)  # fmt: skip
    return out[0, len(r.prompt) :].tolist()


def test_buckets_are_powers_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]


def test_the_cpu_default_is_the_eager_step_with_its_reason():
    model = tiny("llama3.2-1b")
    engine = Engine(model, num_blocks=8, block_size=4)
    assert "CPU" in batch_step.why_not(model, engine.cache)


@pytest.mark.parametrize("name", ["llama3.2-1b", "gemma2-2b", "mixtral-8x7b", "gpt2-small"])
def test_its_logits_equal_the_eager_steps(name):
    """Three rows prefilled, then decode steps computed twice on the same state: the eager
    runner's, then (lengths rewound) the compiled one's, which writes the same slots."""
    torch._dynamo.reset()
    model = tiny(name)
    engine = Engine(model, num_blocks=32, block_size=4, max_batch=4)
    runner = engine.runner
    step = BatchStep(model, engine.cache)
    g = torch.Generator().manual_seed(3)
    reqs = [Request(torch.randint(1, model.vocab_size, (n,), generator=g).tolist(), max_tokens=9)
            for n in (3, 6, 5)]  # fmt: skip
    for r in reqs:
        engine.submit(r)
    engine.step()  # the prefills and each one's first token
    seqs = list(engine.running)
    with torch.inference_mode():
        for _ in range(3):
            for s in seqs:
                assert engine.cache.reserve(s.rid, 1)
            lengths = dict(engine.cache.row_lengths)
            want = runner.decode(seqs)
            engine.cache.row_lengths.update(lengths)
            got = step(seqs)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
            for s, t in zip(seqs, want.argmax(-1).tolist(), strict=True):
                s.tokens.append(t)
                s.filled += 1


def test_the_engine_on_it_serves_each_request_as_generate_alone():
    """Greedy and seeded sampling, prompts of several lengths arriving over the steps, a pool
    small enough that requests are pre-empted and recomputed."""
    torch._dynamo.reset()
    model = tiny("llama3.2-1b")
    g = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(1, model.vocab_size, (n,), generator=g).tolist(), max_tokens=m,
                    temperature=0.0 if i % 2 else 0.9, seed=i)
            for i, (n, m) in enumerate([(3, 8), (7, 5), (2, 10), (5, 7), (4, 6)])]  # fmt: skip
    engine = compiled_engine(model, num_blocks=6, block_size=4, max_batch=4)
    out: dict[int, list[int]] = {}
    rids = [engine.submit(r) for r in reqs[:3]]
    steps = 0
    while engine.has_work:
        if steps == 2:
            rids += [engine.submit(r) for r in reqs[3:]]
        for e in engine.step():
            out.setdefault(e.rid, []).append(e.token)
        steps += 1
    assert engine.runner.step.fn is not None  # it served every decode step
    assert engine.preemptions > 0  # the pool was short
    assert [out[r] for r in rids] == [_alone(model, r) for r in reqs]


def test_steps_within_a_bucket_neither_recompile_nor_break_the_graph():
    torch._dynamo.reset()
    model = tiny("llama3.2-1b")
    engine = compiled_engine(model, num_blocks=40, block_size=16, max_batch=4)
    for n in (3, 4, 2):  # 3 rows: bucket 4; at most 16 tokens a row: one block
        engine.submit(Request(list(range(1, n + 1)), max_tokens=12))
    engine.step()  # prefills
    engine.step()  # the first decode step: the compile
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(9):
            engine.step()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
    assert list(engine.cache.graph_views) == [(4, 1)]


def test_a_step_reads_nothing_from_the_device(device_reads):
    """The compiled function run eagerly over its view: no tensor becomes a Python number, and
    a padding row (3 rows in a bucket of 4) stays finite."""
    model = tiny("llama3.2-1b")
    engine = Engine(model, num_blocks=16, block_size=4, max_batch=4)
    for n in (3, 5, 2):
        engine.submit(Request(list(range(1, n + 1)), max_tokens=5))
    engine.step()
    seqs = list(engine.running)
    step = BatchStep(model, engine.cache)
    for s in seqs:
        engine.cache.reserve(s.rid, 1)
    view = step._view(len(seqs), 2)
    starts = [engine.cache.row_lengths[s.rid] for s in seqs]
    view.load([s.rid for s in seqs], [s.newest for s in seqs], starts)  # the host's half
    with torch.inference_mode(), checked(), device_reads:
        logits = _forward(model, view)
    assert device_reads.names == [], device_reads.names
    assert logits.shape == (4, model.vocab_size) and torch.isfinite(logits).all()


def test_a_step_that_cannot_compile_warns_once_and_the_engine_decodes_eagerly():
    model = tiny("llama3.2-1b")
    engine = compiled_engine(model, num_blocks=16, block_size=4, max_batch=4)
    calls = []

    class Fails(Graphs):  # a Graphs (src/attnlab/graphs.py) whose every compile fails
        def __init__(self):
            super().__init__(_forward)

        def __call__(self, *args):
            calls.append(1)
            raise torch._dynamo.exc.TorchDynamoException("no graph for you")

    engine.runner.step.fn = Fails()
    reqs = [Request([5, 6, 7], max_tokens=4), Request([9, 2], max_tokens=6)]
    with pytest.warns(RuntimeWarning, match="no graph for you.*decodes eagerly"):
        got = engine.run(reqs)
    assert calls == [1] and engine.runner.step.fn is None
    assert got == [_alone(model, r) for r in reqs]
