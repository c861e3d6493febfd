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
run's tokenizer.json written as llama.cpp's converter writes it (a character vocabulary as a
byte-level BPE vocabulary without merges: src/attnlab/interop/gguf/tokenizer.py).

Which family DST is written as: --model-type, else the one the model was read from (an HF folder,
a .gguf file), else, for a run fine-tuned from a checkpoint (model.pretrained), that checkpoint's
(with its context length), else, for a model trained here from a preset, the family whose
architecture matches its config exactly (src/attnlab/interop/export_family.py: GPT-2 for learned
positions and LayerNorm, Llama for RoPE / RMSNorm / SwiGLU, Marian for the 2017 encoder-decoder),
or an error naming the config fields no family has.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

from ..errors import did_you_mean
from . import add_command
from .generate import check_local
from .runs import fail

DTYPES = ("f32", "f16", "bf16")
QUANTS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k")


def one_of(names: tuple[str, ...]):
    """An argparse type: one of `names`, else one line listing them with a did-you-mean."""

    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not one of {', '.join(names)}.{did_you_mean(text, names)}"
            )
        return text

    parse.__name__ = "choice"
    return parse


def _check_model_type(name: str, to: str) -> None:
    """--model-type against the families attnlab writes to `to`, with a did-you-mean."""
    from ..interop.converter import CONVERTERS
    from ..interop.gguf.table import WRITTEN_AS

    known = sorted(WRITTEN_AS if to == "gguf" else CONVERTERS.names())
    if name not in known:
        where = "a .gguf file (llama.cpp)" if to == "gguf" else "an HF folder"
        raise ValueError(
            f"--model-type {name!r}: attnlab writes {where} as {', '.join(known)}."
            f"{did_you_mean(name, known)}"
        )


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
        check_local(args.src)
        dst, to = _destination(args)
        if args.quant:
            from ..interop.gguf.writer import check_outtype

            check_outtype(args.quant)
        if args.model_type:
            _check_model_type(args.model_type, to)
    except (ValueError, FileExistsError) as err:
        return fail(err)
    from ..atomic import Interrupted
    from ..interop.converter import ConversionError
    from ..loading import load_model

    served = load_model(args.src)
    origin = _run_origin(Path(args.src))  # a run fine-tuned from a checkpoint: that checkpoint
    model_type = (
        args.model_type
        or getattr(served.model, "hf_model_type", None)
        or (origin.model_type if origin else None)
    )
    if origin is not None:
        if args.vocab_from is None and origin.gguf is not None:
            args.vocab_from = origin.gguf
        if getattr(served.model, "context_length", None) is None and origin.context:
            served.model.context_length = origin.context  # the checkpoint's, not the default's
    # a model trained here from a preset: no family, no special ids but its tokenizer's own
    built_here = getattr(served.model, "hf_model_type", None) is None and origin is None
    if model_type is None:
        from ..interop.export_family import choose_family

        try:
            model_type = choose_family(served.model.config, to)
        except ConversionError as err:
            return fail(f"{args.src}: {err}")
        print(
            f"writing {args.src} as {model_type}, the family whose architecture matches its "
            "config (--model-type chooses another)",
            file=sys.stderr,
        )
    try:
        if to == "hf":
            _write_hf(served, dst, model_type, args, built_here)
        else:
            _write_gguf(served, dst, model_type, args)
    except Interrupted as err:  # SIGTERM / SIGHUP
        return fail(f"{err}: {_left(dst)}")
    except KeyboardInterrupt:
        fail(f"interrupted: {_left(dst)}")
        return 130  # the shell's status for a process stopped by SIGINT, as `attnlab` gives
    size = sum(f.stat().st_size for f in dst.rglob("*")) if dst.is_dir() else dst.stat().st_size
    print(f"wrote {dst} ({size / 2**20:.1f} MiB)")
    return 0


def _left(dst: Path) -> str:
    """What an interrupted write left at DST (src/attnlab/atomic.py: the new content is wholly
    in place, `completed`, or not at all, and then DST is what it was)."""
    from ..atomic import completed

    if completed(dst):
        return f"{dst} holds the new conversion (it was complete before the stop)"
    if dst.exists():
        return f"nothing new was written: {dst} holds what it held before"
    return f"nothing was written to {dst}"


def _write_hf(
    served, dst: Path, model_type: str, args: argparse.Namespace, built_here: bool
) -> None:
    import torch

    from ..atomic import atomic_folder
    from ..interop import save_pretrained
    from ..train.translation_folder import save_translation, translation_recipe

    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    model = served.model.to(dtype[args.dtype or "f32"])
    with atomic_folder(dst, force=args.force) as tmp:
        if (recipe := translation_recipe(Path(args.src))) is not None:  # tokenizer, decoding
            return save_translation(model, served.tokenizer, recipe, tmp, model_type)
        save_pretrained(model, tmp, model_type)
        if built_here:  # the family's default BOS / EOS ids are some other vocabulary's
            _own_special_ids(tmp / "config.json", served)
        served.tokenizer.save(str(tmp / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for name, i in (("bos_token", served.bos_token_id), ("eos_token", _first(served))):
            if i is not None:
                config[name] = served.token(i)
        if served.chat_template:
            config["chat_template"] = served.chat_template
        # attnlab decodes tokens as the tokenizer's decoder joins them, no spaces taken out
        config["clean_up_tokenization_spaces"] = False
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _own_special_ids(path: Path, served) -> None:
    """config.json's bos_token_id / eos_token_id as the model's own tokenizer has them (None
    where it has none): the converters write the family's defaults (Llama's 1 and 2), which in a
    vocabulary trained here are ordinary tokens that transformers would stop generating at."""
    config = json.loads(path.read_text())
    config.update(bos_token_id=served.bos_token_id, eos_token_id=_first(served))
    path.write_text(json.dumps(config, indent=2))


class Origin(NamedTuple):
    """The checkpoint a run was fine-tuned from (its recipe's model.pretrained)."""

    model_type: str  # its transformers family
    gguf: Path | None  # its .gguf file, whose tokenizer keys the run's GGUF gets
    context: int | None  # the context it states it was trained for


def _run_origin(src: Path) -> Origin | None:
    """The checkpoint a run directory (or a checkpoint folder of one) was fine-tuned from, or
    None for anything else."""
    from ..train import checkpoint

    folder = checkpoint.best_or_last(src) if src.is_dir() else None
    if folder is None and src.is_dir() and (src / checkpoint.MANIFEST).exists():
        folder = src
    if folder is None:
        return None
    pretrained = (checkpoint.load_recipe(folder).get("model") or {}).get("pretrained")
    if not pretrained:
        return None
    from ..interop.converter import context_of
    from ..interop.pretrained import _is_gguf, locate_gguf, locate_pretrained, read_json_object

    if _is_gguf(pretrained):
        from ..interop.gguf import gguf_file_config

        path = locate_gguf(pretrained)
        hf = gguf_file_config(path)[0]
        return Origin(hf["model_type"], path, context_of(hf))
    config_file = locate_pretrained(pretrained) / "config.json"
    what = "the config of the checkpoint the run was fine-tuned from"
    config = read_json_object(config_file, what)
    if not isinstance(config.get("model_type"), str):
        raise ValueError(
            f"{config_file} ({what}) names no model_type: download or write that checkpoint again"
        )
    return Origin(config["model_type"], None, context_of(config))


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
        examples=(
            "attnlab convert runs/shakespeare-char shakespeare-q8.gguf --quant q8_0",
            "attnlab convert SmolLM2-135M-Instruct.Q4_1.gguf smollm2-hf     # to an HF folder",
            "attnlab convert smollm2-hf smollm2-f16.gguf --dtype f16",
        ),
    )
    p.add_argument("src", help="run directory, checkpoint folder, HF folder or .gguf file")
    p.add_argument("dst", help="an HF folder to create, or FILE.gguf")
    p.add_argument("--to", choices=("hf", "gguf"), help="DST's format (default: from its suffix)")
    p.add_argument(
        "--dtype",
        type=one_of(DTYPES),
        metavar="{" + ",".join(DTYPES) + "}",
        help="the weights' float type (default: f32; a .gguf SRC to .gguf keeps each tensor's)",
    )
    p.add_argument(
        "--quant",
        type=one_of(QUANTS),
        metavar="{" + ",".join(QUANTS) + "}",
        help="GGUF block quantization of the weights (norms, biases and routers stay f32, as "
        "llama.cpp's converter keeps them); q4_k / q6_k: use llama.cpp's llama-quantize",
    )
    p.add_argument(
        "--model-type",
        help="the transformers family to write the model as (llama, qwen2, gpt2, ...): models "
        "read from HF or GGUF know theirs, a model trained here gets the family whose "
        "architecture matches its config",
    )
    p.add_argument(
        "--vocab-from",
        type=Path,
        help="a .gguf file whose tokenizer to write (a model fine-tuned from it)",
    )
    p.add_argument("--name", help="general.name of a .gguf DST (default: SRC's name)")
    p.add_argument("--force", action="store_true", help="replace an existing DST")
    p.set_defaults(func=run)
