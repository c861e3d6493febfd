"""`attnlab generate`: stream text from a decoder-only model.

The model comes from a training run (`attnlab train`'s run directory or one of its checkpoint
folders) or from an HF-format folder (config.json + *.safetensors, read without transformers);
the tokenizer from a `tokenizer.json` in that folder or its run directory. Tokens are printed as
they are decoded (KV-cached; greedy or sampling). Past a learned position table (nanoGPT-style
character models) each step sees the last table-length tokens, as nanoGPT's sample.py does.
A checkpoint's own generation settings (generation_config.json: EOS, repetition penalty, no-repeat
n-grams, suppressed tokens, length; src/attnlab/decode/settings.py) apply to the KV-cached path;
without an EOS of its own, the tokenizer's `</s>` / `<|endoftext|>` / `[SEP]` ends the text.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .runs import fail


def load_model_and_tokenizer(target: str):
    """(model, tokenizer) from a run dir, a checkpoint folder or an HF-format folder."""
    from tokenizers import Tokenizer

    path = Path(target)
    if path.suffix == ".gguf":  # a llama.cpp file: model and tokenizer in one
        from ..interop.gguf import load_gguf

        g = load_gguf(path)
        return g.model, g.tokenizer
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is not a folder: pass a run directory, a checkpoint or an HF-format folder"
        )
    if (
        (path / "config.json").exists()
        and any(path.glob("*.safetensors"))
        and not (path / "manifest.json").exists()
    ):
        from ..interop import load_pretrained

        model, folder = load_pretrained(path), path
    else:
        from ..train import checkpoint

        folder = checkpoint.resolve(path, "best") or checkpoint.resolve(path, "last") or path
        model, _ = checkpoint.load(folder)
    for cand in (
        folder / "tokenizer.json",
        folder.parent / "tokenizer.json",
        path / "tokenizer.json",
    ):
        if cand.exists():
            return model.eval(), Tokenizer.from_file(str(cand))
    raise FileNotFoundError(
        f"no tokenizer.json in {folder} or {folder.parent}: the model needs its tokenizer"
    )


def _special(tok, *names: str) -> int | None:
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


def run(args: argparse.Namespace) -> int:
    from ..decode.generate import sliding_stream, stream
    from ..nn.model import DecoderOnlyModel

    model, tok = load_model_and_tokenizer(args.target)
    if not isinstance(model, DecoderOnlyModel):
        return fail(
            f"{args.target} holds a {type(model).__name__}: use `attnlab translate` for encoder-decoders"
        )
    ids = torch.tensor([tok.encode(args.prompt, add_special_tokens=False).ids])
    if ids.numel() == 0:
        return fail("the prompt encodes to no tokens: give a non-empty --prompt")
    own = getattr(model, "generation", None)  # the checkpoint's generation settings, if any
    own_eos = own.eos_ids() if own is not None else ()
    eos = _special(tok, "</s>", "<|endoftext|>", "[SEP]")
    stops = set(own_eos) if own_eos else ({eos} if eos is not None else set())
    n_new = args.max_new_tokens
    if n_new is None:
        n_new = own.new_tokens(ids.shape[1], default=200) if own is not None else 200
    strategy = "sample" if args.temperature > 0 else "greedy"
    sys.stdout.write(args.prompt)
    out: list[int] = []
    shown = ""
    limit = getattr(model.decoder.positional, "max_positions", None)  # learned tables only
    if limit is not None and ids.shape[1] + n_new > limit:
        print(
            f"[the model's learned positions hold {limit} tokens: each step sees the last {limit} "
            f"(a sliding window, recomputed without a KV cache)]",
            file=sys.stderr,
        )
        tokens = sliding_stream(
            model, ids, n_new, limit, args.temperature, args.top_k, args.top_p, args.seed,
        )  # fmt: skip
    else:  # the model's own settings (EOS, repetition penalty, ...) apply; else the tokenizer's EOS
        tokens = stream(
            model, ids, n_new, strategy, **({} if own_eos else {"eos_token_id": eos}),
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        )  # fmt: skip
    for token in tokens:
        if int(token[0]) in stops:
            break
        out.append(int(token[0]))
        text = tok.decode(out)
        sys.stdout.write(text[len(shown) :])  # print only what the new token added
        sys.stdout.flush()
        shown = text
    sys.stdout.write("\n")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "generate", help="stream text from a decoder-only run dir, checkpoint or HF folder"
    )
    p.add_argument(
        "target", help="run directory, checkpoint folder, or HF-format folder with tokenizer.json"
    )
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="default: the checkpoint's max_new_tokens / max_length (generation_config.json), else 200",
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)
