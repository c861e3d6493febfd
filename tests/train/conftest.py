"""The tiny data sets of the training tests (the real layouts, learnable in a few dozen steps)
and a HOME of each test's own."""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import pytest

WORDS = ["ein", "mann", "eine", "frau", "hund", "katze", "spielt", "läuft", "im", "park"]
WORDS += ["auf", "der", "straße", "rot", "blau"]


def write_gz(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Tiny stand-ins with the real layout: a copy task as 'translation' (learnable in a few
    dozen steps), a text for the char LM, and SST-2-style '<label> <text>' lines."""
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    for split, n in (("train", 300), ("val", 20), ("test_2016_flickr", 20)):
        lines = [" ".join(rng.choices(WORDS, k=rng.randint(2, 5))) for _ in range(n)]
        write_gz(root / "multi30k" / f"{split}.de.gz", lines)
        write_gz(root / "multi30k" / f"{split}.en.gz", lines)
    write_gz(
        root / "tinyshakespeare" / "input.txt.gz", ["ROMEO:\nFirst Citizen: speak, speak.\n"] * 300
    )
    for split, n in (("train", 200), ("dev", 30), ("test", 30)):
        lines = []
        for _ in range(n):
            y = rng.randint(0, 1)
            words = rng.choices(["good", "great", "fine"] if y else ["bad", "awful", "poor"], k=3)
            lines.append(f"{y} the film is {' '.join(words)} .")
        write_gz(root / "sentence-classification" / f"stsa.binary.{split}.gz", lines)
    return root


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A HOME of the test's own (test_train.py and test_train_faults.py use it in every test)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # tokenizer cache stays in the test
