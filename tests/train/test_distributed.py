"""Multi-process training: `torchrun --nproc_per_node 2 -m attnlab train [--fsdp]` (gloo on
CPU; DistributedDataParallel, or FSDP2 `fully_shard`) gives the loss curve of one process that sees the same global batch.

The reference is the single-process run of the same recipe: LMBatcher gives rank r of W the
rows [r*B/W, (r+1)*B/W) of the batch a single process draws, and the trainer normalises by the
label count summed over ranks, so the two runs make the same updates up to float rounding."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnlab.train.run as run_mod
from attnlab.cli import main as cli

SETS = [
    "model.overrides.d_model=32", "model.overrides.n_layers=1", "model.overrides.n_heads=2",
    "data.context=16", "batch.size=8", "steps=12", "log_every=1", "eval.every=12",
    "eval.batches=2", "eval.samples=[]", "optimizer.lr=1e-2", "schedule.warmup=2",
]  # fmt: skip


def args(run: Path, data: Path) -> list[str]:
    sets = [x for s in SETS for x in ("--set", s)]
    return ["train", "shakespeare-char", "--run-dir", str(run), "--data-dir", str(data),
            "--device", "cpu", *sets]  # fmt: skip


def train_records(run: Path) -> list[dict]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["split"] == "train"]


@pytest.fixture
def data_dir(tmp_path):
    root = tmp_path / "data"
    (root / "tinyshakespeare").mkdir(parents=True)
    text = "ROMEO:\nFirst Citizen: speak, speak.\nJULIET: what light through yonder window.\n"
    (root / "tinyshakespeare" / "input.txt.gz").write_bytes(gzip.compress((text * 200).encode()))
    return root


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_two_gloo_ranks_match_one_process_with_the_same_global_batch(
    engine, data_dir, tmp_path, monkeypatch
):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(tmp_path / "home-ddp")}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    ddp = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "attnlab", *args(ddp, data_dir)] + (["--fsdp"] if engine == "fsdp" else [])  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    monkeypatch.setenv("HOME", str(tmp_path / "home-single"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    single = tmp_path / "single"
    assert cli(args(single, data_dir)) == 0

    a, b = train_records(ddp), train_records(single)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 13))
    assert b[-1]["loss"] < b[0]["loss"] - 0.5  # it learns: the curve has something to match
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4, abs=1e-6)
        assert x["tokens"] == y["tokens"]  # tokens summed over the ranks
    # rank 0 alone wrote the run: one line per step, a checkpoint and the final results
    assert (ddp / "last").is_dir() and (ddp / "results.json").exists()
    assert run_mod.ckpt.verify(ddp / "last")["step"] == 12
    # the checkpoint holds the full weights (gathered from the shards under FSDP). Adam moves a
    # weight by about lr = 1e-2 a step whatever the gradient's size, so float rounding in tiny
    # gradients shows up as ~1e-5: atol 1e-4 is 1% of one step
    got, _ = run_mod.ckpt.load(ddp / "last")
    want, _ = run_mod.ckpt.load(single / "last")
    for (name, x), (_, y) in zip(got.state_dict().items(), want.state_dict().items(), strict=True):
        assert torch.allclose(x, y, rtol=0, atol=1e-4), (name, float((x - y).abs().max()))


WORKER = """
import sys, torch, torch.distributed as dist
import attnlab as al
from attnlab.train.loop import Trainer, TrainingDiverged
from attnlab.train.schedules import constant, lambda_lr

dist.init_process_group("gloo")
rank = dist.get_rank()
cfg = al.presets.tiny(al.presets.get("gpt2-small"), d_model=32, vocab_size=32)
torch.manual_seed(0)
model = al.build_model(cfg)

class Poisoned(torch.nn.Module):  # rank 1's loss turns NaN at its 3rd forward
    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0
    def forward(self, **kw):
        out = self.inner(**kw)
        self.calls += 1
        if rank == 1 and self.calls == 3:
            out.logits = out.logits * float("nan")
        return out

ddp = torch.nn.parallel.DistributedDataParallel(Poisoned(model))
g = torch.Generator().manual_seed(rank)
def batches():
    while True:
        ids = torch.randint(0, 32, (2, 9), generator=g)
        yield {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
trainer = Trainer(ddp, opt, lambda_lr(opt, constant(0)), batches(), sys.argv[1] + f"/r{rank}",
                  10, progress=False, log_every=1)
try:
    trainer.fit()
except TrainingDiverged as err:
    print(f"rank {rank}: {err}", flush=True)
    sys.exit(3)
"""


def test_nan_on_one_rank_stops_every_rank_without_hanging(tmp_path):
    """A NaN loss on one rank only: both ranks stop at the same update with TrainingDiverged
    (before, the NaN rank stopped alone and the other waited forever in the all-reduce)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank}: the loss is nan at step 3: training stopped" in out, out[-3000:]
