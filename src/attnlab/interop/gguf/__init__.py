"""GGUF, llama.cpp's single-file format, read and written without `transformers`:

    table.py       one entry per `general.architecture` (archs/: one module per llama.cpp
                   converter file), its read rules and its write rules side by side
    layout.py      the file's counts, offsets and sizes checked against its length first
    reader.py      load_gguf: a .gguf file -> LoadedModel (model, tokenizer, chat template, ...);
                   open_gguf: the checked `gguf.GGUFReader` every reading of a file goes through
    config.py      the metadata -> the transformers config.json dict it was written from
    tensors.py     the tensors -> transformers' names and layouts (dequantized, stated scales)
    writer.py      save_gguf: an attnlab model as llama.cpp's converter writes it
    tokenizer.py   tokenizer.* keys <-> a `tokenizers.Tokenizer`; chat templates

The `gguf` package is imported on first use.
"""

from __future__ import annotations

from .reader import gguf_file_config, gguf_file_tokenizer, load_gguf, open_gguf
from .table import ARCHITECTURES
from .writer import Vocab, save_gguf, source_types, vocab_from_gguf, vocab_from_tokenizer

__all__ = [
    "ARCHITECTURES",
    "Vocab",
    "gguf_file_config",
    "gguf_file_tokenizer",
    "load_gguf",
    "open_gguf",
    "save_gguf",
    "source_types",
    "vocab_from_gguf",
    "vocab_from_tokenizer",
]
