"""Does Transformer-XL's memory see further back? A small XL model trained with segment-level
recurrence on tinyshakespeare characters, then scored on the whole validation split at the same
segment length with its memory and without (Dai et al. 2019, arXiv:1901.02860, section 3.2).

Training, as the paper's: the training text is cut into `--batch` contiguous streams; step t
feeds every stream's t-th segment of `--segment` characters, with the memory cache carrying the
last `--mem` positions of each stream from step to step (detached: no gradient crosses a
segment), a fresh memory when the streams wrap around. The model is the preset
transformer-xl-enwik8-12l's architecture (post-norm, relative positions, shared u and v) at a
small size, built and run through attnlab (al.build_model, model.new_cache(kind "memory")).

Evaluation: the validation text as one stream, non-overlapping segments of `--segment`, every
character after the first predicted exactly once; "no memory" runs each segment alone (each
character sees only the earlier characters of its own segment), "memory M" carries a memory of
M positions (the training length, and longer ones, as the paper evaluates with longer memory).
Losses are in nats per character (bits = nats / ln 2), also split by where a character sits in
its segment: the memory should help most at a segment's start, where the segment alone gives
least context. One torch thread throughout.

    python benchmarks/transformer_xl_memory.py --out benchmarks/results/transformer_xl_memory.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import torch
import torch.nn.functional as F

import attnlab as al
from attnlab import data as D


def model_config(vocab: int, a) -> al.ModelConfig:
    """The enwik8 preset's architecture at a small size."""
    return al.presets.get("transformer-xl-enwik8-12l").merged(
        vocab_size=vocab,
        d_model=a.d_model,
        n_layers=a.layers,
        n_heads=a.heads,
        head_dim=a.d_model // a.heads,
        d_ff=4 * a.d_model,
        dropout=a.dropout,
        attention={"mem_len": a.mem, "segment_len": None},  # one call per segment
    )


def streams(ids: torch.Tensor, n: int) -> torch.Tensor:
    """(n, L): the text cut into n contiguous streams (the tail that does not divide dropped)."""
    L = ids.numel() // n
    return ids[: n * L].view(n, L)


def train(model, ids: torch.Tensor, a) -> dict:
    data = streams(ids, a.batch)  # (B, L)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    model.train()
    cache, t, step, curve, start = None, 0, 0, [], time.perf_counter()
    budget = 60 * a.minutes
    while time.perf_counter() - start < budget:
        if cache is None or t + a.segment + 1 > data.shape[1]:  # the streams wrap: new memory
            cache, t = model.new_cache(a.batch, data.shape[1]), 0
        x, y = data[:, t : t + a.segment], data[:, t + 1 : t + a.segment + 1]
        # linear warm-up, then cosine to a tenth over the time budget (the clock, not steps)
        done = min(1.0, (time.perf_counter() - start) / budget)
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))
        for group in opt.param_groups:
            group["lr"] = lr
        logits = model(x, cache=cache).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)  # the original code's clip
        opt.step()
        t, step = t + a.segment, step + 1
        if step % 50 == 0:
            seconds = round(time.perf_counter() - start, 1)
            curve.append({"step": step, "loss": round(loss.item(), 4), "seconds": seconds})
    seconds = round(time.perf_counter() - start, 1)
    return {"steps": step, "seconds": seconds, "tokens": step * a.batch * a.segment, "curve": curve}


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, segment: int, mem: int | None, buckets: int) -> dict:
    """Mean loss over every character of ids after the first, one stream, segments of
    `segment`; mem None: no memory (each segment alone)."""
    model.eval()
    x, y = ids[None, :-1], ids[None, 1:]
    cache = None if mem is None else model.new_cache(1, x.shape[1], mem_len=mem)
    total, count = 0.0, 0
    by_place = torch.zeros(buckets, dtype=torch.float64)
    n_place = torch.zeros(buckets, dtype=torch.float64)
    start = time.perf_counter()
    for s in range(0, x.shape[1], segment):
        logits = model(x[:, s : s + segment], cache=cache).logits[0]  # (t, V)
        nll = F.cross_entropy(logits, y[0, s : s + segment], reduction="none").double()
        total, count = total + nll.sum().item(), count + nll.numel()
        place = torch.arange(nll.numel()) * buckets // segment  # which part of the segment
        by_place.index_add_(0, place, nll)
        n_place.index_add_(0, place, torch.ones_like(nll))
    loss = total / count
    return {
        "memory": mem or 0,
        "val_loss": round(loss, 4),
        "bits_per_char": round(loss / math.log(2), 4),
        "characters": count,
        "loss_by_place": [round(v, 4) for v in (by_place / n_place).tolist()],
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0, help="training time budget")
    p.add_argument("--segment", type=int, default=64)
    p.add_argument("--mem", type=int, default=64, help="memory length in training")
    p.add_argument("--eval-mems", default="64,128,256", help="memory lengths to score with")
    p.add_argument("--batch", type=int, default=8, help="parallel contiguous streams")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--buckets", type=int, default=4, help="parts of a segment for loss_by_place")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results (JSON) here")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    train_text, val_text = D.char_corpus("tinyshakespeare")
    chars = sorted(set(train_text + val_text))  # nanoGPT's vocabulary: every character
    index = {c: i for i, c in enumerate(chars)}
    train_ids = torch.tensor([index[c] for c in train_text])
    val_ids = torch.tensor([index[c] for c in val_text])
    cfg = model_config(len(chars), a)
    model = al.build_model(cfg)
    print(f"{al.count_parameters(cfg):,} parameters; {al.presets.describe(cfg)}")
    trained = train(model, train_ids, a)
    print(f"trained {trained['steps']} steps in {trained['seconds']} s")
    results = [evaluate(model, val_ids, a.segment, None, a.buckets)]
    for mem in (int(m) for m in a.eval_mems.split(",")):
        results.append(evaluate(model, val_ids, a.segment, mem, a.buckets))
    for r in results:
        print(f"memory {r['memory']:>4}: val loss {r['val_loss']:.4f} nats/char "
              f"({r['bits_per_char']:.4f} bpc), by place {r['loss_by_place']}")  # fmt: skip
    flags = (f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out")
    command = "python benchmarks/transformer_xl_memory.py " + " ".join(flags)
    machine = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    machine |= {"python": platform.python_version(), "cpus": os.cpu_count()}
    out = {
        "what": "tinyshakespeare characters: validation loss with and without the memory",
        "command": command,
        "model": {"parameters": al.count_parameters(cfg), "config": cfg.to_dict()},
        "train": {"segment": a.segment, "mem_len": a.mem, "batch": a.batch, **trained},
        "eval": results,
        "machine": machine,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
