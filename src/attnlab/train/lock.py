"""One trainer per run directory: `RUN_DIR/train.lock`, held with an exclusive `flock` for as
long as the trainer runs, holds its PID, and is removed when the trainer ends (finished, failed or
interrupted), so a run folder holds it only while a trainer works in it.

Two trainers on one folder would both append to metrics.jsonl and overwrite each other's
checkpoints. The lock is the kernel's (flock(2)): it goes with the process, however it ends
(SIGKILL, the OOM killer included), so the file a killed trainer leaves behind is stale and simply
taken by the next trainer; the PID in the file is only there to name the owner in the refusal.
Under torchrun rank 0 holds it for all ranks. Where the file system has no flock (some network
mounts) nothing is locked.

Removing the file races with a trainer that opened it just before: that one may lock the removed
file while a third creates and locks a new one. So the owner removes it while still holding the
lock, and a trainer that got the lock checks that the path still names the file it locked
(the same inode), else opens the path again (the usual flock-and-unlink protocol).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path
from types import TracebackType

from ..errors import AttnlabError

LOCK = "train.lock"


class RunLocked(AttnlabError):
    """Another live process trains in the run directory."""

    exit_status = 4  # apart from input errors (2): the folder is busy, try again later

    def __init__(self, run_dir: Path, pid: str):
        owner = f"process {pid}" if pid else "another process"
        kill = f"stop it (kill {pid}: it saves a checkpoint first)" if pid else "stop it"
        super().__init__(
            f"{run_dir} is in use: {owner} is training in it (it holds {run_dir / LOCK}). Two "
            f"trainers on one run would overwrite each other's checkpoints and log every step "
            f"twice: wait for it to finish, or {kill} and run this command again to continue "
            f"from its checkpoint, or train into another folder (--run-dir)"
        )


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the open file `fd` (not removed or replaced since it was opened)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


class RunLock:
    """`with RunLock(run_dir):` holds the run directory's lock (creating the folder), or raises
    RunLocked naming the owner's PID."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.fd: int | None = None
        self.created = False  # the folder did not exist: removed again if left empty

    def __enter__(self) -> RunLock:
        self.created = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / LOCK
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)  # no flock here (ENOLCK, EINVAL ...): run unlocked,
                    with contextlib.suppress(OSError):  # and leave no lock file that means nothing
                        path.unlink()
                    return self
                pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                raise RunLocked(self.run_dir, pid) from None
            if _same_file(fd, path):
                break
            os.close(fd)  # its owner removed it as we opened it: lock the path's file instead
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):  # removed while still held (see the module's doc)
            (self.run_dir / LOCK).unlink()
        os.close(self.fd)  # closing the last descriptor releases the flock
        self.fd = None
        if self.created:
            with contextlib.suppress(OSError):  # a run that failed before writing anything
                self.run_dir.rmdir()  # only an empty folder goes
