"""Efficient attention on CPU: peak extra memory and time of each positional bias through each
attention kernel, against torch's causal sdpa measured in the same process (README, "Performance").

    python benchmarks/attention.py --out benchmarks/results/attention.json   # about 25 min
    python benchmarks/attention.py --quick                                    # n 1k, 2k
    python benchmarks/attention.py --cases alibi,t5/chunked --n 8192 --profile

Shape: B 1, H 8, D 64, fp32, 2 torch threads, n = 1k .. 32k. Every case is causal:

    sdpa-causal       F.scaled_dot_product_attention(q, k, v, is_causal=True): the peer
    naive             the naive kernel, causal mask, no bias: the n×n wall
    alibi/KERNEL      causal ALiBi (bias.LinearBias) through every registered kernel with a bias
    t5/KERNEL         T5's bucketed bias (positional/relative.py, 32 buckets, max distance 128);
                      forward+backward checks that a non-zero gradient reaches its table
    window256/KERNEL  a causal sliding window of 256 keys (MaskSpec window=256), no bias
    linear            causal_linear_attention (attention/linear.py), φ = elu+1, chunks of 64
    model/POSITIONAL  a decoder (2 layers, d_model 512, 8 heads, d_ff 2048, vocab 256), batch 1,
                      one training step (forward, cross-entropy, backward, fused AdamW), in the
                      fwd+bwd columns; positional none (attention is then sdpa is_causal: the
                      peer of these rows), alibi or t5-relative, each through the model's
                      default kernel ("sdpa", which dispatches: alibi.py's channel trick for
                      ALiBi, chunked.py for T5). At n 8k and 16k (--model-n).

Kernels come from the KERNELS registry, so a kernel registered later is measured too; a
(family, kernel) pair that would only re-run another row is skipped with its reason (SKIP).

Memory: a fresh process per (case, n) allocates the inputs (q, k, v and the output gradient; for a
model its weights, optimizer state and ids), runs the case once at n = 256 so that code pages,
thread pools and one-time buffers are loaded before the baseline, returns freed heap to the OS
(glibc malloc_trim), reads its resident set size (VmRSS) as the baseline, resets the peak (VmHWM,
through /proc/self/clear_refs) to it, runs the forward pass once (under no_grad) and reports VmHWM
minus the baseline: the peak extra memory; then the same for forward + backward (the gradients of
q, k, v and of T5's table included). The forward pass leaves nothing behind, so the second figure
equals what a process of its own gives (checked: t5/chunked at n 4096, 367 MB both ways).

Why this is a fair peak on CPU: RSS counts the pages actually touched, and torch's CPU allocator
caches nothing — tensors come straight from glibc malloc, which gives each block above its mmap
threshold its own mapping and unmaps it when freed, so such a block counts exactly while it is
alive. glibc raises that threshold as blocks are freed (from 128 KiB up to 32 MiB) and keeps freed
blocks below it in the heap and in per-thread arenas, where they keep counting: with the default
settings a kernel that allocates many mid-size blocks reads up to 2x its live peak, differently
from run to run (t5/chunked at 4096: 530-780 MB against 367). So the memory process runs with
MALLOC_MMAP_THRESHOLD_ = 1 MiB (fixed; this also stops the dynamic raising): every block of 1 MiB
or more is mapped and unmapped on its own, and the figure is the live peak within the heap's small
blocks, the same to a few MB on every run. The default-settings figure of the first full-size
forward+backward in the timing process is in the JSON too (peak_extra_bytes_default_malloc).
Unlike the profiler's allocator events, RSS also sees what libraries allocate outside torch's
allocator (oneDNN scratchpads, per-thread buffers).

Time: a second fresh process, with glibc's default settings (as users run), times forward +
backward, then forward: the case and the peer once each at full size (warm-up), then R repeats
alternating case and peer (7, 5 or 3: fewer for slower runs); each figure is a median, and the
ratio is the case's median over the peer's from the same process, so load from other processes
falls on both alike. Absolute seconds are in the JSON.

Skips: before each (case, n) the case's peak memory and its process's wall time at the previous n
are scaled by (n / n_prev)² (exact for the n×n cases, an upper bound for the others); when that
exceeds --mem-cap-gb (default 10), or above n 8192 (the targets' n, always measured)
--time-cap-s (default 120), the case is skipped from that n on, with the reason printed. A peer
has no time cap and runs at an n only when a case it serves does. The defaults keep the whole
run near 25 minutes on 2 idle cores.

Targets (the efficient-attention issue, at n = 8192) are checked against TARGETS and printed.
MB are 10^6 bytes, as in "n = 8,192 in fp32: 268 MB for one layer's matrix" (8192² · 4 bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fnmatch
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

B, H, D = 1, 8, 64
N_ALL = (1024, 2048, 4096, 8192, 16384, 32768)
N_QUICK = (1024, 2048)
N_MODEL = (8192, 16384)
WINDOW = 256
MB = 1e6
BUSY = 0.1  # share of the CPUs other processes may use while a row is timed (the † mark)
MMAP_THRESHOLD = 2**20  # glibc's, fixed for the memory runs (docstring)
MODEL = dict(vocab_size=256, d_model=512, n_layers=2, n_heads=8)

# (family, kernel) pairs that would only repeat another row
SKIP = {
    ("t5", "alibi-sdpa"): "alibi-sdpa folds causal ALiBi only; any other bias runs its chunked "
    "fallback (the t5/chunked row)",
    ("window256", "alibi-sdpa"): "without an ALiBi bias alibi-sdpa is the chunked kernel "
    "(the window256/chunked row)",
    **{
        (family, "block-gather"): "block-gather gathers block-sparse layouts (BigBird's); any "
        f"other mask runs its chunked fallback (the {family}/chunked row)"
        for family in ("alibi", "t5", "window256")
    },
    ("window256", "naive"): "the naive kernel builds the whole n×n matrix whatever the window "
    "(the naive row)",
}

# the efficient-attention issue's targets at n = 8192: peak extra MB and time × sdpa-causal
TARGET_N = 8192
TARGETS = {
    "alibi": {"fwd_mb": 200, "fb_mb": 400, "fwd_x": 1.6, "fb_x": 1.5},
    "t5": {"fb_mb": 1000, "fwd_x": 5.0, "fb_x": 6.0},
    "window256": {"fb_mb": 250, "fb_x": 0.35},
    "linear": {"fb_mb": 400, "fb_x": 0.25},
}


# --- the cases -----------------------------------------------------------------------------------


def all_cases() -> tuple[list[str], dict[str, str]]:
    """Every case name, and the (family/kernel) names skipped with their reasons."""
    from attnlab.nn.attention.kernels import KERNELS

    cases, skipped = ["sdpa-causal", "naive"], {}
    for family in ("alibi", "t5", "window256"):
        for name in kernel_names():
            kernel = KERNELS.get(name)
            if family != "window256" and not kernel.caps.bias:
                skipped[f"{family}/{name}"] = "the kernel takes no score bias"
            elif (family, name) in SKIP:
                skipped[f"{family}/{name}"] = SKIP[(family, name)]
            else:
                cases.append(f"{family}/{name}")
    cases.append("linear")
    cases += ["model/none", "model/alibi", "model/t5-relative"]
    return cases, skipped


PEERS = ("sdpa-causal", "model/none")


def matches(name: str, pattern: str) -> bool:
    """A name, a family ("alibi" for alibi/*) or a glob."""
    return name == pattern or name.startswith(pattern + "/") or fnmatch.fnmatch(name, pattern)


def kernel_names() -> list[str]:
    from attnlab.nn.attention.kernels import KERNELS

    return sorted(KERNELS, key=lambda k: (k != "naive", k != "sdpa", k))


def selected(name: str, patterns: list[str] | None) -> bool:
    if patterns is None or name in PEERS:  # the peers always run: the ratios need them
        return True
    return any(matches(name, p) for p in patterns)


@dataclass
class Job:
    """One case at one n with its inputs allocated. `forward`: inference (None: not measured);
    `step`: forward + backward, plus AdamW for a model (None: the kernel has no backward);
    `check`: run after a step, returns what it checked."""

    forward: Callable[[], object] | None
    step: Callable[[], object] | None
    check: Callable[[], dict] | None = None


def attention_inputs(n: int) -> tuple[torch.Tensor, ...]:
    """q, k, v (B, H, n, D), leaves that take gradients, and the output gradient (B, H, n, D)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(B, H, n, D, generator=g)


def attention_job(case: str, n: int, q, k, v, gout) -> Job:
    leaves, check, backward = [q, k, v], None, True
    if case == "sdpa-causal":

        def fn():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    elif case == "linear":
        from attnlab.nn.attention.linear import FEATURE_MAPS, causal_linear_attention

        phi = FEATURE_MAPS.get("elu+1")

        def fn():
            return causal_linear_attention(phi(q), phi(k), v, None, 64)[0]

    else:
        from attnlab.nn.attention.kernels import KERNELS
        from attnlab.nn.attention.masks import MaskSpec
        from attnlab.nn.positional.alibi import ALiBi
        from attnlab.nn.positional.relative import T5RelativeBias

        family, name = ("naive", "naive") if case == "naive" else case.split("/")
        kernel = KERNELS.get(name)
        backward = kernel.caps.backward
        pos = torch.arange(n)[None].expand(B, n)  # (B, n): positions 0 .. n-1
        window = WINDOW if family == "window256" else None
        mask = MaskSpec(pos, pos, causal=True, window=window, aligned=True)
        bias = None
        if family == "alibi":
            bias = ALiBi(n_heads=H, causal=True).score_bias(pos, pos)
        elif family == "t5":
            torch.manual_seed(0)
            scheme = T5RelativeBias(n_heads=H, causal=True)
            table = scheme.relative_attention_bias.weight  # (num_buckets, H)
            leaves.append(table)
            bias = scheme.score_bias(pos, pos)

            def check() -> dict:
                if table.grad is None or not bool(table.grad.abs().sum() > 0):
                    raise RuntimeError(f"{case}: no gradient reached the T5 table")
                return {"t5_table_grad_norm": float(table.grad.norm())}

        def fn():
            return kernel.fn(q, k, v, mask, bias, D**-0.5, 0.0, False)[0]

    def forward():
        with torch.no_grad():
            return fn()

    def step():
        for t in leaves:
            t.grad = None
        fn().backward(gout)

    return Job(forward, step if backward else None, check)


def model_jobs(positional: str, ids: torch.Tensor, lengths: tuple[int, ...]) -> list[Job]:
    """One model and optimizer, and a Job per length (the first is the warm-up: the optimizer
    state it creates is part of the baseline, as the weights are)."""
    import attnlab as al
    from attnlab.config import ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig.from_dict(dict(arch="decoder", positional={"kind": positional}, **MODEL))
    model = al.build_model(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def job(n: int) -> Job:
        x, y = ids[:, :n], ids[:, 1 : n + 1]  # (B, n) inputs and next-token targets

        def step():
            opt.zero_grad(set_to_none=True)
            logits = model(x).logits  # (B, n, vocab)
            F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
            opt.step()

        return Job(None, step)

    return [job(n) for n in lengths]


def make_jobs(case: str, n: int, warm: int = 256) -> tuple[Job, Job, Job, Job]:
    """The case and the peer at n, then both at the warm-up length."""
    if case.startswith("model/"):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, MODEL["vocab_size"], (B, n + 1), generator=g)  # (B, n + 1)
        c_warm, c = model_jobs(case.split("/")[1], ids, (warm, n))
        p_warm, p = model_jobs("none", ids, (warm, n))
        return c, p, c_warm, p_warm
    big, small = attention_inputs(n), attention_inputs(warm)
    return (
        attention_job(case, n, *big),
        attention_job("sdpa-causal", n, *big),
        attention_job(case, warm, *small),
        attention_job("sdpa-causal", warm, *small),
    )


# --- one (case, n) in its own process --------------------------------------------------------------


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith(field + ":")).split()[1])


def release() -> int:
    """Free what can be freed and return the heap's free pages to the OS; the RSS, bytes."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _status_kb("VmRSS") * 1024


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
    except OSError as err:
        raise SystemExit(
            f"cannot reset the peak RSS ({err}): this benchmark needs Linux's "
            "/proc/self/clear_refs; run it on Linux"
        ) from err


def peak_extra(run: Callable[[], object]) -> tuple[int, int, float]:
    """(peak RSS above the baseline during one run, the baseline, the run's seconds)."""
    base = release()
    reset_peak()
    t = clock(run)
    return _status_kb("VmHWM") * 1024 - base, base, t


def clock(f: Callable[[], object]) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def cpu_ticks() -> tuple[int, int]:
    """(busy clock ticks of the whole machine, steal included; ticks of this process)."""
    with open("/proc/stat") as f:
        t = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq ...
    with open("/proc/self/stat") as f:
        st = f.read().rsplit(")", 1)[1].split()  # fields 3.. of proc(5)
    return sum(t) - t[3] - t[4], int(st[11]) + int(st[12])  # utime + stime, all threads


def timing(run: Callable[[], object], peer: Callable[[], object] | None) -> dict:
    """Both at full size once (the warm-up; the case's peak RSS there, under glibc's default
    malloc settings, is kept too), then R repeats alternating with the peer's (None: this case
    is the peer); the medians, their ratio, and the share of the CPUs that other processes used
    meanwhile (above ~0.1 the ratios are unreliable: see the README)."""
    peak, _, first = peak_extra(run)
    if peer is not None:
        peer()
    repeats = 7 if first < 0.2 else 5 if first < 1 else 3
    times, peer_times = [], []
    busy0, mine0, t0 = *cpu_ticks(), time.perf_counter()
    for _ in range(repeats):
        times.append(clock(run))
        if peer is not None:
            peer_times.append(clock(peer))
    busy1, mine1, t1 = *cpu_ticks(), time.perf_counter()
    med = statistics.median(times)
    peer_med = statistics.median(peer_times) if peer is not None else med
    ticks = (t1 - t0) * os.sysconf("SC_CLK_TCK") * (os.cpu_count() or 1)
    return {
        "seconds": med,
        "peer_seconds": peer_med,
        "time_ratio": med / peer_med,
        "repeats": repeats,
        "times": times,
        "peer_times": peer_times,
        "first_seconds": first,
        "foreign_cpu": max(0.0, (busy1 - busy0 - (mine1 - mine0)) / ticks),
        "peak_extra_bytes_default_malloc": peak,
    }


def naive_weights_bytes(n: int) -> int:
    """RSS that the naive kernel's returned weights, (B, H, n, n) fp32, keep alive: one layer's
    score matrix, all heads."""
    from attnlab.nn.attention.kernels import KERNELS
    from attnlab.nn.attention.masks import MaskSpec

    q, k, v, _ = (t.detach() for t in attention_inputs(n))
    pos = torch.arange(n)[None].expand(B, n)  # (B, n)
    mask = MaskSpec(pos, pos, causal=True, aligned=True)
    base = release()
    with torch.no_grad():
        _, weights = KERNELS.get("naive").fn(q, k, v, mask, None, D**-0.5, 0.0, True)
    kept = release() - base  # the output (B, H, n, D) is freed, the weights are held
    del weights
    return kept


def child(case: str, n: int, what: str, profile: bool) -> dict:
    """`what` "memory": the peak extra memory of the forward, then of the forward+backward pass,
    each its first run at size n (this process runs under a fixed mmap threshold, see run_child);
    "time": forward+backward, then forward timed against the peer (glibc's default settings)."""
    job, peer, job_warm, peer_warm = make_jobs(case, n)
    warm = (job_warm,) if what == "memory" else (job_warm, peer_warm)
    for j in warm:  # code pages, thread pools, optimizer state: part of the baseline
        for run in (j.forward, j.step):
            if run is not None:
                run()
    passes = {"forward": (job.forward, peer.forward), "forward_backward": (job.step, peer.step)}
    res: dict = {}
    if what == "memory":
        for k, (run, _) in passes.items():
            if run is not None:
                peak, base, _ = peak_extra(run)
                res[k] = {"peak_extra_bytes": peak, "baseline_rss_bytes": base}
        if job.check is not None and job.step is not None:
            res.update(job.check())
        if case == "naive":
            res["naive_weights_bytes"] = naive_weights_bytes(n)
        return res
    alone = case in PEERS  # the peer's ratio is 1 by definition: time it alone
    for k, (run, p) in reversed(passes.items()):  # forward+backward first: its fresh-process
        if run is not None:  # default-malloc peak is the one worth keeping
            res[k] = timing(run, None if alone else p)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            (job.step or job.forward)()
        res["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    res["load_average"] = os.getloadavg()[0]
    return res


# --- the parent: every case at every n, each in a fresh process -------------------------------------


def run_child(case: str, n: int, a) -> dict:
    """Two fresh processes: memory (glibc's mmap threshold fixed at MMAP_THRESHOLD through its
    environment, see the docstring) and time (the environment as given)."""
    row: dict = {}
    t = time.perf_counter()
    for what in ("memory", "time"):
        cmd = [sys.executable, __file__, "--child", case, str(n), what, "--threads", str(a.threads)]
        env = dict(os.environ)
        if what == "memory":
            env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
        if a.profile:
            cmd.append("--profile")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"error": " | ".join(tail) or f"exit {proc.returncode}"}
        for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items():
            row[k] = {**row[k], **v} if isinstance(v, dict) and k in row else v
    row["wall_seconds"] = time.perf_counter() - t
    return row


def predicted_skip(row: dict, n_prev: int, n: int, a, time_cap: bool) -> str | None:
    """Why `n` would exceed a cap, judging from the same case at n_prev (None: it fits)."""
    if "error" in row:
        return f"failed at n {n_prev}"
    r = n / n_prev
    parts = [row[p] for p in ("forward", "forward_backward") if p in row]
    mem = max(p["peak_extra_bytes"] for p in parts) * r * r  # the n×n part grows as r²
    mem += parts[0]["baseline_rss_bytes"] * r  # the inputs as r (an upper bound: imports too)
    if mem > a.mem_cap_gb * 1e9:
        return (
            f"predicted peak {mem / 1e9:.1f} GB > --mem-cap-gb {a.mem_cap_gb:g} (from n {n_prev})"
        )
    secs = row["wall_seconds"] * r * r
    if time_cap and n > TARGET_N and secs > a.time_cap_s:
        return f"predicted {secs:.0f} s > --time-cap-s {a.time_cap_s:g} (from n {n_prev})"
    return None


def peer_of(case: str) -> str:
    return PEERS[1] if case.startswith("model/") else PEERS[0]


def plan(n: int, cases: list[str], last: dict, dropped: dict, a) -> list[tuple[str, str | None]]:
    """(case, why it is skipped or None) for every case at n. A case skipped for a cap stays
    skipped at larger n; a peer has no time cap and runs when a case of its group does."""
    out = []
    for case in cases:
        if case.startswith("model/") and n not in a.model_ns:
            continue
        why = dropped.get(case)
        if why is None and case in last:
            why = predicted_skip(last[case][1], last[case][0], n, a, case not in PEERS)
            if why is not None:
                dropped[case] = why
        out.append((case, why))
    runs = {peer_of(c) for c, why in out if why is None and c not in PEERS}
    alone = {peer_of(c) for c in cases} - {peer_of(c) for c in cases if c not in PEERS}
    return [
        (c, "not needed: no other case of its group runs at this n")
        if c in PEERS and why is None and c not in runs and c not in alone
        else (c, why)
        for c, why in out
    ]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(x.split(":", 1)[1].strip() for x in out.splitlines() if "Model name" in x)
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def verdicts(rows: list[dict]) -> list[dict]:
    """Each target of TARGETS against every row of its family at TARGET_N."""
    out = []
    for row in rows:
        family = row["case"].split("/")[0]
        if row["n"] != TARGET_N or family not in TARGETS:
            continue
        for key, limit in TARGETS[family].items():
            part = row.get("forward" if key.startswith("fwd") else "forward_backward")
            if part is None:
                continue
            mb = key.endswith("_mb")
            value = part["peak_extra_bytes"] / MB if mb else part["time_ratio"]
            out.append(
                {
                    "case": row["case"],
                    "target": key,
                    "limit": limit,
                    "measured": value,
                    "met": value <= limit,
                }
            )
    return out


def busy(row: dict) -> bool:
    """Whether other processes took more than BUSY of the CPUs while the row was timed."""
    return any(row.get(p, {}).get("foreign_cpu", 0) > BUSY for p in ("forward", "forward_backward"))


def fmt_row(row: dict) -> str:
    if "skipped" in row or "error" in row:
        why = row.get("skipped") or "error: " + row["error"]
        return f"| {row['case']} | {row['n']:,} | {why} | | | |"
    mark = " †" if busy(row) else ""
    cells = []
    for part in ("forward", "forward_backward"):
        m = row.get(part)
        cells.append("-" if m is None else f"{m['peak_extra_bytes'] / MB:,.0f}")
    for part in ("forward", "forward_backward"):
        m = row.get(part)
        cells.append("-" if m is None else f"{m['time_ratio']:.2f}")
    return f"| {row['case']}{mark} | {row['n']:,} | " + " | ".join(cells) + " |"


def report(res: dict) -> str:
    lb, la = res["load_average_before"], res["load_average_after"]
    lines = [
        f"{res['cpu']} ({os.cpu_count()} CPUs), {res['threads']} torch threads, torch "
        f"{res['torch']}; B {B}, H {H}, D {D}, fp32; kernels: {', '.join(res['kernels'])}",
        f"peak extra memory in MB (10^6 bytes); time as a ratio to sdpa-causal (model rows: to "
        f"model/none) in the same process; {res['wall_seconds'] / 60:.1f} min, load average "
        f"{lb[0]:.1f} before, {la[0]:.1f} after",
        "",
        "| case | n | fwd MB | fwd+bwd MB | fwd × | fwd+bwd × |",
        "|---|---|---|---|---|---|",
    ]
    lines += [fmt_row(r) for r in res["results"]]
    for row in res["results"]:
        if row["case"] == "sdpa-causal" and "forward" in row:
            f, fb = row["forward"], row.get("forward_backward", {})
            lines.append(
                f"sdpa-causal at n {row['n']:,}: {f['seconds'] * 1e3:.0f} ms forward, "
                f"{fb.get('seconds', float('nan')) * 1e3:.0f} ms forward+backward"
            )
    for row in res["results"]:
        if row["case"] == "naive" and "naive_weights_bytes" in row:
            n, kept = row["n"], row["naive_weights_bytes"]
            per_head, fwd = kept / (B * H), row["forward"]["peak_extra_bytes"]
            lines.append(
                f"naive, n {n:,}: the returned weights keep {kept / MB:,.0f} MB = "
                f"{per_head / MB:,.1f} MB per head (n²·4 = {n * n * 4 / MB:,.1f} MB); forward "
                f"peak {fwd / MB:,.0f} MB = {fwd / (B * H * n * n * 4):.2f} n×n fp32 matrices "
                "per head"
            )
    if any(busy(r) for r in res["results"]):
        lines.append(
            f"† other processes used more than {BUSY:.0%} of the CPUs while this row was timed "
            "(foreign_cpu in the JSON): its time ratios are unreliable; rerun it with --merge"
        )
    for name, why in res["skipped_pairs"].items():
        lines.append(f"not measured: {name}: {why}")
    for v in res["targets"]:
        unit = " MB" if v["target"].endswith("_mb") else "×"
        verdict = "met" if v["met"] else "NOT met"
        lines.append(
            f"target n {TARGET_N}: {v['case']} {v['target']} <= {v['limit']:g}{unit}: "
            f"measured {v['measured']:,.2f}{unit}  {verdict}"
        )
    return "\n".join(lines)


RUN_KEYS = ("command", "load_average_before", "load_average_after", "wall_seconds")


def merged(path: str, new: dict, names: list[str]) -> dict:
    """The result in `path` with the rows of `new` in place of its rows of the same case and n
    (skipped rows of `new` replace nothing); the runs' commands, times and loads are listed."""
    with open(path) as f:
        old = json.load(f)
    fresh = {(r["case"], r["n"]): r for r in new["results"] if "skipped" not in r}
    rows = [r for r in old["results"] if (r["case"], r["n"]) not in fresh] + list(fresh.values())
    order = {c: i for i, c in enumerate(names)}
    rows.sort(key=lambda r: (r["n"], order.get(r["case"], len(order))))
    runs = old.get("runs", [{k: old[k] for k in RUN_KEYS if k in old}])
    runs.append({k: new[k] for k in RUN_KEYS})
    wall = sum(r["wall_seconds"] for r in runs)
    return {
        **old,
        **{k: new[k] for k in RUN_KEYS},
        "runs": runs,
        "results": rows,
        "wall_seconds": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", help=f"comma-separated lengths (default {','.join(map(str, N_ALL))})")
    p.add_argument("--quick", action="store_true", help="n 1024, 2048 only (models too)")
    p.add_argument("--cases", help="comma-separated names, families or globs: alibi,t5/chunked")
    p.add_argument("--model-n", help=f"model lengths (default {','.join(map(str, N_MODEL))})")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mem-cap-gb", type=float, default=10.0)
    p.add_argument("--time-cap-s", type=float, default=120.0)
    p.add_argument("--profile", action="store_true", help="torch.profiler top ops for each case")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument(
        "--merge",
        metavar="JSON",
        help="start from this earlier result: the rows measured now replace its rows of the same "
        "case and n (to rerun rows timed on a busy machine)",
    )
    p.add_argument("--list", action="store_true", help="print the case names and exit")
    p.add_argument("--child", nargs=3, metavar=("CASE", "N", "WHAT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.child:
        print(json.dumps(child(a.child[0], int(a.child[1]), a.child[2], a.profile)))
        return

    names, skipped_pairs = all_cases()
    if a.list:
        print("\n".join(names))
        return
    patterns = a.cases.split(",") if a.cases else None
    unknown = [x for x in patterns or [] if not any(matches(c, x) for c in names)]
    if unknown:
        raise SystemExit(f"--cases {','.join(unknown)}: no such case; known: {', '.join(names)}")
    ns = (
        N_QUICK if a.quick else tuple(int(x) for x in (a.n or ",".join(map(str, N_ALL))).split(","))
    )
    a.model_ns = (
        N_QUICK
        if a.quick
        else tuple(int(x) for x in (a.model_n or ",".join(map(str, N_MODEL))).split(","))
    )
    cases = [c for c in names if selected(c, patterns)]
    for peer in PEERS:  # a peer runs alone only when asked for by name
        group = [c for c in cases if peer_of(c) == peer and c != peer]
        if patterns and not group and not any(matches(peer, x) for x in patterns):
            cases.remove(peer)

    res = {
        "shape": {"B": B, "H": H, "D": D, "dtype": "float32", "window": WINDOW, "model": MODEL},
        "threads": a.threads,
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "command": " ".join(["python", *sys.argv]),
        "caps": {"mem_cap_gb": a.mem_cap_gb, "time_cap_s": a.time_cap_s},
        "load_average_before": os.getloadavg(),
        "kernels": kernel_names(),
        "skipped_pairs": skipped_pairs,
        "results": [],
    }
    last: dict[str, tuple[int, dict]] = {}  # case -> (n, row) of its last run
    dropped: dict[str, str] = {}
    t_start = time.perf_counter()
    for n in ns:
        for case, why in plan(n, cases, last, dropped, a):
            row: dict = {"case": case, "n": n}
            if why is not None:
                row["skipped"] = why
            else:
                row.update(run_child(case, n, a))
                last[case] = (n, row)
            res["results"].append(row)
            load = f"load {row['load_average']:.1f}  " if "load_average" in row else ""
            print(f"[{time.perf_counter() - t_start:5.0f} s] {load}{fmt_row(row)}", file=sys.stderr)
            if "profile" in row:
                print(row["profile"], file=sys.stderr)
    res["load_average_after"] = os.getloadavg()
    res["wall_seconds"] = time.perf_counter() - t_start
    if a.merge:
        res = merged(a.merge, res, names)
    res["targets"] = verdicts(res["results"])
    print(report(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
