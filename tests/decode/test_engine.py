"""The continuous-batching engine (src/attnlab/decode/engine.py) against each request decoded
alone with `attnlab.generate`.

- Requests arriving at random steps, with random prompt and output lengths, greedy and seeded
  sampling (temperature, top-k, top-p) and stop tokens mixed: every request's tokens equal
  `generate` on that request alone; for several positional schemes and GQA.
- A pool too small for everything at once: requests are pre-empted (counted) and recomputed, and
  the tokens are still those of the request alone; nothing is lost.
- Blocks: a finished or cancelled request returns its blocks at once; the pool ends full.
- Bad input: encoder-decoder and linear-attention models, and requests that can never fit, are
  refused with a message naming the problem (and the field; a server's context cap tightens the
  same rules).
- API: the engine reads nothing on the model but its public inference API (embed, run, logits,
  cache_geometry, ...), watched attribute by attribute while it serves.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

import attnlab as al
from attnlab.config import (
    AttentionConfig,
    LearnedPositions,
    LinearAttentionConfig,
    ModelConfig,
    RoPE,
)
from attnlab.decode import engine as engine_module
from attnlab.decode import output as output_module
from attnlab.decode import runner as runner_module
from attnlab.decode import scheduler as scheduler_module
from attnlab.decode.engine import Engine, Request, RequestError
from attnlab.decode.step_time import CallCosts as PrefillCosts

V = 64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only contend on a loaded 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(positional=None, n_kv_heads=2, seed=0, arch="decoder", attention=None):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        arch=arch,
        vocab_size=V,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        positional=positional or RoPE(),
        attention=attention or AttentionConfig(),
        tie_embeddings=False,
        init="xavier",
    )
    return al.build_model(cfg).eval()


def _requests(n: int, seed: int, max_prompt: int = 20, max_new: int = 14) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(2, V) for _ in range(rng.randint(1, max_prompt))]
        kind = i % 3
        out.append(
            Request(
                prompt,
                max_tokens=rng.randint(1, max_new),
                temperature=0.0 if kind == 0 else rng.choice([0.7, 1.0, 1.3]),
                top_k=rng.choice([None, 5]) if kind == 2 else None,
                top_p=rng.choice([None, 0.9]) if kind == 2 else None,
                seed=rng.randrange(1000),
                stop_token_ids=(rng.randrange(2, V),) if rng.random() < 0.5 else (),
            )
        )
    return out


def _alone(model, r: Request) -> list[int]:
    """The reference: the request decoded by itself with attnlab.generate."""
    ids = torch.tensor([list(r.prompt)])
    kw = {"eos_token_id": r.stop_token_ids[0]} if r.stop_token_ids else {}
    if r.temperature > 0:
        kw |= dict(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, seed=r.seed)
    strategy = "sample" if r.temperature > 0 else "greedy"
    out = al.generate(model, ids, r.max_tokens, strategy, **kw)
    return out[0, len(r.prompt) :].tolist()


def _serve_arriving(engine: Engine, requests: list[Request], seed: int) -> list[list[int]]:
    """Submit each request at a random step while the engine runs; everyone's tokens."""
    rng = random.Random(seed)
    arrival = sorted(rng.randint(0, 12) for _ in requests)
    pending = list(zip(arrival, range(len(requests)), strict=True))
    rid_of: dict[int, int] = {}
    out: dict[int, list[int]] = {}
    step = 0
    while pending or engine.has_work:
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            rid_of[engine.submit(requests[i])] = i
            out[i] = []
        for e in engine.step():
            out[rid_of[e.rid]].append(e.token)
        step += 1
    return [out[i] for i in range(len(requests))]


@pytest.mark.parametrize(
    "positional, n_kv_heads",
    [(RoPE(), 2), (RoPE(), 4), (al.config.ALiBi(), 1), (LearnedPositions(max_len=64), 2)],
    ids=["rope-gqa", "rope-mha", "alibi-mqa", "learned"],
)
def test_continuous_batching_equals_each_request_alone(positional, n_kv_heads):
    model = _model(positional, n_kv_heads)
    requests = _requests(12, seed=3)
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=6, max_prefill_tokens=48)
    got = _serve_arriving(engine, requests, seed=4)
    assert got == [_alone(model, r) for r in requests]
    assert engine.cache.free_count == engine.cache.num_blocks  # every block back
    assert not engine.cache.row_tables


def test_preemption_recomputes_and_changes_nothing():
    model = _model()
    requests = _requests(10, seed=5, max_prompt=12, max_new=20)
    # 12 blocks of 4 tokens: room for about two requests at their longest, so most are
    # pre-empted at least once while others grow
    engine = Engine(model, num_blocks=12, block_size=4, max_batch=8)
    got = _serve_arriving(engine, requests, seed=6)
    assert engine.preemptions > 0
    assert got == [_alone(model, r) for r in requests]
    assert [len(g) for g in got] == [len(_alone(model, r)) for r in requests]
    assert engine.cache.free_count == engine.cache.num_blocks


@pytest.mark.parametrize(
    "positional, n_kv_heads",
    [(RoPE(), 2), (al.config.ALiBi(), 1), (LearnedPositions(max_len=64), 2)],
    ids=["rope-gqa", "alibi-mqa", "learned"],
)
def test_chunked_prefill_equals_each_request_alone(positional, n_kv_heads):
    """A step budget of 9 tokens with up to 6 running: prompts of up to 40 tokens go in chunks of
    1 to 9 beside the decodes (greedy and seeded sampling), and each request still gets its own
    tokens; with a pool small enough to pre-empt too."""
    model = _model(positional, n_kv_heads)
    requests = _requests(12, seed=8, max_prompt=40)
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=6, step_tokens=9)
    steps = []
    real = engine._prefill
    engine._prefill = lambda chunks, out: (steps.append(chunks), real(chunks, out))
    got = _serve_arriving(engine, requests, seed=9)
    assert got == [_alone(model, r) for r in requests]
    assert any(n < len(s.context) for chunks in steps for s, n in chunks)  # prompts were cut
    # the budget bounds the padded batch (rows × the longest chunk), and steps share it
    assert all(len(c) * max(n for _, n in c) <= 9 for c in steps)
    assert any(len(c) > 1 for c in steps)
    assert engine.cache.free_count == engine.cache.num_blocks
    tight = Engine(model, num_blocks=14, block_size=4, max_batch=6, step_tokens=9)
    assert _serve_arriving(tight, requests, seed=9) == got
    assert tight.preemptions > 0


def test_chunked_prefill_keeps_running_requests_decoding():
    """While a 200-token prompt goes in, a running request gets a token at every step."""
    model = _model(LearnedPositions(max_len=256))
    engine = Engine(model, num_blocks=128, block_size=4, max_batch=4, step_tokens=16)
    short = engine.submit(Request([5, 6, 7], max_tokens=30))
    engine.step()
    engine.submit(Request([2 + i % 60 for i in range(200)], max_tokens=2))
    for _ in range(12):
        assert short in [e.rid for e in engine.step()]


def _served_on_a_clock(
    max_step_ms: float, row_ms: float, call_ms: float, token_ms: float, requests, seed: int
) -> list:
    """`requests` served (arriving at random steps) by an engine bounded to max_step_ms on a fake
    clock where a decode row costs row_ms and a prefill call call_ms + token_ms a padded token;
    asserts each request's tokens equal it alone; the steps' (decode rows, padded prompt tokens,
    seconds, prefill calls timed before it)."""
    model = _model()
    engine = Engine(model, num_blocks=256, block_size=4, max_batch=6, step_tokens=64,
                    max_step_ms=max_step_ms)  # fmt: skip
    now, log, steps = [0.0], [], []
    engine.clock = lambda: now[0]
    runner, real_step = engine.runner, engine.step
    decode, prefill = runner.decode, runner.prefill

    def timed_decode(seqs):  # the clock moves while the call runs (the engine times it)
        now[0] += row_ms / 1000 * len(seqs)
        log.append((len(seqs), 0))
        return decode(seqs)

    def timed_prefill(chunks):
        padded = len(chunks) * max(n for _, n in chunks)
        now[0] += (call_ms + token_ms * padded) / 1000
        log.append((0, padded))
        return prefill(chunks)

    def step():
        start, first = now[0], len(log)
        events = real_step()
        calls = log[first:]
        timed = sum(1 for _, n in log[:first] if n)
        steps.append((sum(r for r, _ in calls), sum(n for _, n in calls), now[0] - start, timed))
        return events

    runner.decode, runner.prefill, engine.step = timed_decode, timed_prefill, step
    assert _serve_arriving(engine, requests, seed) == [_alone(model, r) for r in requests]
    return steps


def test_a_step_time_bound_sizes_prompt_chunks_to_what_is_left():
    """max_step_ms: on a clock where a decode row costs 10 ms and a prefill call 5 ms + 2 ms a
    padded token, every step that decodes (once two prefill sizes were timed) stays within
    100 ms, its chunk as large as fits; steps without decodes use the whole token budget; and
    every request still gets its own tokens."""
    requests = _requests(14, seed=21, max_prompt=120, max_new=10)
    steps = _served_on_a_clock(100.0, row_ms=10, call_ms=5, token_ms=2, requests=requests, seed=22)
    fitted = [(r, n, t) for r, n, t, k in steps if r and k >= 3 and n]
    assert fitted, "no step decoded and prefilled after the fit"
    assert all(t <= 0.100 + 1e-9 for _, _, t in fitted), fitted
    # as large as fits (the fit is exact on this clock) in most steps; the others' prompts had
    # less left or several prompts shared the padded width
    full = [padded == (95 - 10 * rows) // 2 for rows, padded, _ in fitted]
    assert sum(full) >= len(full) / 2, fitted
    # no decodes: the token budget, past what the time would allow (47 tokens)
    assert max(n for r, n, _, _ in steps if not r) > 47


def test_a_step_time_bound_below_one_prompt_token_holds_prompts(monkeypatch):
    """A bound that leaves no time for even one prompt token after the decodes (a prefill call
    costs 50 ms + 2 ms a token, 40 ms bound, 10 ms a decode row): steps that decode run no
    prompt work, except one block after HELD_STEPS such steps in a row, so every prompt still
    gets in and every request its own tokens."""
    monkeypatch.setattr(scheduler_module, "HELD_STEPS", 5)
    requests = _requests(10, seed=23, max_prompt=60, max_new=30)
    steps = _served_on_a_clock(40.0, row_ms=10, call_ms=50, token_ms=2, requests=requests, seed=24)
    late = [(r, n) for r, n, _, k in steps if r and k >= 2]  # the fit has a line
    assert any(n == 0 for _, n in late) and all(n <= 4 for _, n in late), late
    i = [j for j, (r, n, _, k) in enumerate(steps) if r and k >= 2 and n]
    assert i, "no held prompt was moved on"
    for j in i:  # a block only after 5 steps in a row that held it back
        assert all(r and not n for r, n, _, _ in steps[j - 5 : j]), steps[j - 5 : j + 1]
    assert all(t <= 0.040 + 1e-9 for r, n, t, k in steps if r and k >= 2 and not n)


@pytest.mark.parametrize("step_tokens", [None, 16], ids=["whole", "chunked"])
def test_last_step_counts_what_the_step_computed(step_tokens):
    """Engine.last_step (the server's step kinds in /metrics): (decode rows, prompt tokens)."""
    engine = Engine(_model(), num_blocks=32, block_size=4, max_batch=4, step_tokens=step_tokens)
    engine.submit(Request([3] * 10, max_tokens=3))
    engine.step()
    assert engine.last_step == (0, 10)
    engine.submit(Request([4] * 5, max_tokens=2))
    engine.step()  # the first request decodes, the second's prompt goes in
    assert engine.last_step == (1, 5)
    engine.step()
    assert engine.last_step == (2, 0)


def test_prefill_costs_fit_and_follow_the_machine():
    """The fit recovers t = a + b·n from exact calls (no margin then), follows a change of
    speed (older calls weigh less), falls back to the slope through the origin on one size,
    gives no token where not one fits, widens its margin on a noisy machine, and is not thrown
    by a stall or by times that are not positive numbers."""
    costs = PrefillCosts()
    assert costs.fitted is None and costs.tokens_within(1.0, first=7) == 7
    costs.add(10, 0.030)
    assert costs.fitted == pytest.approx((0.0, 0.003))
    for n in (1, 8, 32, 64, 128) * 30:
        costs.add(n, 0.020 + 0.0025 * n)
    a, b = costs.fitted
    assert a == pytest.approx(0.020, rel=0.01) and b == pytest.approx(0.0025, rel=0.01)
    assert costs.margin == pytest.approx(1.0, abs=0.02)  # the line is right: no margin
    assert costs.tokens_within(0.120, first=7) in (38, 39, 40)
    assert costs.tokens_within(0.020, first=7) == 0  # not even one token fits
    assert costs.tokens_within(0.0235, first=7) == 1
    for n in (1, 8, 32, 64, 128) * 40:  # the machine got twice as slow
        costs.add(n, 2 * (0.020 + 0.0025 * n))
    a, b = costs.fitted
    assert a == pytest.approx(0.040, rel=0.05) and b == pytest.approx(0.005, rel=0.02)
    # calls 0.8x-1.2x the line: the margin keeps most calls within the time asked
    noisy = PrefillCosts()
    rng = random.Random(3)
    for n in (1, 8, 32, 64, 128) * 40:
        noisy.add(n, (0.020 + 0.0025 * n) * rng.uniform(0.8, 1.2))
    assert 1.1 < noisy.margin < 1.4
    # times that are not positive numbers are ignored; a stall counts as twice the line at most
    kept = PrefillCosts()
    for n in (1, 8, 32, 64, 128) * 30:
        kept.add(n, 0.020 + 0.0025 * n)
    before = kept.fitted
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        kept.add(64, bad)
    assert kept.fitted == before
    kept.add(16, 30.0)  # one 30 s stall (a page fault storm, another process)
    a, b = kept.fitted  # moved by a clipped sample only, and back after some calls
    assert a < 0.030 and b == pytest.approx(0.0025, rel=0.1)
    assert kept.tokens_within(0.120, first=7) >= 20
    for n in (1, 8, 32, 64, 128) * 20:
        kept.add(n, 0.020 + 0.0025 * n)
    assert kept.fitted == pytest.approx((0.020, 0.0025), rel=0.01)
    flat = PrefillCosts()  # calls all at 0 s (a coarse clock): no fit, the first guess
    for n in (1, 8, 32):
        flat.add(n, 0.0)
    assert flat.fitted is None and flat.tokens_within(0.05, first=7) == 7


def _shared_prefix_requests(n: int, seed: int) -> list[Request]:
    """Requests starting with one of three system prompts (5, 13 and 24 tokens: shorter than,
    across and over several blocks of 4), then their own turn; greedy and seeded sampling."""
    rng = random.Random(seed)
    systems = [[rng.randrange(2, V) for _ in range(k)] for k in (5, 13, 24)]
    out = []
    for i in range(n):
        own = [rng.randrange(2, V) for _ in range(rng.randint(0, 9))]
        out.append(
            Request(
                [*systems[i % 3], *own] or [2],
                max_tokens=rng.randint(1, 12),
                temperature=0.0 if i % 2 else 0.9,
                seed=rng.randrange(1000),
            )
        )
    return out


@pytest.mark.parametrize("blocks", [64, 16], ids=["roomy", "evicting"])
def test_prefix_caching_equals_each_request_alone(blocks):
    """Requests sharing system prompts take the cached blocks of those that came before and
    prefill only the rest; the tokens are each request's own (greedy and seeded sampling),
    also with a pool so small that cached blocks are evicted and requests pre-empted."""
    model = _model()
    requests = _shared_prefix_requests(18, seed=11)
    engine = Engine(model, num_blocks=blocks, block_size=4, max_batch=4, step_tokens=12,
                    prefix_caching=True)  # fmt: skip
    got = _serve_arriving(engine, requests, seed=12)
    assert got == [_alone(model, r) for r in requests]
    stats = engine.cache.stats()
    assert stats["prefix_hit_blocks"] > 0
    assert engine.cache.available == engine.cache.num_blocks  # nothing held but the cache
    assert not engine.cache.row_tables
    if blocks == 16:
        assert engine.preemptions > 0 or stats["blocks_cached"] < 16


def test_prefix_caching_skips_the_cached_prefill():
    """The second request with the same 24-token start prefills only what follows it."""
    model = _model()
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=4, step_tokens=40,
                    prefix_caching=True)  # fmt: skip
    system = list(range(2, 26))
    chunks = []
    real = engine._prefill
    engine._prefill = lambda c, out: (chunks.append([n for _, n in c]), real(c, out))
    engine.run([Request([*system, 30, 31], max_tokens=3)])
    first = engine.cache.stats()["prefix_hit_blocks"]
    engine.run([Request([*system, 40], max_tokens=3)])
    # its 6 full blocks of the system prompt were cached: only its last token was computed,
    # as a one-token step, no prompt chunk
    assert (first, engine.cache.stats()["prefix_hit_blocks"]) == (0, 6)
    assert chunks == [[26]]
    with pytest.raises(ValueError, match="needs chunked prefill"):
        Engine(model, prefix_caching=True)


def test_a_burst_sharing_a_system_prompt_computes_it_once():
    """Six requests with one 24-token system prompt sent at once: the first computes the prompt
    (in chunks of 10), the others wait until its blocks are cached, then compute only their own
    turn; a request with another start is admitted meanwhile. Tokens: each request's own."""
    model = _model()
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=8, step_tokens=10,
                    prefix_caching=True)  # fmt: skip
    rng = random.Random(3)
    system = [rng.randrange(2, V) for _ in range(24)]
    requests = [Request([*system, rng.randrange(2, V)], max_tokens=4) for _ in range(6)]
    other = Request([rng.randrange(2, V) for _ in range(9)], max_tokens=4)
    requests.insert(2, other)

    def served(engine):
        computed = []
        real = engine._prefill
        engine._prefill = lambda c, out: (computed.extend(n for _, n in c), real(c, out))
        got = engine.run(requests)
        assert got == [_alone(model, r) for r in requests]
        return sum(computed)

    # prompt chunks: 25 + 9 tokens for the first and the other; the five others find 6 blocks
    # cached and compute their last token in a one-token step
    assert served(engine) == 25 + 9
    assert engine.cache.stats()["prefix_hit_blocks"] == 5 * 6
    eager = Engine(model, num_blocks=64, block_size=4, max_batch=8, step_tokens=10,
                   prefix_caching=True)  # fmt: skip
    eager.scheduler._prefix_in_flight = lambda seq: False  # all admitted at once compute it
    assert served(eager) == 6 * 25 + 9


def test_logprobs_are_the_models_own():
    """With logprobs k, each token's event carries its log-probability and the k best tokens',
    equal to log_softmax of the model's logits over the whole sequence (float64 reference),
    while other requests in the batch ask for none."""
    model = _model()
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=4, step_tokens=16)
    asks = [Request([5, 9, 11, 3], max_tokens=6, logprobs=3),
            Request([7, 8], max_tokens=5, temperature=0.8, seed=4, logprobs=0),
            Request([2, 4, 6], max_tokens=4)]  # fmt: skip
    rids = [engine.submit(r) for r in asks]
    events: dict[int, list] = {r: [] for r in rids}
    while engine.has_work:
        for e in engine.step():
            events[e.rid].append(e)
    for req, rid in zip(asks, rids, strict=True):
        got = events[rid]
        seq = torch.tensor([[*req.prompt, *(e.token for e in got)]])
        with torch.no_grad():
            ref = model(seq).logits[0].double().log_softmax(-1)  # (T, V)
        for i, e in enumerate(got):
            row = ref[len(req.prompt) - 1 + i]
            if req.logprobs is None:
                assert e.logprob is None and e.top_logprobs == ()
                continue
            assert abs(e.logprob - row[e.token].item()) < 1e-4
            assert len(e.top_logprobs) == req.logprobs
            if req.logprobs:
                assert [t for t, _ in e.top_logprobs] == row.topk(req.logprobs).indices.tolist()
                assert e.top_logprobs[0][0] == e.token  # greedy: the best one
    with pytest.raises(RequestError, match="logprobs"):
        engine.submit(Request([3], logprobs=21))


def _penalised_alone(model, r: Request) -> list[int]:
    """The reference: OpenAI's penalties written out, the whole sequence recomputed per token."""
    from attnlab.decode.generate import sample_next

    gen = torch.Generator().manual_seed(r.seed) if r.temperature > 0 else None
    out: list[int] = []
    for _ in range(r.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([[*r.prompt, *out]])).logits[:, -1].float()  # (1, V)
        for t in set(out):
            logits[0, t] -= r.frequency_penalty * out.count(t) + r.presence_penalty
        if r.temperature > 0:
            token = int(sample_next(logits, r.temperature, r.top_k, r.top_p, gen)[0])
        else:
            token = int(logits.argmax())
        out.append(token)
    return out


def test_presence_and_frequency_penalties_equal_their_formula():
    model = _model()
    asks = [Request([5, 9, 11], max_tokens=12, presence_penalty=1.5),
            Request([7, 8], max_tokens=12, frequency_penalty=0.8, presence_penalty=-0.5),
            Request([2, 4], max_tokens=12, temperature=0.9, seed=3, frequency_penalty=1.2),
            Request([3, 3, 3], max_tokens=12)]  # fmt: skip
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=4)
    got = engine.run(asks)
    assert got == [_penalised_alone(model, r) for r in asks]
    assert got[0] != _alone(model, Request([5, 9, 11], max_tokens=12))  # the penalty acted
    with pytest.raises(RequestError, match="presence_penalty"):
        engine.submit(Request([3], presence_penalty=2.5))


@pytest.mark.parametrize("step_tokens", [None, 7], ids=["whole", "chunked"])
def test_prompt_logprobs_are_the_models_own(step_tokens):
    """echo's prompt log-probabilities: with the first event, each prompt token's given the
    tokens before it (and the k best), equal to a float64 log_softmax of the model's logits,
    whole or in chunks of 7, and with the prefix cache on (which then computes the prompt)."""
    model = _model()
    kw = dict(step_tokens=step_tokens, prefix_caching=step_tokens is not None)
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=4, **kw)
    prompt = [5, 9, 11, 3, 17, 2, 8, 30, 12, 6, 21, 4, 9, 9, 40, 3]
    engine.run([Request(prompt, max_tokens=2)])  # its blocks are cached now
    rid = engine.submit(Request(prompt, max_tokens=3, prompt_logprobs=2))
    events = []
    while engine.has_work:
        events += [e for e in engine.step() if e.rid == rid]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].double().log_softmax(-1)  # (P, V)
    got = events[0].prompt_logprobs
    assert len(got) == len(prompt) - 1 and all(e.prompt_logprobs is None for e in events[1:])
    for j, (lp, top) in enumerate(got):
        assert abs(lp - ref[j, prompt[j + 1]].item()) < 1e-4
        assert [t for t, _ in top] == ref[j].topk(2).indices.tolist()


class _OnlySome:
    """A constraint allowing tokens 7 and 8 only, complete after three of them."""

    def __init__(self) -> None:
        self.taken: list[int] = []

    def allowed(self, vocab_size: int) -> torch.Tensor:
        ok = torch.zeros(vocab_size, dtype=torch.bool)
        ok[[7, 8]] = True
        return ok

    def accept(self, token: int) -> None:
        self.taken.append(token)

    @property
    def finished(self) -> bool:
        return len(self.taken) == 3


def test_a_constraint_masks_every_other_token_and_ends_the_request():
    model = _model()
    engine = Engine(model, num_blocks=32, block_size=4, max_batch=2)
    greedy, sampled = _OnlySome(), _OnlySome()
    got = engine.run([Request([5, 6], max_tokens=10, constraint=greedy),
                      Request([5, 6], max_tokens=10, temperature=1.0, seed=1, constraint=sampled)])  # fmt: skip
    assert [len(g) for g in got] == [3, 3] and all(set(g) <= {7, 8} for g in got)
    assert greedy.taken == got[0] and sampled.taken == got[1]


def test_blocks_are_freed_at_finish_and_cancel():
    model = _model()
    engine = Engine(model, num_blocks=40, block_size=4)
    short = engine.submit(Request([5, 6, 7], max_tokens=2))
    long = engine.submit(Request(list(range(2, 12)), max_tokens=30))
    engine.step()  # both prefilled: 1 + 3 blocks
    assert engine.cache.free_count == 40 - 1 - 3
    ends = [e for e in engine.step() if e.finish_reason]  # short's second token: done
    assert [(e.rid, e.finish_reason) for e in ends] == [(short, "length")]
    assert engine.cache.free_count == 40 - 3  # its block is back at once
    engine.cancel(long)
    engine.step()
    assert engine.cache.free_count == 40 and not engine.running and not engine.has_work


def test_stop_token_ends_with_stop():
    model = _model()
    r = Request([3, 4, 5, 6], max_tokens=10)
    first = _alone(model, r)[2]  # the third greedy token as the stop token
    engine = Engine(model, num_blocks=16, block_size=4)
    events = []
    engine.on_event = events.append
    engine.run([Request([3, 4, 5, 6], max_tokens=10, stop_token_ids=(first,))])
    tokens = [e.token for e in events]
    assert tokens[-1] == first and events[-1].finish_reason == "stop"
    assert len(tokens) == _alone(model, r).index(first) + 1


def test_bad_models_and_requests_are_refused():
    with pytest.raises(TypeError, match="decoder-only"):
        Engine(_model(arch="encoder-decoder"))
    linear = _model(attention=LinearAttentionConfig())
    with pytest.raises(TypeError, match="recurrent"):
        Engine(linear)
    engine = Engine(_model(LearnedPositions(max_len=32)), num_blocks=6, block_size=4)
    with pytest.raises(ValueError, match="context of 32"):
        engine.submit(Request([3] * 30, max_tokens=10))
    with pytest.raises(ValueError, match="whole pool"):
        engine.submit(Request([3] * 20, max_tokens=10))
    for bad, match in [
        (Request([], max_tokens=3), "empty"),
        (Request([3, V], max_tokens=3), "token ids"),
        (Request([3], max_tokens=0), "max_tokens"),
        (Request([3], temperature=-1), "temperature"),
        (Request([3], top_p=0.0), "top_p"),
        (Request([3], top_k=0), "top_k"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.submit(bad)
    assert not engine.has_work  # nothing bad was queued
    for bad in (0.0, -5.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite time > 0"):
            Engine(_model(), step_tokens=80, max_step_ms=bad)
    with pytest.raises(ValueError, match="needs step_tokens"):
        Engine(_model(), max_step_ms=100.0)


def test_a_server_context_tightens_the_same_rules():
    """The server passes its max_model_len as `context`; errors name the field at fault."""
    engine = Engine(_model(), num_blocks=16, block_size=4)
    engine.check(Request([3] * 4, max_tokens=1), context=5)  # exactly the context: fits
    for req, param, match in [
        (
            Request([3] * 5, max_tokens=1),
            "prompt",
            "the prompt is 5 tokens, the model's context is 5",
        ),
        (Request([3] * 4, max_tokens=2), "max_tokens", "context of 5 tokens: lower max_tokens"),
        (Request([], max_tokens=2), "prompt", "empty"),
        (Request([3], top_p=2.0), "top_p", "top_p"),
    ]:
        with pytest.raises(RequestError, match=match) as err:
            engine.submit(req, context=5)
        assert err.value.param == param
    assert not engine.has_work


# what the engine may touch on a model: the documented inference API (nn/model.py, _Decoding)
PUBLIC_API = {"eval", "embed", "run", "logits", "cache_geometry", "max_positions", "vocab_size"}


def test_the_engine_uses_only_the_public_model_api():
    """Every attribute the engine's code reads on the model, recorded as it serves requests
    (prefill, decode, sampling, pre-emption): none private, none outside the inference API."""
    model, seen = _model(), set()
    # the engine's parts: engine.py and the scheduler, runner and output side it holds together
    engine_files = {
        m.__file__ for m in (engine_module, scheduler_module, runner_module, output_module)
    }

    class Watched(type(model)):
        def __getattribute__(self, name):
            if sys._getframe(1).f_code.co_filename in engine_files:
                seen.add(name)
            return super().__getattribute__(name)

    model.__class__ = Watched
    engine = Engine(model, num_blocks=6, block_size=4, max_batch=4)
    engine.run(_requests(5, seed=3))
    assert {"embed", "run", "logits", "cache_geometry"} <= seen  # the watcher saw the engine
    assert seen <= PUBLIC_API, f"the engine reads {sorted(seen - PUBLIC_API)} on the model"
