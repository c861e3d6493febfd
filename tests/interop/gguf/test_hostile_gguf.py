"""Forged GGUF files through the commands a user runs (`attnlab generate`, `convert`): each ends
in one error line naming the file and what is wrong, within seconds and without the memory a
count, offset or size the file states would take (issue 49, item 15; the third fault probe's
files). Every file is a valid one (tests/helpers/gguf_writing.py writes it as llama.cpp's
converter does) with one thing changed, so only that thing can be blamed; the reference that the
rest of each file is sound: the unchanged file loads and generates (`test_the_unchanged_file_loads`).
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import gguf  # noqa: E402

from helpers.gguf_writing import tiny_hf_llama, write_gguf  # noqa: E402
from helpers.guarded_cli import run_guarded  # noqa: E402

ARRAY, UINT8, INT32 = 9, 0, 5  # GGUF value types (gguf-py constants.py GGUFValueType)
SECONDS = 10  # each command, in a child process whose imports are already paid
GREW = 300 * 2**20  # peak memory a refused file may add: the fixes refuse before allocating


def _with_key(data: bytes, keys_end: int, name: str, vtype: int, payload: bytes) -> bytes:
    """`data` (a GGUF file whose keys end at `keys_end`) with one more key after the last one.
    Its size is made a multiple of the alignment (32) by padding the name, so the tensor data
    moves by whole alignments and every tensor offset stays valid."""
    base = 8 + 4 + len(payload)
    name += "_" * (-(base + len(name)) % 32)
    raw = struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", vtype) + payload
    (n_keys,) = struct.unpack_from("<Q", data, 16)
    return data[:16] + struct.pack("<Q", n_keys + 1) + data[24:keys_end] + raw + data[keys_end:]


def _offset_field(reader, index: int) -> int:
    """The byte position of tensor `index`'s offset in its tensor info (name, n_dims, dims,
    type, offset: the GGUF spec's order)."""
    t = reader.tensors[index]
    return t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape) + 4


@pytest.fixture(scope="module")
def forged(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hostile")
    hf = tiny_hf_llama()
    ok = write_gguf(folder / "ok.gguf", hf, "llama")
    data = ok.read_bytes()
    reader = gguf.GGUFReader(ok)
    keys_end = reader.tensors[0].field.offset  # where the tensor infos start
    files = {"ok": ok}

    def put(name: str, content: bytes) -> None:
        files[name] = folder / f"{name}.gguf"
        files[name].write_bytes(content)

    for name, item, count in [("uint8-2^62", UINT8, 2**62), ("int32-2^40", INT32, 2**40)]:
        key = ARRAY, struct.pack("<IQ", item, count)  # the probe's two arrays, no elements
        put(name, _with_key(data, keys_end, "attnlab.hostile", *key))
    assert reader.tensors[0].data_offset == reader.data_offset  # the first tensor's offset is 0
    wrapped = bytearray(data)
    struct.pack_into("<Q", wrapped, _offset_field(reader, 0), 2**64 - 32)
    put("offset-2^64-32", bytes(wrapped))
    put("truncated", data[: len(data) // 2])
    put("not-gguf", b"GGUF" + bytes(range(256)) * 8)
    for name, key, value in [
        ("wide", "llama.embedding_length", 4096),  # the probe's 235 KB file claiming d_model 4096
        ("deep", "llama.block_count", 10**9),
        ("ffn", "llama.feed_forward_length", 10**6),  # 1.5 GB of FFNs in a 138 KB file
    ]:
        files[name] = write_gguf(folder / f"{name}.gguf", hf, "llama", **{key: value})
    return files


@pytest.fixture(scope="module")
def outcomes(forged, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    gen = ["--prompt", "hi", "--max-new-tokens", "2", "--temperature", "0"]
    commands = {
        name: ["generate", str(forged[name]), *gen]
        for name in ("ok", "wide", "deep", "ffn", "offset-2^64-32", "int32-2^40")
    }
    for name in ("truncated", "not-gguf"):
        commands[f"vocab-from {name}"] = [
            "convert", str(forged["ok"]), str(out / f"{name}.gguf"), "--vocab-from",
            str(forged[name]),
        ]  # fmt: skip
    # last: before the fix it hung, and the deadline cuts off every command after it
    commands["uint8-2^62"] = ["generate", str(forged["uint8-2^62"]), *gen]
    return dict(zip(commands, run_guarded(list(commands.values())), strict=True))


def test_the_unchanged_file_loads(outcomes):
    ok = outcomes["ok"]
    assert ok is not None and ok.rc == 0, ok


def _refused(outcomes, forged, name: str, *says: str) -> str:
    got = outcomes[name]
    assert got is not None, f"{name}: still running at the deadline (a hang) or killed at the cap"
    path = str(forged[name.removeprefix("vocab-from ")])
    assert got.rc == 2 and "Traceback" not in got.err, f"{name}: rc {got.rc}: {got.err}"
    line = got.err.strip()
    assert line.startswith("error: ") and "\n" not in line, line
    assert path in line, f"{name}: the message does not name the file: {line}"
    for s in says:
        assert s in line, f"{name}: {s!r} not in {line}"
    assert got.seconds < SECONDS, f"{name}: {got.seconds:.1f} s"
    assert got.grew < GREW, f"{name}: the peak memory rose by {got.grew / 2**20:.0f} MiB"
    return line


@pytest.mark.parametrize("name", ["uint8-2^62", "int32-2^40"])
def test_an_array_count_the_file_cannot_hold(outcomes, forged, name):
    """The probe's files: the reader looped on empty reads for minutes (2^62) or failed with
    numpy's dtype message naming nothing (2^40)."""
    count = f"{2**62:,}" if "2^62" in name else f"{2**40:,}"
    _refused(outcomes, forged, name, "attnlab.hostile", count, "bytes are left")


def test_a_tensor_offset_that_wraps(outcomes, forged):
    """2^64 − 32 wrapped (uint64) to 32 bytes before the data: rc 0, the embedding shifted by 8
    floats."""
    _refused(outcomes, forged, "offset-2^64-32", "token_embd.weight", "past the end of the file")


@pytest.mark.parametrize(
    ("name", "key"),
    [("wide", "llama.embedding_length"), ("deep", "llama.block_count"),
     ("ffn", "llama.feed_forward_length")],
)  # fmt: skip
def test_sizes_the_tensors_cannot_hold(outcomes, forged, name, key):
    """The metadata's sizes against the tensors', before a model is built: a width the embedding
    does not have, 10^9 blocks (the architecture's config rules loop over them), an FFN width
    that builds 1.5 GB."""
    _refused(outcomes, forged, name, key)


@pytest.mark.parametrize("name", ["truncated", "not-gguf"])
def test_convert_vocab_from_a_bad_file_names_it(outcomes, forged, name):
    _refused(outcomes, forged, f"vocab-from {name}")


def test_metadata_arrays_are_checked_against_the_memory(forged):
    """The gguf package's reader keeps about 1 KB per array element (layout.py): a machine
    with less memory than the file's arrays need is told so before the reader starts."""
    from attnlab.errors import FileFormatError
    from attnlab.interop.gguf.layout import READER_BYTES_PER_ELEMENT, check_layout

    layout = check_layout(forged["ok"])
    reader = gguf.GGUFReader(forged["ok"])  # the reference: the gguf package's own reading
    arrays = sum(
        len(f.data) for f in reader.fields.values() if f.types[0] == gguf.GGUFValueType.ARRAY
    )
    assert layout.array_elements == arrays > 0
    assert layout.values == sum(int(t.n_elements) for t in reader.tensors)
    check_layout(forged["ok"], available=arrays * READER_BYTES_PER_ELEMENT)
    with pytest.raises(FileFormatError, match=r"metadata arrays hold .* GiB available"):
        check_layout(forged["ok"], available=arrays * READER_BYTES_PER_ELEMENT - 1)
