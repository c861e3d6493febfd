"""One prepared run on one H100/H200-class GPU (at most ~8 minutes): what attnlab's GPU paths do,
each against a peer measured in the same process, written to benchmarks/results/gpu_*.json.

Each section runs in a process of its own with its share of --budget-s (benchmarks/gpu_runner.py):
rows are appended as they finish and the JSON is rewritten after every section, so a section
that crashes, hangs or runs past its share is stopped and loses only itself; each section ends
with its counters (graphs compiled, unfused-flex warnings, CUDA-graph skips). Every timed window
follows an untimed run of the same shapes; greedy rows are compared with ties allowed where the
reference's two logits are within 4 ulp (random bf16 weights make near-ties common).

    python benchmarks/gpu.py --out benchmarks/results/gpu_h200.json        # make bench-gpu
    python benchmarks/gpu.py --smoke --device cpu --out /tmp/gpu.json      # the script itself, tiny
    python benchmarks/gpu.py --sections lab --data-dir .data --out benchmarks/results/gpu_lab.json

(g) correctness (first): every attention kind of (b) at n 1,024 in fp32, forward and backward,
    through the selector and through flex by name, against the naive kernel (tolerance 1e-3).
(a) presets: every preset at test size on the device: fp32 logits against the CPU's, one bf16
    autocast training step (finite loss and gradients), greedy tokens against the CPU's.
(b) attention: one layer's forward + backward (bf16, B 1, d_model 1024, 16 heads of 64, causal)
    at n 8k / 32k / 128k for no positions, ALiBi, T5's buckets, soft-capping (Gemma 2), sinks
    (GPT-OSS), a sliding window of 1,024, Longformer (window 256 + 8 global tokens, bidirectional)
    and BigBird (blocks of 64, 3 random), each through the selector ("auto") and against two
    peers in the same process: torch's sdpa with is_causal (flash) and torch's own flex_attention
    with an ALiBi score_mod and a causal BlockMask. Peak extra CUDA memory (max_memory_allocated
    above what the inputs hold) and the median of timed repeats (CUDA events). The kernel each
    case got is recorded (`record_choices`).
(c) training: tokens/s and MFU of a GPT-2-small shape (12 layers, d 768, 12 heads, vocab 50,257)
    and a Llama shape (16 layers, d 2048, GQA 32/8, SwiGLU 8,192, vocab 32,000) at batch 8 x 1,024
    in bf16 autocast with fused AdamW, attnlab against transformers (the same weights through
    attnlab.interop.from_hf), eager and under torch.compile. MFU = 6·N·tokens/s (+ attention's
    12·L·d·T per token) over the device's bf16 dense peak (--peak-tflops, 989 for H100/H200 SXM).

(d) decode: greedy decoding on Llama-3.2-1B's shape (bf16, random weights), batch 1 / 8 / 32, a
    32-token prompt and 128 new tokens: attnlab's generate (the compiled step on a fixed cache)
    against transformers' generate (dynamic cache; static cache, compiled), every row's tokens
    against attnlab's eager greedy, and the bandwidth bound (copy rate / weight bytes per step).

(e) serve: the engine (its decode graphs captured at start, the workload run once untimed)
    with 32 / 256 requests of 128-token prompts and 128 new tokens at
    once, against transformers' static batch of the same prompts: tokens/s, TTFT and inter-token
    p50 / p99, every request's tokens against attnlab's generate.

(f) lab (only when asked for: --sections lab; about 3 minutes, --lab-budget-s): `attnlab lab run`
    on CUDA end to end, each in a process of its own (the CLI, as a user runs it): norms --quick
    (every record and its timings on cuda), then the full norms experiment, 8 seeds x 3 variants
    (1,200 steps; the control rmsnorm-short 120: no --set steps, which would also set the
    control's) in 4 parallel jobs on the one GPU, with wall time, runs per minute, the training
    and timing phases and the report's verdicts (src/attnlab/lab/report.py judge). A run past the
    budget is stopped with its jobs; the runs it finished are judged (`partial`). It reads
    tinyshakespeare where attnlab looks for it, or from --data-dir DIR (DIR/tinyshakespeare/
    input.txt.gz): on a device machine, which cannot download it, carry a copy (e.g. .data/,
    ignored by .git/info/exclude). Without CUDA (--device cuda) it is skipped with the reason;
    --smoke --device cpu runs norms --quick twice, the second with 2 jobs and 2 seeds.

Targets (issues 34, 35) are checked and printed: batch-1 decode >= 50 % of the bound and >= 2x
transformers' static cache; the engine >= 5,000 tokens/s at 32 requests and >= 10,000 at 256; at n 32k every kind within 1.5x sdpa-causal's memory
and 2x its time (T5 3x); training >= 1.1x transformers eager and >= 1.0x compiled; GPT-2-small
compiled >= 40 % MFU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import attnlab as al
from attnlab.config import ModelConfig
from attnlab.decode.engine import Engine, Request
from attnlab.graphs import compiled_graphs
from attnlab.nn.attention import AttnContext, MaskSpec, record_choices
from attnlab.nn.attention.block_sparse import BlockSparseMask

TARGETS = {"memory_vs_sdpa": 1.5, "time_vs_sdpa": 2.0, "t5_time_vs_sdpa": 3.0}
TRAIN_TARGETS = {"eager": 1.1, "compiled": 1.0, "gpt2_compiled_mfu": 0.40}
ROOT = Path(__file__).resolve().parents[1]
LAB, LAB_SEEDS, LAB_JOBS = "norms", 8, 4  # (f): the full experiment, its seeds, parallel jobs


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up (CUDA events on a GPU)."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def peak_extra(fn, device: str) -> int | None:
    """Bytes above what was allocated before `fn` at its peak (CUDA only)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


# --- (a) every preset ---------------------------------------------------------------------------


def preset_inputs(cfg: ModelConfig, g: torch.Generator) -> tuple[tuple, dict]:
    if cfg.frontend is not None and cfg.frontend.kind == "audio":
        f = cfg.frontend
        x = torch.randn(1, f.num_mel_bins, 2 * f.max_source_positions, generator=g)
        return (), {"input_features": x, "decoder_input_ids": torch.zeros(1, 4, dtype=torch.long)}
    if cfg.frontend is not None:
        f = cfg.frontend
        return (), {
            "pixel_values": torch.randn(1, f.num_channels, f.image_size, f.image_size, generator=g)
        }
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=g)
    if cfg.arch == "encoder-decoder":
        return (ids, ids[:, :7]), {}
    return (ids,), {}


def presets_section(device: str, deadline: float, emit) -> list[dict]:
    rows = []
    for name in al.presets.names():
        cfg = al.presets.tiny(al.presets.get(name))
        row: dict = {"preset": name}
        if time.perf_counter() > deadline:
            rows.append(emit({**row, "skipped": "past the time budget"}))
            continue
        try:
            torch.manual_seed(0)
            cpu = al.build_model(cfg).eval()
            dev = al.build_model(cfg).eval()
            dev.load_state_dict(cpu.state_dict())
            dev = dev.to(device)
            args, kwargs = preset_inputs(cfg, torch.Generator().manual_seed(0))
            move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
            with torch.no_grad():
                want = cpu(*args, **kwargs)
                got = dev(*map(move, args), **{k: move(v) for k, v in kwargs.items()})
            a = want.logits if want.logits is not None else want.hidden
            b = got.logits if got.logits is not None else got.hidden
            row["fp32_max_abs_diff"] = float((a - b.float().cpu()).abs().max())
            dev.train()
            with torch.autocast(device, dtype=torch.bfloat16):
                out = dev(*map(move, args), **{k: move(v) for k, v in kwargs.items()})
            y = out.logits if out.logits is not None else out.hidden
            loss = y.float().square().mean() + (out.aux_loss if out.aux_loss is not None else 0)
            loss.backward()
            grads = [p.grad for p in dev.parameters() if p.grad is not None]
            row["bf16_step_finite"] = bool(torch.isfinite(loss)) and all(
                bool(torch.isfinite(g).all()) for g in grads
            )
            if cfg.arch == "decoder" and cfg.frontend is None:
                dev.eval()
                ids = args[0]
                want = al.generate(cpu, ids, max_new_tokens=8)
                got = al.generate(dev, ids.to(device), max_new_tokens=8).cpu()
                row["greedy"] = same_tokens(cpu, ids.shape[1], got[0], want[0], torch.float32)
        except Exception as err:  # a row that fails says why; the run goes on
            row["error"] = f"{type(err).__name__}: {err}"[:400]
        rows.append(emit(row))
    return rows


# --- (b) attention at length --------------------------------------------------------------------


class Layer:
    """One attention layer of d_model 1024, 16 heads, with the context a stack would build."""

    def __init__(self, kind: str, n: int, device: str, dtype: torch.dtype) -> None:
        H, D = 16, 64
        self.kind, self.n = kind, n
        attention = dict(d_model=H * D, n_heads=H)
        if kind == "softcap":
            attention["softcap"] = 50.0
        if kind == "sinks":
            attention["sinks"] = True
        self.attn = al.nn.attention.Attention(**attention).to(device, dtype)
        pos = torch.arange(n, device=device)[None]
        causal = kind not in ("longformer", "bigbird")
        window = {"window": 1024, "longformer": 256}.get(kind)
        g = None
        if kind == "longformer":
            g = torch.zeros(1, n, dtype=torch.bool, device=device)
            g[:, :: n // 8] = True
        real = None
        if kind == "padding":  # the first 7 keys padding: rows 0-6 see no key (mean(v))
            real = torch.arange(n, device=device)[None] >= 7
        mask = MaskSpec(pos, pos, causal, window, real, True, q_global=g, k_global=g)
        bias, self.t5 = None, None
        if kind == "alibi":
            from attnlab.nn.positional.alibi import ALiBi

            bias = ALiBi(n_heads=H, causal=True).to(device).score_bias(pos, pos)
        if kind == "t5":
            from attnlab.nn.positional.relative import T5RelativeBias

            self.t5 = T5RelativeBias(n_heads=H, causal=True).to(device)
            bias = self.t5.score_bias(pos, pos)
        if kind == "bigbird":
            from attnlab.nn.attention.bigbird_plan import random_blocks

            rand = torch.from_numpy(random_blocks(-(-n // 64), 64, 3, H, 0, False, 4096))
            mask = BlockSparseMask.bigbird(n, 64, rand.to(device))
            bias = mask.bias()
        self.ctx = AttnContext(mask, bias)
        self.x = torch.randn(1, n, H * D, device=device, dtype=dtype, requires_grad=True)

    def step(self) -> None:
        out, _ = self.attn(self.x, self.ctx)
        out.sum().backward()


def sdpa_peer(n: int, device: str, dtype: torch.dtype):
    q, k, v = (
        torch.randn(1, 16, n, 64, device=device, dtype=dtype, requires_grad=True) for _ in "qkv"
    )

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return step


def flex_alibi_peer(n: int, device: str, dtype: torch.dtype):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    q, k, v = (
        torch.randn(1, 16, n, 64, device=device, dtype=dtype, requires_grad=True) for _ in "qkv"
    )
    slopes = torch.tensor([2 ** (-8 * (h + 1) / 16) for h in range(16)], device=device)
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, n, n, device=device)

    def step():
        mod = lambda s, b, h, q, kv: s + slopes[h] * (kv - q)  # noqa: E731
        compiled(q, k, v, score_mod=mod, block_mask=bm).sum().backward()

    return step


KINDS = ["none", "alibi", "t5", "softcap", "sinks", "window", "longformer", "bigbird"]


def attention_section(
    lengths: list[int], device: str, deadline: float, repeats: int, emit
) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for n in lengths:
        peers = {"sdpa-causal": sdpa_peer(n, device, dtype)}
        if device == "cuda":
            peers["flex-alibi"] = flex_alibi_peer(n, device, dtype)
        base = {}
        for name, fn in peers.items():
            base[name] = {
                "time_s": timed(fn, device, repeats),
                "peak_bytes": peak_extra(fn, device),
            }
            rows.append(emit({"n": n, "case": name, **base[name]}))
        for kind in KINDS:
            if time.perf_counter() > deadline:
                rows.append(emit({"n": n, "case": kind, "skipped": "past the time budget"}))
                continue
            row: dict = {"n": n, "case": kind}
            try:
                layer = Layer(kind, n, device, dtype)
                layers = record_choices(layer.attn)
                row["time_s"] = timed(layer.step, device, repeats)
                row["peak_bytes"] = peak_extra(layer.step, device)
                row["kernel"] = sorted({c.name for _, cs in layers for c in cs})
                ref = base["sdpa-causal"]
                row["time_vs_sdpa"] = row["time_s"] / ref["time_s"]
                if row["peak_bytes"] is not None:
                    row["memory_vs_sdpa"] = row["peak_bytes"] / max(1, ref["peak_bytes"])
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"[:400]
                if device == "cuda":
                    torch.cuda.empty_cache()
            rows.append(emit(row))
    return rows


# --- (g) correctness of the fused kernels ------------------------------------------------------


def grads_of(layer: Layer, kernel: str, backward: bool) -> list[torch.Tensor]:
    """The layer's output and, with `backward`, the gradients of x, of every parameter and of
    T5's bucket table (which reaches it through flex's score_mod), through `kernel`: float32."""
    al.set_kernel(layer.attn, kernel)
    t5 = list(layer.t5.parameters()) if layer.t5 is not None else []
    inputs = [layer.x, *(p for p in layer.attn.parameters() if p.requires_grad), *t5]
    for t in inputs:
        t.grad = None
    with torch.set_grad_enabled(backward):
        out, _ = layer.attn(layer.x, layer.ctx)
    if not backward:
        return [out.detach().float()]
    (out.float() * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum().backward()
    return [out.detach().float()] + [t.grad.float() for t in inputs if t.grad is not None]


def correctness_section(device: str, smoke: bool, deadline: float, emit) -> list[dict]:
    """Every attention kind of (b) and a padded one (its first rows see no key) at n = 1,000
    (smoke: 200: padded to their buckets, as every real length) in float32, forward and
    backward (the CPU: forward, as torch compiles flex for inference only there), through the
    selector ("auto") and through flex by name, against the naive kernel: the largest error of
    the output and of each gradient relative to that tensor's largest magnitude. A tolerance,
    not a token match: fp32 sums in another order differ by ~1e-6 of the scale. A flex call
    that fell back to the chunked kernel is a failure here (`flex_fallback_calls`)."""
    from attnlab.nn.attention.kernels import flex

    n, rows = (200 if smoke else 1000), []
    backward = device == "cuda"
    for kind in [*KINDS, "padding"]:
        row: dict = {"kind": kind, "n": n, "backward": backward}
        if time.perf_counter() > deadline:
            rows.append(emit({**row, "skipped": "past the time budget"}))
            continue
        try:
            layer = Layer(kind, n, device, torch.float32)
            want = grads_of(layer, "naive", backward)
            fallbacks = flex.FALLBACKS["calls"]
            for kernel in ("auto", "flex"):
                layers = record_choices(layer.attn)
                got = grads_of(layer, kernel, backward)
                record_choices(layer.attn, on=False)
                err = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
                          for a, b in zip(got, want, strict=True))  # fmt: skip
                row[f"{kernel}_max_rel_err"] = err
                row[f"{kernel}_kernel"] = sorted({c.name for _, cs in layers for c in cs})
            row["flex_fallback_calls"] = flex.FALLBACKS["calls"] - fallbacks
            row["ok"] = (
                max(row["auto_max_rel_err"], row["flex_max_rel_err"]) < 1e-3
                and row["flex_fallback_calls"] == 0
            )
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:400]
            traceback.print_exc()
        rows.append(emit(row))
    return rows


# --- (c) training against transformers ----------------------------------------------------------


def hf_models(shape: str, smoke: bool):
    import transformers

    if shape == "gpt2-small":
        kw = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
        if smoke:
            kw = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64)
        cfg = transformers.GPT2Config(**kw, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
        return transformers.GPT2LMHeadModel(cfg)
    kw = dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
              intermediate_size=8192, vocab_size=32000, max_position_embeddings=4096)  # fmt: skip
    if smoke:
        kw = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256, max_position_embeddings=64)  # fmt: skip
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))


def train_rate(
    model, ids, device: str, compiled: bool, steps: int, ours: bool
) -> tuple[float, float]:
    """(tokens/s, first loss) of bf16-autocast training steps with fused AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    fwd = torch.compile(model) if compiled else model

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = fwd(ids).logits if ours else fwd(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first = float(step().detach())
    for _ in range(2):  # warm-up (compilation)
        step()
    sec = timed(step, device, steps)
    return ids.numel() / sec, first


def training_section(
    device: str, smoke: bool, peak_tflops: float, deadline: float, emit
) -> list[dict]:
    rows = []
    B, T = (2, 32) if smoke else (8, 1024)
    for shape in ("gpt2-small", "llama"):
        for compiled in (False, True):
            if time.perf_counter() > deadline:
                row = {"shape": shape, "compiled": compiled, "skipped": "past the time budget"}
                rows.append(emit(row))
                continue
            row: dict = {"shape": shape, "compiled": compiled}
            try:
                torch.manual_seed(0)
                hf = hf_models(shape, smoke).to(device)
                ours = al.interop.from_hf(hf).to(device)
                ids = torch.randint(0, hf.config.vocab_size, (B, T), device=device)
                n_params = sum(p.numel() for p in hf.parameters())
                cfg = hf.config
                L = getattr(cfg, "n_layer", None) or cfg.num_hidden_layers
                d = getattr(cfg, "n_embd", None) or cfg.hidden_size
                flops_per_token = 6 * n_params + 12 * L * d * T
                for name, model, is_ours in (("transformers", hf, False), ("attnlab", ours, True)):
                    rate, first = train_rate(
                        model, ids, device, compiled, 3 if smoke else 10, is_ours
                    )
                    row[f"{name}_tokens_per_s"] = rate
                    row[f"{name}_first_loss"] = first
                    row[f"{name}_mfu"] = rate * flops_per_token / (peak_tflops * 1e12)
                row["ratio"] = row["attnlab_tokens_per_s"] / row["transformers_tokens_per_s"]
                del hf, ours
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"[:400]
                traceback.print_exc()
            if device == "cuda":
                torch.cuda.empty_cache()
            rows.append(emit(row))
    return rows


# --- (d) decoding against transformers ----------------------------------------------------------


def llama_1b(smoke: bool):
    """Llama-3.2-1B's shape with random weights (transformers builds it; no download)."""
    import transformers

    kw = dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
              intermediate_size=8192, vocab_size=128256, max_position_embeddings=4096,
              tie_word_embeddings=True, rope_theta=500000.0)  # fmt: skip
    if smoke:
        kw.update(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256)  # fmt: skip
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))


def copy_rate(device: str) -> float:
    """Bytes/s the device moves in a large copy (read + write): the bandwidth bound's rate."""
    n = (1 << 30) if device == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    sec = timed(lambda: b.copy_(a), device, 10)
    return 2 * n / sec


def decode_row(ours, hf, B: int, P: int, N: int, device: str, repeats: int, bound: float) -> dict:
    """One decode row: B random prompts of P tokens, N new tokens (decode_section); bound: the
    bandwidth bound's tokens/s."""
    row: dict = {}
    hf_kw = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)
    ids = torch.randint(0, hf.config.vocab_size, (B, P), device=device)
    want = al.generate(ours, ids, N, eos_token_id=None, cache_kind="static")
    runs = {
        "attnlab": lambda: al.generate(ours, ids, N, eos_token_id=None, cache_kind="fixed"),
        "attnlab_eager": lambda: al.generate(ours, ids, N, eos_token_id=None, cache_kind="static"),
        "transformers_dynamic": lambda: hf.generate(ids, **hf_kw),
        "transformers_static": lambda: hf.generate(ids, **hf_kw, cache_implementation="static"),
    }
    for name, fn in runs.items():
        out = fn()  # the warm-up: compiles and captures where it does
        row[f"{name}_tokens"] = tally(ours, P, out, want)
        row[f"{name}_tokens_per_s"] = B * N / timed(fn, device, repeats)
    row["of_bound"] = row["attnlab_tokens_per_s"] / bound
    row["vs_transformers_static"] = (
        row["attnlab_tokens_per_s"] / row["transformers_static_tokens_per_s"]
    )
    return row


def same_tokens(model, P: int, got: torch.Tensor, want: torch.Tensor, dtype=None) -> str:
    """Whether a greedy row `got` (prompt of P tokens + new ones) is the reference's `want`:
    "equal"; "tie" where it is still a greedy path of the reference `model` — every new token
    of `got`, teacher-forced in one forward pass, within 4 ulp of `dtype` (the compared run's:
    random bf16 weights make near-ties common, and either token of a tie is a correct greedy
    choice) of the top logit at the largest logit's scale; else "differs"."""
    got = got.to(want.device)
    if torch.equal(got, want):
        return "equal"
    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(got[None, :-1].to(dev)).logits[0, P - 1 :].float()  # (N, V)
    chosen = logits.gather(1, got[P:, None].to(dev))[:, 0]
    gap = logits.max(dim=1).values - chosen  # (N,) how far each token is from the top
    eps = torch.finfo(dtype or next(model.parameters()).dtype).eps
    return "tie" if bool((gap <= 4 * eps * logits.abs().max()).all()) else "differs"


def tally(model, P: int, got: torch.Tensor, want: torch.Tensor) -> dict[str, int]:
    """same_tokens over every row of (B, P + N) outputs: how many of each."""
    out = {"equal": 0, "tie": 0, "differs": 0}
    for b in range(want.shape[0]):
        out[same_tokens(model, P, got[b], want[b])] += 1
    return out


def add_row(rows: list[dict], row: dict, deadline: float, measure, emit) -> None:
    """row, completed by measure() (or with the reason it is not), appended and emitted."""
    if time.perf_counter() > deadline:
        row["skipped"] = "past the time budget"
    else:
        try:
            row |= measure()
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:400]
            traceback.print_exc()
    rows.append(emit(row))


def decode_section(device: str, smoke: bool, deadline: float, emit) -> list[dict]:
    """Greedy decoding of a 32-token prompt, 128 new tokens (smoke: 8 and 16), batch 1 / 8 / 32,
    bf16 on CUDA: attnlab's generate on the fixed cache (the compiled step: CUDA's default) and
    on the static one (the eager step), against transformers' generate with its dynamic cache and with cache_implementation="static"
    (compiled, CUDA graphs); tokens of every row checked against attnlab's eager greedy (the
    static cache). Tokens/s counts new tokens; the bound is the copy rate over the weights' bytes
    per step."""
    rows: list[dict] = []
    P, N = (8, 16) if smoke else (32, 128)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    hf = llama_1b(smoke).to(device=device, dtype=dtype).eval()
    ours = al.interop.from_hf(hf).to(device=device, dtype=dtype).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    rate = copy_rate(device)
    for B in (1, 8, 32):
        row: dict = {"batch": B, "prompt": P, "new_tokens": N, "weight_bytes": weight_bytes}
        row["bound_tokens_per_s"] = bound = B * rate / weight_bytes
        measure = lambda B=B, bound=bound: decode_row(  # noqa: E731
            ours, hf, B, P, N, device, 2 if smoke else 3, bound
        )
        add_row(rows, row, deadline, measure, emit)
    return rows


def serve_row(ours, hf, n: int, P: int, N: int, device: str) -> dict:
    """One serve row: n random prompts of P tokens, N new tokens each (serve_section)."""
    row: dict = {}
    g = torch.Generator().manual_seed(n)
    prompts = torch.randint(0, hf.config.vocab_size, (n, P), generator=g).to(device)
    want = torch.cat([al.generate(ours, prompts[i : i + 32], N, eos_token_id=None,
                                  cache_kind="static")[:, P:] for i in range(0, n, 32)])  # fmt: skip
    engine = Engine(ours, num_blocks=n * (P + N) // 16 + 64, block_size=16, max_batch=n,
                    max_prefill_tokens=max(4096, 8 * P))  # fmt: skip
    # the decode graphs of this workload captured first (every step padded to n rows and the
    # widest table), then the workload itself once untimed: the timed run compiles nothing
    blocks = -(-(P + N) // 16)
    engine.warm_up(rows=[1 << (n - 1).bit_length()], widths=[1 << (blocks - 1).bit_length()])
    reqs = [Request(p.tolist(), max_tokens=N) for p in prompts]
    engine.run(reqs)
    times: dict[int, list[float]] = {}
    engine.on_event = lambda e: times.setdefault(e.rid, []).append(time.perf_counter())
    compiles = compiled_graphs()
    sync(device)
    t0 = time.perf_counter()
    got = engine.run(reqs)
    row["attnlab_tokens_per_s"] = n * N / (time.perf_counter() - t0)
    row["compiles_in_timed_run"] = compiled_graphs() - compiles
    full = torch.tensor([p + g for p, g in zip(prompts.tolist(), got, strict=True)])
    row["rows"] = tally(ours, P, full, torch.cat((prompts, want), dim=1).cpu())
    ttft = sorted(ts[0] - t0 for ts in times.values())
    gaps = sorted(b - a for ts in times.values() for a, b in itertools.pairwise(ts))
    for name, xs in (("ttft", ttft), ("itl", gaps)):
        row[f"{name}_p50_ms"] = 1e3 * statistics.median(xs)
        row[f"{name}_p99_ms"] = 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    mask = torch.ones_like(prompts)
    hf_kw = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)
    secs = timed(lambda: hf.generate(prompts, attention_mask=mask, **hf_kw,
                                     cache_implementation="static"), device, 1)  # fmt: skip
    row["transformers_static_tokens_per_s"] = n * N / secs
    row["vs_transformers_static"] = row["attnlab_tokens_per_s"] / (n * N / secs)
    return row


def serve_section(device: str, smoke: bool, deadline: float, emit) -> list[dict]:
    """The engine on the same 1B shape: 32 / 128 / 256 requests at once, 128-token prompts, 128
    new tokens each (greedy), against transformers' static batch (all prompts as one batch,
    generate with cache_implementation="static"). Tokens/s counts generated tokens over the
    wall time from the first submit to the last token; TTFT and inter-token p50 / p99 come from
    each event's time. Every request's tokens are checked against attnlab's generate of that
    prompt (static cache, eager), batch by batch."""
    rows: list[dict] = []
    P, N = (8, 8) if smoke else (128, 128)
    counts = (4, 8) if smoke else (32, 256)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    hf = llama_1b(smoke).to(device=device, dtype=dtype).eval()
    ours = al.interop.from_hf(hf).to(device=device, dtype=dtype).eval()
    for n in counts:
        row: dict = {"requests": n, "prompt": P, "new_tokens": N}
        add_row(rows, row, deadline, lambda n=n: serve_row(ours, hf, n, P, N, device), emit)
    return rows


# --- (f) the lab on CUDA ------------------------------------------------------------------------


def lab_cli(argv: list[str], timeout: float) -> dict:
    """`attnlab lab run ...` in a process (and process group) of its own: its exit status, wall
    seconds, when it began timing (its "timing N run(s)" line) and its last lines; past
    `timeout` seconds the group, the lab's parallel jobs with it, is stopped (`stopped`)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "attnlab", "lab", "run", *argv]
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    out = proc.stdout

    def read() -> None:
        for line in out:
            lines.append((time.perf_counter() - t0, line.rstrip()))
            print(f"  lab: {line.rstrip()}", flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    row: dict = {"command": "attnlab lab run " + " ".join(argv)}
    try:
        proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        row["stopped"] = f"past the lab's time budget ({timeout:.0f} s left when it began)"
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    row["wall_s"] = time.perf_counter() - t0
    reader.join(timeout=5)
    row["returncode"] = proc.returncode
    timing = [t for t, line in lines if line.startswith("timing ")]
    if timing:
        row["training_s"], row["timing_s"] = timing[0], row["wall_s"] - timing[0]
    row["output_tail"] = [line for _, line in lines[-8:]]
    return row


def lab_records(out: Path) -> list[dict]:
    """Every finished run's record (RUN/lab.json; a stopped lab's results.jsonl may lag)."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("*/lab.json"))]


def lab_row(argv: list[str], out: Path, quick: bool, device: str, timeout: float) -> dict:
    """One lab run (lab_cli) and what its records say: runs, errors, devices, the verdicts."""
    from attnlab.lab import spec
    from attnlab.lab.report import judge
    from attnlab.lab.runner import plan

    lab = spec.load(LAB)
    seeds = [int(x) for x in argv[argv.index("--seeds") + 1 :]] if "--seeds" in argv else None
    runs = plan(lab, out, quick, seeds)
    row = lab_cli([*argv, "--out", str(out)], timeout)
    records = lab_records(out)
    row["runs"], row["runs_finished"] = len(runs), len(records)
    row["steps"] = {r.variant: r.recipe["steps"] for r in runs}
    row["runs_per_min"] = len(records) / (row["wall_s"] / 60)
    if records:
        row["run_seconds_mean"] = statistics.mean(r["seconds"] for r in records)
    row["errors"] = {r["run_dir"]: r["errors"] for r in records if r.get("errors")}
    row["devices"] = sorted({r["device"] for r in records})
    row["timing_devices"] = sorted({(r.get("timing") or {}).get("device") or "none" for r in records})  # fmt: skip
    row["on_device"] = bool(records) and row["devices"] == row["timing_devices"] == [device]
    row["partial"] = len(records) < len(runs)
    row["verdicts"] = [
        {"claim": r.claim.id, "status": r.verdict.status, "reason": r.verdict.reason,
         "a_mean": r.a_mean, "b_mean": r.b_mean}
        for r in judge(lab, records, quick)
    ]  # fmt: skip
    return row


def lab_data(data_dir: Path | None) -> str | None:
    """Why the lab cannot read tinyshakespeare (nothing is downloaded here), or None."""
    from attnlab.data.locate import candidates

    places = candidates("tinyshakespeare", data_dir)
    if any((p / "input.txt.gz").is_file() for p in places):
        return None
    return f"tinyshakespeare/input.txt.gz is in none of {[str(p) for p in places]}: pass --data-dir"


def lab_section(device: str, smoke: bool, budget_s: float, deadline: float,
                data_dir: Path | None, emit) -> list[dict]:  # fmt: skip
    """(f): norms --quick on the device, then the full experiment in LAB_JOBS parallel jobs (smoke:
    --quick again, 2 jobs, 2 seeds), within `budget_s` seconds in all (module docstring)."""
    stop = min(deadline, time.perf_counter() + budget_s)
    seeds = [1, 2] if smoke else list(range(1, LAB_SEEDS + 1))
    jobs = 2 if smoke else LAB_JOBS
    common = ["--device", device] + (["--data-dir", str(data_dir)] if data_dir else [])
    cases = [
        ("quick", [LAB, "--quick", *common], True),
        (f"{len(seeds)} seeds, {jobs} jobs" + (" (quick)" if smoke else ""),
         [LAB, *(["--quick"] if smoke else []), "--jobs", str(jobs), *common, "--seeds", *map(str, seeds)],
         smoke),
    ]  # fmt: skip
    why = None
    if device == "cuda" and not torch.cuda.is_available():
        why = "no CUDA device"
    elif (missing := lab_data(data_dir)) is not None:
        why = missing
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="gpu-lab-") as tmp:
        for i, (case, argv, quick) in enumerate(cases):
            row: dict = {"lab": LAB, "case": case, "device": device}
            if why is not None:
                row["skipped"] = why
            elif i and not rows[0].get("on_device"):
                row["skipped"] = "the quick run did not finish on the device"
            elif time.perf_counter() > stop:
                row["skipped"] = "past the time budget"
            else:
                try:
                    row |= lab_row(argv, Path(tmp) / f"case{i}", quick, device,
                                   stop - time.perf_counter())  # fmt: skip
                except Exception as err:
                    row["error"] = f"{type(err).__name__}: {err}"[:400]
                    traceback.print_exc()
            rows.append(emit(row))
    return rows


def verdicts(result: dict) -> list[str]:
    out = []
    for name in ("correctness", "decode", "serve", "attention", "training"):
        for row in result.get(name, []):
            if "error" in row:
                what = {k: v for k, v in row.items() if k in ("kind", "n", "case", "batch",
                                                             "requests", "shape", "compiled")}  # fmt: skip
                out.append(f"FAIL {name} {what}: {row['error']}")
    for row in result.get("correctness", []):
        if "ok" in row:
            out.append(f"{'PASS' if row['ok'] else 'FAIL'} correctness {row['kind']} n {row['n']}: "
                       f"flex {row['flex_max_rel_err']:.1e}, auto {row['auto_max_rel_err']:.1e} "
                       f"({', '.join(row['auto_kernel'])}) of naive")  # fmt: skip
    presets = [r for r in result.get("presets", []) if "preset" in r and "skipped" not in r]
    if presets:
        bad = [r["preset"] for r in presets if "error" in r or r.get("fp32_max_abs_diff", 0) > 1e-3
               or not r.get("bf16_step_finite", True) or r.get("greedy") == "differs"]  # fmt: skip
        out.append(f"{'PASS' if not bad else 'FAIL'} presets: {len(presets) - len(bad)}/"
                   f"{len(presets)} match the CPU{' (not: ' + ', '.join(bad) + ')' if bad else ''}")  # fmt: skip
    for name, c in result.get("counters", {}).items():
        ok = not c["unfused_flex_warnings"] and not c["flex_fallback_calls"]
        out.append(f"{'PASS' if ok else 'FAIL'} {name}: {c['graphs_compiled']} graphs compiled, "
                   f"{c['unfused_flex_warnings']} unfused flex, {c['flex_fallback_calls']} flex "
                   f"calls on chunked, {c['cudagraph_skips']} CUDA-graph skips")  # fmt: skip
    for name, status in result.get("sections", {}).items():
        for what in ("skipped", "stopped", "crashed"):
            if what in status:
                out.append(f"FAIL {name}: {what} ({status[what]})")
    for row in result.get("attention", []):
        if (
            row.get("n") != 32768
            or row["case"] in ("sdpa-causal", "flex-alibi")
            or "time_vs_sdpa" not in row
        ):
            continue
        t_cap = TARGETS["t5_time_vs_sdpa"] if row["case"] == "t5" else TARGETS["time_vs_sdpa"]
        ok = (
            row["time_vs_sdpa"] <= t_cap
            and row.get("memory_vs_sdpa", 0) <= TARGETS["memory_vs_sdpa"]
        )
        out.append(f"{'PASS' if ok else 'FAIL'} n 32k {row['case']}: time {row['time_vs_sdpa']:.2f}x, "
                   f"memory {row.get('memory_vs_sdpa', float('nan')):.2f}x sdpa-causal ({row.get('kernel')})")  # fmt: skip
    for row in result.get("training", []):
        if "ratio" not in row:
            continue
        need = TRAIN_TARGETS["compiled" if row["compiled"] else "eager"]
        out.append(f"{'PASS' if row['ratio'] >= need else 'FAIL'} train {row['shape']} "
                   f"{'compiled' if row['compiled'] else 'eager'}: {row['ratio']:.2f}x transformers "
                   f"(MFU {row['attnlab_mfu']:.1%})")  # fmt: skip
    for row in result.get("decode", []):
        if "attnlab_tokens" in row and row["attnlab_tokens"]["differs"]:
            out.append(f"FAIL decode batch {row['batch']}: rows against eager greedy "
                       f"{row['attnlab_tokens']}")  # fmt: skip
        if "of_bound" in row and row["batch"] == 1:
            ok = row["of_bound"] >= 0.5 and row["vs_transformers_static"] >= 2.0
            out.append(f"{'PASS' if ok else 'FAIL'} decode batch 1: {row['attnlab_tokens_per_s']:.0f} "
                       f"tokens/s, {row['of_bound']:.0%} of the bound, "
                       f"{row['vs_transformers_static']:.2f}x transformers static")  # fmt: skip
    for row in result.get("serve", []):
        if "attnlab_tokens_per_s" not in row or row["requests"] not in (32, 256):
            continue
        need = 5000 if row["requests"] == 32 else 10000
        ok = row["attnlab_tokens_per_s"] >= need and row["rows"]["differs"] == 0
        out.append(f"{'PASS' if ok else 'FAIL'} engine {row['requests']} x {row['new_tokens']}: "
                   f"{row['attnlab_tokens_per_s']:.0f} tokens/s (target {need}), rows against "
                   f"generate {row['rows']}, {row['compiles_in_timed_run']} compiles timed, "
                   f"{row['vs_transformers_static']:.2f}x transformers static")  # fmt: skip
    for row in result.get("lab", []):
        if "returncode" not in row:
            continue
        ok = row["returncode"] == 0 and row["on_device"] and not row["errors"]
        claims = ", ".join(f"{v['claim']} {v['status']}" for v in row["verdicts"])
        out.append(f"{'PASS' if ok else 'FAIL'} lab {row['lab']} {row['case']} on {row['device']}: "
                   f"{row['runs_finished']}/{row['runs']} runs in {row['wall_s']:.0f} s "
                   f"({row['runs_per_min']:.1f} runs/min){' PARTIAL' if row['partial'] else ''}; "
                   f"{claims}")  # fmt: skip
    return out


SECTIONS = ("correctness", "decode", "serve", "attention", "training", "presets", "lab")
# each section's share of the time left when it starts (the lab has its own --lab-budget-s)
SHARES = {"correctness": 1.0, "decode": 1.5, "serve": 1.5, "attention": 1.5, "training": 1.5,
          "presets": 0.5, "lab": 1.0}  # fmt: skip


def run_section(args: argparse.Namespace) -> int:
    """The child: one section, its rows appended to --rows as they finish, then its counters."""
    from gpu_runner import Rows

    rows = Rows(args.rows, args.section)
    emit, device, smoke = rows.emit, args.device, args.smoke
    deadline = time.perf_counter() + (args.section_deadline - time.time())  # the parent's clock
    lengths = [256, 512] if smoke else [int(n) for n in args.lengths.split(",")]
    name = args.section
    if name == "correctness":
        correctness_section(device, smoke, deadline, emit)
    elif name == "decode":
        decode_section(device, smoke, deadline, emit)
    elif name == "serve":
        serve_section(device, smoke, deadline, emit)
    elif name == "attention":
        attention_section(lengths, device, deadline, 3 if smoke else 5, emit)
    elif name == "training":
        training_section(device, smoke, args.peak_tflops, deadline, emit)
    elif name == "presets":
        presets_section(device, deadline, emit)
    elif name == "lab":
        lab_section(device, smoke, args.lab_budget_s, deadline, args.data_dir, emit)
    rows.summary(device)
    return 0


def collect(rows_path: Path, head: dict) -> dict:
    """The result so far: `head`, each section's rows (its counters apart), the verdicts."""
    from gpu_runner import read_rows

    result = dict(head)
    for row in read_rows(rows_path):
        name = row.pop("section")
        if "summary" in row:
            result.setdefault("counters", {})[name] = row["summary"]
        elif {"skipped", "stopped", "crashed", "process_s"} & row.keys() and len(row) == 1:
            result.setdefault("sections", {}).setdefault(name, {}).update(row)
        else:
            result.setdefault(name, []).append(row)
    result["verdicts"] = verdicts(result)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: check the script runs")
    p.add_argument("--sections", default="correctness,decode,serve,attention,training,presets")
    p.add_argument("--lengths", default="8192,32768,131072")
    p.add_argument("--budget-s", type=float, default=450.0, help="the whole run's time budget")
    p.add_argument("--section-budget", action="append", default=[], metavar="NAME=SECONDS",
                   help="a section's own budget instead of its share (repeatable)")  # fmt: skip
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak")
    p.add_argument("--lab-budget-s", type=float, default=180.0, help="(f) lab: its time budget")
    p.add_argument("--data-dir", type=Path, default=None, help="(f) lab: holds tinyshakespeare/")
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)  # the child's
    p.add_argument("--rows", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--section-deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.section is not None:
        return run_section(args)
    from gpu_runner import run_sections, write_atomic

    sections = args.sections.split(",")
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown sections {unknown}: choose from {', '.join(SECTIONS)}")
    budgets = {}
    for item in args.section_budget:
        name, _, sec = item.partition("=")
        budgets[name] = float(sec)
    t0 = time.perf_counter()
    head: dict = {
        "device": torch.cuda.get_device_name()
        if args.device == "cuda" and torch.cuda.is_available()
        else platform.processor(),
        "torch": torch.__version__,
        "smoke": args.smoke,
        "budget_s": args.budget_s,
    }
    rows_path = args.out.with_name(args.out.name + ".rows.jsonl")
    rows_path.unlink(missing_ok=True)

    def command(section: str, seconds: float) -> list[str]:
        # an absolute deadline (epoch seconds), so the child's start-up counts against it
        argv = [sys.executable, __file__, *sys.argv[1:], "--section", section,
                "--rows", str(rows_path), "--section-deadline", str(time.time() + seconds)]  # fmt: skip
        return argv

    def write() -> None:
        result = collect(rows_path, head) | {"wall_s": time.perf_counter() - t0}
        write_atomic(args.out, json.dumps(result, indent=1))

    run_sections(command, sections, SHARES, args.budget_s, rows_path, write, budgets)
    result = collect(rows_path, head)
    print("\n".join(result["verdicts"]))
    rows_path.unlink(missing_ok=True)  # everything is in --out now
    return 0


if __name__ == "__main__":
    sys.exit(main())
