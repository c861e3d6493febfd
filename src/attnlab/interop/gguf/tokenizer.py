"""The tokenizer and chat template a GGUF file's metadata describes, built with the `tokenizers`
library (no `transformers`), as transformers' GGUF loading builds them
(transformers/integrations/gguf/gguf_tokenizer_mapping.py) so both encode and decode alike.

A GGUF file has no tokenizer.json. llama.cpp stores `tokenizer.ggml.model` (the algorithm),
`.tokens` (the vocabulary, id = position), `.merges` (BPE merges, best first), `.token_type`
(1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte), `.scores` (SentencePiece's piece
scores), `.pre` (which pre-tokenizer regex the vocabulary was trained with) and the special ids.
Two algorithms are supported:

- `gpt2`, the byte-level BPE of GPT-2, Llama 3, Qwen2, SmolLM, OLMo 2, GPT-OSS, DeepSeek-V3: a BPE
  model over the vocabulary and merges, GPT-2's byte-level pre-tokenizer (or the regex `.pre`
  names, where transformers knows one) and decoder. transformers' rules kept here: a token spelled
  outside the byte alphabet is re-spelled through it, a control token spelled outside it is not
  added (a llama.cpp mislabel), and `add_space_prefix` is ignored.
- `llama`, SentencePiece BPE (Llama 2, Gemma 2 / 3, Phi-3): a BPE model with byte fallback
  (`<0x41>` pieces) whose merges, absent from such files, are recovered from the vocabulary as
  transformers' `generate_merges` recovers them (every split of a piece into two pieces, best score
  first); "▁" stands for the space. The families differ in how the space is written, so the
  architecture picks the variant, as in transformers' `GGUF_SENTENCEPIECE_BUILDERS`: Llama's
  Metaspace (a "▁" before the first word), Phi-3's normalizer (a "▁" before the text, every space
  a "▁"), Gemma's (no prefix; its merge order is the order of the file, not the scores, and its
  all-space pieces are stored as spaces). A BOS is added by default, as llama.cpp does.

In both, control tokens become special added tokens and user-defined ones plain added tokens, so
both are matched whole in the text.

The chat template (`tokenizer.chat_template`) is Jinja, rendered in a sandbox with the settings
and helpers (raise_exception, tojson, strftime_now) of transformers' `apply_chat_template`.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from typing import Any

from ...errors import did_you_mean

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
# o200k (GPT-4o; GPT-OSS's `gpt-4o`), as its tokenizer.json gives it (llama.cpp llama-vocab.cpp
# quotes the same pattern for LLAMA_VOCAB_PRE_TYPE_GPT4O before rewriting it for its own engine)
_O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2),
    **dict.fromkeys(("gpt-4o", "minimax-m2"), _O200K),
}
# the vocabularies that split as GPT-2 does (llama.cpp's GPT-2 pre-tokenizer group); any other
# `tokenizer.ggml.pre` (deepseek-v3, command-r, tekken, ...) splits text its own way, and is
# refused rather than silently tokenized wrong
GPT2_SPLIT = frozenset(
    (
        None,
        "default",
        "gpt-2",
        "gpt2",
        "smollm",
        "olmo",
        "mpt",
        "jais",
        "trillion",
        "granite-docling",
    )
)


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
    from tokenizers import AddedToken

    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(
            f"tokenizer.ggml.model {kind!r}: attnlab builds byte-level BPE ('gpt2') and "
            "SentencePiece ('llama') tokenizers from GGUF metadata"
            + did_you_mean(kind, ["gpt2", "llama"])
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok, vocab, spelled_ok = (_byte_level if kind == "gpt2" else _sentencepiece)(meta, tokens)
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind in zip(tokens, types, strict=True)
            if kind == CONTROL and spelled_ok(t)
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == USER_DEFINED and t in vocab
        ]
    )
    tok.post_processor = _ends(meta, tokens, default_bos=kind == "llama")
    return tok


def _byte_level(meta: dict[str, Any], tokens: list[str]):
    """GPT-2's byte-level BPE over the file's vocabulary and merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

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
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in SPLITS and pre not in GPT2_SPLIT:
        known = sorted(k for k in (*SPLITS, *GPT2_SPLIT) if k)
        raise ValueError(
            f"tokenizer.ggml.pre {pre!r}: attnlab does not know how this vocabulary splits text "
            f"before BPE (known: {', '.join(known)}), and GPT-2's split would tokenize it wrong"
        )
    split = SPLITS.get(pre)
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
    return tok, vocab, lambda t: set(t) <= letters


SPACE = "\u2581"  # SentencePiece's "▁", which stands for a space
# general.architecture -> how its SentencePiece vocabulary writes spaces (transformers'
# GGUF_SENTENCEPIECE_BUILDERS); every other architecture: Llama's Metaspace
SPM_VARIANTS = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}


def _sentencepiece(meta: dict[str, Any], tokens: list[str]):
    """SentencePiece BPE with byte fallback, the merges recovered from the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    scores = meta.get("tokenizer.ggml.scores")
    if not scores:  # llama.cpp's _set_vocab_sentencepiece always writes them
        raise ValueError(
            "tokenizer.ggml.model 'llama' (SentencePiece) needs tokenizer.ggml.scores, the "
            "pieces' priorities; this file has none (a byte-level vocabulary mislabelled? then "
            "its model is 'gpt2'): re-convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    variant = SPM_VARIANTS.get(meta.get("general.architecture"), "llama")
    if variant == "gemma":  # all-space pieces stored as spaces; merge order = file order
        tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        priority = {t: -i for i, t in enumerate(tokens)}
    else:
        priority = dict(zip(tokens, scores, strict=True))
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = (
        [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
        if "tokenizer.ggml.merges" in meta
        else recovered_merges(vocab, priority)
    )
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=True,
            byte_fallback=True,
            unk_token=tokens[unk] if variant == "gemma" and unk is not None else None,
        )
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if variant == "gemma":
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif variant == "phi3":
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first", split=False
        )
    if variant != "gemma":  # the prefix space comes off again
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok, vocab, lambda t: True


def recovered_merges(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (transformers'
    tokenization_utils_base.py `generate_merges`): every split of a piece into two pieces of the
    vocabulary, the pairs of one piece in id order, then all by the piece's priority, best first
    (ties: the longer left, then right part first; otherwise in vocabulary order)."""
    pairs = []
    for piece, score in priority.items():
        own = [
            (piece[:k], piece[k:], score)
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        pairs += sorted(own, key=lambda p: (vocab[p[0]], vocab[p[1]]))
    pairs.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
    return [(left, right) for left, right, _ in pairs]


def _ends(meta: dict[str, Any], tokens: list[str], default_bos: bool = False):
    """The BOS / EOS that `add_bos_token` / `add_eos_token` put around every text, as
    transformers' post-processor (bos $A eos; a pair: bos $A eos bos $B eos). A file that does
    not say adds a BOS to SentencePiece text (`default_bos`), as llama.cpp and transformers do."""
    from tokenizers.processors import TemplateProcessing

    pre, post, ids = [], [], []
    for name, side in (("bos", pre), ("eos", post)):
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        add = meta.get(f"tokenizer.ggml.add_{name}_token", default_bos and name == "bos")
        if add and i is not None:
            side.append(tokens[i])
            ids.append((tokens[i], i))

    def seq(s: str, type_id: int) -> list[str]:
        return (
            [f"{t}:{type_id}" for t in pre] + [f"${s}:{type_id}"] + [f"{t}:{type_id}" for t in post]
        )

    return TemplateProcessing(
        single=seq("A", 0), pair=seq("A", 0) + seq("B", 1), special_tokens=ids
    )


def special_tokens(meta: dict[str, Any]) -> dict[str, str]:
    """The text of the special tokens a GGUF file's metadata names (bos_token, eos_token,
    unk_token, pad_token), as chat templates read them."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return {
        f"{name}_token": tokens[meta[f"tokenizer.ggml.{key}_token_id"]]
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
        if meta.get(f"tokenizer.ggml.{key}_token_id") is not None
        and meta[f"tokenizer.ggml.{key}_token_id"] < len(tokens)
    }


def render_chat(
    template: str,
    messages: list[dict],
    special: dict[str, str],
    add_generation_prompt: bool = False,
    **kwargs: Any,
) -> str:
    """`template` rendered over `messages` with transformers' Jinja settings: a sandbox,
    trim_blocks / lstrip_blocks, loop controls, and the special tokens' text (`special`:
    bos_token, eos_token, ...) as variables."""
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
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special, **kwargs
    )


# --- writing: a tokenizers.Tokenizer as tokenizer.* keys ------------------------------------------

UNUSED = 5  # llama.cpp's token type of the padding rows past the vocabulary ([PAD<i>])


def pre_tokenizer_name(pre: dict | None) -> str | None:
    """The `tokenizer.ggml.pre` of a tokenizer.json pre_tokenizer: GPT-2's byte-level split is
    "gpt-2"; a Split on one of SPLITS' regexes before a regex-free ByteLevel is that name; digits
    one by one before GPT-2's split is "smollm" (SmolLM's). None: no name llama.cpp knows."""
    if not pre:
        return None
    if pre.get("type") == "ByteLevel":
        return "gpt-2" if pre.get("use_regex", True) else None
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    kinds = [s.get("type") for s in steps]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm" if steps[1].get("use_regex", True) else None
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = steps[0].get("pattern", {}).get("Regex")
        return next((name for name, regex in SPLITS.items() if regex == pattern), None)
    return None


def gguf_vocab_items(
    tok,
    vocab_size: int,
    *,
    chat_template: str | None = None,
    bos: int | None = None,
    eos: int | None = None,
    pad: int | None = None,
    pre: str | None = None,
) -> list[tuple[str, Any, str]]:
    """A `tokenizers.Tokenizer` as the tokenizer.* keys llama.cpp's converter writes
    (`TextModel._set_vocab_gpt2`): (key, value, kind), kind one of "str", "u32", "bool",
    "[str]", "[i32]". The tokens by id, padded to the model's `vocab_size` with "[PAD<i>]"
    (unused); special added tokens CONTROL, the other added tokens USER_DEFINED; the merges; the
    pre-tokenizer's name (`pre`, else `pre_tokenizer_name` of the tokenizer's own).

    A byte-level BPE vocabulary is written as it is. A character vocabulary (attnlab's `char`
    tokenizer, src/attnlab/data/tokenizers.py) is written as the byte-level BPE vocabulary
    without merges that tokenizes alike: each character one byte, spelled through GPT-2's byte
    alphabet (' ' as 'Ġ', '\\n' as 'Ċ'), so llama.cpp's BPE, with nothing to merge, gives one
    token per character (`char_tokens`). Other vocabularies (SentencePiece, WordPiece) are
    refused with the reason."""
    data = json.loads(tok.to_str())
    model = data.get("model") or {}
    probe = "a"  # a text whose first id is BOS if the tokenizer adds one
    if model.get("type") == "WordLevel":
        vocab, merges, pre = char_tokens(data), [], pre or "gpt-2"
        probe = next(iter(model["vocab"]), probe)  # a character the vocabulary has
    else:
        vocab, merges, pre = _byte_level_bpe(data, pre)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [UNUSED] * vocab_size
    for token, i in vocab.items():
        if i < vocab_size:
            tokens[i], types[i] = token, 1
    for added in data.get("added_tokens", []):
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    items: list[tuple[str, Any, str]] = [
        ("tokenizer.ggml.model", "gpt2", "str"),
        ("tokenizer.ggml.pre", pre, "str"),
        ("tokenizer.ggml.tokens", tokens, "[str]"),
        ("tokenizer.ggml.token_type", types, "[i32]"),
        ("tokenizer.ggml.merges", merges, "[str]"),  # llama.cpp needs the key, even empty
    ]
    for name, i in (("bos", bos), ("eos", eos), ("padding", pad)):
        if i is not None:
            items.append((f"tokenizer.ggml.{name}_token_id", int(i), "u32"))
    first = tok.encode(probe).ids[:1]
    items.append(("tokenizer.ggml.add_bos_token", bos is not None and first == [bos], "bool"))
    if chat_template:
        items.append(("tokenizer.chat_template", chat_template, "str"))
    return items


def _byte_level_bpe(data: dict, pre: str | None) -> tuple[dict[str, int], list[str], str]:
    """(vocabulary, merges, pre-tokenizer name) of a byte-level BPE tokenizer.json, or a
    ValueError naming what llama.cpp would read otherwise."""
    model = data.get("model") or {}
    pre = pre or pre_tokenizer_name(data.get("pre_tokenizer"))
    decoder = (data.get("decoder") or {}).get("type")
    if model.get("type") != "BPE" or decoder != "ByteLevel" or model.get("byte_fallback"):
        raise ValueError(
            f"this tokenizer is {model.get('type')} with a {decoder} decoder: attnlab writes "
            "byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM) and character "
            "vocabularies to GGUF; for another kind, pass the .gguf file the model came from "
            "(its tokenizer is copied)"
        )
    if pre is None:
        raise ValueError(
            "the tokenizer's pre-tokenizer is none that llama.cpp names (known: gpt-2, smollm, "
            f"{', '.join(sorted(SPLITS))}): llama.cpp would split text differently"
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return model["vocab"], merges, pre


# attnlab's character tokenizer (src/attnlab/data/tokenizers.py `_char`): every character its
# own piece, the pieces joined as they are
_EACH_CHARACTER = {"type": "Split", "pattern": {"Regex": r"[\s\S]"}, "behavior": "Isolated"}


def char_tokens(data: dict) -> dict[str, int]:
    """A character vocabulary (a tokenizer.json whose WordLevel model looks up each character
    alone and whose decoder joins them) as byte-level BPE tokens: each character, one byte in
    UTF-8, spelled through GPT-2's byte alphabet ('Ġ' for ' ', 'Ċ' for '\\n'). The special
    tokens (the tokenizer's added tokens) keep their text. A ValueError names what does not
    fit: characters of more than one byte (without merges, llama.cpp would split each into its
    bytes, which have no tokens), another split or a normalizer."""
    pre = data.get("pre_tokenizer") or {}
    each = all(pre.get(k) == v for k, v in _EACH_CHARACTER.items())
    decoder = (data.get("decoder") or {}).get("type")
    if not each or data.get("normalizer") or decoder != "Fuse":
        raise ValueError(
            "this WordLevel tokenizer is not a character vocabulary (each character looked up "
            f"alone, no normalizer, a Fuse decoder; it has pre_tokenizer {pre.get('type')!r}, "
            f"decoder {decoder!r}): llama.cpp has no word-level vocabulary; write an HF folder "
            "instead (`attnlab convert SRC DIR --to hf`)"
        )
    special = {a["content"] for a in data.get("added_tokens", [])}
    alphabet = byte_alphabet()
    vocab, wide = {}, []
    for token, i in data["model"]["vocab"].items():
        if token in special:
            vocab[token] = i
        elif len(token.encode("utf-8")) == 1:
            vocab[alphabet[token.encode("utf-8")[0]]] = i
        else:
            wide.append(token)
    if wide:
        shown = ", ".join(repr(c) for c in sorted(wide)[:8]) + (" ..." if len(wide) > 8 else "")
        raise ValueError(
            f"the character vocabulary holds {len(wide)} character(s) of more than one byte in "
            f"UTF-8 ({shown}): llama.cpp's byte-level vocabulary without merges has a token per "
            "byte only, and would split each of them into bytes the model has no token for; "
            "write an HF folder instead (`attnlab convert SRC DIR --to hf`), or train on text "
            "of one-byte (ASCII) characters"
        )
    return vocab
