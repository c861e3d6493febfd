"""The tokenizer and chat template a GGUF file's metadata describes, built with the `tokenizers`
library (no `transformers`), as transformers' GGUF loading builds them
(transformers/integrations/gguf/gguf_tokenizer_mapping.py) so both encode and decode alike.

A GGUF file has no tokenizer.json. llama.cpp stores `tokenizer.ggml.model` (the algorithm),
`.tokens` (the vocabulary, id = position), `.merges` (BPE merges, best first), `.token_type`
(1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte), `.pre` (which pre-tokenizer regex the
vocabulary was trained with) and the special ids. Supported: `gpt2`, the byte-level BPE of GPT-2,
Llama 3, Qwen2 and SmolLM. It becomes a BPE model over the vocabulary and merges, GPT-2's
byte-level pre-tokenizer (or the regex `.pre` names, where transformers knows one) and decoder;
control tokens become special added tokens and user-defined ones plain added tokens, so both are
matched whole in the text. transformers' rules kept here: a token spelled outside the byte
alphabet is re-spelled through it, a control token spelled outside it is not added (a llama.cpp
mislabel), and `add_space_prefix` is ignored for byte-level vocabularies.

The chat template (`tokenizer.chat_template`) is Jinja, rendered in a sandbox with the settings
and helpers (raise_exception, tojson, strftime_now) of transformers' `apply_chat_template`.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from typing import Any

from ..errors import did_you_mean

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

# `tokenizer.ggml.pre` -> the split regex of that vocabulary (others: GPT-2's, as transformers).
# Llama 3's (tiktoken cl100k-style) and Qwen2's patterns, as their tokenizer.json files give them.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2),
}


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (Radford et al. 2019, encoder.py
    `bytes_to_unicode`): printable Latin-1 bytes stand for themselves, the other 68 bytes for
    the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def tokenizer_from_gguf(meta: dict[str, Any]):
    """A `tokenizers.Tokenizer` from a GGUF file's `tokenizer.*` metadata (see the module doc)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model {kind!r}: attnlab builds byte-level BPE ('gpt2') tokenizers "
            "from GGUF metadata" + did_you_mean(kind, ["gpt2"])
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = byte_alphabet()
    letters = set(alphabet.values())

    def spelled(t: str) -> str:
        return t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))

    vocab = {spelled(t): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = SPLITS.get(meta.get("tokenizer.ggml.pre"))
    tok.pre_tokenizer = (
        pre_tokenizers.ByteLevel(add_prefix_space=False)
        if split is None
        else pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind in zip(tokens, types, strict=True)
            if kind == CONTROL and set(t) <= letters
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == USER_DEFINED and t in vocab
        ]
    )
    tok.post_processor = _ends(meta, tokens)
    return tok


def _ends(meta: dict[str, Any], tokens: list[str]):
    """The BOS / EOS that `add_bos_token` / `add_eos_token` put around every text, as
    transformers' post-processor (bos $A eos; a pair: bos $A eos bos $B eos)."""
    from tokenizers.processors import TemplateProcessing

    pre, post, ids = [], [], []
    for name, side in (("bos", pre), ("eos", post)):
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        if meta.get(f"tokenizer.ggml.add_{name}_token") and i is not None:
            side.append(tokens[i])
            ids.append((tokens[i], i))

    def seq(s: str, type_id: int) -> list[str]:
        return (
            [f"{t}:{type_id}" for t in pre] + [f"${s}:{type_id}"] + [f"{t}:{type_id}" for t in post]
        )

    return TemplateProcessing(
        single=seq("A", 0), pair=seq("A", 0) + seq("B", 1), special_tokens=ids
    )


def render_chat(
    template: str,
    messages: list[dict],
    meta: dict[str, Any],
    add_generation_prompt: bool = False,
    **kwargs: Any,
) -> str:
    """`template` rendered over `messages` with transformers' Jinja settings: a sandbox,
    trim_blocks / lstrip_blocks, loop controls, and the special tokens' text as variables."""
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as err:
        raise ImportError("chat templates need jinja2: pip install 'attnlab[gguf]'") from err

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    special = {
        f"{name}_token": tokens[meta[f"tokenizer.ggml.{key}_token_id"]]
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
        if meta.get(f"tokenizer.ggml.{key}_token_id") is not None
        and meta[f"tokenizer.ggml.{key}_token_id"] < len(tokens)
    }
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special, **kwargs
    )
