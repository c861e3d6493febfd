"""A one-time build that a killed builder can neither block nor leave half done (matvec.py's kernels).

torch's `cpp_extension.load` guards its build folder with a FileBaton: a `lock` file created at the
start and removed at the end. A builder killed by a signal never removes it, and every later
process polls for it forever; its Ctrl-C path SIGKILLs ninja, whose compilers then run on orphaned.
So attnlab never lets two of its processes meet at that baton:

- `attnlab.lock` in the build folder is taken with `flock`, which the kernel releases when its
  holder dies, even by SIGKILL. Loading a finished build takes it shared; building takes it
  exclusive, and only then is a torch `lock` left by a dead builder removed (only holders of this
  lock ever build, so one that is there is stale). The builder writes its pid into the file.
- `attnlab.built` holds the key of the build that finished and was loaded; it is removed before a
  build starts and written (atomically) after the product loaded, so a build cut short is rebuilt,
  never loaded. A product whose marker matches is imported directly (no ninja, no baton).
- The build runs as `_guard`, a child in a session of its own that dies with its parent (Linux's
  PR_SET_PDEATHSIG) and, on SIGTERM or SIGHUP, SIGKILLs every process of its session: ninja puts
  each compile in a process group of its own, so the session, not a group, is what holds them all.
  A parent interrupted by an exception (Ctrl-C, a handler's SystemExit) kills the session itself.
- A process that waits for another builder waits at most `ATTNLAB_KERNEL_BUILD_WAIT` seconds
  (600 by default), then raises `BuildWaitTimeout` (matvec.py falls back to torch's matmuls).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

T = TypeVar("T")

LOCK = "attnlab.lock"
MARKER = "attnlab.built"
WAIT_ENV = "ATTNLAB_KERNEL_BUILD_WAIT"
DEFAULT_WAIT_S = 600.0
NOTICE_AFTER_S = 1.0  # a cached load holds the lock for a fraction of a second: no line for that


class BuildWaitTimeout(TimeoutError):
    """Another process held the build lock past the wait bound."""


def wait_bound() -> float:
    """Seconds to wait for another builder (`ATTNLAB_KERNEL_BUILD_WAIT`, default 600)."""
    raw = os.environ.get(WAIT_ENV, "").strip()
    try:
        return float(raw) if raw else DEFAULT_WAIT_S
    except ValueError:
        raise ValueError(
            f"{WAIT_ENV}={raw!r} is not a number of seconds; e.g. {WAIT_ENV}=600"
        ) from None


def load_once(
    build_dir: Path,
    key: str,
    build: list[str],
    product: Path,
    load: Callable[[], T],
    *,
    what: str,
    start: str,
) -> T:
    """load() of `product`, after running the command `build` (which makes it in build_dir) unless
    a build with this `key` finished there before. `start` is printed to stderr when a build
    starts, a line with its time when it ends; nothing is printed for a cached load."""
    build_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_bound()
    with open(build_dir / LOCK, "a+") as lock:
        noticed = _acquire(lock, fcntl.LOCK_SH, deadline, build_dir, what, noticed=False)
        if _built(build_dir, key, product):
            return load()
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
        _acquire(lock, fcntl.LOCK_EX, deadline, build_dir, what, noticed=noticed)
        if _built(build_dir, key, product):  # built by the process this one waited for
            return load()
        _write_pid(lock, str(os.getpid()))
        try:
            (build_dir / "lock").unlink(missing_ok=True)  # torch's baton, left by a dead builder
            (build_dir / MARKER).unlink(missing_ok=True)
            print(start, file=sys.stderr, flush=True)
            began = time.monotonic()
            run_killable(build)
            result = load()
            tmp = build_dir / f"{MARKER}.{os.getpid()}"
            tmp.write_text(key)
            os.replace(tmp, build_dir / MARKER)
            print(
                f"attnlab: {what} built in {time.monotonic() - began:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            return result
        finally:
            _write_pid(lock, "")


def _built(build_dir: Path, key: str, product: Path) -> bool:
    try:
        return (build_dir / MARKER).read_text() == key and product.exists()
    except OSError:
        return False


def _write_pid(lock: IO[str], text: str) -> None:
    lock.seek(0)
    lock.truncate()
    lock.write(text)
    lock.flush()


def _acquire(
    lock: IO[str], mode: int, deadline: float, build_dir: Path, what: str, *, noticed: bool
) -> bool:
    """flock(mode), polling until `deadline`; one line on stderr once the wait passes
    NOTICE_AFTER_S. Returns whether that line was printed."""
    began = time.monotonic()
    while True:
        try:
            fcntl.flock(lock.fileno(), mode | fcntl.LOCK_NB)
            return noticed
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now >= deadline:
            raise BuildWaitTimeout(
                f"another process (pid {_holder(build_dir)}) was still building {what} in "
                f"{build_dir} after {wait_bound():.0f} s; set {WAIT_ENV} to wait longer"
            )
        if not noticed and now - began >= NOTICE_AFTER_S:
            print(
                f"attnlab: another process is building {what} (pid {_holder(build_dir)}); "
                f"waiting up to {deadline - began:.0f} s more ({WAIT_ENV})",
                file=sys.stderr,
                flush=True,
            )
            noticed = True
        time.sleep(0.2)


def _holder(build_dir: Path) -> str:
    try:
        return (build_dir / LOCK).read_text().strip() or "?"
    except OSError:
        return "?"


def run_killable(argv: list[str]) -> None:
    """Run argv under `_guard` in a session of its own; raise RuntimeError with the end of its
    output when it fails. Killed with its whole session when this process is interrupted."""
    proc = subprocess.Popen(
        [sys.executable, "-I", __file__, str(os.getpid()), *argv],  # -I: nn/ not on sys.path
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate()
    except BaseException:  # Ctrl-C, or a SIGTERM handler's SystemExit: the compilers go too
        kill_session(proc.pid)
        proc.wait()
        raise
    if proc.returncode != 0:
        tail = out.decode(errors="replace").strip().splitlines()[-20:]
        raise RuntimeError("\n".join(tail) or f"the build exited with status {proc.returncode}")


def kill_session(sid: int) -> None:
    """SIGKILL every live process of session `sid` except this one, until none is left."""
    me = os.getpid()
    for _ in range(200):
        pids = [p for p in _session(sid) if p != me]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _session(sid: int) -> list[int]:
    """Live (not zombie) processes of session sid, from /proc; without /proc, its leader's group."""
    if not os.path.isdir("/proc"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(sid, signal.SIGKILL)
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # state ppid pgrp session ...
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            found.append(int(entry))
    return found


def _guard(parent: int, argv: list[str]) -> int:
    """The build's session leader: runs argv, and takes the whole session down with it on
    SIGTERM/SIGHUP or when `parent` dies (any way, SIGKILL included)."""

    def die(signum: int, _frame: object) -> None:
        kill_session(os.getsid(0))
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, die)
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the line above
        die(signal.SIGTERM, None)
    return subprocess.Popen(argv).wait()


if __name__ == "__main__":  # run by path (run_killable): stdlib only, the package is not imported
    sys.exit(_guard(int(sys.argv[1]), sys.argv[2:]))
