"""RMSNorm speed on CPU: attnlab against torch's fused LayerNorm and torch's F.rms_norm.

    python benchmarks/norms.py --out benchmarks/results/norms.json       # 2 threads, then 1
    python benchmarks/norms.py --threads 1 --dims 512 --dtypes bf16 --out /tmp/norms.json
    python benchmarks/norms.py --rows 8 --out /tmp/norms-decode.json     # decoding-sized rows

Rows 3,072 (e.g. batch 12 x 256 tokens), d in {128, 512, 4096}, fp32 and, where the CPU has
native bf16 arithmetic (AVX512-BF16 or AMX, detected at run time), bf16. Each case is timed
forward only (under no_grad: inference) and forward + backward (grad of x and of the weight,
upstream gradient fixed, `.grad` cleared between calls). Cases:

    attnlab            attnlab.nn.norms.rms_norm, what RMSNorm.forward calls (nn/norms.py);
                       called as a function, like the torch cases, not through nn.Module
    attnlab-reference  rms_norm_reference: the formula, which RMSNorm ran before (the oracle)
    torch-layer_norm   F.layer_norm with weight and bias (nn.LayerNorm's default): the peer
    torch-rms_norm     F.rms_norm with weight; on CPU torch has no fused kernel for it, and in
                       bf16 it multiplies by the weight before rounding (one rounding, where
                       Llama's order rounds x̂ first), so its bf16 output differs from attnlab's

Every case of one (threads, dtype, d, pass) group is timed in the same rounds, one window each,
the order rotating every round, so background load falls on all of them alike; a case's time is
the median of its windows, and its ratio to torch-layer_norm the median of same-round ratios
(the ratio of the medians is in the JSON too). `uptime` is recorded before and after each thread
count.

Before timing, one tensor of just under 32 MiB is allocated and freed. glibc's malloc raises its
mmap threshold to the size of the largest mmap'd block freed so far (capped at 32 MiB) and
returns heap memory to the system above twice that, so until then every temporary of a few MiB
is mmap'd (or trimmed) and page-faulted afresh on each call, about 1 µs a page on this VM; which
case pays for that would depend on the order the cases ran in. A training process is in the
warm state after its first large free. --cold-allocator skips the warm-up.

Threads: 2 (the development machine's core count), then 1. On a shared machine a 2-thread op
stalls whenever another process preempts one of its threads, and the more ops a call launches
the more often it stalls (at load average 3-4 from another 2-thread job, LayerNorm's forward
took 8 ms instead of 0.1 ms and attnlab's ratios came out 2-50x), so check the recorded load,
and read the 1-thread figures as the steadier measure of the kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab.nn.norms import RMSNorm, rms_norm, rms_norm_reference

EPS_RMS, EPS_LN = 1e-6, 1e-5
CASES = ("attnlab", "attnlab-reference", "torch-layer_norm", "torch-rms_norm")
PEER = "torch-layer_norm"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(x.split(":", 1)[1].strip() for x in out.splitlines() if "Model name" in x)
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def cpu_features() -> dict[str, object]:
    """What torch's CPU kernels can use here (torch dispatches on these at run time)."""
    probe = {
        "avx512_bf16": getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)(),
        "amx_tile": getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)(),
    }
    return {"capability": torch.backends.cpu.get_cpu_capability(), **probe}


def native_bf16(features: dict[str, object]) -> bool:
    return bool(features["avx512_bf16"] or features["amx_tile"])


def tensors(rows: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x (rows, d) with a non-zero mean, weight and bias (d,), an upstream gradient (rows, d)."""
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(rows, d, generator=g) * 2 + 0.5).to(dtype)
    weight = (torch.randn(d, generator=g) * 0.2 + 1).to(dtype)
    bias = (torch.randn(d, generator=g) * 0.2).to(dtype)
    return x, weight, bias, torch.randn(rows, d, generator=g).to(dtype)


def make_case(
    name: str, rows: int, d: int, dtype: torch.dtype, backward: bool
) -> Callable[[], object]:
    """A no-argument callable running one forward (and backward) of `name` on fixed tensors."""
    x, weight, bias, grad = tensors(rows, d, dtype)
    params = [weight, bias]
    if name == "attnlab":
        fn = lambda t: rms_norm(t, weight, EPS_RMS)  # noqa: E731
        params = [weight]
    elif name == "attnlab-reference":
        fn = lambda t: rms_norm_reference(t, weight, EPS_RMS)  # noqa: E731
    elif name == "torch-layer_norm":
        fn = lambda t: F.layer_norm(t, (d,), weight, bias, EPS_LN)  # noqa: E731
    elif name == "torch-rms_norm":
        fn = lambda t: F.rms_norm(t, (d,), weight, EPS_RMS)  # noqa: E731
    else:
        raise ValueError(f"case {name!r}: unknown; known: {', '.join(CASES)}")
    if not backward:

        def forward() -> object:
            with torch.no_grad():
                return fn(x)

        return forward
    x.requires_grad_(True)
    for p in params:
        p.requires_grad_(True)
    leaves = [x, *params]

    def forward_backward() -> object:
        for t in leaves:
            t.grad = None
        fn(x).backward(grad)
        return x.grad

    return forward_backward


def calibrate(run: Callable[[], object], window_s: float) -> int:
    """Calls per window so that one window takes about `window_s` (at least 1)."""
    run()
    t0 = time.perf_counter()
    run()
    once = max(time.perf_counter() - t0, 1e-6)
    return max(1, round(window_s / once))


def time_group(runs: dict[str, Callable[[], object]], rounds: int, window_s: float) -> dict:
    """Median seconds per call of each case over `rounds` interleaved windows."""
    calls = {name: calibrate(run, window_s) for name, run in runs.items()}
    windows: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            run, n = runs[name], calls[name]
            t0 = time.perf_counter()
            for _ in range(n):
                run()
            windows[name].append((time.perf_counter() - t0) / n)
    out = {}
    for name, w in windows.items():
        row = {
            "median_s": statistics.median(w),
            "min_s": min(w),
            "windows_s": w,
            "calls": calls[name],
        }
        if PEER in windows:
            pairs = zip(w, windows[PEER], strict=True)
            row["vs_layer_norm"] = row["median_s"] / statistics.median(windows[PEER])
            row["vs_layer_norm_paired"] = statistics.median(a / b for a, b in pairs)
        out[name] = row
    return out


def check_same_function(rows: int, d: int, dtype: torch.dtype) -> dict[str, float]:
    """attnlab vs its formula on the benchmark's inputs: forward and gradients, max |diff|."""
    x, weight, _, up = tensors(rows, d, dtype)
    x.requires_grad_(True)
    norm = RMSNorm(dim=d, eps=EPS_RMS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    w_ref = norm.weight.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    ours, ref = norm(x), rms_norm_reference(x_ref, w_ref, EPS_RMS)
    ours.backward(up)
    ref.backward(up)

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.double() - b.double()).abs().max().item()

    return {
        "forward_max_abs_diff": diff(ours, ref),
        "forward_equal_fraction": (ours == ref).double().mean().item(),
        "grad_x_max_abs_diff": diff(x.grad, x_ref.grad),
        "grad_weight_max_abs_diff": diff(norm.weight.grad, w_ref.grad),
    }


def warm_allocator() -> None:
    """Free one block just under glibc's 32 MiB mmap-threshold cap (module doc)."""
    block = torch.empty(((32 << 20) - (1 << 16)) // 4)
    block.fill_(0.0)
    del block


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def run(args) -> dict:
    if not args.cold_allocator:
        warm_allocator()
    features = cpu_features()
    dtypes = args.dtypes or ["fp32", *(["bf16"] if native_bf16(features) else [])]
    rows, load = [], {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        load[threads] = {"uptime_before": uptime(), "load_average_before": os.getloadavg()}
        for dtype_name in dtypes:
            for d in args.dims:
                for backward in (False, True):
                    runs = {
                        name: make_case(name, args.rows, d, DTYPES[dtype_name], backward)
                        for name in args.cases
                    }
                    rows.append(
                        {
                            "threads": threads,
                            "dtype": dtype_name,
                            "d": d,
                            "pass": "forward+backward" if backward else "forward",
                            "results": time_group(runs, args.rounds, args.window),
                        }
                    )
                    print(line(rows[-1]), file=sys.stderr, flush=True)
        load[threads].update(uptime_after=uptime(), load_average_after=os.getloadavg())
    checks = {
        f"{t}/d{d}": check_same_function(args.rows, d, DTYPES[t]) for t in dtypes for d in args.dims
    }
    return {
        "rows": args.rows,
        "rounds": args.rounds,
        "window_s": args.window,
        "eps": {"rmsnorm": EPS_RMS, "layernorm": EPS_LN},
        "allocator_warmed": not args.cold_allocator,
        "libc": " ".join(platform.libc_ver()),
        "cpu": cpu_model(),
        "cpu_features": features,
        "cores": os.cpu_count(),
        "load_by_threads": load,
        "results": rows,
        "attnlab_vs_reference": checks,
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "platform": platform.platform(),
        "command": " ".join(["python", *sys.argv]),
    }


def line(row: dict) -> str:
    cells = []
    for name, r in row["results"].items():
        ratio = f" ({r['vs_layer_norm_paired']:.2f}x)" if name != PEER else ""
        cells.append(f"{name} {r['median_s'] * 1e6:,.0f} us{ratio}")
    head = f"{row['threads']}t {row['dtype']:>4} d={row['d']:<5} {row['pass']:<16} "
    return head + "  ".join(cells)


def table(res: dict) -> str:
    """Markdown: median µs per call, and (x) time / LayerNorm's time (<= 1.00x: no slower)."""
    names = [n for n in CASES if n in res["results"][0]["results"]]
    lines = [
        "| threads | dtype | d | pass | " + " | ".join(names) + " |",
        "|" + "---|" * (4 + len(names)),
    ]
    for row in res["results"]:
        cells = []
        for n in names:
            r = row["results"][n]
            ratio = f" ({r['vs_layer_norm_paired']:.2f}x)" if n != PEER else ""
            cells.append(f"{r['median_s'] * 1e6:,.0f}{ratio}")
        head = f"| {row['threads']} | {row['dtype']} | {row['d']} | {row['pass']} | "
        lines.append(head + " | ".join(cells) + " |")
    lines.append(
        f"rows {res['rows']}; µs per call, median of {res['rounds']} interleaved windows; (x): "
        f"median same-round time / {PEER}'s. {res['cpu']} "
        f"({res['cpu_features']['capability']}), torch {res['versions']['torch']}, "
        f"allocator warmed: {res['allocator_warmed']}"
    )
    for threads, load in res["load_by_threads"].items():
        lines.append(f"{threads} threads: before {load['uptime_before']}")
        lines.append(f"{threads} threads: after  {load['uptime_after']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/norms.json"))
    p.add_argument(
        "--threads", type=int, nargs="+", default=[2, 1], help="torch thread counts, in turn"
    )
    p.add_argument("--rows", type=int, default=3072)
    p.add_argument("--dims", type=int, nargs="+", default=[128, 512, 4096])
    p.add_argument(
        "--dtypes",
        nargs="+",
        choices=list(DTYPES),
        help="default: fp32, and bf16 where the CPU has native bf16 (AVX512-BF16 or AMX)",
    )
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--rounds", type=int, default=15, help="timed windows per case")
    p.add_argument("--window", type=float, default=0.05, help="seconds per window (about)")
    p.add_argument(
        "--cold-allocator",
        action="store_true",
        help="skip the malloc warm-up (module doc): page faults then depend on the case order",
    )
    args = p.parse_args(argv)
    res = run(args)
    print(table(res))
    for key, c in res["attnlab_vs_reference"].items():
        print(
            f"attnlab vs formula {key}: forward max |diff| {c['forward_max_abs_diff']:.2e} "
            f"({100 * c['forward_equal_fraction']:.2f} % equal), grad x "
            f"{c['grad_x_max_abs_diff']:.2e}, grad w {c['grad_weight_max_abs_diff']:.2e}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
