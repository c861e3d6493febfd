"""Training throughput: attnlab against transformers' GPT-2 and x-transformers, one shape.

    python benchmarks/train.py --out benchmarks/results/train.json          # CPU, fp32
    python benchmarks/train.py --compile ...   # also attnlab and transformers under torch.compile
    python benchmarks/train.py --device cuda --out benchmarks/results/train-cuda.json  # bf16 autocast

One GPT-2-style decoder in every library: 6 layers, d_model 384, 6 heads (head dim 64), d_ff 1536,
vocab 8192, context 256, batch 8; learned positions, pre-norm LayerNorm, GELU-tanh, tied
embeddings, dropout 0. A training step is forward + cross-entropy + backward + AdamW step on
fixed, pre-generated random batches (no data loading is timed), with the same AdamW (fused where
torch has it) and the same torch thread count for every library. Warm-up steps are excluded and
the libraries' timing windows are interleaved round-robin (the order rotates every round), so
background load on a shared machine hits them alike; each library's figure is the median over
its windows. The machine's matmul peak (a large square matmul in the training dtype) is measured
in the same rounds, with the same threads.

Threads default to 1: on a shared machine a multi-threaded step stalls at OpenMP barriers
whenever another process preempts one of its threads (2-thread windows swung 5x here, 1-thread
ones ~1.3x); pass --threads N on an idle machine.

Model FLOPs per token (Kaplan et al. 2020, section 2.1; PaLM, Chowdhery et al. 2022, appendix B):

    6·N + 12·L·d·T      N = non-embedding parameters + d·V (the tied output projection is a real
                        matmul each step; the input embedding lookup is not), L layers, d d_model,
                        T context; attention is counted unmasked, as PaLM does.

Model FLOP/s = tokens/s x FLOPs/token; "% of peak" divides it by the measured matmul FLOP/s.
Sanity: every library's loss at step 0 must be about ln(8192) = 9.01 (random init, random data),
and attnlab must reproduce transformers' logits from the same weights (attnlab.interop.from_hf).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D_MODEL, N_LAYERS, N_HEADS, CONTEXT, BATCH = 8192, 384, 6, 6, 256, 8
TARGETS = {"vs_transformers": 1.3, "vs_x_transformers": 1.0, "fraction_of_peak": 0.75}


@dataclass
class Lib:
    name: str
    model: nn.Module
    logits: Callable[[torch.Tensor], torch.Tensor]  # (B, T) ids -> (B, T, V) logits
    non_embedding: int  # parameters outside the token and position tables
    opt: torch.optim.Optimizer | None = None
    windows: list[float] = field(default_factory=list)  # tokens/s of each timed window
    loss0: float = float("nan")


def count(model: nn.Module, skip: tuple[nn.Parameter, ...]) -> int:
    ids = {id(p) for p in skip}
    return sum(p.numel() for p in model.parameters() if id(p) not in ids)


def build_attnlab() -> Lib:
    import attnlab as al
    from attnlab.config import AttentionConfig, DenseFFN, LayerNormConfig, LearnedPositions

    cfg = al.presets.get("gpt2-small").replace(
        vocab_size=VOCAB,
        d_model=D_MODEL,
        n_layers=N_LAYERS,
        n_heads=N_HEADS,
        positional=LearnedPositions(max_len=CONTEXT),
        attention=AttentionConfig(qkv_bias=True, o_bias=True, dropout=0.0),
        norm=LayerNormConfig(eps=1e-5),
        ffn=DenseFFN(activation="gelu-tanh"),
        dropout=0.0,
        tie_embeddings=True,
    )
    model = al.build_model(cfg)  # kernel "sdpa", the default
    skip = (model.embed_tokens.weight, model.decoder.positional.weight)
    return Lib("attnlab", model, lambda x: model(x).logits, count(model, skip))


def build_transformers(attn: str) -> Lib:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=CONTEXT,
        n_embd=D_MODEL,
        n_layer=N_LAYERS,
        n_head=N_HEADS,
        activation_function="gelu_new",  # GELU-tanh
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation=attn)
    skip = (model.transformer.wte.weight, model.transformer.wpe.weight)
    return Lib(
        f"transformers-{attn}",
        model,
        lambda x: model(input_ids=x, use_cache=False).logits,
        count(model, skip),
    )


def build_x_transformers() -> Lib:
    """Matching sizes and GELU-tanh; the library's own small differences from GPT-2 stay (no
    q/k/v/o biases, bias-free LayerNorm, position embedding scaled by d^-0.5): 14,208 fewer
    parameters than GPT-2's 13,891,584 (0.1 %)."""
    from x_transformers import Decoder, TransformerWrapper

    model = TransformerWrapper(
        num_tokens=VOCAB,
        max_seq_len=CONTEXT,
        tie_embedding=True,
        tie_embedding_scale=1.0,  # GPT-2's plain tied head (the default scales logits by d^-0.5)
        attn_layers=Decoder(
            dim=D_MODEL,
            depth=N_LAYERS,
            heads=N_HEADS,
            attn_dim_head=D_MODEL // N_HEADS,
            attn_flash=True,  # torch's scaled_dot_product_attention, as attnlab's sdpa kernel
            ff_mult=4,
            ff_custom_activation=nn.GELU(approximate="tanh"),
        ),
    )
    with torch.no_grad():  # GPT-2's N(0, 0.02) embedding (x-transformers defaults to Kaiming)
        nn.init.normal_(model.token_emb.emb.weight, std=0.02)
    skip = (model.token_emb.emb.weight, model.pos_emb.emb.weight)
    return Lib("x-transformers", model, model, count(model, skip))


def flops_per_token(lib: Lib) -> int:
    return 6 * (lib.non_embedding + D_MODEL * VOCAB) + 12 * N_LAYERS * D_MODEL * CONTEXT


class Runner:
    def __init__(self, device: torch.device, amp: bool) -> None:
        self.device, self.amp = device, amp

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def step(self, lib: Lib, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        lib.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.amp):
            logits = lib.logits(x)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        lib.opt.step()
        return loss.detach()

    def window(self, lib: Lib, batches, steps: int) -> float:
        """Tokens/s over `steps` training steps."""
        self.sync()
        t0 = time.perf_counter()
        for i in range(steps):
            x, y = batches[i % len(batches)]
            self.step(lib, x, y)
        self.sync()
        return steps * BATCH * CONTEXT / (time.perf_counter() - t0)

    def matmul(self, a: torch.Tensor, b: torch.Tensor, reps: int) -> float:
        """FLOP/s of `reps` square matmuls."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        self.sync()
        return reps * 2 * a.shape[0] ** 3 / (time.perf_counter() - t0)


def check_same_function(device: torch.device) -> float | None:
    """Max |logit difference| between a transformers GPT-2 and attnlab.interop.from_hf of it."""
    try:
        import attnlab as al

        hf = build_transformers("eager").model.to(device).eval()
        ours = al.interop.from_hf(hf).to(device).eval()
    except ImportError:
        return None
    x = torch.randint(0, VOCAB, (2, 64), device=device)
    with torch.no_grad():
        return (hf(input_ids=x, use_cache=False).logits - ours(x).logits).abs().max().item()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """The same optimizer for every library: torch's fused AdamW where this torch has it (CPU and
    CUDA since 2.4; on CPU it is ~3x faster than the per-tensor loop), else the default."""
    try:
        return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)


def build_all(args) -> tuple[list[Lib], dict[str, str]]:
    builders = {
        "attnlab": build_attnlab,
        "transformers-sdpa": lambda: build_transformers("sdpa"),
        "transformers-eager": lambda: build_transformers("eager"),
        "x-transformers": build_x_transformers,
    }
    libs, skipped = [], {}
    for name in args.libs:
        torch.manual_seed(0)
        base = name.removesuffix("+compile")
        try:
            lib = builders[base]()
        except ImportError as e:
            hint = (
                "pip install -e '.[bench]'"
                if name == "x-transformers"
                else "pip install -e '.[hf]'"
            )
            skipped[name] = f"not installed ({e}): {hint}"
            print(f"[skip] {name}: {skipped[name]}", file=sys.stderr)
            continue
        lib.model.to(args.device).train()
        lib.opt = adamw(lib.model)
        if base != name:  # torch.compile of the forward (inductor; the backward via AOTAutograd)
            lib.name, lib.logits = name, torch.compile(lib.logits)
        libs.append(lib)
    return libs, skipped


def run(args) -> dict:
    torch.set_num_threads(args.threads)  # one setting for every library
    device = torch.device(args.device)
    amp = device.type == "cuda" and torch.cuda.is_bf16_supported()
    load_before = os.getloadavg()
    libs, skipped = build_all(args)
    runner = Runner(device, amp)

    g = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(args.n_batches):
        ids = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=g).to(device)
        batches.append((ids[:, :-1], ids[:, 1:]))

    for lib in libs:  # warm-up, and the step-0 loss on the same first batch for everyone
        lib.loss0 = runner.step(lib, *batches[0]).item()
        for i in range(1, args.warmup):
            runner.step(lib, *batches[i % len(batches)])

    mm_dtype = torch.bfloat16 if amp else torch.float32
    n = args.matmul_n or (8192 if device.type == "cuda" else 2048)
    reps = args.matmul_reps or (50 if device.type == "cuda" else 5)
    a = torch.randn(n, n, device=device, dtype=mm_dtype)
    b = torch.randn(n, n, device=device, dtype=mm_dtype)
    runner.matmul(a, b, 2)  # warm-up
    peak_windows = []
    for r in range(args.rounds):
        order = libs[r % len(libs) :] + libs[: r % len(libs)] if libs else []
        for lib in order:
            lib.windows.append(runner.window(lib, batches, args.steps))
        peak_windows.append(runner.matmul(a, b, reps))
        print(
            f"round {r + 1}/{args.rounds}: "
            + "  ".join(f"{lib.name} {lib.windows[-1]:.0f}" for lib in libs)
            + f"  matmul {peak_windows[-1] / 1e9:.1f} GFLOP/s",
            file=sys.stderr,
        )
    peak = statistics.median(peak_windows)
    load_after = os.getloadavg()

    rows = {}
    for lib in libs:
        tps = statistics.median(lib.windows)
        fpt = flops_per_token(lib)
        rows[lib.name] = {
            "tokens_per_s": tps,
            "windows_tokens_per_s": lib.windows,
            "parameters": sum(p.numel() for p in lib.model.parameters()),
            "non_embedding_parameters": lib.non_embedding,
            "flops_per_token": fpt,
            "model_flops_per_s": tps * fpt,
            "fraction_of_peak": tps * fpt / peak,
            "loss_step0": lib.loss0,
        }
    for row in rows.values():
        for key, ref in (
            ("vs_transformers", "transformers-sdpa"),
            ("vs_x_transformers", "x-transformers"),
        ):
            row[key] = row["tokens_per_s"] / rows[ref]["tokens_per_s"] if ref in rows else None
            if ref in rows:  # the same ratio window by window (same round, same background load)
                pairs = zip(
                    row["windows_tokens_per_s"], rows[ref]["windows_tokens_per_s"], strict=True
                )
                row[key + "_paired_median"] = statistics.median(x / y for x, y in pairs)

    ours = rows.get("attnlab", {})
    targets = {
        k: {
            "target": v,
            "measured": ours.get(k),
            "met": None if ours.get(k) is None else ours[k] >= v,
        }
        for k, v in TARGETS.items()
    }
    return {
        "shape": {
            "n_layers": N_LAYERS,
            "d_model": D_MODEL,
            "n_heads": N_HEADS,
            "vocab": VOCAB,
            "context": CONTEXT,
            "batch": BATCH,
            "dtype": "bf16 autocast" if amp else "fp32",
        },
        "flops_formula": "6*(N_non_embedding + d_model*vocab) + 12*n_layers*d_model*context per token",
        "device": args.device,
        "threads": torch.get_num_threads(),
        "optimizer": "AdamW(lr 3e-4, wd 0.1, fused)"
        if libs and libs[0].opt.defaults.get("fused")
        else "AdamW(lr 3e-4, wd 0.1)",
        "steps_per_window": args.steps,
        "rounds": args.rounds,
        "warmup_steps": args.warmup,
        "matmul": {"n": n, "dtype": str(mm_dtype), "flops_per_s": peak, "windows": peak_windows},
        "load_average_before": load_before,
        "load_average_after": load_after,
        "same_function_max_logit_diff_vs_transformers": check_same_function(device),
        "results": rows,
        "skipped": skipped,
        "targets_attnlab": targets,
        "versions": versions(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "command": " ".join(["python", *sys.argv]),
    }


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("attnlab", "transformers", "x_transformers"):
        try:
            from importlib.metadata import version

            out[mod] = version(mod.replace("_", "-"))
        except Exception:
            out[mod] = "not installed"
    return out


def table(res: dict) -> str:
    def ratio(v):
        return "-" if v is None else f"{v:.2f}x"

    lines = [
        f"{'library':<26} {'params':>10} {'loss@0':>7} {'tokens/s':>9} "
        f"{'min..max':>11} {'vs transformers':>16} {'vs x-transformers':>18} {'% matmul peak':>14}"
    ]
    for name, r in res["results"].items():
        w = r["windows_tokens_per_s"]
        lines.append(
            f"{name:<26} {r['parameters']:>10,} {r['loss_step0']:>7.3f} {r['tokens_per_s']:>9.0f} "
            f"{min(w):>5.0f}..{max(w):<4.0f} {ratio(r['vs_transformers']):>16} {ratio(r['vs_x_transformers']):>18} "
            f"{100 * r['fraction_of_peak']:>13.1f}%"
        )
    for name, why in res["skipped"].items():
        lines.append(f"{name:<26} skipped: {why}")
    mm = res["matmul"]
    lb, la = res["load_average_before"], res["load_average_after"]
    lines += [
        f"matmul peak: {mm['flops_per_s'] / 1e9:.1f} GFLOP/s ({mm['n']}^3 {mm['dtype']}, median of "
        f"{len(mm['windows'])}); threads {res['threads']}; {res['shape']['dtype']} on {res['device']}",
        f"FLOPs/token = {res['flops_formula']}",
        f"ln(vocab) = {math.log(VOCAB):.3f}; attnlab vs transformers logits from the same weights: "
        f"max diff {res['same_function_max_logit_diff_vs_transformers']}",
        f"load average before {lb[0]:.2f} {lb[1]:.2f} {lb[2]:.2f}, after {la[0]:.2f} {la[1]:.2f} "
        f"{la[2]:.2f} (on a shared machine the figures are provisional)",
    ]
    ours = res["results"].get("attnlab", {})
    paired = [
        f"{ours[k + '_paired_median']:.2f}x vs {ref}"
        for k, ref in (("vs_transformers", "transformers"), ("vs_x_transformers", "x-transformers"))
        if k + "_paired_median" in ours
    ]
    if paired:
        lines.append("attnlab, median of same-round ratios: " + ", ".join(paired))
    for k, t in res["targets_attnlab"].items():
        m = "-" if t["measured"] is None else f"{t['measured']:.2f}"
        verdict = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        lines.append(f"target {k}: >= {t['target']}  measured {m}  {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/train.json"))
    p.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast where supported)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads, the same for every library (1: steady on a shared machine; "
        "set the core count on an idle one)",
    )
    p.add_argument("--rounds", type=int, default=7, help="timed windows per library")
    p.add_argument("--steps", type=int, default=0, help="steps per window; 0: 2 on CPU, 20 on CUDA")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps; 0: 2 on CPU, 10 on CUDA")
    p.add_argument("--n-batches", type=int, default=4, help="distinct pre-generated batches")
    p.add_argument("--matmul-n", type=int, default=0, help="0: 2048 on CPU, 8192 on CUDA")
    p.add_argument("--matmul-reps", type=int, default=0, help="0: 5 on CPU, 50 on CUDA")
    p.add_argument(
        "--libs",
        nargs="+",
        default=["attnlab", "transformers-sdpa", "transformers-eager", "x-transformers"],
        choices=["attnlab", "transformers-sdpa", "transformers-eager", "x-transformers"],
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time attnlab and transformers-sdpa under torch.compile (extra rows; the "
        "targets stay eager against eager)",
    )
    args = p.parse_args(argv)
    if args.compile:
        args.libs += [f"{n}+compile" for n in ("attnlab", "transformers-sdpa") if n in args.libs]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda given but torch.cuda.is_available() is False")
    cuda = args.device.startswith("cuda")
    args.steps = args.steps or (20 if cuda else 2)
    args.warmup = args.warmup or (10 if cuda else 2)
    busy = os.getloadavg()[0]
    if not cuda and busy + args.threads > (os.cpu_count() or 1):
        print(
            f"note: load average {busy:.1f} on {os.cpu_count()} cores: other processes compete for "
            f"the CPU, so treat the figures as provisional (the ratios, measured in interleaved "
            f"windows, hold up better than the absolute numbers)",
            file=sys.stderr,
        )
    res = run(args)
    print(table(res))
    for name, r in res["results"].items():
        if abs(r["loss_step0"] - math.log(VOCAB)) > 0.5:
            print(
                f"WARNING: {name} loss at step 0 is {r['loss_step0']:.3f}, expected ~{math.log(VOCAB):.2f}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
