"""`attnlab lab summary`: every claim with one column per corpus (src/attnlab/lab/summary.py),
and docs/lab.md quoting exactly what the committed results say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from attnlab.cli import main as cli
from attnlab.lab import summary
from helpers import ROOT
from helpers.lab import two_corpus_lab


def _results(folder: Path, rope: list[float], alibi: list[float]) -> None:
    folder.mkdir(parents=True)
    rows = [{"variant": v, "seed": s + 1, "metrics": {"val_loss": x}}
            for v, xs in (("rope", rope), ("alibi", alibi)) for s, x in enumerate(xs)]  # fmt: skip
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_one_column_per_corpus_and_whether_they_agree(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(two_corpus_lab(), sort_keys=False))
    _results(tmp_path / "tiny", [1.5, 1.52, 1.49], [1.6, 1.63, 1.61])  # rope lower: pass
    text = summary.table(tmp_path, [str(path)])
    head, _, row, *_ = text.splitlines()
    assert head == "| experiment (seeds) | claim | tinyshakespeare |" and "not run" not in text
    assert row.startswith("| `tiny` (tinyshakespeare 3) | **c** (control) | -0.1") and "**pass**" in row  # fmt: skip
    assert "- tinyshakespeare: 1 claims: 1 pass, 0 fail, 0 inconclusive, 0 no verdict." in text
    # the second corpus: rope higher there, the claim fails, and the row says they differ
    _results(tmp_path / "tiny-wikitext-2", [4.0, 4.1, 4.05], [3.9, 3.95, 3.97])
    text = summary.table(tmp_path, [str(path)])
    head, _, row, *_ = text.splitlines()
    assert head == "| experiment (seeds) | claim | tinyshakespeare | wikitext-2 | on both corpora |"
    assert "(tinyshakespeare 3, wikitext-2 3)" in row
    assert row.count("**pass**") == 1 and row.count("**fail**") == 1 and row.endswith("| **differs** |")  # fmt: skip


def test_write_replaces_only_the_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{summary.BEGIN}\nold\n{summary.END}\noutro\n")
    summary.write_into(page, "| new |\n")
    assert page.read_text() == f"intro\n{summary.BEGIN}\n\n| new |\n\n{summary.END}\noutro\n"
    page.write_text("no block\n")
    with pytest.raises(ValueError, match="has no summary block"):
        summary.write_into(page, "x")


def test_docs_lab_md_quotes_the_committed_results(capsys):
    """docs/lab.md's summary is what `attnlab lab summary docs/lab` computes from the committed
    results: rewrite it with `attnlab lab summary docs/lab --write docs/lab.md`."""
    page = (ROOT / "docs" / "lab.md").read_text()
    assert summary.BEGIN in page and summary.END in page
    block = page.split(summary.BEGIN, 1)[1].split(summary.END, 1)[0].strip()
    assert block == summary.table(ROOT / "docs" / "lab").strip()
    assert cli(["lab", "summary", str(ROOT / "docs" / "lab")]) == 0
    assert capsys.readouterr().out.strip() == block
