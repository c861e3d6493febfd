"""The CPU kernels' build is keyed by what it is made of, not where (src/attnlab/nn/matvec.py):
a second checkout of the same sources (another clone, CI's, a second venv) loads the build the
first made instead of rebuilding it, and the first still loads it after."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.nn import matvec

SRC = Path(matvec.__file__).resolve().parents[2]  # .../src
LOAD = "from attnlab.nn import matvec; import sys; sys.exit(0 if matvec.extension() else 3)"


def _load(src: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LOAD],
        env={**os.environ, "PYTHONPATH": str(src)},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_second_checkout_loads_the_same_build_without_rebuilding(tmp_path):
    if not matvec.ready():
        pytest.skip("the native kernels are off or cannot be built here")
    copy = tmp_path / "elsewhere" / "src"
    shutil.copytree(SRC / "attnlab", copy / "attnlab")
    there = _load(copy)
    assert there.returncode == 0, there.stderr
    assert "building attnlab's CPU kernels" not in there.stderr, there.stderr
    here = _load(SRC)  # and the first checkout's build is still the one on disk
    assert here.returncode == 0 and "building" not in here.stderr, here.stderr


NAME = "from attnlab.nn import matvec; print(matvec._build_name())"


def _name(src: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-c", NAME],
        env={**os.environ, "PYTHONPATH": str(src)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


def test_checkouts_whose_sources_differ_build_in_folders_of_their_own(tmp_path):
    """Two clones on different commits, used alternately, each build once in total: their builds
    live in different folders (one lock each), so neither rebuilds, invalidates or waits on the
    other's. The same sources elsewhere share the one folder (the test above loads it)."""
    same, changed = tmp_path / "same" / "src", tmp_path / "changed" / "src"
    for copy in (same, changed):
        shutil.copytree(SRC / "attnlab", copy / "attnlab")
    kernel = changed / "attnlab" / "nn" / "csrc" / "matvec.cpp"
    kernel.write_text(kernel.read_text() + "\n// another commit\n")
    here, there, other = _name(SRC), _name(same), _name(changed)
    assert here == there, (here, there)
    assert here != other and here.rsplit("_", 1)[0] == other.rsplit("_", 1)[0], (here, other)
    assert here == matvec._build_name()
