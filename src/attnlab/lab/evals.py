"""Evaluations of a lab run: each takes the run's model and context and returns flat metrics
(`name: number`, `name_se` its standard error, lists for curves). Registered in EVALS with a
pydantic model of its arguments, so an experiment's YAML is checked before anything runs.

    val_loss        loss on non-overlapping windows of the whole validation split at the
                    training length L (every character predicted once)
    length          the same at multiples of L, per position: learned positions record
                    "unsupported past its table" instead of failing
    rope_scaling    the trained RoPE model with linear / NTK / dynamic-NTK / YaRN scaling at
                    factor f, evaluated at f·L, no training
    gqa_convert     al.surgery.to_gqa of the trained model, evaluated before any uptraining
    grad_norms      per-block gradient norms of a fresh draw (initialisation) and of the model
    decode_latency  per-step decode time with the KV cache vs recomputing the prefix
    attention_cost  forward+backward time (and CUDA peak memory) per step vs sequence length
    norm_timing     forward+backward time of one call of the model's norm
    step_timing     forward+backward time of one training batch of the recipe's shape
    softmax_mc      Monte Carlo: variance of q·k and softmax entropy vs d_k, with and without
                    the 1/sqrt(d_k) scale (no model)
    model_stats     always run: parameters (total, non-embedding, active), KV bytes per token,
                    training throughput

The timed evaluations (`timed`: decode_latency, attention_cost, norm_timing, step_timing) do
not run beside training: the runner times every run after all training is done, one run at a
time, paired runs one after the other (src/attnlab/lab/runner.py), so that parallel jobs and
the order of runs do not decide a timing claim. Every clock is read through `_time_ms`, which on
CUDA waits for the device before it starts and before it stops (CUDA runs asynchronously: the
host's clock alone would time the kernel launches).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from ..registry import Registry


class Args(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


@dataclass(frozen=True)
class Eval:
    args: type[Args]
    fn: Callable[[Any, Any], dict[str, Any]]
    needs_training: bool = False  # only meaningful on a trained model
    timed: bool = False  # a timing: run alone, after training (module docstring)


EVALS: Registry[Eval] = Registry("evaluation")


def register(name: str, args: type[Args], needs_training: bool = False, timed: bool = False):
    def add(fn):
        EVALS.register(name)(Eval(args, fn, needs_training, timed))
        return fn

    return add


@dataclass
class RunContext:
    """What an evaluation may use: the run's model (trained or fresh), its config and recipe."""

    recipe: Any  # attnlab.train.recipes.Recipe
    cfg: Any  # attnlab.ModelConfig
    model: nn.Module
    run_dir: Path
    base_context: int  # L: the lab's training length (before variant overrides)
    tokenizer: Any = None
    data_dir: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    trained: bool = True
    _val: torch.Tensor | None = None

    def val_ids(self) -> torch.Tensor:
        """The whole validation split as token ids (1-D)."""
        if self._val is None:
            from ..data import char_corpus

            _, text = char_corpus(self.recipe.data.dataset, self.data_dir)
            if self.recipe.data.tokenizer != "char":  # BPE: the tokenizer's own ids
                ids = self.tokenizer.encode(text, add_special_tokens=False).ids
                self._val = torch.tensor(ids, dtype=torch.long)
                return self._val
            vocab = self.tokenizer.get_vocab()
            self._val = torch.tensor([vocab[c] for c in text if c in vocab], dtype=torch.long)
        return self._val


def _mean_se(xs: list[float]) -> tuple[float, float | None]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    return m, statistics.stdev(xs) / math.sqrt(len(xs))


@torch.no_grad()
def window_losses(
    model: nn.Module, ids: torch.Tensor, T: int, max_windows: int | None, batch_tokens: int = 8192
) -> tuple[list[float], torch.Tensor]:
    """Non-overlapping windows of T predictions over `ids` (window i reads ids[i·T : i·T + T + 1]):
    (mean loss of each window, mean loss at each position (T,))."""
    n = (len(ids) - 1) // T
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise ValueError(f"the validation split ({len(ids)} tokens) is shorter than one window ({T + 1})")  # fmt: skip
    device = next(model.parameters()).device
    starts = torch.arange(n) * T
    idx = starts[:, None] + torch.arange(T + 1)  # (n, T+1)
    per_window, per_pos = [], torch.zeros(T, dtype=torch.float64)
    b = max(1, batch_tokens // T)
    was = model.training
    model.eval()
    try:
        for i in range(0, n, b):
            w = ids[idx[i : i + b]].to(device)  # (b, T+1)
            logits = model(w[:, :-1]).logits.float()  # (b, T, V)
            nll = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), w[:, 1:], reduction="none"
            ).double()  # (b, T)
            per_window += nll.mean(1).tolist()
            per_pos += nll.sum(0).cpu()
    finally:
        model.train(was)
    return per_window, per_pos / n


def _bins(curve: torch.Tensor, bins: int) -> list[float]:
    """A per-position curve averaged into at most `bins` equal bins (for plots)."""
    T = len(curve)
    k = max(1, math.ceil(T / bins))
    return [float(curve[i : i + k].mean()) for i in range(0, T, k)]


# --- losses ---------------------------------------------------------------------------------


class ValLossArgs(Args):
    max_windows: int | None = Field(None, gt=0)


@register("val_loss", ValLossArgs)
def val_loss(ctx: RunContext, a: ValLossArgs) -> dict[str, Any]:
    T = ctx.recipe.data.context
    losses, _ = window_losses(ctx.model, ctx.val_ids(), T, a.max_windows)
    m, se = _mean_se(losses)
    return {"val_loss": m, "val_loss_se": se, "val_windows": len(losses)}


class LengthArgs(Args):
    multiples: list[int] = Field(default_factory=lambda: [1, 2, 4, 8], min_length=1)
    max_windows: int | None = Field(None, gt=0)
    bins: int = Field(32, gt=0)


def _unsupported(model: nn.Module, T: int) -> str | None:
    from ..nn.positional.learned import LearnedPositions

    for m in model.modules():
        if isinstance(m, LearnedPositions) and m.max_positions < T:
            return f"unsupported past its table ({m.max_positions} positions)"
    return None


@register("length", LengthArgs)
def length(ctx: RunContext, a: LengthArgs) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mult in a.multiples:
        T = mult * ctx.base_context
        note = _unsupported(ctx.model, T)
        if note is not None:
            out[f"len_note_x{mult}"] = note
            continue
        losses, curve = window_losses(ctx.model, ctx.val_ids(), T, a.max_windows)
        m, se = _mean_se(losses)
        out |= {f"len_loss_x{mult}": m, f"len_loss_x{mult}_se": se}
        out[f"len_curve_x{mult}"] = _bins(curve, a.bins)
    return out


class RopeScalingArgs(Args):
    methods: list[str] = Field(default_factory=lambda: ["linear", "ntk", "dynamic-ntk", "yarn"])
    factors: list[int] = Field(default_factory=lambda: [4, 8])
    max_windows: int | None = Field(None, gt=0)


@register("rope_scaling", RopeScalingArgs, needs_training=True)
def rope_scaling(ctx: RunContext, a: RopeScalingArgs) -> dict[str, Any]:
    from ..build import build_model

    if ctx.cfg.positional.kind != "rope":
        raise ValueError(f"rope_scaling needs a RoPE model, got positional {ctx.cfg.positional.kind!r}")  # fmt: skip
    L = ctx.recipe.data.context
    state = ctx.model.state_dict()
    out: dict[str, Any] = {}
    for method in a.methods:
        for f in a.factors:
            scaling: dict[str, Any] = {"kind": method, "factor": float(f)}
            if method in ("dynamic-ntk", "yarn"):
                scaling["original_max_len"] = L
            pos = {**ctx.cfg.positional.to_dict(), "scaling": scaling}
            model = build_model(ctx.cfg.replace(positional=pos)).to(ctx.device)
            model.load_state_dict(state)  # inv_freq is a non-persistent buffer: rebuilt scaled
            losses, _ = window_losses(model, ctx.val_ids(), f * L, a.max_windows)
            m, se = _mean_se(losses)
            out |= {f"scaled_{method}_x{f}": m, f"scaled_{method}_x{f}_se": se}
    return out


class GQAConvertArgs(Args):
    n_kv_heads: list[int] = Field(min_length=1)
    max_windows: int | None = Field(None, gt=0)


@register("gqa_convert", GQAConvertArgs, needs_training=True)
def gqa_convert(ctx: RunContext, a: GQAConvertArgs) -> dict[str, Any]:
    from ..surgery import to_gqa

    out: dict[str, Any] = {}
    for g in a.n_kv_heads:
        losses, _ = window_losses(
            to_gqa(ctx.model, g), ctx.val_ids(), ctx.recipe.data.context, a.max_windows
        )
        m, se = _mean_se(losses)
        out |= {f"converted_kv{g}_loss": m, f"converted_kv{g}_loss_se": se}
    return out


# --- gradients ------------------------------------------------------------------------------


class GradArgs(Args):
    batch: int = Field(8, gt=0)  # windows per batch
    batches: int = Field(4, gt=1)  # separate batches: the spread gives a standard error


def _block_grad_norms(model: nn.Module, ids: torch.Tensor) -> list[float]:
    model.zero_grad(set_to_none=True)
    out = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(out.logits.transpose(1, 2), ids[:, 1:])
    loss.backward()
    norms = []
    for block in model.decoder.blocks:
        sq = sum(float(p.grad.double().pow(2).sum()) for p in block.parameters() if p.grad is not None)  # fmt: skip
        norms.append(math.sqrt(sq))
    model.zero_grad(set_to_none=True)
    return norms


@register("grad_norms", GradArgs)
def grad_norms(ctx: RunContext, a: GradArgs) -> dict[str, Any]:
    """Per-block gradient norms on `batches` batches of validation windows at L: of a fresh model
    drawn with the run's seed (initialisation; Xiong et al. 2020, section 3) and of this model.
    grad_ratio_*: last block's norm over the first's, mean over batches (± its standard error)."""
    from ..build import build_model

    T = ctx.recipe.data.context
    ids = ctx.val_ids()
    n = a.batch * a.batches
    if len(ids) < n * T + 1:
        raise ValueError(f"grad_norms: the validation split holds fewer than {n} windows of {T + 1}")  # fmt: skip
    windows = torch.stack([ids[i * T : i * T + T + 1] for i in range(n)]).to(ctx.device)
    torch.manual_seed(ctx.recipe.seed)
    fresh = build_model(ctx.cfg).to(ctx.device)
    out: dict[str, Any] = {}
    for tag, model in (("init", fresh), ("final", ctx.model)):
        was = model.training
        model.eval()  # no dropout: the gradient of the function itself
        per = [_block_grad_norms(model, windows[i * a.batch : (i + 1) * a.batch]) for i in range(a.batches)]  # fmt: skip
        model.train(was)
        layers = [sum(p[j] for p in per) / len(per) for j in range(len(per[0]))]
        ratio, se = _mean_se([p[-1] / max(p[0], 1e-30) for p in per])
        out |= {f"grad_layers_{tag}": layers, f"grad_ratio_{tag}": ratio, f"grad_ratio_{tag}_se": se}  # fmt: skip
    return out


# --- timing ---------------------------------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`: CUDA runs asynchronously, so a host clock read
    without this times the launches only. Nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """One call of fn in milliseconds, the work it queued on `device` included (the one place
    the timings wait for the device, before the clock starts and before it stops)."""
    _synchronize(device)
    t0 = time.perf_counter()
    fn()
    _synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def _times_ms(
    fn: Callable[[], Any], reps: int, device: torch.device, warmup: int = 1
) -> list[float]:
    """Milliseconds of `reps` calls of fn on `device` after `warmup` untimed ones (`_time_ms`)."""
    for _ in range(warmup):
        fn()
    return [_time_ms(fn, device) for _ in range(reps)]


class DecodeArgs(Args):
    positions: list[int] = Field(default_factory=lambda: [64, 128, 256, 512], min_length=1)
    reps: int = Field(5, gt=0)


@register("decode_latency", DecodeArgs, timed=True)
@torch.no_grad()
def decode_latency(ctx: RunContext, a: DecodeArgs) -> dict[str, Any]:
    """Time of one decode step at position t: with the KV cache (one token through the model)
    and without (the whole prefix of t + 1 tokens recomputed). Greedy tokens from both paths
    are compared over the longest prefix (`same_tokens` 1.0 when every one agrees)."""
    from ..decode.steps import decode_step, prefill

    model = ctx.model.eval()
    top = max(a.positions)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ctx.cfg.vocab_size, (1, top + 1), generator=g).to(ctx.device)
    out: dict[str, Any] = {}
    for t in a.positions:

        def cached(t=t):
            _, _, state = prefill(model, ids[:, :t], 1)
            return state

        # on CUDA the cached step is the compiled one (decode/compiled_step.py): its first call
        # compiles and captures a graph, so it is warmed up there; the CPU's native step is not
        cached_ms, warm = [], 1 if ctx.device.type == "cuda" else 0
        for i in range(warm + a.reps):
            state = None  # the last state goes first: its fixed cache (and graph) is reused
            state = cached()
            ms = _time_ms(lambda t=t, state=state: decode_step(model, ids[:, t], state), ctx.device)  # fmt: skip
            if i >= warm:
                cached_ms.append(ms)
        del state
        full_ms = _times_ms(lambda t=t: model(ids[:, : t + 1]), a.reps, ctx.device)
        for tag, xs in (("cached", cached_ms), ("recompute", full_ms)):
            m, se = _mean_se(xs)
            out |= {f"decode_ms_{tag}_at{t}": statistics.median(xs), f"decode_ms_{tag}_at{t}_se": se}  # fmt: skip
            del m
    # same tokens: greedy continuation of a short prompt, cached vs recomputed
    from ..decode.generate import generate

    prompt, n = ids[:, :4], min(16, top)
    fast = generate(model, prompt, max_new_tokens=n, strategy="greedy")
    seq = prompt
    for _ in range(n):
        seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], dim=1)
    out["same_tokens"], out["same_tokens_se"] = float(torch.equal(fast, seq)), 0.0
    return out


class CostArgs(Args):
    lengths: list[int] = Field(default_factory=lambda: [128, 256, 512, 1024], min_length=1)
    batch: int = Field(1, gt=0)
    reps: int = Field(3, gt=0)


@register("attention_cost", CostArgs, timed=True)
def attention_cost(ctx: RunContext, a: CostArgs) -> dict[str, Any]:
    """Forward + backward time of one training step vs sequence length; peak memory where the
    device has allocator statistics (CUDA). On CPU, benchmarks/attention.py measures RSS in
    fresh processes."""
    model = ctx.model.train()
    out: dict[str, Any] = {}
    cuda = ctx.device.type == "cuda"
    for n in a.lengths:
        ids = torch.randint(0, ctx.cfg.vocab_size, (a.batch, n + 1), device=ctx.device)

        def step(ids=ids):
            model.zero_grad(set_to_none=True)
            logits = model(ids[:, :-1]).logits
            torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:]).backward()

        if cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        xs = _times_ms(step, a.reps, ctx.device)
        _, se = _mean_se(xs)
        out |= {f"step_ms_at{n}": statistics.median(xs), f"step_ms_at{n}_se": se}
        if cuda:
            out[f"peak_mb_at{n}"] = torch.cuda.max_memory_allocated(ctx.device) / 2**20
    model.zero_grad(set_to_none=True)
    return out


class NormTimingArgs(Args):
    rows: int = Field(4096, gt=0)
    reps: int = Field(50, gt=0)


@register("norm_timing", NormTimingArgs, timed=True)
def norm_timing(ctx: RunContext, a: NormTimingArgs) -> dict[str, Any]:
    """Forward + backward of the model's own norm module on (rows, d_model), in microseconds."""
    norm = ctx.model.decoder.blocks[0].ffn_norm
    x = torch.randn(a.rows, ctx.cfg.d_model, device=ctx.device, requires_grad=True)
    grad = torch.randn_like(x)

    def call():
        y = norm(x)
        y.backward(grad)

    xs = [t * 1e3 for t in _times_ms(call, a.reps, ctx.device, warmup=5)]
    _, se = _mean_se(xs)
    return {"norm_call_us": statistics.median(xs), "norm_call_us_se": se}


class StepTimingArgs(Args):
    reps: int = Field(20, gt=0)
    warmup: int = Field(3, ge=0)


@register("step_timing", StepTimingArgs, timed=True)
def step_timing(ctx: RunContext, a: StepTimingArgs) -> dict[str, Any]:
    """Forward + backward of one training batch (the recipe's batch size and context, random
    tokens) in milliseconds: the median of `reps` after `warmup`. The time of a step does not
    depend on the weights' values, so a fresh draw times the same as the trained model."""
    model = ctx.model.train()
    b, n = ctx.recipe.batch.size, ctx.recipe.data.context
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ctx.cfg.vocab_size, (b, n + 1), generator=g).to(ctx.device)

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1]).logits
        torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:]).backward()

    xs = _times_ms(step, a.reps, ctx.device, warmup=a.warmup)
    model.zero_grad(set_to_none=True)
    _, se = _mean_se(xs)
    return {"train_step_ms": statistics.median(xs), "train_step_ms_se": se}


class SoftmaxMCArgs(Args):
    d_k: list[int] = Field(default_factory=lambda: [16, 64, 256, 1024], min_length=1)
    n_keys: int = Field(64, gt=1)
    samples: int = Field(2000, gt=1)


@register("softmax_mc", SoftmaxMCArgs)
def softmax_mc(ctx: RunContext, a: SoftmaxMCArgs) -> dict[str, Any]:
    """q, k with unit-variance entries (Vaswani et al. 2017, footnote 4): q·k has variance d_k;
    divided by sqrt(d_k), variance 1. Entropy of softmax over n_keys scores, as a fraction of
    its maximum log(n_keys): near 0 means saturated (one-hot, vanishing gradients)."""
    g = torch.Generator().manual_seed(ctx.recipe.seed)
    out: dict[str, Any] = {}
    for d in a.d_k:
        q = torch.randn(a.samples, 1, d, generator=g, dtype=torch.float64)
        k = torch.randn(a.samples, a.n_keys, d, generator=g, dtype=torch.float64)
        s = (q * k).sum(-1)  # (samples, n_keys)
        for tag, scores in (("unscaled", s), ("scaled", s / math.sqrt(d))):
            var = scores.var(dim=1)  # per sample: variance over its keys
            p = scores.softmax(-1)
            ent = -(p * p.clamp_min(1e-300).log()).sum(-1) / math.log(a.n_keys)
            for name, x in (("var", var), ("entropy", ent)):
                out[f"{name}_{tag}_d{d}"] = float(x.mean())
                out[f"{name}_{tag}_d{d}_se"] = float(x.std() / math.sqrt(len(x)))
    return out


# --- always --------------------------------------------------------------------------------


def model_stats(ctx: RunContext) -> dict[str, Any]:
    from ..build import count_parameters
    from ..cache.base import kv_bytes
    from ..train import metrics as M

    cfg = ctx.cfg
    total = count_parameters(cfg)
    embed = cfg.vocab_size * cfg.d_model
    pos = getattr(cfg.positional, "max_len", 0) * cfg.d_model if cfg.positional.kind == "learned" else 0  # fmt: skip
    out: dict[str, Any] = {"params": total, "non_embedding_params": total - embed - pos}
    idle = 0  # active: less the experts each sparse block does not route a token to
    for block in ctx.model.decoder.blocks:  # (dense blocks, as DeepSeek's first ones, have none)
        experts = getattr(block.ffn, "experts", None)
        if experts:
            per_expert = sum(p.numel() for p in experts[0].parameters())
            idle += (len(experts) - block.ffn.top_k) * per_expert
    out["active_params"] = total - idle
    out["kv_bytes_per_token"] = kv_bytes(cfg.n_layers, cfg.kv_heads, cfg.attn_head_dim, 4)
    for k in ("params", "non_embedding_params", "active_params", "kv_bytes_per_token"):
        out[f"{k}_se"] = 0.0  # exact counts
    try:
        train = [r for r in M.read(ctx.run_dir) if r.get("split") == "train"]
    except FileNotFoundError:
        train = []
    tps = [r["tokens_per_s"] for r in train[len(train) // 2 :] if r.get("tokens_per_s")]
    if tps:
        m, se = _mean_se(tps)
        out |= {"tokens_per_s": m, "tokens_per_s_se": se}
    return out
