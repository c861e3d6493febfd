"""An existing folder replaced whole (src/attnlab/atomic.py `atomic_folder(force=True)`, what
`attnlab convert --force` writes with) stopped at each stage (issue 49, item 18): the destination
is always the old folder or the new one, `completed` says which, and nothing is left beside it
once the next write to it has run. The reference is the disk itself: what each file holds.

The stages: while the new folder is written; a signal between the two renames (held back, so it
lands after the swap); the second rename failing (the old folder put back); a stop while the old
folder is removed (the new one stays; the old one's rest goes with the next write).
"""

from __future__ import annotations

import os
import signal

import pytest

from attnlab import atomic
from attnlab.atomic import PARTIAL, Interrupted, atomic_folder, completed


def _old(tmp_path):
    dst = tmp_path / "model"
    dst.mkdir()
    (dst / "weights").write_text("old")
    return dst


def _write(dst, text: str = "new") -> None:
    with atomic_folder(dst, force=True) as tmp:
        (tmp / "weights").write_text(text)


def _beside(tmp_path) -> list[str]:
    """What lies next to the destination: partials and old folders set aside."""
    return sorted(p.name for p in tmp_path.iterdir() if PARTIAL in p.name)


def test_stopped_while_writing_keeps_the_old_folder(tmp_path):
    dst = _old(tmp_path)
    with pytest.raises(KeyboardInterrupt), atomic_folder(dst, force=True) as tmp:
        (tmp / "weights").write_text("half")
        raise KeyboardInterrupt
    assert (dst / "weights").read_text() == "old" and not completed(dst)
    assert _beside(tmp_path) == []


@pytest.mark.parametrize("which", [1, 2])
def test_a_signal_between_the_renames_waits_for_the_swap(tmp_path, monkeypatch, which):
    """SIGTERM arriving during either rename of the swap is delivered after both: the folder is
    the new one, never missing, and the write reports the stop (Interrupted)."""
    dst = _old(tmp_path)
    real, calls = os.replace, []

    def replace(src, to):
        calls.append(src)
        real(src, to)
        if len(calls) == which:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only notes it here

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(Interrupted, match="SIGTERM"):
        _write(dst)
    assert (dst / "weights").read_text() == "new" and completed(dst)
    monkeypatch.undo()
    _write(dst, "next")  # the next write sweeps whatever the stopped one left
    assert (dst / "weights").read_text() == "next" and _beside(tmp_path) == []


def test_a_failed_swap_puts_the_old_folder_back(tmp_path, monkeypatch):
    dst = _old(tmp_path)
    real = os.replace

    def replace(src, to):
        if str(src).endswith(f"{PARTIAL}{os.getpid()}") and to == dst:  # the new one in
            raise OSError(28, "No space left on device")
        real(src, to)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(OSError, match="No space"):
        _write(dst)
    assert (dst / "weights").read_text() == "old" and not completed(dst)
    assert _beside(tmp_path) == []


def test_stopped_while_removing_the_old_folder_keeps_the_new_and_the_next_write_sweeps(
    tmp_path, monkeypatch
):
    """The stop issue 49 met (a 514 MB old folder takes a while to remove): the new folder is in
    place, `completed` says so, and the old one's rest, named as a partial of the destination,
    is removed by the next write (before: `.model.old.attnlab-partial-PID`, which no sweep
    matched, stayed for good)."""
    dst = _old(tmp_path)
    real = atomic._remove

    def remove(p):
        if p.name.endswith(".old") and p.exists():
            raise KeyboardInterrupt
        real(p)

    monkeypatch.setattr(atomic, "_remove", remove)
    with pytest.raises(KeyboardInterrupt):
        _write(dst)
    assert (dst / "weights").read_text() == "new" and completed(dst)
    assert _beside(tmp_path) == [f".model{PARTIAL}{os.getpid()}.old"]
    monkeypatch.undo()
    _write(dst, "next")
    assert (dst / "weights").read_text() == "next" and _beside(tmp_path) == []


def test_the_old_names_orphans_are_swept_too(tmp_path):
    """An orphan of the old naming (`.NAME.old.attnlab-partial-PID` of a process gone) is
    removed by the next write to NAME."""
    dst = _old(tmp_path)
    orphan = tmp_path / f".model.old{PARTIAL}999999999"
    orphan.mkdir()
    (orphan / "weights").write_text("old")
    _write(dst)
    assert _beside(tmp_path) == []
