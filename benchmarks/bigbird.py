"""BigBird's block-sparse attention on CPU: peak extra memory and forward+backward time of one
layer's attention, against torch's causal sdpa measured in the same process.

    python benchmarks/bigbird.py                   # n 8192, B 1, H 12, D 64, blocks of 64, r 3
    python benchmarks/bigbird.py --n 4096 --mode eval --kernel chunked

The case: q, k, v (B, H, n, D) fp32 with requires_grad, the mask description a
`BlockSparseAttention` layer builds (nn/attention/block_sparse.py: training mode's random plan,
or eval mode's block-0 plan with its key-count bias), through the layer's kernel; the peer is
F.scaled_dot_product_attention(q, k, v, is_causal=True). Each runs forward + backward
(out.backward(gout)), 2 torch threads.

Memory, as benchmarks/attention.py measures it: one process per case; after a warm-up at the
shortest block-sparse length (n = (6 + 2r)·b)
freed heap goes back to the OS (glibc malloc_trim), the resident set (VmRSS) is the baseline, the
peak (VmHWM, reset through /proc/self/clear_refs) minus the baseline is the peak extra memory.
Time: the case and the peer alternate, 3 repeats each, medians; the ratio is case / peer.
MB are 10^6 bytes.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from attnlab.nn.attention import KERNELS, BlockSparseAttention


def _kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _baseline() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to VmRSS
    return _kb("VmRSS") * 1024


def inputs(n: int, B: int, H: int, D: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(B, H, n, D, generator=g)


def case_fn(a: argparse.Namespace, n: int):
    layer = BlockSparseAttention(
        d_model=a.heads * a.dim,
        n_heads=a.heads,
        block_size=a.block,
        num_random_blocks=a.random,
        kernel=a.kernel,
    ).train(a.mode == "train")
    kernel = KERNELS.get(a.kernel)

    def run(q, k, v, gout):
        mask = layer.pattern(n, None, q.device)
        out, _ = kernel.fn(q, k, v, mask, mask.bias(), a.dim**-0.5)
        out.backward(gout)

    return run


def peer(q, k, v, gout):
    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(gout)


def one(a: argparse.Namespace, which: str) -> dict:
    """Run in a child process: the peak extra memory of `which` ('case' or 'peer')."""
    torch.set_num_threads(a.threads)
    fn = case_fn(a, a.n) if which == "case" else peer
    warm = (6 + 2 * a.random) * a.block  # the shortest length that runs block-sparse
    small = inputs(warm, a.batch, a.heads, a.dim)
    (case_fn(a, warm) if which == "case" else peer)(*small)  # code pages, thread pools
    del small
    args = inputs(a.n, a.batch, a.heads, a.dim)
    base = _baseline()
    fn(*args)
    peak = _kb("VmHWM") * 1024 - base
    times = {"case": [], "peer": []}
    other = peer if which == "case" else case_fn(a, a.n)
    for _ in range(a.repeats):
        for name, f in ((which, fn), ("peer" if which == "case" else "case", other)):
            for t in args[:3]:
                t.grad = None
            t0 = time.perf_counter()
            f(*args)
            times[name].append(time.perf_counter() - t0)
    return {"peak_mb": peak / 1e6, **{f"{k}_s": statistics.median(v) for k, v in times.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--random", type=int, default=3)
    p.add_argument("--kernel", default="sdpa")
    p.add_argument("--mode", choices=["train", "eval"], default="train")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", choices=["case", "peer"])
    a = p.parse_args()
    if a.child:
        print(json.dumps(one(a, a.child)))
        return
    res = {}
    for which in ("case", "peer"):
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--child", which],
            capture_output=True,
            text=True,
            check=True,
        )
        res[which] = json.loads(out.stdout.strip().splitlines()[-1])
    case, ref = res["case"], res["peer"]
    time_case = statistics.median([case["case_s"], ref["case_s"]])
    time_peer = statistics.median([case["peer_s"], ref["peer_s"]])
    print(
        json.dumps(
            {
                "n": a.n,
                "mode": a.mode,
                "kernel": a.kernel,
                "peak_extra_mb": round(case["peak_mb"], 1),
                "peer_peak_extra_mb": round(ref["peak_mb"], 1),
                "fwd_bwd_s": round(time_case, 3),
                "peer_fwd_bwd_s": round(time_peer, 3),
                "time_x_sdpa_causal": round(time_case / time_peer, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
