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
no longer run (and this process's own that no write of it is using).

A folder that replaces an existing one (`force`) is swapped in two renames: the old folder aside
as `.<dst name>.attnlab-partial-<pid>.old`, the new one in, with SIGINT / SIGTERM / SIGHUP held
back between the two (and the old one put back if the second fails), so the destination is
always either the old folder or the new one, never missing. Then the old one is removed; a stop
during that removal (a large folder takes a while) leaves the new folder in place and the old
one's rest for the next write's sweep. `completed(dst)` says whether this process's last write to
`dst` got into place, so a caller stopped afterwards can say what the disk holds.
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
_OLD = ".old"  # the suffix of an old folder set aside while a new one replaces it
_active: set[Path] = set()  # this process's partials that a write is using now
_placed: set[Path] = set()  # destinations whose last write by this process got into place


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
    """Remove the partials of `dst` (and old folders set aside) that processes no longer running
    left, and this process's own that none of its writes is using; returns them."""
    gone = []
    prefix = f".{dst.name}{PARTIAL}"
    if not dst.parent.is_dir():
        return gone
    for p in dst.parent.iterdir():
        if not p.name.startswith(prefix):
            continue
        pid = p.name[len(prefix) :].removesuffix(_OLD)
        if not pid.isdecimal():
            continue
        mine = int(pid) == os.getpid()
        if (mine and p not in _active) or (not mine and not _alive(int(pid))):
            _remove(p)
            gone.append(p)
    return gone


def completed(dst: str | Path) -> bool:
    """Whether this process's last atomic write to `dst` was renamed into place (so a stop
    after that point left the new content there, not the old)."""
    return Path(dst) in _placed


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
def _held_back() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP wait until the block is done (main thread only), then are
    delivered to the handlers they had: for a few renames that must happen together."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    kinds = [getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n)]
    old = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in kinds}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)


@contextlib.contextmanager
def _partial(dst: Path) -> Iterator[Path]:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_of(dst)
    mine = (tmp, tmp.with_name(tmp.name + _OLD))
    _placed.discard(dst)
    sweep(dst)
    sweep(dst.with_name(dst.name + _OLD))  # old folders set aside under attnlab's former name
    _remove(tmp)
    _active.update(mine)
    try:
        with _signals_raise():
            try:
                yield tmp
            except BaseException:
                _remove(tmp)
                raise
    finally:
        _active.difference_update(mine)


@contextlib.contextmanager
def atomic_file(dst: str | Path) -> Iterator[Path]:
    """A path to write `dst`'s new content to; renamed onto `dst` (replacing it) on success."""
    dst = Path(dst)
    with _partial(dst) as tmp:
        yield tmp
        _readable(tmp)
        fsync(tmp)
        os.replace(tmp, dst)
        _placed.add(dst)
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
        if not dst.exists():
            os.replace(tmp, dst)
            _placed.add(dst)
            fsync(dst.parent)
            return
        # force: the old one aside and the new one in, together; then the old one gone
        old = tmp.with_name(tmp.name + _OLD)
        _remove(old)
        with _held_back():
            os.replace(dst, old)
            try:
                os.replace(tmp, dst)
            except BaseException:
                os.replace(old, dst)
                raise
            _placed.add(dst)
        fsync(dst.parent)
        _remove(old)  # stopped here: the new folder stays, the next write sweeps the old
