"""The lab tests' stand-in corpus and a fresh HOME (test_lab.py, test_lab_adopt.py,
test_lab_corpus.py and test_lab_timing.py use it in every test)."""

from __future__ import annotations

import gzip

import pytest


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A stand-in tinyshakespeare (the real layout, 12k characters)."""
    root = tmp_path_factory.mktemp("data")
    text = "".join(f"ROMEO:\nFirst Citizen {i % 7}: speak, speak.\n" for i in range(400))
    (root / "tinyshakespeare").mkdir()
    (root / "tinyshakespeare" / "input.txt.gz").write_bytes(gzip.compress(text.encode()))
    return root


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A fresh HOME (tokenizer and data caches), but the built CPU kernels of the real one:
    rebuilding them would take minutes (src/attnlab/nn/matvec.py)."""
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", get_default_build_root())  # before HOME changes
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
