"""Data: locating data sets, tokenizers, datasets, batching."""

from .locate import DataNotFoundError, locate, read_text

__all__ = ["DataNotFoundError", "locate", "read_text"]
