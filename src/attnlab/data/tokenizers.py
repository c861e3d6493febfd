"""Tokenizers trained on a training split with the `tokenizers` library, cached by content hash.

Three kinds, one per task:

- ``"char"``: one token per character of the training text (the char-rnn / nanoGPT LM). Ids are
  the special tokens first, then the sorted distinct characters, so without specials they equal
  nanoGPT's ``stoi``. ``vocab_size`` is ignored: the vocabulary is every character seen.
- ``"bpe"``: byte-level BPE (GPT-2, Radford et al. 2019, section 2.2): the 256 byte symbols are
  always in the vocabulary, so there is no unknown token and decoding is lossless; a prefix space
  makes a sentence's first word share tokens with mid-sentence words, and the decoder strips it
  again. For translation train one joint tokenizer on source + target text (Vaswani et al. 2017,
  section 5.1: "a shared source-target vocabulary"). Detokenized output equals the input text,
  which is what sacreBLEU wants.
- ``"wordpiece"``: BERT's WordPiece (Devlin et al. 2018): lower-casing BERT normaliser, BERT
  pre-tokenizer (whitespace and punctuation), ``##`` continuation pieces. For classification.

Special tokens come first, ids ``0 .. len(special_tokens) - 1`` in the order given. Their roles
are read from their spelling (`ROLE_NAMES`): with the default ``("<pad>", "<s>", "</s>",
"<unk>")``, `special_ids` gives ``{"pad": 0, "bos": 1, "eos": 2, "unk": 3}``.

The cache key is the SHA-256 of (recipe version, kind, vocab size, special tokens, every text), so
the same inputs give the same file, ``CACHE_DIR/<kind>-<hash>/tokenizer.json``, written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the library is imported when a tokenizer is built, not with attnlab.data
    from tokenizers import Tokenizer

Kind = Literal["char", "bpe", "wordpiece"]
KINDS: tuple[str, ...] = ("char", "bpe", "wordpiece")
DEFAULT_SPECIALS: tuple[str, ...] = ("<pad>", "<s>", "</s>", "<unk>")
RECIPE_VERSION = 1  # bump when a recipe below changes: old cache entries are then not reused

# Role -> accepted spellings (ours, BERT's, GPT-2's).
ROLE_NAMES: dict[str, tuple[str, ...]] = {
    "pad": ("<pad>", "[PAD]"),
    "bos": ("<s>", "<bos>", "[CLS]", "<|startoftext|>"),
    "eos": ("</s>", "<eos>", "[SEP]", "<|endoftext|>"),
    "unk": ("<unk>", "[UNK]"),
    "mask": ("<mask>", "[MASK]"),
}


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "attnlab" / "tokenizers"


def cache_key(
    kind: str, texts: Sequence[str], vocab_size: int | None, special_tokens: Sequence[str]
) -> str:
    """SHA-256 hex digest naming a tokenizer: recipe, kind, size, specials and every text."""
    h = hashlib.sha256()
    header = {
        "recipe": RECIPE_VERSION,
        "kind": kind,
        "vocab_size": None if kind == "char" else vocab_size,
        "special_tokens": list(special_tokens),
    }
    h.update(json.dumps(header, sort_keys=True).encode())
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))  # length prefix: ["ab", "c"] != ["a", "bc"]
        h.update(data)
    return h.hexdigest()


def cache_path(
    kind: str,
    texts: Sequence[str],
    vocab_size: int | None,
    special_tokens: Sequence[str] = DEFAULT_SPECIALS,
    cache_dir: str | Path | None = None,
) -> Path:
    """Where `train_tokenizer` stores (or finds) the tokenizer for these inputs."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(kind, texts, vocab_size, special_tokens)
    return root / f"{kind}-{key[:24]}" / "tokenizer.json"


def train_tokenizer(
    kind: Kind,
    texts: Iterable[str],
    vocab_size: int | None,
    special_tokens: Sequence[str] = DEFAULT_SPECIALS,
    cache_dir: str | Path | None = None,
) -> Tokenizer:
    """A tokenizer of `kind` trained on `texts`, loaded from the cache when it was trained before."""
    if kind not in KINDS:
        raise ValueError(f"tokenizer kind {kind!r} unknown; choose one of {', '.join(KINDS)}")
    if kind != "char" and (not isinstance(vocab_size, int) or vocab_size <= len(special_tokens)):
        raise ValueError(
            f"vocab_size ({vocab_size}) must be an int above the number of special tokens "
            f"({len(special_tokens)}) for a {kind!r} tokenizer"
        )
    if len(set(special_tokens)) != len(special_tokens):
        raise ValueError(f"special_tokens {tuple(special_tokens)} repeat a token")
    if kind == "wordpiece" and not any(t in ROLE_NAMES["unk"] for t in special_tokens):
        raise ValueError(
            f"a wordpiece tokenizer needs an unknown token among special_tokens "
            f"{tuple(special_tokens)}: add one of {ROLE_NAMES['unk']}"
        )
    texts = list(texts)
    path = cache_path(kind, texts, vocab_size, special_tokens, cache_dir)
    from tokenizers import Tokenizer

    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = _BUILDERS[kind](texts, vocab_size, list(special_tokens))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"tokenizer.json.{os.getpid()}.tmp")
    tok.save(str(tmp))
    tmp.replace(path)  # atomic: concurrent trainers (one per rank) never see half a file
    return Tokenizer.from_file(str(path))


def _char(texts: list[str], vocab_size: int | None, specials: list[str]) -> Tokenizer:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = sorted(set().union(*map(set, texts)) - set(specials))
    vocab = {t: i for i, t in enumerate([*specials, *chars])}
    unk = next((t for t in specials if t in ROLE_NAMES["unk"]), None)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # each char
    tok.decoder = decoders.Fuse()  # concatenate, no spaces between tokens
    tok.add_special_tokens(specials)
    return tok


def _bpe(texts: list[str], vocab_size: int | None, specials: list[str]) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    # The byte-level decoder joins tokens into one string; Strip then removes the prefix space.
    tok.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def _wordpiece(texts: list[str], vocab_size: int | None, specials: list[str]) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    unk = next(t for t in specials if t in ROLE_NAMES["unk"])
    tok = Tokenizer(models.WordPiece(unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


_BUILDERS = {"char": _char, "bpe": _bpe, "wordpiece": _wordpiece}


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """Role -> id for the tokenizer's special tokens, e.g. {"pad": 0, "bos": 1, "eos": 2, "unk": 3}.

    Only roles present appear (a char tokenizer built with ``special_tokens=()`` gives ``{}``)."""
    specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    out = {}
    for role, names in ROLE_NAMES.items():
        for name in names:
            if name in specials:
                out[role] = specials[name]
                break
    return out


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of `text`, without special tokens (collate adds bos/eos)."""
    return tok.encode(text, add_special_tokens=False).ids


def encode_batch(tok: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """`encode` over many texts, in parallel threads."""
    return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def decode(tok: Tokenizer, ids: Iterable[int], until_eos: bool = True) -> str:
    """Detokenized text of `ids`: cut at the first eos (generated output runs on after it when
    batched), negative ids (label padding -100) and special tokens dropped."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()  # a tensor
    ids = [int(i) for i in ids if int(i) >= 0]
    eos = special_ids(tok).get("eos")
    if until_eos and eos is not None and eos in ids:
        ids = ids[: ids.index(eos)]
    return tok.decode(ids, skip_special_tokens=True)


def decode_batch(
    tok: Tokenizer, batch: Iterable[Iterable[int]], until_eos: bool = True
) -> list[str]:
    return [decode(tok, ids, until_eos) for ids in batch]
