"""The lab's quality gate against seed spread, its second corpora (`lab run NAME --corpus C`) and
the BPE language model they train (src/attnlab/lab/report.py, runner.py, spec.py;
src/attnlab/train/tasks/lm.py)."""

from __future__ import annotations

import gzip
import json

import pytest
import yaml

from attnlab.cli import main as cli
from attnlab.lab import spec
from attnlab.lab.report import gate_failures, gate_notes, judge
from attnlab.lab.runner import default_out, plan, run_lab
from helpers.lab import WIKI, two_corpus_lab

# every test in a fresh HOME (tests/lab/conftest.py)
pytestmark = pytest.mark.usefixtures("own_cache")


def _rec(variant, seed, loss):
    return {"variant": variant, "seed": seed, "metrics": {"val_loss": loss}}


# --- the gate and the seed spread ---------------------------------------------------------------


def test_a_gate_missed_by_less_than_the_seed_spread_passes():
    lab = spec.from_dict(two_corpus_lab())
    # rope misses 2.0 by 0.01 on seed 2; its two seeds differ by 0.03 (sd 0.0212)
    recs = [_rec("rope", 1, 1.98), _rec("rope", 2, 2.01), _rec("alibi", 1, 1.9), _rec("alibi", 2, 1.95)]  # fmt: skip
    assert gate_failures(lab, recs, {"rope", "alibi"}, False) == []
    assert gate_notes(lab, recs, False) == ["rope s2 (2.010)"]
    (r,) = judge(lab, recs)
    assert r.verdict.status != "no verdict"
    # a miss larger than the spread is a failure, named with the spread it was judged by
    recs[1] = _rec("rope", 2, 2.10)  # sd of (1.98, 2.10) = 0.0849: 2.10 > 2.0849
    (fail,) = gate_failures(lab, recs, {"rope"}, False)
    assert fail == "rope s2 val_loss 2.100 > 2.0 + seed spread 0.085"
    # one seed: no spread, the maximum is strict
    assert gate_failures(lab, [_rec("rope", 1, 2.001)], {"rope"}, False) == ["rope s1 val_loss 2.001 > 2.0"]  # fmt: skip


def test_a_diverged_seed_is_not_rescued_by_the_spread_it_causes():
    lab = spec.from_dict(two_corpus_lab(seeds=[1, 2, 3, 4, 5]))
    recs = [_rec("rope", s, 1.7) for s in range(1, 5)] + [_rec("rope", 5, 3.5)]
    # sd of four 1.7s and a 3.5 is 0.805: 3.5 > 2.805
    assert [f.split(" val_loss")[0] for f in gate_failures(lab, recs, {"rope"}, False)] == ["rope s5"]  # fmt: skip
    nan = [_rec("rope", 1, 1.7), _rec("rope", 2, float("nan"))]
    assert gate_failures(lab, nan, {"rope"}, False) == ["rope s2 val_loss nan > 2.0"]


# --- corpora ------------------------------------------------------------------------------------


def test_a_corpus_changes_the_data_the_gate_and_the_folder(tmp_path):
    lab = spec.from_dict(two_corpus_lab())
    runs = plan(lab, tmp_path, corpus="wikitext-2")
    assert all(r.recipe["data"]["dataset"] == "wikitext-2" and r.recipe["data"]["tokenizer"] == "bpe" for r in runs)  # fmt: skip
    assert all(r.recipe["data"]["dataset"] == "tinyshakespeare" for r in plan(lab, tmp_path))
    assert lab.gate_max() == 2.0 and lab.gate_max(corpus="wikitext-2") == 9.0
    assert str(default_out(lab, False, "wikitext-2")).endswith("labs/tiny-wikitext-2")
    assert str(default_out(lab, True, "wikitext-2")).endswith("labs/tiny-wikitext-2-quick")
    # the corpus gate decides: 3.0 fails the recipe's 2.0 but not wikitext's 9.0
    recs = [_rec(v, s, 3.0 + 0.1 * s) for v in ("rope", "alibi") for s in (1, 2)]
    assert judge(lab, recs)[0].verdict.status == "no verdict"
    assert judge(lab, recs, corpus="wikitext-2")[0].verdict.status != "no verdict"
    with pytest.raises(ValueError, match=r"no corpus 'wikitext2'.*Did you mean 'wikitext-2'"):
        run_lab(_write(tmp_path, two_corpus_lab()), corpus="wikitext2", out=tmp_path / "o")


def _write(tmp_path, data) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def data_dir(data_dir):
    """tests/lab/conftest.py's stand-in tinyshakespeare, and WikiText-2's valid and test files beside it."""
    (data_dir / "wikitext-2").mkdir()
    for split, n in (("valid", 300), ("test", 300)):
        wiki = "".join(f" = Section {i} = \n The river @-@ bank {i % 11} was <unk> in 19{i % 90} . \n" for i in range(n))  # fmt: skip
        (data_dir / "wikitext-2" / f"{split}.txt.gz").write_bytes(gzip.compress(wiki.encode()))  # fmt: skip
    return data_dir


def test_a_corpus_run_trains_bpe_and_says_so(data_dir, tmp_path):
    from attnlab.data import char_corpus
    from attnlab.lab.evals import RunContext
    from attnlab.train import checkpoint as ckpt
    from attnlab.train.run import load_tokenizer

    out = tmp_path / "out"
    run_lab(_write(tmp_path, two_corpus_lab()), out=out, data_dir=data_dir, corpus="wikitext-2", log=lambda *a: None)  # fmt: skip
    records = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["errors"] == {} for r in records)
    rec = records[0]
    assert rec["threads"] >= 1 and rec["cpu"] and rec["device"] == "cpu" and "load_before" in rec
    report = (out / "report.md").read_text()
    assert "Corpus: **wikitext-2** — BPE" in report and "val_loss ≤ 9.0" in report
    assert "--corpus wikitext-2" in report
    assert yaml.safe_load((out / "lab.yaml").read_text())["corpus"] == "wikitext-2"
    # the rewritten report keeps the corpus (read from lab.yaml)
    assert cli(["lab", "report", str(out)]) == 0
    assert "Corpus: **wikitext-2**" in (out / "report.md").read_text()
    # the model reads BPE ids: the validation split is the tokenizer's encoding of it
    folder = ckpt.best_or_last(out / "rope-s1")
    tok = load_tokenizer(folder)
    assert 256 < tok.get_vocab_size() <= 300
    model, cfg = ckpt.load(folder)
    from attnlab.train.recipes import Recipe

    recipe = Recipe.from_dict(json.loads((out / "rope-s1" / "lab.json").read_text())["recipe"])
    ctx = RunContext(recipe, cfg, model, out / "rope-s1", 64, tok, data_dir)
    _, held_out = char_corpus("wikitext-2", data_dir)
    assert ctx.val_ids().tolist() == tok.encode(held_out, add_special_tokens=False).ids
    assert tok.decode(ctx.val_ids().tolist()).strip() == held_out.strip()


def test_wikitext_is_valid_then_test_split_90_10(data_dir):
    from attnlab.data import char_corpus

    train, held_out = char_corpus("wikitext-2", data_dir)
    whole = "".join(gzip.decompress((data_dir / "wikitext-2" / f"{s}.txt.gz").read_bytes()).decode() for s in ("valid", "test"))  # fmt: skip
    assert train + held_out == whole and len(train) == int(len(whole) * 0.9)


@pytest.mark.parametrize("name", [n for n in spec.names() if spec.load(n).corpora])
def test_every_corpus_of_every_experiment_runs_quick(name, data_dir, tmp_path):
    lab = spec.load(name)
    for corpus in lab.corpora:
        out = tmp_path / corpus
        argv = ["lab", "run", name, "--quick", "--corpus", corpus, "--out", str(out), "--data-dir", str(data_dir)]  # fmt: skip
        assert cli(argv) == 0
        records = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
        assert {r["variant"] for r in records} == set(lab.variants)
        assert all(r["errors"] == {} for r in records), [r["errors"] for r in records]
        assert f"Corpus: **{corpus}**" in (out / "report.md").read_text()


def test_a_corpus_scale_converts_margins_and_effects_of_loss_claims_only():
    claims = [
        {"id": "c", "text": "t", "literature": "l", "citation": "x", "a": "rope.val_loss",
         "b": "alibi.val_loss", "expect": "lower", "control": True, "effect": 0.02},
        {"id": "e", "text": "t", "literature": "l", "citation": "x", "a": "rope.val_loss",
         "b": "alibi.val_loss", "expect": "equal", "margin": 0.03},
        {"id": "r", "text": "t", "literature": "l", "citation": "x", "a": "rope.val_loss",
         "b": "alibi.val_loss", "expect": "lower", "log": True, "margin": 0.1, "effect": 0.2},
    ]  # fmt: skip
    corpora = {"wikitext-2": {"overrides": WIKI, "gate": 9.0, "scale": 2.5}}
    lab = spec.from_dict(two_corpus_lab(claims=claims, corpora=corpora))
    # rope - alibi = 0.05 on both seeds: inside 0.03 x 2.5 = 0.075, outside 0.03
    recs = [_rec("rope", 1, 3.05), _rec("rope", 2, 3.15), _rec("alibi", 1, 3.0), _rec("alibi", 2, 3.1)]  # fmt: skip
    scaled = {r.claim.id: r for r in judge(lab, recs, corpus="wikitext-2")}
    assert scaled["c"].claim.effect == pytest.approx(0.05)
    assert scaled["e"].claim.margin == pytest.approx(0.075)
    assert scaled["r"].claim.margin == 0.1 and scaled["r"].claim.effect == 0.2  # ratios keep theirs
    lab2 = spec.from_dict(two_corpus_lab(claims=claims, corpora=corpora, gate={"metric": "val_loss", "max": 9.0}))  # fmt: skip
    plain = {r.claim.id: r for r in judge(lab2, recs)}
    assert plain["e"].claim.margin == 0.03 and plain["e"].verdict.status == "fail"


def test_the_power_note_of_a_one_seed_claim_says_what_is_missing():
    from attnlab.lab.report import power_note

    lab = spec.from_dict(two_corpus_lab(seeds=[1]))
    recs = [{"variant": v, "seed": 1, "metrics": {"val_loss": x, "val_loss_se": 0.05}} for v, x in (("rope", 1.50), ("alibi", 1.52))]  # fmt: skip
    (r,) = judge(lab, recs)
    note = power_note(r)
    assert r.verdict.status == "inconclusive"
    assert note.startswith("power ") and "for the measured effect 0.02 (within-run error only); needs >= 2 paired seeds" in note  # fmt: skip
