"""`attnlab train` when something around it goes wrong: a second trainer on the same run
directory, a trainer killed while holding its lock, a checkpoint write that fails (a file-size
limit: the EFBIG a full disk's ENOSPC stands for), a run asked to do what it has already done, an
explicit thread count on resume, a busy machine, and the usage slips of `--set` and recipe names.

Each is driven through the command (a subprocess where the processes themselves matter: locks,
rlimits) on the tiny data sets of tests/train/conftest.py; the reference is the run's own files
(metrics.jsonl, the checkpoint manifests) and the uninterrupted behaviour.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch

from attnlab.cli import main as cli
from attnlab.train import checkpoint as ckpt
from attnlab.train import recipes, run, threads
from attnlab.train.lock import LOCK
from helpers.train import TINY, set_args, train_records

# tests/train/conftest.py's fixtures: the tiny data sets (data_dir), and a tokenizer cache inside
# the test for every test
pytestmark = pytest.mark.usefixtures("own_cache")

SETS = [*TINY["shakespeare-char"], "eval.samples=[]", "checkpoint.minutes=null", "log_every=1"]


def command(run_dir, data_dir, *sets: str) -> list[str]:
    return [sys.executable, "-m", "attnlab", "train", "shakespeare-char", "--run-dir",
            str(run_dir), "--data-dir", str(data_dir), "--device", "cpu",
            *set_args([*SETS, *sets])]  # fmt: skip


def environment(tmp_path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(tmp_path / "home")}


def wait_for(condition, what: str, seconds: float = 60) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def logged_past(run_dir, step: int) -> bool:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return len(lines) > 1 and json.loads(lines[-2])["step"] >= step  # [-1] may be half written


# --- one trainer per run directory ----------------------------------------------------------


def test_a_second_trainer_is_refused_naming_the_first(data_dir, tmp_path):
    """While one trainer runs, a second on the same folder exits at once with an error naming
    the first one's PID and the choices; the first finishes with every step logged once."""
    env, r = environment(tmp_path), tmp_path / "r"
    first = subprocess.Popen(
        command(r, data_dir, "steps=600", "eval.every=300"), env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    wait_for(lambda: logged_past(r, 5) or first.poll() is not None, "the first trainer's steps")
    second = subprocess.run(
        command(r, data_dir, "steps=600", "eval.every=300", "seed=2"), env=env, text=True,
        capture_output=True,
    )  # fmt: skip
    assert first.poll() is None, "the first trainer finished before the second started"
    assert second.returncode == 4, second.stderr
    assert "Traceback" not in second.stderr
    assert f"process {first.pid} is training in it" in second.stderr, second.stderr
    assert f"kill {first.pid}" in second.stderr and "--run-dir" in second.stderr
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    steps = [s for s, _ in train_records(r)]
    assert steps == list(range(1, 601))  # once each: nothing from the refused trainer
    assert not list(r.glob(".tmp-*"))


def test_a_killed_trainers_lock_does_not_block_the_next(data_dir, tmp_path):
    """SIGKILL leaves the lock file with the dead trainer's PID in it; the kernel released the
    lock itself, so the same command resumes from the last checkpoint."""
    env, r = environment(tmp_path), tmp_path / "r"
    cmd = command(r, data_dir, "steps=300", "eval.every=1000", "checkpoint.every=20")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: logged_past(r, 45) or proc.poll() is not None, "a checkpoint and more steps")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert (r / LOCK).read_text().strip() == str(proc.pid)
    saved = ckpt.verify(ckpt.resolve(r, "last"))["step"]
    assert 20 <= saved < 300, "the run finished before it could be killed"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"resumed {r} at step {saved}" in out.stdout
    assert [s for s, _ in train_records(r)] == list(range(1, 301))


# --- a checkpoint that cannot be written ----------------------------------------------------


def limited(limit: int):
    """A child's file-size limit (what `ulimit -f` sets). Python ignores SIGXFSZ, so a write past
    it fails with EFBIG instead of killing the process."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.parametrize("fails", ["model.safetensors", "state.pt"])
def test_a_failed_checkpoint_write_is_one_clear_error(fails, data_dir, tmp_path):
    """A file-size limit between the sizes of the checkpoint's files fails one of them (the
    weights through safetensors, the state through torch.save): one error line saying which
    checkpoint, why, and that the previous one is intact; exit status 5; no traceback, no
    temporary folder; the same command without the limit then finishes the run."""
    env, r = environment(tmp_path), tmp_path / "r"
    first = command(r, data_dir, "steps=10", "eval.every=10", "log_every=5")
    subprocess.run(first, env=env, check=True, capture_output=True)
    files = ckpt.verify(r / "last")["files"]
    weights, state = files["model.safetensors"]["bytes"], files["state.pt"]["bytes"]
    assert weights < state  # the state holds two Adam moments per weight
    limit = weights // 2 if fails == "model.safetensors" else (weights + state) // 2
    assert limit > (r / "metrics.jsonl").stat().st_size * 3  # room for the log to grow
    cmd = command(r, data_dir, "steps=20", "eval.every=10", "log_every=5")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, preexec_fn=limited(limit))
    assert out.returncode == 5, out.stderr
    assert "Traceback" not in out.stderr
    error = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, out.stderr
    assert "could not write checkpoint 'best' of step 20" in error[0], error[0]
    assert "exceeds the file-size limit" in error[0] and "(EFBIG)" in error[0]
    assert f"the previous checkpoint {r / 'best'} (step 10) is intact" in error[0]
    assert not list(r.glob(".tmp-*")) and not list(r.glob(".old-*"))
    assert ckpt.verify(r / "best")["step"] == ckpt.verify(r / "last")["step"] == 10
    again = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert f"resumed {r} at step 10" in again.stdout
    assert ckpt.verify(r / "last")["step"] == 20
    assert [s for s, _ in train_records(r)] == [5, 10, 15, 20]


# --- a run asked for what it has done -------------------------------------------------------


def test_a_finished_run_is_not_tested_again_and_fewer_steps_are_refused(
    data_dir, tmp_path, capsys, monkeypatch
):
    r = tmp_path / "r"
    argv = ["train", "shakespeare-char", "--run-dir", str(r), "--data-dir", str(data_dir),
            "--device", "cpu", *set_args([*SETS, "steps=6", "eval.every=3"])]  # fmt: skip
    assert cli(argv) == 0
    before = {n: (r / n).read_bytes() for n in ("metrics.jsonl", "results.json")}
    tested = []
    monkeypatch.setattr(run, "finish", lambda *a: tested.append(a) or {})
    capsys.readouterr()
    assert cli(argv) == 0  # the same command again: done, said so, nothing redone
    out = capsys.readouterr().out
    assert f"{r} already finished its 6 steps" in out and "--set steps=N with N > 6" in out
    assert tested == [] and {n: (r / n).read_bytes() for n in before} == before
    assert cli([*argv, "--set", "steps=4"]) == 2
    err = capsys.readouterr().err
    assert f"{r} is already at step 6, past the steps asked for (4)" in err, err
    assert "raise steps above 6" in err and "--run-dir" in err
    assert {n: (r / n).read_bytes() for n in before} == before


# --- threads --------------------------------------------------------------------------------


def test_threads_asked_for_win_on_resume_and_a_busy_machine_is_pointed_out_once(
    data_dir, tmp_path, capsys, monkeypatch
):
    """A run of 2 threads resumed with --threads 1 continues with 1 and says the resume is then
    exact only to rounding (the next checkpoint records 1). The load warning is printed once."""
    r = tmp_path / "r"
    argv = ["train", "shakespeare-char", "--run-dir", str(r), "--data-dir", str(data_dir),
            "--device", "cpu", *set_args([*SETS, "steps=8", "eval.every=100"])]  # fmt: skip
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # spinning threads: the warned case
    try:
        assert cli([*argv, "--threads", "2", "--stop-at", "4"]) == 0
        assert ckpt.load_state(r / "last")["threads"] == 2
        assert capsys.readouterr().err.count("1-minute load average is 99.0") == 1
        assert cli([*argv, "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(1)  # the suite's setting (tests/conftest.py)
    out = capsys.readouterr()
    assert "using 1 thread as --threads 1 asks (the run used 2)" in out.out, out.out
    assert "only to rounding" in out.out
    assert "load average" not in out.err  # one thread: nothing to advise
    assert ckpt.load_state(r / "last")["threads"] == 1


def test_resume_threads_default_is_the_runs_own_and_an_explicit_count_wins(capsys, monkeypatch):
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    try:
        torch.set_num_threads(1)
        threads.resume_threads(2, None, speak=True)  # nothing asked: bit-exact
        assert torch.get_num_threads() == 2
        assert "using 2 threads as the run did (was 1): the resume is bit-exact" in (
            capsys.readouterr().out
        )
        torch.set_num_threads(1)
        threads.resume_threads(2, "OMP_NUM_THREADS=1", speak=True)
        assert torch.get_num_threads() == 1
        assert "as OMP_NUM_THREADS=1 asks (the run used 2)" in capsys.readouterr().out
    finally:
        torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.choose(None) == "OMP_NUM_THREADS=3"
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.choose(None) is None
    with pytest.raises(ValueError, match="--threads 0"):
        threads.choose(0)


@pytest.mark.parametrize(
    ("load", "n_threads", "warned"),
    [(2.0, 2, True), (7.5, 4, True), (1.9, 2, False), (3.0, 1, False)],
)
def test_busy_cores_warning(load, n_threads, warned, monkeypatch):
    """Warned when the 1-minute load already fills the cores (load >= cores) and the run would
    add more than one thread; the advice names both ways to ask for one."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # spinning threads: the ones at risk
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads.torch, "get_num_threads", lambda: n_threads)
    got = threads.busy_cores_warning()
    assert (got is not None) == warned
    if warned:
        assert f"load average is {load:.1f} on 2 core(s)" in got
        assert "--threads 1" in got and "OMP_NUM_THREADS=1" in got
        assert "OMP_WAIT_POLICY=PASSIVE" in got
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # the CLI's default: they sleep instead
    assert threads.busy_cores_warning() is None


# --- usage slips ----------------------------------------------------------------------------


def test_set_without_equals_shows_the_form(capsys):
    with pytest.raises(SystemExit) as exit:
        cli(["train", "shakespeare-char", "--set", "steps", "50"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "--set takes KEY=VALUE, e.g. --set steps=50" in err, err
    assert "write --set steps=VALUE" in err and "unrecognized arguments" not in err
    assert [line for line in err.splitlines() if line] == [err.strip()]  # one line


def test_a_recipe_file_name_is_found_in_configs(capsys, tmp_path):
    assert (
        recipes.find("multi30k-de-en-quick.yaml") == recipes.CONFIGS / "multi30k-de-en-quick.yaml"
    )
    # through the command: the file is found and read (an invalid override, reported as such)
    assert cli(["train", "sst2.yaml", "--run-dir", str(tmp_path / "r"), "--set", "seed=-1"]) == 2
    err = capsys.readouterr().err
    assert "seed = -1" in err and "no recipe" not in err, err
    assert not (tmp_path / "r").exists()
    with pytest.raises(FileNotFoundError, match=r"did you mean '.*configs/sst2\.yaml'"):
        recipes.find(tmp_path / "sst2.yaml")
