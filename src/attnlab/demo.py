"""`attnlab demo`: the quickest end-to-end run — train a small character-level language model with
any preset's architecture on tinyshakespeare (located as DESIGN.md says, never downloaded into the
repository), report train/validation loss as it learns, then generate text with the KV cache.

It is a smoke test of the whole stack on real data (config -> build -> train -> cached decoding),
not a recipe: the recipes with measured targets live in configs/ (`attnlab train`).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from . import presets
from .build import build_model, count_parameters
from .data import read_text
from .generate import generate


def run(
    preset: str = "llama2-7b",
    steps: int = 600,
    d_model: int = 128,
    n_layers: int = 4,
    context: int = 64,
    batch_size: int = 32,
    lr: float = 2e-3,
    seed: int = 0,
    data_dir: str | None = None,
) -> dict:
    torch.manual_seed(seed)
    text = read_text("tinyshakespeare", "input.txt.gz", data_dir)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))  # the usual split: first 90 % train, last 10 % validation
    train, val = data[:split], data[split:]
    cfg = presets.tiny(
        presets.get(preset), d_model=d_model, n_layers=n_layers, vocab_size=len(chars)
    )
    if cfg.arch != "decoder":
        raise ValueError(
            f"the demo trains a language model: pick a decoder-only preset, not {preset!r} ({cfg.arch})"
        )
    cfg = cfg.replace(dropout=0.0)
    model = build_model(cfg)
    print(
        f"{preset} architecture at d_model {d_model}, {n_layers} layers: {count_parameters(cfg):,} parameters"
    )
    print(f"  {presets.describe(cfg)}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)

    def batch(split_data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(split_data) - context - 1, (batch_size,), generator=gen)
        x = torch.stack([split_data[i : i + context] for i in ix])
        y = torch.stack([split_data[i + 1 : i + context + 1] for i in ix])
        return x, y

    @torch.no_grad()
    def evaluate(split_data: torch.Tensor, n: int = 20) -> float:
        model.eval()
        losses = [
            F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item()
            for x, y in map(batch, [split_data] * n)
        ]
        model.train()
        return sum(losses) / n

    start = time.perf_counter()
    history = []
    for step in range(1, steps + 1):
        for group in opt.param_groups:  # linear warm-up then cosine decay to 10 %
            warm = min(1.0, step / 50)
            group["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        x, y = batch(train)
        out = model(x)
        loss = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
        if out.aux_loss is not None:
            loss = loss + out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps:
            tr, va = evaluate(train), evaluate(val)
            history.append({"step": step, "train_loss": tr, "val_loss": va})
            print(
                f"  step {step:5d}  train loss {tr:.3f}  val loss {va:.3f}  ({time.perf_counter() - start:.0f} s)"
            )
    prompt = torch.tensor([[stoi[c] for c in "ROMEO:\n"]])
    out = generate(
        model, prompt, max_new_tokens=200, strategy="sample", temperature=0.8, top_k=20, seed=seed
    )
    sample = "".join(chars[i] for i in out[0].tolist())
    print("\n--- sample (KV-cached, temperature 0.8, top-k 20) ---\n" + sample)
    return {"history": history, "sample": sample}
