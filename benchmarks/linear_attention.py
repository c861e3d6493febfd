"""Causal linear attention (src/attnlab/nn/attention/linear.py, chunked) against
torch.nn.functional.scaled_dot_product_attention(is_causal=True), in the same process.

The attention function alone, q, k, v -> out: (B, H, n, D) fp32, φ = elu + 1 applied inside the
linear case. Time is the best of `--repeats` runs after one warm-up, forward and forward +
backward. Memory is the peak resident memory a case adds above its inputs, measured in a fresh
process per case (Linux: VmHWM reset through /proc/self/clear_refs before the case), so one
case's allocations cannot hide another's; it includes what kernels allocate internally.

    python benchmarks/linear_attention.py                 # n 8192, B 1, H 8, D 64, 2 threads
    python benchmarks/linear_attention.py --n 2048 --json benchmarks/results/linear_attention.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

CASES = ("sdpa", "linear")


def attention(case: str, q, k, v, chunk: int):
    if case == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    from attnlab.nn.attention.linear import FEATURE_MAPS, causal_linear_attention

    phi = FEATURE_MAPS.get("elu+1")
    return causal_linear_attention(phi(q), phi(k), v, None, chunk)[0]


def inputs(a, grad: bool):
    g = torch.Generator().manual_seed(0)
    shape = (a.batch, a.heads, a.n, a.dim)
    return [torch.randn(shape, generator=g).requires_grad_(grad) for _ in range(3)]


def best_time(case: str, a, backward: bool) -> float:
    q, k, v = inputs(a, backward)
    times = []
    for _ in range(a.repeats + 1):  # the first is a warm-up
        for t in (q, k, v):
            t.grad = None
        start = time.perf_counter()
        out = attention(case, q, k, v, a.chunk)
        if backward:
            out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - start)
        del out
    return min(times[1:])


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1])


def peak_extra_bytes(case: str, a, backward: bool) -> int:
    """In this (fresh) process: peak RSS while running the case, minus RSS with its inputs."""
    q, k, v = inputs(a, backward)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    before = _status_kb("VmRSS")
    out = attention(case, q, k, v, a.chunk)
    if backward:
        out.backward(torch.ones_like(out))
    return (_status_kb("VmHWM") - before) * 1024


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(x.split(":", 1)[1].strip() for x in out.splitlines() if "Model name" in x)
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--memory-of", nargs=2, metavar=("CASE", "BACKWARD"), help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.memory_of:  # the child process of one memory measurement
        print(peak_extra_bytes(a.memory_of[0], a, a.memory_of[1] == "1"))
        return
    res = {
        "shape": dict(B=a.batch, H=a.heads, n=a.n, D=a.dim, dtype="float32", chunk=a.chunk),
        "threads": a.threads,
        "cpu": cpu_model(),
        "torch": torch.__version__,
    }
    args = [f"--{k}={getattr(a, k)}" for k in ("n", "batch", "heads", "dim", "chunk", "threads")]
    for case in CASES:
        for backward in (False, True):
            name = f"{case} {'forward+backward' if backward else 'forward'}"
            child = [sys.executable, __file__, *args, "--memory-of", case, str(int(backward))]
            mem = int(subprocess.run(child, capture_output=True, text=True, check=True).stdout)
            res[name] = {"seconds": best_time(case, a, backward), "peak_extra_bytes": mem}
    for what in ("forward", "forward+backward"):
        lin, ref = res[f"linear {what}"], res[f"sdpa {what}"]
        res[f"linear / sdpa {what}"] = {
            "time": lin["seconds"] / ref["seconds"],
            "peak_extra_memory": lin["peak_extra_bytes"] / ref["peak_extra_bytes"],
        }
    input_bytes = 3 * a.batch * a.heads * a.n * a.dim * 4
    print(f"{res['cpu']}, {a.threads} threads, torch {torch.__version__}")
    print(f"B {a.batch}, H {a.heads}, n {a.n}, D {a.dim}, fp32, chunk {a.chunk}; ", end="")
    print(f"q, k, v {input_bytes / 2**20:.0f} MiB")
    for case in CASES:
        for what in ("forward", "forward+backward"):
            r = res[f"{case} {what}"]
            mb = r["peak_extra_bytes"] / 2**20
            print(f"  {case:6s} {what:17s} {r['seconds'] * 1e3:8.1f} ms   peak +{mb:7.1f} MiB")
    for what in ("forward", "forward+backward"):
        r = res[f"linear / sdpa {what}"]
        print(f"  linear / sdpa {what}: time {r['time']:.3f}, memory {r['peak_extra_memory']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
