"""Files and folders written whole or not at all: what `attnlab convert` and `save_pretrained`
write goes to a hidden sibling of its destination and is renamed into place when complete
(rename is atomic within a file system), so a reader never sees half a model.

    with atomic_file(dst) as tmp:                 # write tmp; on success tmp replaces dst
        ...
    with atomic_folder(dst, force=False) as tmp:  # a folder; an existing dst needs force
        ...

The sibling is named `.<dst name>.attnlab-partial-<pid>`. A write that raises, or is stopped by
SIGTERM / SIGHUP / Ctrl-C, removes it before the exception goes on (SIGTERM and SIGHUP are turned
into an exception for the time of the write, in the main thread). A process killed outright
(SIGKILL, the OOM killer, power loss) cannot clean up: its partial stays, never at the
destination, and the next write to the same destination removes the partials of processes that
no longer run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

PARTIAL = ".attnlab-partial-"


class Interrupted(BaseException):
    """SIGTERM or SIGHUP during an atomic write (raised so that the write cleans up)."""


def partial_of(dst: Path, pid: int | None = None) -> Path:
    return dst.parent / f".{dst.name}{PARTIAL}{os.getpid() if pid is None else pid}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def sweep(dst: Path) -> list[Path]:
    """Remove the partials of `dst` that processes no longer running left; returns them."""
    gone = []
    prefix = f".{dst.name}{PARTIAL}"
    if not dst.parent.is_dir():
        return gone
    for p in dst.parent.iterdir():
        if not p.name.startswith(prefix):
            continue
        pid = p.name[len(prefix) :]
        if pid.isdecimal() and int(pid) != os.getpid() and not _alive(int(pid)):
            _remove(p)
            gone.append(p)
    return gone


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def fsync(path: Path) -> None:
    """Flush a file or folder to disk where the file system allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on folders; the rename still orders writes
        pass
    finally:
        os.close(fd)


def _readable(path: Path) -> None:
    """A new file's usual permissions (0666 less the umask): writers that go through a private
    temporary file of their own (safetensors) leave 0600."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise Interrupted inside the block (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(f"stopped by signal {signal.Signals(signum).name}")

    kinds = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s]
    old = {s: signal.signal(s, handler) for s in kinds}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _partial(dst: Path) -> Iterator[Path]:
    dst.parent.mkdir(parents=True, exist_ok=True)
    sweep(dst)
    tmp = partial_of(dst)
    _remove(tmp)
    with _signals_raise():
        try:
            yield tmp
        except BaseException:
            _remove(tmp)
            raise


@contextlib.contextmanager
def atomic_file(dst: str | Path) -> Iterator[Path]:
    """A path to write `dst`'s new content to; renamed onto `dst` (replacing it) on success."""
    dst = Path(dst)
    with _partial(dst) as tmp:
        yield tmp
        _readable(tmp)
        fsync(tmp)
        os.replace(tmp, dst)
        fsync(dst.parent)


@contextlib.contextmanager
def atomic_folder(dst: str | Path, force: bool = False) -> Iterator[Path]:
    """An empty folder to write `dst`'s content into; renamed to `dst` on success. An existing
    `dst` is refused (FileExistsError) unless `force`, then replaced whole."""
    dst = Path(dst)
    if dst.exists() and not force:
        raise FileExistsError(
            f"{dst} exists: choose another destination, or pass --force to replace it"
        )
    with _partial(dst) as tmp:
        tmp.mkdir()
        yield tmp
        for f in tmp.iterdir():
            if f.is_file():
                _readable(f)
            fsync(f)
        fsync(tmp)
        if dst.exists():  # force: the old one aside, the new one in, the old one gone
            old = partial_of(dst.with_name(dst.name + ".old"))
            _remove(old)
            os.replace(dst, old)
            os.replace(tmp, dst)
            _remove(old)
        else:
            os.replace(tmp, dst)
        fsync(dst.parent)
