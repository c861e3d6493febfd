"""A Llama-style model on CPU: decoding (fp32, fused, int8, bf16) and training, vs transformers.

    python benchmarks/llama.py --out benchmarks/results/llama.json

The model (both libraries, the same weights): 6 layers, d_model 384, 6 query heads and 2 KV heads
(GQA, head dim 64), SwiGLU d_ff 1024, RMSNorm, RoPE, untied head, vocab 32,000. transformers'
`LlamaForCausalLM` is built from a random-init config; attnlab's model is
`attnlab.interop.from_hf` of it (the logits are checked equal first).

Decoding: batch 1, greedy, a 32-token prompt and 64 new tokens (EOS off), the same 2 torch threads
for everyone; rows: transformers (sdpa), attnlab fp32, attnlab fused (`al.fuse`), fused + int8
and fused + bf16 (`al.quantize`; bf16 only where the CPU has native bf16). Training: forward +
cross-entropy + backward + fused AdamW, batch 8 × 256 tokens, attnlab vs transformers. Every
figure is the median over interleaved windows (the order rotates each round), so background load
on a shared machine hits the rows alike; ratios are taken within one run.

SmolLM2-135M's real weights (int8 perplexity, the bandwidth limit): benchmarks/smollm2.py.
--profile prints torch.profiler's top ops of one decoding run / training step of each row (the
training profile is printed anyway when attnlab misses the 1.3x target).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from smollm2 import cpu_name  # benchmarks/smollm2.py, beside this file

VOCAB, D, LAYERS, HEADS, KV_HEADS, D_FF = 32000, 384, 6, 6, 2, 1024
PROMPT, NEW = 32, 64
BATCH, CONTEXT = 8, 256
TARGETS = {"train_vs_transformers": 1.3}


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=D_FF,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


def median_window(times: list[float]) -> float:
    return statistics.median(times)


# --- decoding ----------------------------------------------------------------------------------


def decoders(hf, bf16: bool) -> dict:
    """Row name -> a function prompt (1, T) -> (1, T + NEW) ids."""
    import attnlab as al

    base = al.interop.from_hf(hf).eval()
    fused = al.fuse(copy.deepcopy(base))
    rows = {
        "transformers": lambda ids: hf.generate(
            ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0
        ),
        "attnlab fp32": lambda ids: al.generate(base, ids, NEW, "greedy", eos_token_id=None),
        "attnlab fused": lambda ids: al.generate(fused, ids, NEW, "greedy", eos_token_id=None),
    }
    int8 = al.quantize(al.fuse(copy.deepcopy(base)), "int8")
    rows["attnlab fused+int8"] = lambda ids: al.generate(
        int8, ids, NEW, "greedy", eos_token_id=None
    )
    if bf16:
        b16 = al.quantize(al.fuse(copy.deepcopy(base)), "bf16")
        rows["attnlab fused+bf16"] = lambda ids: al.generate(
            b16, ids, NEW, "greedy", eos_token_id=None
        )
    return rows


def time_rows(rows: dict, args_of, rounds: int, tokens: int) -> dict[str, list[float]]:
    """Interleaved windows: tokens/s of every row, `rounds` times, the order rotating."""
    names = list(rows)
    out = {n: [] for n in names}
    with torch.inference_mode():
        for n in names:  # warm-up
            rows[n](*args_of())
        for r in range(rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                a = args_of()
                t0 = time.perf_counter()
                rows[n](*a)
                out[n].append(tokens / (time.perf_counter() - t0))
            print(
                f"round {r + 1}: " + "  ".join(f"{n} {out[n][-1]:.0f}" for n in names),
                file=sys.stderr,
            )
    return out


def profile(fn, *a, top: int = 12) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU]) as p:
        fn(*a)
    return p.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def bench_decode(hf, args) -> dict:
    from attnlab.nn.quantize import cpu_has_native_bf16

    bf16 = cpu_has_native_bf16()
    rows = decoders(hf, bf16)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=g)
    with torch.inference_mode():
        outs = {n: f(prompt)[0, PROMPT:] for n, f in rows.items()}
    ref = outs["transformers"]
    agree = {n: int((o == ref).cumprod(0).sum()) for n, o in outs.items()}  # leading equal tokens
    windows = time_rows(rows, lambda: (prompt,), args.rounds, NEW)
    res = {
        n: {
            "tokens_per_s": median_window(w),
            "windows": w,
            "tokens_equal_to_transformers": agree[n],
        }
        for n, w in windows.items()
    }
    for n in res:
        res[n]["vs_transformers"] = res[n]["tokens_per_s"] / res["transformers"]["tokens_per_s"]
        res[n]["vs_attnlab_fp32"] = res[n]["tokens_per_s"] / res["attnlab fp32"]["tokens_per_s"]
    if args.profile:
        with torch.inference_mode():
            for n in ("attnlab fp32", "attnlab fused+int8"):
                print(f"--- profile: decode, {n}\n{profile(rows[n], prompt)}")
    return res


# --- training ----------------------------------------------------------------------------------


def bench_train(hf, args) -> dict:
    import attnlab as al

    hf_t = copy.deepcopy(hf).train()
    ours = al.interop.from_hf(hf).train()
    libs = {
        "transformers": (hf_t, lambda x: hf_t(input_ids=x, use_cache=False).logits),
        "attnlab": (ours, lambda x: ours(x).logits),
    }
    opts = {n: torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True) for n, (m, _) in libs.items()}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]

    def step(name: str) -> None:
        _model, logits = libs[name]
        opts[name].zero_grad(set_to_none=True)
        F.cross_entropy(logits(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        opts[name].step()

    rows = {n: (lambda n=n: [step(n) for _ in range(args.train_steps)]) for n in libs}
    for n in libs:  # warm-up step outside the timed windows
        step(n)
    names, windows = list(rows), {n: [] for n in rows}
    for r in range(args.rounds):
        for n in names[r % 2 :] + names[: r % 2]:
            t0 = time.perf_counter()
            rows[n]()
            windows[n].append(args.train_steps * BATCH * CONTEXT / (time.perf_counter() - t0))
        print(
            f"train round {r + 1}: " + "  ".join(f"{n} {windows[n][-1]:.0f}" for n in names),
            file=sys.stderr,
        )
    res = {n: {"tokens_per_s": median_window(w), "windows": w} for n, w in windows.items()}
    res["attnlab"]["vs_transformers"] = (
        res["attnlab"]["tokens_per_s"] / res["transformers"]["tokens_per_s"]
    )
    if args.profile or res["attnlab"]["vs_transformers"] < TARGETS["train_vs_transformers"]:
        for n in names:
            print(f"--- profile: training step, {n}\n{profile(step, n)}")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/llama.json"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="timed windows per row")
    p.add_argument("--train-steps", type=int, default=2, help="training steps per window")
    p.add_argument("--skip", nargs="*", default=[], choices=["decode", "train"])
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import attnlab as al

    hf = hf_llama()
    ours = al.interop.from_hf(hf).eval()
    x = torch.randint(0, VOCAB, (2, 48))
    with torch.no_grad():
        diff = (hf(input_ids=x).logits - ours(x).logits).abs().max().item()
    res = {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "load_average_before": os.getloadavg(),
        "shape": {
            "layers": LAYERS,
            "d_model": D,
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "d_ff": D_FF,
            "vocab": VOCAB,
        },
        "same_weights_max_logit_diff": diff,
        "torch": torch.__version__,
        "command": " ".join(["python", *sys.argv]),
    }
    if "decode" not in args.skip:
        res["decode"] = bench_decode(hf, args)
    if "train" not in args.skip:
        res["train"] = bench_train(hf, args)
    res["load_average_after"] = os.getloadavg()
    print(report(res))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def report(res: dict) -> str:
    lines = [
        f"CPU {res['cpu']}, {res['threads']} threads; attnlab vs transformers logits: max diff {res['same_weights_max_logit_diff']:.2e}"
    ]
    for n, r in res.get("decode", {}).items():
        lines.append(
            f"decode {n:<20} {r['tokens_per_s']:7.1f} tok/s  {r['vs_transformers']:.2f}x transformers  "
            f"{r['vs_attnlab_fp32']:.2f}x attnlab fp32  ({r['tokens_equal_to_transformers']}/{NEW} tokens = transformers')"
        )
    for n, r in res.get("train", {}).items():
        extra = f"  {r['vs_transformers']:.2f}x transformers" if "vs_transformers" in r else ""
        lines.append(f"train  {n:<20} {r['tokens_per_s']:7.0f} tok/s{extra}")
    lb, la = res["load_average_before"], res["load_average_after"]
    lines.append(
        f"load average before {lb[0]:.2f}, after {la[0]:.2f} (a shared machine: ratios hold better than absolutes)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
