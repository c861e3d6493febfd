"""Longformer attention on CPU against torch's causal sdpa, measured in the same process.

    python benchmarks/longformer.py --out benchmarks/results/longformer.json
    python benchmarks/longformer.py --n 2048,8192 --repeats 3

Shape: B 1, H 12, D 64 (d_model 768), fp32, 2 torch threads, window W = 512 (transformers'
attention_window: |q − k| <= 256), 4 global tokens (positions 0, 1, n/4, n/2). Forward only,
under no_grad. Two levels:

    kernel   the attention itself on the same q, k, v (B, H, n, D):
               sdpa-causal   F.scaled_dot_product_attention(is_causal=True): the peer
               longformer    the default kernel ("sdpa" -> chunked blocks) on the local mask
                             (window ∪ global keys) + the global rows' (B, H, 4, n) call
    layer    the whole attention layer, projections included:
               softmax-causal  attnlab's Attention with a plain causal mask (sdpa is_causal):
                               4 projections
               longformer      LongformerAttention (nn/attention/longformer.py) with the global
                               tokens: 4 projections + 3 global ones (k/v_global over all n)

Time: after one warm-up run each, the case and its peer alternate for --repeats rounds; each
figure is a median and the ratio is longformer / peer from the same process, so load from other
processes falls on both alike; `best` is the ratio of the fastest runs (on a loaded machine the
many small block-by-block operations of the longformer path suffer more than one fused call). `largest` is the largest tensor (elements) the longformer layer
creates (tests/helpers/memory.py's LargestTensor), against the n·n·H a score tensor would hold.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab.nn.attention import Attention, AttnContext, GlobalRows, LongformerAttention, MaskSpec
from attnlab.nn.attention.kernels import KERNELS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.memory import LargestTensor  # the tests' own measure

H, D, WINDOW = 12, 64, 512


def masks(n: int) -> tuple[MaskSpec, MaskSpec]:
    pos = torch.arange(n)[None]  # (1, n)
    g = torch.zeros(1, n, dtype=torch.bool)
    g[0, [0, 1, n // 4, n // 2]] = True
    window = WINDOW // 2 + 1  # |q - k| <= W / 2 (config/attention.py, LongformerAttentionConfig)
    longformer = MaskSpec(pos, pos, False, window, None, True, q_global=g, k_global=g)
    return longformer, MaskSpec(pos, pos, True, aligned=True)


def alternate(case, peer, repeats: int) -> dict[str, float]:
    case(), peer()  # warm-up
    a, b = [], []
    for _ in range(repeats):
        for fn, out in ((case, a), (peer, b)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    med, best = (statistics.median(a), statistics.median(b)), (min(a), min(b))
    return dict(longformer_s=med[0], peer_s=med[1], ratio=med[0] / med[1],
                best_longformer_s=best[0], best_peer_s=best[1], best_ratio=best[0] / best[1])  # fmt: skip


def run(n: int, repeats: int) -> dict:
    torch.manual_seed(0)
    spec, causal = masks(n)
    q, k, v = (torch.randn(1, H, n, D) for _ in range(3))
    sdpa = KERNELS.get("sdpa").fn
    rows = GlobalRows.of(spec.q_global)

    def longformer_kernel():
        sdpa(q, k, v, spec.local(), None, D**-0.5)
        sdpa(rows.gather(q.transpose(1, 2)).transpose(1, 2), k, v, spec.select_rows(rows), None, D**-0.5)  # fmt: skip

    x = torch.randn(1, n, H * D)
    lf = LongformerAttention(d_model=H * D, n_heads=H).eval()
    sm = Attention(d_model=H * D, n_heads=H, qkv_bias=True, o_bias=True).eval()
    with torch.no_grad():
        kernel = alternate(
            longformer_kernel,
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            repeats,
        )
        layer = alternate(
            lambda: lf(x, AttnContext(spec)), lambda: sm(x, AttnContext(causal)), repeats
        )
        with LargestTensor() as mode:
            lf(x, AttnContext(spec))
    return {
        "n": n,
        "kernel (peer: sdpa-causal)": kernel,
        "layer (peer: softmax-causal)": layer,
        "largest_elements": mode.largest,
        "score_tensor_elements": H * n * n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="2048,4096,8192")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for n in (int(s) for s in args.n.split(",")):
        r = run(n, args.repeats)
        results.append(r)
        kr, lr = r["kernel (peer: sdpa-causal)"], r["layer (peer: softmax-causal)"]
        print(
            f"n {n:>6}  kernel {kr['longformer_s']:.3f}s vs sdpa-causal {kr['peer_s']:.3f}s = "
            f"{kr['ratio']:.2f}x (best {kr['best_ratio']:.2f}x)   layer {lr['longformer_s']:.3f}s "
            f"vs softmax-causal {lr['peer_s']:.3f}s = {lr['ratio']:.2f}x (best "
            f"{lr['best_ratio']:.2f}x)   largest {r['largest_elements']:,} of "
            f"{r['score_tensor_elements']:,}",
            flush=True,
        )
    if args.out:
        meta = dict(B=1, H=H, D=D, attention_window=WINDOW, global_tokens=4, threads=args.threads)
        meta.update(torch=torch.__version__, repeats=args.repeats)
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
