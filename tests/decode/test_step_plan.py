"""The engine's step as vLLM v1's loop (src/attnlab/decode/scheduler.py, engine.py): the scheduler
plans, the runner and the output side compute, and only the scheduler writes request state —
`update` moves a request on, admission and pre-emption set what its cache holds."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from attnlab import ModelConfig, build_model
from attnlab.decode import engine as engine_module
from attnlab.decode.engine import Engine, Request
from attnlab.decode.requests import Seq
from attnlab.decode.scheduler import Scheduler, StepPlan

V = 64
OWNER = "attnlab.decode.scheduler"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(arch="decoder", vocab_size=V, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, tie_embeddings=False)  # fmt: skip
    return build_model(cfg).eval()


class _Guarded(list):
    """A list that records who mutates it (the module of the calling frame)."""

    writers: list[str]

    def _note(self) -> None:
        self.writers.append(sys._getframe(2).f_globals["__name__"])

    def append(self, x):
        self._note()
        super().append(x)

    def extend(self, xs):
        self._note()
        super().extend(xs)

    def clear(self):
        self._note()
        super().clear()


def _watched(writers: list[str]) -> type:
    class Watched(Seq):
        """A Seq that records the module of every write to its state after construction."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            for name in ("tokens", "prompt_lp"):
                guarded = _Guarded(getattr(self, name))
                guarded.writers = writers
                object.__setattr__(self, name, guarded)
            object.__setattr__(self, "_built", True)

        def __setattr__(self, name, value):
            if getattr(self, "_built", False):
                writers.append(sys._getframe(1).f_globals["__name__"])
            object.__setattr__(self, name, value)

    return Watched


def _requests(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    system = [rng.randrange(2, V) for _ in range(9)]
    out = []
    for i in range(n):
        prompt = [*system, *(rng.randrange(2, V) for _ in range(rng.randint(1, 12)))]
        out.append(Request(prompt, max_tokens=rng.randint(2, 9), temperature=0.8 * (i % 2),
                           seed=i, logprobs=2 if i % 3 == 0 else None,
                           prompt_logprobs=1 if i % 4 == 1 else None))  # fmt: skip
    return out


@pytest.mark.parametrize(
    "options",
    [dict(), dict(step_tokens=12, prefix_caching=True)],
    ids=["whole-prompts", "chunked-prefix"],
)
def test_only_the_scheduler_writes_request_state(monkeypatch, options):
    """Every write to a request's filled count, tokens or prompt log-probabilities comes from the
    scheduler's module, over a run with pre-emption (a pool of 8 blocks), sampling, log-
    probabilities and (chunked) prefix caching; and the tokens are those of the same engine
    without the watch."""
    writers: list[str] = []
    monkeypatch.setattr(engine_module, "Seq", _watched(writers))
    model, requests = _model(), _requests(10, seed=3)
    engine = Engine(model, num_blocks=8, block_size=4, max_batch=4, **options)
    got = engine.run(requests)
    assert engine.preemptions > 0  # admission, update and pre-emption all wrote
    assert writers and set(writers) == {OWNER}, sorted(set(writers))
    monkeypatch.undo()
    plain = Engine(model, num_blocks=8, block_size=4, max_batch=4, **options)
    assert plain.run(requests) == got


def test_without_the_schedulers_update_a_step_moves_no_request_on(monkeypatch):
    """With `Scheduler.update` replaced by one that only records its plan, a step computes (the
    plan has prefills, the cache holds their keys) and yet no request's filled count, tokens or
    prompt log-probabilities change and no request leaves: there is no other writer."""
    plans: list[StepPlan] = []
    monkeypatch.setattr(Scheduler, "update", lambda self, plan, out: plans.append(plan) or [])
    engine = Engine(_model(), num_blocks=32, block_size=4, max_batch=4, step_tokens=16)
    for r in _requests(3, seed=5):
        engine.submit(r)
    for _ in range(2):
        assert engine.step() == []
    assert plans and all(p.prefills for p in plans)
    assert len(engine.running) == 3
    for s in engine.running:
        assert (s.filled, s.tokens, s.prompt_lp) == (0, [], [])
    assert sum(engine.cache.row_lengths.values()) > 0  # the forward ran
