"""A GGUF file's layout checked against its length before the `gguf` package reads it.

The `gguf` package's reader trusts every count and offset a file states: an array key claiming
2^62 elements made it loop on empty reads for minutes while its memory grew by gigabytes, and a
tensor offset of 2^64 − 32 wrapped around (uint64 arithmetic) to the 32 bytes before the data,
so the model loaded shifted by 8 floats without a word. `check_layout` walks the header as
llama.cpp's `gguf_init_from_file_impl` (ggml/src/gguf.cpp) does, in Python integers, and
refuses, naming the file and the key or tensor:

- a count (keys, tensors, array elements, string bytes, dimensions) that the bytes left in the
  file cannot hold, a value type it does not know, an array of arrays (llama.cpp reads none), a
  string that is not UTF-8 (the spec's encoding; attnlab decodes every one);
- a tensor whose type is unknown, whose rows are not whole blocks, whose offset is not aligned
  or whose data ends past the end of the file;
- metadata arrays the reader would need more memory for than this machine has: the gguf
  package keeps about `READER_BYTES_PER_ELEMENT` per array element (numpy views; measured on
  gguf 0.19: 1.0 KB each for 400,000 strings and integers).

What it returns (`Layout`) also tells the loader how many values the tensors hold, so a size the
metadata claims can be checked against them before a model is built (reader.py).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from ...errors import FileFormatError, excerpt

READER_BYTES_PER_ELEMENT = 1024

# GGUF value types (gguf-py constants.py GGUFValueType) -> their size in bytes; 8 STRING, 9 ARRAY
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_FIX = "the file is truncated, damaged or hostile: download or convert it again"


@dataclass(frozen=True)
class Layout:
    """What the header states, each count checked: the tensors' (name, elements) in file order
    and the metadata arrays' element count."""

    tensors: tuple[tuple[str, int], ...]
    array_elements: int

    @property
    def values(self) -> int:
        """The values the tensors hold, all together (what dequantizing them allocates)."""
        return sum(n for _, n in self.tensors)


class _Cursor:
    """Reads the header's fields in order, each checked against the bytes left."""

    def __init__(self, path: Path, buf, order: str) -> None:
        self.path, self.buf, self.order, self.at = path, buf, order, 0

    def fail(self, what: str) -> FileFormatError:
        return FileFormatError(f"{self.path}: {what} (at byte {self.at:,}): {_FIX}")

    def left(self) -> int:
        return len(self.buf) - self.at

    def take(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        if size > self.left():
            raise self.fail(f"the file ends inside {what}")
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.at)
        self.at += size
        return value

    def skip(self, size: int, what: str) -> None:
        if size > self.left():
            raise self.fail(f"{what} needs {size:,} bytes but {self.left():,} are left")
        self.at += size

    def count(self, each: int, what: str) -> int:
        """A u64 count of items of at least `each` bytes, which the bytes left must hold."""
        n = self.take("Q", what)
        if n * each > self.left():
            raise self.fail(
                f"{what} claims {n:,} items of {each} byte(s) or more but {self.left():,} bytes "
                "are left"
            )
        return n

    def string(self, what: str) -> str:
        n = self.count(1, what)
        raw = bytes(self.buf[self.at : self.at + n])
        self.at += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise self.fail(f"{what} is not UTF-8 ({err.reason})") from err


def _value(c: _Cursor, kind: int, key: str) -> int:
    """Step over one value of type `kind`; the array elements it holds."""
    if kind in _SCALAR:
        c.skip(_SCALAR[kind], f"the value of {key!r}")
        return 0
    if kind == _STRING:
        c.string(f"the string of {key!r}")
        return 0
    if kind != _ARRAY:
        raise c.fail(f"key {key!r} has the unknown value type {kind}")
    item = c.take("I", f"the array type of {key!r}")
    if item == _ARRAY:
        raise c.fail(f"key {key!r} is an array of arrays, which llama.cpp does not read")
    if item not in _SCALAR and item != _STRING:
        raise c.fail(f"key {key!r} is an array of the unknown value type {item}")
    n = c.count(_SCALAR.get(item, 8), f"the array {key!r}")
    if item == _STRING:
        for i in range(n):
            c.string(f"{key}[{i}]")
    else:
        c.skip(n * _SCALAR[item], f"the array {key!r}")
    return n


def check_layout(path: str | Path, available: int | None = None) -> Layout:
    """The layout of the GGUF file at `path`, every count, offset and size checked against its
    length (and the metadata arrays against `available` bytes of memory, where known) before
    anything is read into memory; FileFormatError naming the file and what is wrong."""
    import gguf

    path = Path(path)
    with path.open("rb") as f:
        if path.stat().st_size == 0:
            raise FileFormatError(f"{path} is empty: {_FIX}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _walk(path, buf, gguf, available)


def _walk(path: Path, buf, gguf, available: int | None) -> Layout:
    c = _Cursor(path, buf, "<")
    if c.take("I", "the magic number") != gguf.GGUF_MAGIC:
        raise FileFormatError(f"{path} is not a GGUF file (no GGUF magic number at its start)")
    version = c.take("I", "the version")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order (as gguf-py reads)
        c.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in (2, 3):
        raise FileFormatError(
            f"{path} is GGUF version {version}; version 2 and 3 files are read: convert the model "
            "again with a current llama.cpp"
        )
    n_tensors = c.take("Q", "the tensor count")
    n_keys = c.take("Q", "the key count")
    for what, n, least in (("keys", n_keys, 13), ("tensors", n_tensors, 24)):
        if n * least > c.left():  # a key: 8-byte length, 4-byte type, 1-byte value at least
            raise c.fail(f"the header claims {n:,} {what}, more than the file can hold")
    alignment, elements = gguf.GGUF_DEFAULT_ALIGNMENT, 0
    for i in range(n_keys):
        key = c.string(f"the name of key {i}")
        kind = c.take("I", f"the type of {key!r}")
        start = c.at
        elements += _value(c, kind, excerpt(key, 80))
        if key == "general.alignment":
            if kind != 4:
                raise c.fail("general.alignment is not a uint32")
            (alignment,) = struct.unpack_from(c.order + "I", buf, start)
            if alignment == 0 or alignment & (alignment - 1):
                raise c.fail(f"general.alignment = {alignment} is not a power of two")
    if available is not None and elements * READER_BYTES_PER_ELEMENT > available:
        raise FileFormatError(
            f"{path}: its metadata arrays hold {elements:,} elements; reading them takes about "
            f"{elements * READER_BYTES_PER_ELEMENT / 2**30:.1f} GiB (the gguf package keeps about "
            f"1 KB per element) but this machine has {available / 2**30:.1f} GiB available: "
            f"{_FIX}"
        )
    infos = [_tensor_info(c, gguf, i) for i in range(n_tensors)]
    data = -(-c.at // alignment) * alignment
    tensors = []
    for name, kind, n, offset in infos:
        block, type_bytes = gguf.GGML_QUANT_SIZES[kind]
        size = n // block * type_bytes
        if offset % alignment:
            raise FileFormatError(
                f"{path}: tensor {name!r} starts at offset {offset:,}, which is not a multiple of "
                f"the alignment ({alignment}): {_FIX}"
            )
        if data + offset + size > len(buf):
            raise FileFormatError(
                f"{path}: tensor {name!r} ({size:,} bytes at offset {offset:,} of the data, which "
                f"starts at byte {data:,}) ends past the end of the file ({len(buf):,} bytes): "
                f"{_FIX}"
            )
        tensors.append((name, n))
    return Layout(tuple(tensors), elements)


def _tensor_info(c: _Cursor, gguf, i: int) -> tuple[str, object, int, int]:
    """(name, GGMLQuantizationType, elements, offset) of the next tensor info, checked."""
    name = excerpt(c.string(f"the name of tensor {i}"), 80)
    dims = c.take("I", f"the dimension count of {name!r}")
    if dims > _MAX_DIMS:
        raise c.fail(f"tensor {name!r} has {dims} dimensions; llama.cpp allows {_MAX_DIMS}")
    shape = [c.take("Q", f"the shape of {name!r}") for _ in range(dims)]
    raw = c.take("I", f"the type of {name!r}")
    offset = c.take("Q", f"the offset of {name!r}")
    try:
        kind = gguf.GGMLQuantizationType(raw)
        block, _ = gguf.GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise c.fail(f"tensor {name!r} has the unknown type {raw}") from None
    n = 1
    for d in shape:
        n *= d
    if shape and shape[0] % block:
        raise c.fail(
            f"tensor {name!r} has rows of {shape[0]:,} values, not whole blocks of {block} "
            f"({kind.name})"
        )
    return name, kind, n, offset
