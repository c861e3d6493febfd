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

On stderr: "loading MODEL ..." and the seconds it took (issue 49 saw ~20 s of silence there); a
reply that stopped at its token limit (the server's finish_reason "length") says so and what
raises the limit (--max-new-tokens, or /reset where the model's context ended it); a message that
would pass the context is not sent (its token count and the limit) nor kept; a line that is not
UTF-8 is skipped, naming its first bad byte. The conversation goes on after each.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

from . import add_command
from .generate import (
    Reply,
    chat_prompt,
    check_local,
    check_prompt_fits,
    context_room,
    decode_reply,
    decoding_options,
    load_decoder,
    speed_options,
)
from .runs import fail
from .text_input import check_text, read_stdin, utf8

COMMANDS = {"/reset": "clears the conversation", "/exit": "leaves (as Ctrl-D does)"}


def _read_line(interactive: bool, number: int) -> str:
    """One line of the user's, as UTF-8 text ("" at EOF); ValueError for one that is not."""
    where = f"line {number} of stdin" if not interactive else "that line"
    if interactive:
        try:
            return check_text(input("> "), where)
        except UnicodeDecodeError as err:  # a terminal read strictly: the bytes it could not take
            return utf8(err.object, where)
    return read_stdin(where, line=True)


def _lines(interactive: bool):
    """The user's lines, without their line break, until EOF, /exit or Ctrl-C at the prompt;
    a line that is not UTF-8 text is said on stderr and skipped (the conversation goes on)."""
    if interactive:
        with contextlib.suppress(ImportError):  # not on every platform
            import readline  # noqa: F401  (input() gains line editing and history)
    number = 0
    while True:
        number += 1
        try:
            line = _read_line(interactive, number)
        except (EOFError, KeyboardInterrupt):  # Ctrl-D, or Ctrl-C at the prompt: leave
            if interactive:
                sys.stdout.write("\n")
            return
        except ValueError as err:  # not UTF-8 (a UnicodeDecodeError too, from input())
            print(f"[skipped: {err}]", file=sys.stderr)
            continue
        if not interactive and not line:  # EOF
            return
        line = line.rstrip("\r\n")
        if line.strip() == "/exit":
            return
        yield line


def run(args: argparse.Namespace) -> int:
    import torch

    check_local(args.target)  # a hub id is answered with its download, not "loading"
    start = time.perf_counter()
    print(f"loading {args.target} ...", file=sys.stderr, flush=True)  # ~20 s for a GGUF (issue 49)
    served = load_decoder(args)
    print(f"loaded in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
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
    room = context_room(served)
    for line in _lines(interactive):
        if line.strip() == "/reset":
            history = []
            print("[conversation cleared]", file=sys.stderr)
            continue
        if not line.strip():
            continue
        turn = [*history, {"role": "user", "content": line}]
        text = chat_prompt(served, [*system, *turn])
        ids = torch.tensor([served.tokenizer.encode(text, add_special_tokens=False).ids])
        try:  # a message past the context is refused, not prefilled (1 MB: 250,000 tokens)
            fix = "shorten the message" + (", or /reset to start over" if history else "")
            check_prompt_fits(ids.shape[1], room, "the conversation with this message", fix)
        except ValueError as err:
            print(f"[not sent: {err}]", file=sys.stderr)
            continue
        shown, reply = "", Reply()
        try:
            for shown_next in decode_reply(served, ids, args, reply):
                sys.stdout.write(shown_next[len(shown) :])  # what the new token added
                sys.stdout.flush()
                shown = shown_next
        except KeyboardInterrupt:  # Ctrl-C during a reply: stop it, keep the conversation
            sys.stdout.write(" [stopped]")
            reply.finish = "stop"
        sys.stdout.write("\n\n" if interactive else "\n")
        sys.stdout.flush()
        if reply.finish == "length":  # the server's finish_reason "length": never cut silently
            how = (
                "/reset starts a new conversation"
                if reply.by_context
                else "raise --max-new-tokens for longer replies"
            )
            print(
                f"[the reply stopped at {reply.limit} new tokens ({reply.limit_by}): {how}]",
                file=sys.stderr,
                flush=True,
            )
        history = [*turn, {"role": "assistant", "content": shown}]
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
        examples=(
            "attnlab chat SmolLM2-135M-Instruct.Q4_1.gguf",
            'attnlab chat SmolLM2-135M-Instruct.Q4_1.gguf --system "Answer in one sentence." --temperature 0',
        ),
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
