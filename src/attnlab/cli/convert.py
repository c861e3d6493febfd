"""`attnlab convert SRC DST`: a model from where it lives (a run directory, a checkpoint folder,
an HF folder, a .gguf file) to an HF folder (transformers, vLLM, SGLang read it) or a .gguf file
(llama.cpp, ollama, LM Studio run it), with its tokenizer, chat template, special tokens and
generation settings.

    attnlab convert runs/my-run out/my-model                 # an HF folder, f32
    attnlab convert model.gguf out/model --dtype bf16         # GGUF -> HF
    attnlab convert out/model model-q8.gguf --quant q8_0      # HF -> GGUF (llama.cpp's layout)
    attnlab convert a.gguf b.gguf                             # every tensor kept in its type

DST is written whole or not at all (src/attnlab/atomic.py): a hidden sibling renamed into place
when complete (for a folder: the weights, then config.json, then the whole folder), nothing at
DST if the write is stopped; an existing DST is refused unless --force. The GGUF side is
src/attnlab/interop/gguf/writer.py; its tokenizer is the source .gguf file's own keys (or
--vocab-from FILE.gguf's, or those of the .gguf file a run was fine-tuned from), else the
byte-level BPE tokenizer.json written as llama.cpp's converter writes it. A run fine-tuned from a
checkpoint (model.pretrained) is written as that checkpoint's family.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import add_command
from .runs import fail

DTYPES = ("f32", "f16", "bf16")
QUANTS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k")


def _destination(args: argparse.Namespace) -> tuple[Path, str]:
    dst = Path(args.dst)
    to = args.to or ("gguf" if dst.suffix == ".gguf" else "hf")
    if to == "hf" and args.quant:
        raise ValueError(
            f"--quant {args.quant} writes GGUF blocks; an HF folder holds f32 / f16 / bf16 "
            "weights (--dtype), or write DST.gguf"
        )
    if to == "gguf" and dst.suffix != ".gguf":
        raise ValueError(f"--to gguf writes a file: name it {dst.name}.gguf")
    if to == "hf" and dst.suffix == ".gguf":
        raise ValueError(f"--to hf writes a folder, not {dst.name}: drop the .gguf suffix")
    if args.dtype and args.quant:
        raise ValueError("--dtype and --quant both set the weights' type: give one")
    if dst.exists() and not args.force:
        raise FileExistsError(f"{dst} exists: choose another DST, or pass --force to replace it")
    if Path(args.src).resolve() == dst.resolve():
        raise ValueError("SRC and DST are the same path: write the conversion elsewhere")
    return dst, to


def run(args: argparse.Namespace) -> int:
    try:
        dst, to = _destination(args)
        if args.quant:
            from ..interop.gguf.writer import check_outtype

            check_outtype(args.quant)
    except (ValueError, FileExistsError) as err:
        return fail(err)
    from ..atomic import Interrupted
    from ..loading import load_model

    served = load_model(args.src)
    origin = _run_origin(Path(args.src))  # a run fine-tuned from a checkpoint: that checkpoint
    model_type = (
        args.model_type
        or getattr(served.model, "hf_model_type", None)
        or (origin[0] if origin else None)
    )
    if args.vocab_from is None and origin is not None and origin[1] is not None:
        args.vocab_from = origin[1]
    if model_type is None:
        return fail(
            f"{args.src} holds a model attnlab built itself: name the transformers family to "
            "write it as with --model-type (llama, qwen2, gpt2, ...); its config is checked "
            "to be exactly expressible there"
        )
    try:
        if to == "hf":
            _write_hf(served, dst, model_type, args)
        else:
            _write_gguf(served, dst, model_type, args)
    except Interrupted as err:
        return fail(f"{err}: nothing was written to {dst}")
    size = sum(f.stat().st_size for f in dst.rglob("*")) if dst.is_dir() else dst.stat().st_size
    print(f"wrote {dst} ({size / 2**20:.1f} MiB)")
    return 0


def _write_hf(served, dst: Path, model_type: str, args: argparse.Namespace) -> None:
    import torch

    from ..atomic import atomic_folder
    from ..interop import save_pretrained

    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    model = served.model.to(dtype[args.dtype or "f32"])
    with atomic_folder(dst, force=args.force) as tmp:
        save_pretrained(model, tmp, model_type)
        served.tokenizer.save(str(tmp / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for name, i in (("bos_token", served.bos_token_id), ("eos_token", _first(served))):
            if i is not None:
                config[name] = served.token(i)
        if served.chat_template:
            config["chat_template"] = served.chat_template
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _run_origin(src: Path) -> tuple[str, Path | None] | None:
    """(transformers model_type, its .gguf file or None) of the checkpoint a run directory was
    fine-tuned from (its recipe's model.pretrained), or None for anything else."""
    from ..train import checkpoint

    folder = checkpoint.best_or_last(src) if src.is_dir() else None
    if folder is None and src.is_dir() and (src / checkpoint.MANIFEST).exists():
        folder = src
    if folder is None:
        return None
    pretrained = (checkpoint.load_recipe(folder).get("model") or {}).get("pretrained")
    if not pretrained:
        return None
    from ..interop.pretrained import _is_gguf, locate_gguf, locate_pretrained

    if _is_gguf(pretrained):
        from ..interop.gguf import gguf_file_config

        path = locate_gguf(pretrained)
        return gguf_file_config(path)[0]["model_type"], path
    config = json.loads((locate_pretrained(pretrained) / "config.json").read_text())
    return config["model_type"], None


def _first(served) -> int | None:
    return served.eos_token_ids[0] if served.eos_token_ids else None


def _write_gguf(served, dst: Path, model_type: str, args: argparse.Namespace) -> None:
    from ..interop.gguf import save_gguf, source_types, vocab_from_gguf, vocab_from_tokenizer

    src = Path(args.src)
    from_gguf = src.suffix == ".gguf"
    vocab_file = args.vocab_from or (src if from_gguf else None)
    if vocab_file is not None:
        vocab = vocab_from_gguf(vocab_file)
    else:
        vocab = vocab_from_tokenizer(
            served.tokenizer,
            served.model.vocab_size,
            chat_template=served.chat_template,
            bos=served.bos_token_id,
            eos=_first(served),
        )
    outtype = args.quant or args.dtype
    types = file_type = None
    if outtype is None and from_gguf:  # every tensor as the source stores it
        types, file_type = source_types(src)
    save_gguf(
        served.model,
        dst,
        vocab=vocab,
        outtype=outtype or "f32",
        model_type=model_type,
        name=args.name or served.name,
        types=types,
        file_type=file_type,
        progress=sys.stderr.isatty(),
    )


def register(sub) -> None:
    p = add_command(
        sub,
        "convert",
        "write a model as an HF folder or a llama.cpp .gguf file",
        "SRC: a run directory, a checkpoint folder, an HF folder or a .gguf file. DST: a folder "
        "(HF: config.json, model.safetensors, tokenizer files; transformers and vLLM read it) or "
        "a .gguf file (llama.cpp's layout; llama.cpp, ollama and LM Studio run it). Written "
        "whole or not at all; an existing DST needs --force.",
    )
    p.add_argument("src", help="run directory, checkpoint folder, HF folder or .gguf file")
    p.add_argument("dst", help="an HF folder to create, or FILE.gguf")
    p.add_argument("--to", choices=("hf", "gguf"), help="DST's format (default: from its suffix)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="the weights' float type (default: f32; a .gguf SRC to .gguf keeps each tensor's)",
    )
    p.add_argument(
        "--quant",
        choices=QUANTS,
        help="GGUF block quantization of the weights (norms, biases and routers stay f32, as "
        "llama.cpp's converter keeps them); q4_k / q6_k: use llama.cpp's llama-quantize",
    )
    p.add_argument(
        "--model-type",
        help="the transformers family to write a model attnlab built itself as (llama, qwen2, "
        "gpt2, ...); models read from HF or GGUF know theirs",
    )
    p.add_argument(
        "--vocab-from",
        type=Path,
        help="a .gguf file whose tokenizer to write (a model fine-tuned from it)",
    )
    p.add_argument("--name", help="general.name of a .gguf DST (default: SRC's name)")
    p.add_argument("--force", action="store_true", help="replace an existing DST")
    p.set_defaults(func=run)
