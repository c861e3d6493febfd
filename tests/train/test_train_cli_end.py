"""How `attnlab train` ends, through the command (issue 49, item 11): its sample printed as text,
the run folder left without `train.lock` however the run ends (finished, failed, interrupted), a
lock file a killed trainer left not blocking, and Ctrl-C reported as what happened, not as an error.

References: the run's own results.json (the sample as saved), the run folder's files, the
checkpoint the interrupted run kept (its manifest's step). The real SIGINT, in a subprocess, is
tests/train/test_train.py's test_sigint_saves_a_checkpoint_and_the_rerun_is_exact.
"""

from __future__ import annotations

import fcntl
import json
import os

import pytest

from attnlab.cli import main as cli
from attnlab.train import lock as lock_module
from attnlab.train.lock import LOCK, RunLock, RunLocked
from attnlab.train.loop import Trainer, TrainingInterrupted
from helpers.train import TINY, set_args

pytestmark = pytest.mark.usefixtures("own_cache")


@pytest.fixture(autouse=True)
def no_native_kernels(monkeypatch):
    """The sample's decoding without attnlab's C++ kernels: a HOME of the test's own would build
    them (minutes) for a few tokens that torch's ops give as well."""
    monkeypatch.setenv("ATTNLAB_KERNELS", "0")


# the recipe's one sample ("ROMEO:") stays
SETS = [*TINY["shakespeare-char"], "checkpoint.minutes=null", "log_every=1", "eval.every=100",
        "schedule.warmup=1"]  # fmt: skip


def argv(run_dir, data_dir, *sets: str) -> list[str]:
    return ["train", "shakespeare-char", "--run-dir", str(run_dir), "--data-dir", str(data_dir),
            "--device", "cpu", "--threads", "1", *set_args([*SETS, *sets])]  # fmt: skip


def test_the_sample_is_printed_as_text(data_dir, tmp_path, capsys):
    """The char LM's sample, several lines of text, is printed with its line breaks (not as a
    Python repr with a literal \\n), each line once, as results.json holds it; no lock is left."""
    run = tmp_path / "r"
    assert cli(argv(run, data_dir, "steps=3", "decoding.sample_tokens=60")) == 0  # the recipe's
    out = capsys.readouterr().out
    sample = json.loads((run / "results.json").read_text())["samples"]["ROMEO:"]
    assert sample.startswith("ROMEO:") and "\n" in sample  # the tiny text is line after line
    assert "\\n" not in out and "'ROMEO:'" not in out
    first, *rest = sample.split("\n")
    lines = out.splitlines()
    at = lines.index("  ROMEO:")
    assert lines[at + 1] == f"    -> {first}"
    assert lines[at + 2 : at + 2 + len(rest)] == [f"       {x}".rstrip() for x in rest]
    assert not (run / LOCK).exists()


def test_a_failed_run_leaves_no_lock(data_dir, tmp_path, capsys, monkeypatch):
    """An error inside training (here the loop's first update fails as a bad input would): one
    error line, and the run folder holds no train.lock."""

    def fails(self):
        raise ValueError("a batch the model cannot take")

    monkeypatch.setattr(Trainer, "fit", fails)
    run = tmp_path / "r"
    assert cli(argv(run, data_dir, "steps=3")) == 2
    assert "error: a batch the model cannot take" in capsys.readouterr().err
    assert run.is_dir() and not (run / LOCK).exists()


def test_ctrl_c_in_the_loop_is_reported_as_it_is(data_dir, tmp_path, capsys, monkeypatch):
    """The loop's own report of a Ctrl-C (it saved, here is how to continue) is what is printed,
    alone and not called an error; status 130; no lock left."""
    run = tmp_path / "r"
    assert cli(argv(run, data_dir, "steps=2")) == 0  # a checkpoint to resume from

    def interrupted(self):
        raise TrainingInterrupted(2, run / "last", "SIGINT")

    monkeypatch.setattr(Trainer, "fit", interrupted)
    capsys.readouterr()
    assert cli(argv(run, data_dir, "steps=4")) == 130
    err = capsys.readouterr().err
    assert err == f"interrupted (SIGINT): saved a checkpoint of step 2 in {run / 'last'}: run " \
        f"the same command again to continue exactly from there\n"  # fmt: skip
    assert not (run / LOCK).exists()


def test_ctrl_c_outside_the_loop_names_the_checkpoint_kept(data_dir, tmp_path, capsys,
                                                             monkeypatch):  # fmt: skip
    """A Ctrl-C the loop does not catch (before training starts, in the final test, a second
    one) stops at once: the message says which checkpoint the same command continues from, or
    that none was saved; never "error: interrupted"; status 130; no lock left."""
    run = tmp_path / "r"

    def ctrl_c(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "fit", ctrl_c)
    assert cli(argv(run, data_dir, "steps=2")) == 130
    err = capsys.readouterr().err
    assert (
        err.startswith("interrupted (Ctrl-C) before a checkpoint was saved") and "error" not in err
    )
    assert not (run / LOCK).exists()
    monkeypatch.undo()
    assert cli(argv(run, data_dir, "steps=2")) == 0
    monkeypatch.setattr(Trainer, "fit", ctrl_c)
    capsys.readouterr()
    assert cli(argv(run, data_dir, "steps=4")) == 130
    err = capsys.readouterr().err
    assert err == (f"interrupted (Ctrl-C): the checkpoint of step 2 in {run / 'last'} is kept: "
                   f"run the same command again to continue from there\n")  # fmt: skip
    assert not (run / LOCK).exists()


def test_a_stale_lock_file_does_not_block(data_dir, tmp_path, capsys):
    """A train.lock that a killed trainer left (its PID inside, nobody holding it) is taken and
    then removed; one a live process holds refuses the run (status 4) and is left to its owner."""
    run = tmp_path / "r"
    run.mkdir()
    (run / LOCK).write_text("999999\n")
    assert cli(argv(run, data_dir, "steps=2")) == 0
    assert not (run / LOCK).exists()
    fd = os.open(run / LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"4242\n")
        assert cli(argv(run, data_dir, "steps=4")) == 4
        assert "process 4242 is training in it" in capsys.readouterr().err
        assert (run / LOCK).exists()
    finally:
        os.close(fd)


def test_a_lock_removed_while_opening_it_is_not_shared(tmp_path, monkeypatch):
    """Trainer B opens train.lock just before its owner A ends and removes it; C then creates and
    locks a new one. B's flock of the removed file succeeds, but B must see that the path names
    another file now, open it again and be refused: one trainer (C) in the folder, not two."""
    a = RunLock(tmp_path).__enter__()
    stale = os.open(tmp_path / LOCK, os.O_RDWR)  # B's open, before A ends
    a.__exit__(None, None, None)
    assert not (tmp_path / LOCK).exists()
    c = RunLock(tmp_path).__enter__()
    real_open, handed = os.open, []

    def b_opens(path, *args, **kwargs):  # B's first open returns the file it opened earlier
        if not handed:
            handed.append(path)
            return stale
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(lock_module.os, "open", b_opens)
    with pytest.raises(RunLocked, match=f"process {os.getpid()}"):
        RunLock(tmp_path).__enter__()
    monkeypatch.undo()
    c.__exit__(None, None, None)
    assert not (tmp_path / LOCK).exists()
