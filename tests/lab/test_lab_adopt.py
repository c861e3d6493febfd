"""`attnlab lab run NAME --from DIR`: the finished runs of another lab folder (the committed
docs/lab/NAME) count as done when their recipe hash matches (src/attnlab/lab/runner.py adopt)."""

from __future__ import annotations

import json

import pytest
import yaml

import attnlab.train.run as R
from attnlab.lab.runner import recipe_hash, run_lab
from helpers.lab import tiny_lab

# every test in a fresh HOME (tests/lab/conftest.py)
pytestmark = pytest.mark.usefixtures("own_cache")


def test_only_new_seeds_train_and_other_recipes_are_not_adopted(data_dir, tmp_path, monkeypatch):
    data = data_dir
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_lab(), sort_keys=False))
    first = tmp_path / "first"
    run_lab(path, out=first, data_dir=data, log=lambda *a: None)
    committed = tmp_path / "committed"  # what docs/lab keeps: results.jsonl, no checkpoints
    committed.mkdir()
    (committed / "results.jsonl").write_text((first / "results.jsonl").read_text())
    rows = [json.loads(x) for x in (committed / "results.jsonl").read_text().splitlines()]
    assert all(len(r["recipe_sha256"]) == 64 and "recipe" not in r for r in rows)
    trained, real, said = [], R.train, []
    monkeypatch.setattr(R, "train", lambda recipe, *a, **k: trained.append(recipe.seed) or real(recipe, *a, **k))  # fmt: skip
    out = tmp_path / "more"
    run_lab(path, out=out, data_dir=data, seeds=[1, 2, 3], source=committed, log=said.append)
    assert sorted(trained) == [3, 3] and "adopted 4 finished run(s) from" in said[0]
    got = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["variant"], r["seed"]) for r in got) == sorted((v, s) for v in ("rope", "alibi") for s in (1, 2, 3))  # fmt: skip
    same = {(r["variant"], r["seed"]): r["metrics"]["val_loss"] for r in rows}
    assert all(r["metrics"]["val_loss"] == same[(r["variant"], r["seed"])] for r in got if r["seed"] < 3)  # fmt: skip
    # another recipe (5 steps) adopts nothing and says why
    path.write_text(yaml.safe_dump(tiny_lab(overrides={**tiny_lab()["overrides"], "steps": 5}), sort_keys=False))  # fmt: skip
    said.clear()
    trained.clear()
    run_lab(path, out=tmp_path / "other", data_dir=data, source=committed, log=said.append)
    assert said[0].startswith("adopted 0") and "another recipe" in said[1] and len(trained) == 4
    assert recipe_hash({"a": 1, "b": 2}) == recipe_hash({"b": 2, "a": 1})
