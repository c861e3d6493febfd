"""`attnlab chat MODEL`: a conversation with a chat model, as llama.cpp's `llama-cli` (its
conversation mode) and `ollama run` hold one.

Each turn the whole conversation (--system's message, then every user and assistant turn so far)
is rendered with the model's own chat template and decoded by the functions `attnlab generate`
uses (src/attnlab/cli/generate.py: the same loading, stop tokens and settings). So a turn is
exactly what `attnlab generate --chat` gives for that conversation, and a greedy or seeded turn
can be replayed. The prompt is prefilled afresh each turn (no KV cache is kept between turns: the
template may rewrite earlier turns, and a prefill is one batched forward pass); an assistant turn
enters the history as the text decoded from its tokens.

On a terminal: a `> ` prompt with line editing, `/reset` clears the conversation, `/exit` or
Ctrl-D leaves, Ctrl-C stops a reply (what was shown stays in the history) or, at the prompt,
leaves. With stdin not a terminal each non-empty line is one user message (the same commands
apply) and each reply is printed as it streams, then a line break: a conversation can be scripted
and tested.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from . import add_command
from .generate import (
    chat_prompt,
    decode_reply,
    decoding_options,
    load_decoder,
    speed_options,
)
from .runs import fail

COMMANDS = {"/reset": "clears the conversation", "/exit": "leaves (as Ctrl-D does)"}


def _lines(interactive: bool):
    """The user's lines, without their line break, until EOF, /exit or Ctrl-C at the prompt."""
    if interactive:
        with contextlib.suppress(ImportError):  # not on every platform
            import readline  # noqa: F401  (input() gains line editing and history)
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):  # Ctrl-D, or Ctrl-C at the prompt: leave
            if interactive:
                sys.stdout.write("\n")
            return
        if not interactive and not line:  # EOF
            return
        line = line.rstrip("\r\n")
        if line.strip() == "/exit":
            return
        yield line


def run(args: argparse.Namespace) -> int:
    import torch

    served = load_decoder(args)
    if served.chat_template is None:
        return fail(
            f"{args.target} has no chat template (the GGUF key tokenizer.chat_template, or "
            "chat_template in tokenizer_config.json / chat_template.jinja), so there is no way "
            "to write a conversation for it: it is a base model; continue text with "
            f"`attnlab generate {args.target} --prompt TEXT`"
        )
    interactive = sys.stdin.isatty()
    if interactive:
        keys = ", ".join(f"{k} {what}" for k, what in COMMANDS.items())
        print(f"chatting with {served.name}: {keys}; Ctrl-C stops a reply", file=sys.stderr)
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    history: list[dict] = []
    warned = False  # the conversation has passed the model's context (said once)
    for line in _lines(interactive):
        if line.strip() == "/reset":
            history, warned = [], False
            print("[conversation cleared]", file=sys.stderr)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        text = chat_prompt(served, [*system, *history])
        ids = torch.tensor([served.tokenizer.encode(text, add_special_tokens=False).ids])
        ctx, n_new = served.context_length, args.max_new_tokens or 0
        if ctx and not warned and ids.shape[1] + n_new > ctx:
            warned = True
            print(
                f"[{ids.shape[1]} tokens of conversation + up to {n_new} new pass the {ctx} "
                "positions the model was trained for: past them replies degrade; /reset starts "
                "a new conversation]",
                file=sys.stderr,
            )
        shown = ""
        try:
            for shown_next in decode_reply(served, ids, args):
                sys.stdout.write(shown_next[len(shown) :])  # what the new token added
                sys.stdout.flush()
                shown = shown_next
        except KeyboardInterrupt:  # Ctrl-C during a reply: stop it, keep the conversation
            sys.stdout.write(" [stopped]")
        sys.stdout.write("\n\n" if interactive else "\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": shown})
    return 0


def register(sub) -> None:
    p = add_command(
        sub, "chat", "talk with a chat model in the terminal: a .gguf file, an HF folder or a run",
        "Each turn renders the whole conversation with the model's chat template and streams the "
        "reply, KV-cached, as `attnlab generate --chat` does (greedy with --temperature 0). "
        "/reset clears the conversation, /exit or Ctrl-D leaves, Ctrl-C stops a reply. With "
        "stdin not a terminal, each line is one user message and each reply ends in a line break. "
        "MODEL: a llama.cpp .gguf file, an HF-format folder (config.json, *.safetensors, "
        "tokenizer.json, a chat template in tokenizer_config.json), a run directory of "
        "`attnlab train` or one of its checkpoints; local only (a hub id: download it first).",
    )  # fmt: skip
    p.add_argument(
        "target",
        metavar="MODEL",
        help=".gguf file, HF-format folder with tokenizer.json, run directory or checkpoint",
    )
    p.add_argument("--system", default=None, help="a system message that opens the conversation")
    decoding_options(p)
    speed_options(p)
    p.set_defaults(func=run)
