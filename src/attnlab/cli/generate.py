"""`attnlab generate`: stream text from a decoder-only model.

The model comes from a training run (`attnlab train`'s run directory or one of its checkpoint
folders), an HF-format folder (config.json + *.safetensors, read without transformers) or a
llama.cpp .gguf file (weights, tokenizer and chat template in one), loaded as `attnlab serve`
loads it (src/attnlab/loading.py). Tokens are printed as they are decoded (KV-cached;
greedy or sampling). `--chat` wraps the prompt as a user message in the model's own chat
template; `--fuse` / `--quantize int8|int4|bf16` / `--packed` swap in the faster inference modules
(src/attnlab/nn/fuse.py, quantize.py). Past a learned position table (nanoGPT-style character
models) each step sees the last table-length tokens, as nanoGPT's sample.py does. A checkpoint's
own generation settings (generation_config.json: EOS, repetition penalty, no-repeat n-grams,
suppressed tokens, length; src/attnlab/decode/settings.py) apply to the KV-cached path; the
model's EOS tokens (or else the tokenizer's `</s>` / `<|endoftext|>` / `[SEP]`) end the text.
`--prompt -` (or no --prompt with stdin not a terminal) reads the prompt from stdin, as UTF-8
(other bytes are refused, naming the first and its line, not replaced). A whole
conversation is `attnlab chat` (src/attnlab/cli/chat.py), which decodes each turn with the
functions below. MODEL is read from this machine only: a hub id (OWNER/NAME) that is not a local
path is answered with the download to run first.

The model's stated context (a GGUF file's context_length, an HF config's max_position_embeddings)
holds prompt and reply, as llama.cpp's KV cache does: a prompt that fills it is refused with its
token count and the limit (a 1 MB line is 250,000 tokens and gigabytes of prefill), and a reply
ends where the context does. stdout is the text alone; one line on stderr at the end gives the
prompt's tokens, the time to the first new token, the reply's tokens and tokens/s after the first
(llama.cpp's "prompt eval" and "eval"), and why it stopped (a stop token, or the limit and what set
it: --max-new-tokens, the checkpoint's settings or the context).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from . import add_command
from .numbers import integer, real, threads
from .runs import check_decoder_only, fail
from .text_input import check_text, read_stdin

if TYPE_CHECKING:
    import torch

    from ..interop.loaded import LoadedModel

# a Hugging Face hub id: OWNER/NAME, the characters the hub allows in each
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def load_model_and_tokenizer(target: str):
    """(model, tokenizer) from a run dir, a checkpoint folder, an HF-format folder or a .gguf
    file (src/attnlab/loading.py, the loader `attnlab serve` uses)."""
    from ..loading import load_model

    loaded = load_model(target)
    return loaded.model, loaded.tokenizer


def speed_options(p: argparse.ArgumentParser) -> None:
    """--fuse / --quantize, shared with `attnlab serve` (src/attnlab/cli/serve.py)."""
    p.add_argument(
        "--fuse", action="store_true", help="fuse q/k/v and gate/up projections (same outputs)"
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--quantize",
        choices=["int8", "int4", "bf16"],
        default=None,
        help="weight-only int8, 4-bit (blocks of 32) or bf16 linear maps, the tied head "
        "included (implies --fuse)",
    )
    how.add_argument(
        "--packed",
        action="store_true",
        help="keep a GGUF file's Q4_0/Q4_1/Q4_K weights in 4-bit blocks and its Q8_0/Q5_0/Q6_K "
        "ones in 8-bit blocks (other types stay fp32): the same values in ~the file's bytes, "
        "fastest for one sequence (implies --fuse)",
    )


def packs_on_load(args: argparse.Namespace) -> bool:
    """Whether a .gguf file is loaded packed (`--packed`, which excludes `--quantize`): then the
    blocks are found by the scales the file states (Q4_K, Q5_0, Q6_K too), not by the weights'
    values alone."""
    return bool(getattr(args, "packed", False))


def apply_speed_options(model, args: argparse.Namespace):
    """The model with the --fuse / --quantize / --packed the user asked for (al.fuse,
    al.quantize, pack_exact); a .gguf file loaded packed (`packs_on_load`) is fused and packed
    already."""
    import sys

    from ..nn.fuse import fuse
    from ..nn.quant_blocks import pack_exact
    from ..nn.quantize import is_quantized, quantize

    packed, how = getattr(args, "packed", False), getattr(args, "quantize", None)
    if is_quantized(model):  # packed on load
        return model
    if getattr(args, "fuse", False) or how or packed:
        model = fuse(model)
    if how:
        model = quantize(model, how, head=True)
    if packed:
        counts = pack_exact(model)
        if counts["float"] and not counts["Int4Linear"] + counts["BlockInt8Linear"]:
            print(
                "attnlab: --packed kept nothing packed: no weight of this model is GGUF Q4_0 / "
                "Q4_1 / Q4_K / Q5_0 / Q6_K / Q8_0 blocks (a .gguf file of those types); it runs as "
                "fp32 with fused projections",
                file=sys.stderr,
            )
    return model


def _special(tok, *names: str) -> int | None:
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


def check_local(target: str) -> None:
    """FileNotFoundError for a MODEL that is not here and reads as a Hugging Face hub id
    (OWNER/NAME): attnlab opens local files only, so the fix is a download."""
    if HUB_ID.fullmatch(target) and not target.endswith(".gguf") and not Path(target).exists():
        raise FileNotFoundError(
            f"{target} does not exist: attnlab reads local folders and files only (no "
            f"downloads); if it is a Hugging Face hub id, download it first, e.g. "
            f"`hf download {target} --local-dir DIR`, then pass DIR"
        )


def load_decoder(args: argparse.Namespace) -> LoadedModel:
    """The decoder-only model at args.target (`load_model`, as `attnlab serve` loads it) with
    the --fuse / --quantize / --packed swaps done; --threads set first."""
    import torch

    from .. import loading

    check_local(args.target)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    device = check_device(args)
    served = loading.load_model(args.target, packed=packs_on_load(args))
    check_decoder_only(served.model, Path(args.target), getattr(args, "command", "generate"))
    served.model = apply_speed_options(served.model, args)
    if device is not None:
        served.model = served.model.to(device)
    return served


def check_device(args: argparse.Namespace):
    """--device as a torch.device (None: the CPU, where the model loads), refused where this
    torch cannot run it or with the CPU-only --fuse / --quantize / --packed kernels."""
    import torch

    name = getattr(args, "device", None)
    if name is None or name == "cpu":
        return None
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"--device {name!r} is not a device (cpu, cuda, cuda:1, ...)") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {name}: this torch ({torch.__version__}) sees no CUDA device; install a "
            'CUDA build of torch (README, "On a GPU"), or leave out --device'
        )
    cpu_only = [o for o in ("fuse", "quantize", "packed") if getattr(args, o, None)]
    if cpu_only:
        raise ValueError(
            f"--{cpu_only[0]} is a CPU kernel option: leave it out with --device {name}"
        )
    return device


def chat_prompt(served: LoadedModel, messages: list[dict]) -> str:
    """The conversation as the model's chat template writes it, the assistant's turn opened."""
    from ..serve.chat import render_chat

    eos = served.eos_token_ids[0] if served.eos_token_ids else None
    return render_chat(
        served.chat_template, messages, served.token(served.bos_token_id), served.token(eos)
    )


def context_room(served: LoadedModel) -> int | None:
    """The tokens a prompt and its reply may fill together on the KV-cached path: the context
    the model states (a GGUF file's context_length, an HF config's max_position_embeddings).
    None where nothing bounds them: a learned position table slides its window instead (each
    step sees the last table-length tokens, nanoGPT's sample.py, without a cache), and a model
    that states no context (a run with RoPE) is decoded as far as asked."""
    if served.model.max_positions is not None:
        return None
    return served.context_length


def check_prompt_fits(n_tokens: int, room: int | None, what: str, fix: str) -> None:
    """ValueError when `n_tokens` of prompt leave no room for one new token in the context (the
    whole prompt is prefilled into a KV cache: a 1 MB line is 250,000 tokens and gigabytes)."""
    if room is not None and n_tokens >= room:
        raise ValueError(
            f"{what} is {n_tokens:,} tokens and the model's context holds {room:,} (prompt and "
            f"reply together): {fix}"
        )


@dataclass
class Reply:
    """What one `decode_reply` did, for the lines said after it: why it stopped (`finish`, as
    the server's finish_reason), what set its token limit, and when its tokens came."""

    prompt_tokens: int = 0
    tokens: int = 0  # new tokens shown (a stop token is not)
    generated: int = 0  # new tokens decoded, the stop token included
    limit: int = 0  # the most new tokens it could make
    limit_by: str = "--max-new-tokens"  # what set `limit`
    by_context: bool = False  # `limit` is what the model's context leaves
    finish: Literal["stop", "length"] = "length"  # "stop": a stop token ended it
    started: float = 0.0  # time.perf_counter() before the prompt's prefill
    first: float = 0.0  # ... at the first new token
    last: float = 0.0  # ... at the last

    def speed(self) -> str:
        """The prompt's time to the first token and the decode rate after it (llama.cpp's
        "prompt eval" and "eval" times), as one bracketed line."""
        if not self.generated:
            return f"[{self.prompt_tokens} prompt tokens, no new token]"
        rate = ""
        if self.generated > 1 and self.last > self.first:
            rate = f" at {(self.generated - 1) / (self.last - self.first):.1f} tokens/s"
        how = (
            "ended by a stop token"
            if self.finish == "stop"
            else f"stopped at the limit of {self.limit} new tokens ({self.limit_by})"
        )
        return (
            f"[{self.prompt_tokens} prompt tokens, first new token after "
            f"{self.first - self.started:.2f} s; {self.tokens} new tokens{rate}; {how}]"
        )


def decode_reply(
    served: LoadedModel, ids: torch.Tensor, args: argparse.Namespace, reply: Reply | None = None
) -> Iterator[str]:
    """The text decoded so far after each new token of the continuation of ids (1, T), until a
    stop token: the checkpoint's own settings and EOS, else the tokenizer's, and the model's
    EOS tokens; greedy at --temperature 0. On the KV-cached path the reply ends at the model's
    context (`context_room`). `reply`, if given, records how it went (`Reply`)."""
    from ..decode.generate import sliding_stream, stream

    model, tok = served.model, served.tokenizer
    ids = ids.to(next(model.parameters()).device)
    own = getattr(model, "generation", None)  # the checkpoint's generation settings, if any
    own_eos = own.eos_ids() if own is not None else ()
    eos = _special(tok, "</s>", "<|endoftext|>", "[SEP]")
    stops = set(own_eos) if own_eos else ({eos} if eos is not None else set())
    stops |= set(served.eos_token_ids)
    reply = reply if reply is not None else Reply()
    n_new, reply.limit_by = args.max_new_tokens, "--max-new-tokens"
    if n_new is None:
        n_new = own.new_tokens(ids.shape[1], default=200) if own is not None else 200
        says = own is not None and (own.max_new_tokens or own.max_length) is not None
        reply.limit_by = (
            "the checkpoint's generation_config.json; --max-new-tokens overrides it"
            if says
            else "--max-new-tokens, default 200"
        )
    room = context_room(served)
    if room is not None and ids.shape[1] + n_new > room:  # the cache holds the context, no more
        n_new, reply.limit_by = max(room - ids.shape[1], 0), f"the model's {room}-token context"
        reply.by_context = True
    reply.prompt_tokens, reply.limit = ids.shape[1], n_new
    reply.started = time.perf_counter()
    strategy = "sample" if args.temperature > 0 else "greedy"
    limit = model.max_positions  # learned tables only
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
    out: list[int] = []
    for token in tokens:
        reply.last = time.perf_counter()
        reply.first = reply.first or reply.last
        reply.generated += 1
        if int(token[0]) in stops:
            reply.finish = "stop"
            return
        out.append(int(token[0]))
        reply.tokens = len(out)
        yield tok.decode(out)


def read_prompt(args: argparse.Namespace) -> str:
    """--prompt's text; with `--prompt -`, or no --prompt and stdin not a terminal, stdin's
    (less one final line break, as a file or `echo` ends it). UTF-8 only (`utf8`)."""
    chat = getattr(args, "chat", False)
    if args.prompt is not None and args.prompt != "-":
        return check_text(args.prompt, "--prompt")
    if args.prompt is None and sys.stdin.isatty():
        if chat:
            raise ValueError(
                "--chat needs --prompt TEXT (one user message; --prompt - reads it from stdin); "
                f"for a conversation, run `attnlab chat {args.target}`"
            )
        raise ValueError("give --prompt TEXT, or pipe the prompt on stdin (--prompt -)")
    text = read_stdin("the prompt on stdin")
    return text[:-1] if text.endswith("\n") else text


def run(args: argparse.Namespace) -> int:
    import torch

    chat = getattr(args, "chat", False)
    system = getattr(args, "system", None)
    if system is not None and not chat:
        return fail("--system is the chat template's system message: add --chat")
    prompt = read_prompt(args)  # before the (slow) load: stdin or a usage error at once
    served = load_decoder(args)
    text = prompt
    if chat:  # the prompt as the user's turn of the model's template
        if served.chat_template is None:
            return fail(f"{args.target} has no chat template: leave out --chat")
        messages = [{"role": "system", "content": system}] if system is not None else []
        text = chat_prompt(served, [*messages, {"role": "user", "content": prompt}])
    ids = torch.tensor([served.tokenizer.encode(text, add_special_tokens=False).ids])
    if ids.numel() == 0:
        return fail("the prompt encodes to no tokens: give a non-empty --prompt")
    check_prompt_fits(ids.shape[1], context_room(served), "the prompt", "shorten it")
    sys.stdout.write(prompt + ("\n" if chat else ""))  # a new turn
    shown, reply = "", Reply()
    for text in decode_reply(served, ids, args, reply):
        sys.stdout.write(text[len(shown) :])  # print only what the new token added
        sys.stdout.flush()
        shown = text
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(reply.speed(), file=sys.stderr)  # stdout is the text alone
    return 0


def decoding_options(p: argparse.ArgumentParser) -> None:
    """The decoding options `attnlab generate` and `attnlab chat` share, with --system (a chat
    template's system message)."""
    p.add_argument(
        "--max-new-tokens",
        type=integer(1),
        default=None,
        help="default: the checkpoint's max_new_tokens / max_length (generation_config.json), "
        "else 200; a reply also ends at the model's context",
    )
    p.add_argument("--temperature", type=real(0), default=0.8, help="0 = greedy")
    p.add_argument(
        "--top-k", type=integer(1), default=None, help="sample among the k most likely tokens only"
    )
    p.add_argument(
        "--top-p",
        type=real(0, 1, low_open=True),
        default=None,
        help="sample within the top-p probability mass, in (0, 1]",
    )
    p.add_argument("--seed", type=integer(0, 2**64 - 1), default=0, help="the sampling seed")
    p.add_argument("--threads", type=threads, default=None, help="torch intra-op threads")
    p.add_argument("--device", default=None, help="cpu (the default), cuda, cuda:1 ...")


def register(sub) -> None:
    p = add_command(
        sub, "generate", "stream text from a decoder-only model: a .gguf file, an HF folder or a run",
        "KV-cached; greedy with --temperature 0. MODEL: a llama.cpp .gguf file, an HF-format "
        "folder (config.json, *.safetensors, tokenizer.json), a run directory of "
        "`attnlab train` or one of its checkpoints.",
        examples=(
            'attnlab generate runs/shakespeare-char --prompt "ROMEO:" --max-new-tokens 100',
            'attnlab generate SmolLM2-135M-Instruct.Q4_1.gguf --chat --prompt "What is the capital of France?" --temperature 0',
            'attnlab generate smollm2-hf --prompt "Once upon a time" --seed 1',
        ),
    )  # fmt: skip
    p.add_argument(
        "target",
        metavar="MODEL",
        help=".gguf file, HF-format folder with tokenizer.json, run directory or checkpoint",
    )
    p.add_argument(
        "--prompt",
        default=None,
        help="the text to continue; - reads it from stdin, less one final line break (default: "
        "stdin when it is not a terminal)",
    )
    decoding_options(p)
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt as a user message in the model's chat template (GGUF, HF folders); "
        "a conversation: attnlab chat",
    )
    p.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    speed_options(p)
    p.set_defaults(func=run)
