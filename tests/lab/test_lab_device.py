"""The lab on a device other than the CPU (src/attnlab/lab/evals.py, runner.py): timings wait for
a CUDA device (its work is asynchronous), every evaluation puts its inputs on the run's device,
an unknown or missing device is refused before anything runs, and parallel jobs keep working.
Checked on the CPU with the meta device and stand-ins for torch.cuda; the one test that needs a
GPU runs `lab run norms --quick --device cuda` end to end and skips without one."""

from __future__ import annotations

import gzip
import json
import os
import time
import weakref

import pytest
import torch

from attnlab.build import build_model
from attnlab.cli import main as cli
from attnlab.lab import evals, spec
from attnlab.lab.runner import plan, run_lab
from attnlab.nn.model import DecoderOnlyModel
from attnlab.train.recipes import Recipe, model_config

VOCAB = 40


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """A stand-in tinyshakespeare (the real layout) and a cache of the test's own."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = tmp_path / "data"
    text = "".join(f"ROMEO:\nFirst Citizen {i % 7}: speak, speak.\n" for i in range(400))
    (root / "tinyshakespeare").mkdir(parents=True)
    (root / "tinyshakespeare" / "input.txt.gz").write_bytes(gzip.compress(text.encode()))
    return root


def _ctx(tmp_path, device: str) -> evals.RunContext:
    """norms' quick model (RoPE, 2 heads) on `device`, with a validation split of random ids."""
    run = plan(spec.load("norms"), tmp_path, quick=True)[0]
    recipe = Recipe.from_dict(run.recipe)
    cfg = model_config(recipe.model, vocab_size=VOCAB)
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    ctx = evals.RunContext(recipe, cfg, model, tmp_path, recipe.data.context, device=torch.device(device))  # fmt: skip
    ctx._val = torch.randint(0, VOCAB, (4000,))  # as val_ids(): on the CPU
    return ctx


# --- timings wait for CUDA ---------------------------------------------------------------------


class FakeCuda:
    """torch.cuda.synchronize's stand-in: `fn` queues work that takes `delay` seconds on the
    'device'; synchronize waits for it (as the real one waits for the kernels)."""

    def __init__(self, delay: float) -> None:
        self.delay, self.pending, self.calls = delay, False, []

    def launch(self) -> None:
        self.pending = True  # returns at once, as a kernel launch does

    def synchronize(self, device=None) -> None:
        self.calls.append(device)
        if self.pending:
            time.sleep(self.delay)
            self.pending = False


def test_times_ms_waits_for_a_cuda_device_and_only_for_one(monkeypatch):
    fake = FakeCuda(delay=0.05)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    cuda = torch.device("cuda", 0)
    calls = []
    xs = evals._times_ms(lambda: calls.append(1) or fake.launch(), 3, cuda, warmup=2)
    assert len(calls) == 5 and len(xs) == 3  # 2 untimed warm-ups, 3 timed calls
    assert all(x >= 50 for x in xs), xs  # the queued work is in every time, not the launch only
    assert fake.calls == [cuda] * 6  # before the clock starts and before it stops, each call
    # the warm-ups' queued work is waited for before the first clock starts, not timed
    fake = FakeCuda(delay=0.05)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    evals._times_ms(fake.launch, 1, cuda, warmup=1)
    assert fake.calls == [cuda, cuda]
    # the CPU: no synchronisation at all (the CPU's times are as they were)
    fake = FakeCuda(delay=0.05)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    xs = evals._times_ms(lambda: None, 3, torch.device("cpu"))
    assert fake.calls == [] and len(xs) == 3


TIMED = {
    "decode_latency": {"positions": [4], "reps": 1},
    "attention_cost": {"lengths": [8], "reps": 1},
    "norm_timing": {"rows": 8, "reps": 1},
    "step_timing": {"reps": 1, "warmup": 0},
}


class Seen(Exception):
    """Raised by the spies once they have seen what they look at."""


def test_the_timed_evaluations_are_every_timed_one():
    assert set(TIMED) == {k for k in evals.EVALS.names() if evals.EVALS.get(k).timed}


@pytest.mark.parametrize("kind", sorted(TIMED))
def test_every_timing_waits_for_the_runs_device(kind, tmp_path, monkeypatch):
    """The clock (`_times_ms`, or `_time_ms` for one call) is given the run's device, so on CUDA
    it synchronises: here the meta device, which no timing could name by accident (the spies
    stop at the first clock, before any forward: no attention kernel runs on meta)."""
    from attnlab.decode import steps

    devices = []

    def clock(fn, device):
        devices.append(device)
        raise Seen

    def clocks(fn, reps, device, warmup=1):
        return clock(fn, device)

    monkeypatch.setattr(evals, "_time_ms", clock)
    monkeypatch.setattr(evals, "_times_ms", clocks)
    monkeypatch.setattr(steps, "prefill", lambda model, ids, n: (ids, None, object()))
    ctx = _ctx(tmp_path, "meta")
    ev = evals.EVALS.get(kind)
    with pytest.raises(Seen):
        ev.fn(ctx, ev.args.model_validate(TIMED[kind]))
    assert devices == [torch.device("meta")]


def test_decode_latency_lets_the_last_cache_go_before_the_next_prefill(tmp_path, monkeypatch):
    """On CUDA the cached step reuses one fixed cache per model, and so its captured graph, only
    when the last loop's state is gone (decode/compiled_step.py reusable_cache): each repeat
    must drop its state before the next prefill, or every repeat builds a new cache and times
    a capture."""
    from attnlab.decode import steps

    alive: list[int] = []  # states alive when each prefill is called
    live = set()

    class State:
        pass

    def prefill(model, ids, n):
        alive.append(len(live))
        state = State()
        live.add(id(state))
        weakref.finalize(state, live.discard, id(state))
        return ids, None, state

    monkeypatch.setattr(steps, "prefill", prefill)
    monkeypatch.setattr(steps, "decode_step", lambda model, token, state: None)
    ctx = _ctx(tmp_path, "cpu")
    ev = evals.EVALS.get("decode_latency")
    out = ev.fn(ctx, ev.args.model_validate({"positions": [4, 8], "reps": 3}))
    assert alive == [0] * 6
    assert out["decode_ms_cached_at8"] >= 0 and out["decode_ms_recompute_at8"] > 0


# --- inputs on the run's device ----------------------------------------------------------------


MODEL_EVALS = {  # every evaluation that runs the model (norm_timing runs its norm: below)
    "val_loss": {"max_windows": 2},
    "length": {"multiples": [1, 2], "max_windows": 2},
    "rope_scaling": {"methods": ["linear"], "factors": [2], "max_windows": 1},
    "gqa_convert": {"n_kv_heads": [1], "max_windows": 1},
    "grad_norms": {"batch": 1, "batches": 2},
    "decode_latency": {"positions": [4], "reps": 1},
    "attention_cost": {"lengths": [8], "reps": 1},
    "step_timing": {"reps": 1, "warmup": 0},
}


def test_the_model_evaluations_are_every_one_but_softmax_mc():
    assert set(MODEL_EVALS) | {"norm_timing", "softmax_mc"} == set(evals.EVALS.names())


@pytest.mark.parametrize("kind", sorted(MODEL_EVALS))
def test_evaluations_feed_the_model_on_the_runs_device(kind, tmp_path, monkeypatch):
    """The model (and a fresh draw or a converted copy of it) on the meta device: an input left
    on the CPU would be seen here as such (the spy stops at the first forward)."""
    seen = []

    def forward(self, input_ids, *args, **kwargs):
        seen.append((input_ids.device.type, next(self.parameters()).device.type))
        raise Seen

    monkeypatch.setattr(DecoderOnlyModel, "forward", forward)
    ctx = _ctx(tmp_path, "meta")
    ev = evals.EVALS.get(kind)
    with pytest.raises(Seen):
        ev.fn(ctx, ev.args.model_validate(MODEL_EVALS[kind]))
    assert seen == [("meta", "meta")]


def test_norm_timing_feeds_the_norm_on_the_runs_device(tmp_path):
    ctx = _ctx(tmp_path, "meta")
    norm = ctx.model.decoder.blocks[0].ffn_norm
    seen = []

    def forward(x):
        seen.append((x.device.type, next(norm.parameters()).device.type))
        raise Seen

    norm.forward = forward
    ev = evals.EVALS.get("norm_timing")
    with pytest.raises(Seen):
        ev.fn(ctx, ev.args.model_validate({"rows": 8, "reps": 1}))
    assert seen == [("meta", "meta")]


# --- the runner ---------------------------------------------------------------------------------


def test_a_device_torch_does_not_have_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="0 CUDA device"):
        run_lab("norms", quick=True, device="cuda", out=out, log=lambda *a: None)
    assert not out.exists()  # no run folder, no lab.yaml
    assert cli(["lab", "run", "norms", "--quick", "--device", "cuda", "--out", str(out)]) == 2
    assert "CUDA" in capsys.readouterr().err and not out.exists()
    with pytest.raises(ValueError, match="--device 'gpu'"):
        run_lab("norms", quick=True, device="gpu", out=out, log=lambda *a: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="cuda:1: torch sees 1 CUDA device"):
        run_lab("norms", quick=True, device="cuda:1", out=out, log=lambda *a: None)


def _records(out) -> list[dict]:
    return [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]


def test_quick_norms_with_two_jobs_on_the_cpu(data_dir, tmp_path):
    out = tmp_path / "norms"
    argv = ["lab", "run", "norms", "--quick", "--device", "cpu", "--jobs", "2",
            "--out", str(out), "--data-dir", str(data_dir)]  # fmt: skip
    assert cli(argv) == 0
    records = _records(out)
    assert {r["variant"] for r in records} == set(spec.load("norms").variants)
    assert all(r["errors"] == {} for r in records), [r["errors"] for r in records]
    # trained in 2 processes, each with its share of the cores; timed afterwards with 1 thread
    assert {r["threads"] for r in records} == {max(1, (os.cpu_count() or 1) // 2)}
    assert all(r["device"] == "cpu" and r["timing"]["device"] == "cpu" for r in records)
    assert all(r["timing"]["threads"] == 1 for r in records)
    assert all(r["metrics"]["norm_call_us"] > 0 and r["metrics"]["train_step_ms"] > 0 for r in records)  # fmt: skip
    assert (out / "report.md").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("jobs", [1, 2])
def test_quick_norms_on_cuda(jobs, data_dir, tmp_path):
    """End to end on the GPU: trained there (in spawned jobs with --jobs 2), evaluated and timed
    there, and every record says so."""
    out = tmp_path / "norms"
    argv = ["lab", "run", "norms", "--quick", "--device", "cuda", "--jobs", str(jobs),
            "--out", str(out), "--data-dir", str(data_dir)]  # fmt: skip
    assert cli(argv) == 0
    records = _records(out)
    assert {r["variant"] for r in records} == set(spec.load("norms").variants)
    assert all(r["errors"] == {} for r in records), [r["errors"] for r in records]
    assert all(r["device"] == "cuda" and r["timing"]["device"] == "cuda" for r in records)
    assert all(r["metrics"]["norm_call_us"] > 0 and r["metrics"]["train_step_ms"] > 0 for r in records)  # fmt: skip
    for r in records:  # the trainer says where it trained
        assert "steps on cuda" in (out / r["run_dir"] / "log.txt").read_text()
