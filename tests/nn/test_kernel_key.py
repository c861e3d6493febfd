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
