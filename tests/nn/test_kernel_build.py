"""The kernels' one-time build (src/attnlab/nn/build_lock.py, matvec.py's `_ext`) against the ways
a build ends badly, each in subprocesses over a private folder:

- a builder ended by SIGTERM, SIGINT (KeyboardInterrupt), SIGHUP or SIGKILL mid-build leaves no
  process of its build alive (the fake build below puts a `sleep` in a process group of its own,
  as ninja does with each compile) and no marker, and the next process builds and loads within a
  bound, a stale torch `lock` file in the folder notwithstanding;
- two concurrent builders: one builds, the other waits (and says so) and loads the same result;
- a holder of the lock past ATTNLAB_KERNEL_BUILD_WAIT: `matvec.ready()` falls back (False, the
  RuntimeWarning) instead of waiting forever;
- the start and end lines on a build only, not on a cached load; a changed key rebuilds.

The fake build stands in for torch's (which takes ~2 min here); one `slow` test does the real one
through matvec in a temporary TORCH_EXTENSIONS_DIR (`pytest -m slow tests/nn/test_kernel_build.py`).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnlab.nn import build_lock, matvec

# like ninja: a compile (`sh` and its `sleep`) in a process group of its own, then the product
FAKE_BUILD = """
import os, subprocess, sys, time
product, seconds, pids = sys.argv[1], float(sys.argv[2]), sys.argv[3]
sh = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE,
                      process_group=0)
sleeper = sh.stdout.readline().decode().strip()
with open(pids, "a") as f:
    f.write(f"{os.getpid()} {sh.pid} {sleeper}\\n")
time.sleep(seconds)
os.killpg(sh.pid, 9)
sh.wait()
with open(product, "a") as f:
    f.write("built\\n")
"""

# one process that loads through build_lock with the fake build: prints the product's build count
DRIVER = """
import signal, sys
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if inherited off
from attnlab.nn import build_lock
d, seconds, key, fake = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
product = d / "product.txt"
text = build_lock.load_once(d, key, [sys.executable, fake, str(product), seconds,
                            str(d / "pids.txt")], product, product.read_text, what="the fake",
                            start="START fake build")
print("LOADED", text.count("built"), flush=True)
"""


@pytest.fixture
def scripts(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "fake_build.py").write_text(FAKE_BUILD)
    (tmp_path / "driver.py").write_text(DRIVER)
    return tmp_path / "driver.py", tmp_path / "fake_build.py"


def driver(scripts, build_dir: Path, seconds: float, key: str = "k1", **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(scripts[0]), str(build_dir), str(seconds), key, str(scripts[1])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def finish(proc: subprocess.Popen, bound: float = 120) -> tuple[str, str]:
    out, err = proc.communicate(timeout=bound)
    assert proc.returncode == 0, err
    return out, err


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_for(path: Path, bound: float = 60) -> str:
    end = time.monotonic() + bound
    while time.monotonic() < end:
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text()
        time.sleep(0.1)
    raise AssertionError(f"{path} never written")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL])
def test_killed_builder_leaves_nothing_running_and_blocks_nobody(scripts, tmp_path, sig):
    build_dir = tmp_path / "build"
    first = driver(scripts, build_dir, 300)
    pids = [int(p) for p in wait_for(build_dir / "pids.txt").split()]
    assert all(alive(p) for p in pids)
    (build_dir / "lock").write_text("")  # torch's baton as a killed torch build leaves it
    first.send_signal(sig)
    first.communicate(timeout=30)
    assert first.returncode != 0
    end = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "a process of the killed build survived"
    assert not (build_dir / build_lock.MARKER).exists()

    began = time.monotonic()
    out, err = finish(driver(scripts, build_dir, 0.2), bound=60)
    assert out.strip() == "LOADED 1" and "START fake build" in err
    assert time.monotonic() - began < 60
    assert not (build_dir / "lock").exists()


def test_concurrent_builders_build_once(scripts, tmp_path):
    build_dir = tmp_path / "build"
    procs = [driver(scripts, build_dir, 4) for _ in range(2)]
    results = [finish(p) for p in procs]
    assert [out.strip() for out, _ in results] == ["LOADED 1", "LOADED 1"]
    errs = [err for _, err in results]
    assert sum("START fake build" in e for e in errs) == 1
    assert sum("another process is building the fake" in e for e in errs) == 1
    assert len((build_dir / "pids.txt").read_text().splitlines()) == 1


def test_cached_load_is_silent_and_a_new_key_rebuilds(scripts, tmp_path):
    build_dir = tmp_path / "build"
    out, err = finish(driver(scripts, build_dir, 0.1))
    assert out.strip() == "LOADED 1"
    assert "START fake build" in err and "attnlab: the fake built in" in err
    out, err = finish(driver(scripts, build_dir, 0.1))
    assert out.strip() == "LOADED 1" and err == ""
    out, err = finish(driver(scripts, build_dir, 0.1, key="k2"))
    assert out.strip() == "LOADED 2" and "START fake build" in err


def test_wait_bound_falls_back_to_torch(tmp_path):
    """A live holder of matvec's build lock past ATTNLAB_KERNEL_BUILD_WAIT: ready() is False with
    the fallback's warning, after the waiting line, well before the holder lets go."""
    build_dir = tmp_path / matvec._build_name()
    build_dir.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; f = open(sys.argv[1], 'a+');"
            "fcntl.flock(f, fcntl.LOCK_EX); f.write(str(os.getpid())); f.flush();"
            "print('held', flush=True); time.sleep(300)",
            str(build_dir / build_lock.LOCK),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        began = time.monotonic()
        waiter = subprocess.run(
            [
                sys.executable,
                "-W",
                "always",
                "-c",
                "from attnlab.nn import matvec; print(matvec.ready())",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), build_lock.WAIT_ENV: "3"},
        )
        elapsed = time.monotonic() - began
    finally:
        holder.kill()
        holder.wait()
    assert waiter.stdout.strip() == "False", waiter.stderr
    assert f"another process is building attnlab's CPU kernels (pid {holder.pid})" in waiter.stderr
    assert "RuntimeWarning" in waiter.stderr and "could not be built" in waiter.stderr
    assert "building attnlab's CPU kernels once" not in waiter.stderr
    assert elapsed < 60


def test_lock_is_free_after_a_holder_is_killed(tmp_path):
    """The premise of the design: flock dies with its holder (SIGKILL included)."""
    path = tmp_path / build_lock.LOCK
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX);"
            "print('held', flush=True); time.sleep(300)",
            str(path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with open(path, "a+") as f:
        with pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.kill()
        holder.wait()
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.slow
def test_real_build_then_cached_load(tmp_path):
    """torch's build through matvec (~2 min on 2 cores), a stale torch `lock` already there; then
    a cached load: True both times, the start and end lines only the first time."""
    (tmp_path / matvec._build_name()).mkdir()
    (tmp_path / matvec._build_name() / "lock").write_text("")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    cmd = [sys.executable, "-c", "from attnlab.nn import matvec; print(matvec.ready())"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert first.stdout.strip() == "True", first.stderr
    assert "building attnlab's CPU kernels once" in first.stderr
    assert "attnlab: attnlab's CPU kernels built in" in first.stderr
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert second.stdout.strip() == "True", second.stderr
    assert "attnlab" not in second.stderr
