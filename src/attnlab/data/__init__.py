"""Data: locating data sets, tokenizers, datasets, batching.

`attnlab.data.tokenizers` imports the `tokenizers` library only when a tokenizer is built."""

from .batching import LMBatcher, TokenBudgetBatcher
from .collate import (
    IGNORE_INDEX,
    classification_lengths,
    collate_classification,
    collate_translation,
    translation_lengths,
)
from .datasets import char_corpus, classification, label_names, num_labels, translation_pairs
from .locate import DataNotFoundError, locate, read_text
from .tokenizers import (
    ROLE_NAMES,
    decode,
    decode_batch,
    encode,
    encode_batch,
    special_ids,
    train_tokenizer,
)

__all__ = [
    "IGNORE_INDEX",
    "ROLE_NAMES",
    "DataNotFoundError",
    "LMBatcher",
    "TokenBudgetBatcher",
    "char_corpus",
    "classification",
    "classification_lengths",
    "collate_classification",
    "collate_translation",
    "decode",
    "decode_batch",
    "encode",
    "encode_batch",
    "label_names",
    "locate",
    "num_labels",
    "read_text",
    "special_ids",
    "train_tokenizer",
    "translation_lengths",
    "translation_pairs",
]
