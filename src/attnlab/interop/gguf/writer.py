"""An attnlab model -> a GGUF file that llama.cpp (and ollama, LM Studio) runs, written as
llama.cpp's own converter (convert_hf_to_gguf.py and its conversion/ package) writes the
transformers checkpoint the model converts to.

    save_gguf(model, "model.gguf", vocab=vocab_from_gguf("source.gguf"), outtype="q8_0")

The model goes through its transformers converter first (src/attnlab/interop/<family>.py:
`config_to_hf`, `weights_to_hf`), so the file is what llama.cpp's converter would write from the
HF folder `save_pretrained` writes. What differs by architecture is its entry in the table
(src/attnlab/interop/gguf/table.py; the entries in src/attnlab/interop/gguf/archs/), the one the
reader undoes: the metadata keys its `set_gguf_parameters` writes (`parameters`), what its
`modify_tensors` and `generate_extra_tensors` write (experts stacked per kind, GPT-OSS's
interleaved gate/up split, DeepSeek's kv_b_proj split, Falcon's q/k/v groups as [q | k | v],
Llama 3's frequency factors as `rope_freqs`, Phi-3's LongRoPE factors as `rope_factors_long` /
`_short`) and the value changes both directions share (`to_file`: q/k rows permuted for the
llama-derived classes, Gemma's norms stored as 1 + w, GPT-2's Conv1D transposed, GPT-NeoX's and
BLOOM's per-head q/k/v as [q | k | v]); the other tensors take llama.cpp's names from the `gguf`
package's TensorNameMap, as the converter calls it. The reader beside it
(src/attnlab/interop/gguf/reader.py) undoes each change; tests/interop/gguf/test_gguf_write.py
checks the two against each other and against transformers.

Storage types follow the converter's `prepare_tensors`: 1-D tensors, norms, biases and MoE routers
stay F32; the other weights take `outtype` (f32, f16, bf16, q8_0, and the block types q4_0, q4_1,
q5_0, q5_1 that llama.cpp's `llama-quantize --pure` gives every weight); a tensor whose rows are
not whole blocks falls back to F16, as the converter does. The blocks are the `gguf` package's
quantizers (gguf.quants), llama.cpp's reference rounding. K-quants (q4_k, q6_k) are refused:
that package cannot write them; quantize an f16 file with llama.cpp's llama-quantize instead.

The tokenizer is written from a `Vocab`: the `tokenizer.*` keys of a GGUF file copied with their
types (`vocab_from_gguf`, what a model read from GGUF and trained here carries out again), or a
byte-level BPE tokenizer.json written as the converter's `_set_vocab_gpt2` writes it
(`vocab_from_tokenizer`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..converter import ConversionError, config_to_hf, converter_for, model_type_of
from .archs.base import Arch, Tensors
from .table import ARCHITECTURES, WRITTEN_AS

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
_REFUSED = {
    "q4_k": "the gguf package cannot quantize K-quants",
    "q6_k": "the gguf package cannot quantize K-quants",
}


@dataclass(frozen=True)
class Vocab:
    """The `tokenizer.*` keys a GGUF file gets (and, from a GGUF source, its model card's
    `general.*` keys: license, languages, ...): (key, value, GGUFValueType, array element type)."""

    items: tuple[tuple[str, Any, Any, Any], ...]

    def get(self, key: str, default: Any = None) -> Any:
        return next((v for k, v, _, _ in self.items if k == key), default)


# general.* keys the writer states itself rather than copies
_OWN_GENERAL = ("architecture", "name", "type", "file_type", "quantization_version", "alignment")


def vocab_from_gguf(path: str | Path) -> Vocab:
    """Every `tokenizer.*` key of a GGUF file, and its model card's `general.*` keys (basename,
    license, languages, ...), with their stored types, to write unchanged."""
    from gguf import GGUFValueType

    from .reader import _value, open_gguf

    reader = open_gguf(path)  # its layout checked first: every failure names the file
    items = []
    for key, f in reader.fields.items():
        own = key.startswith("general.") and key.split(".", 1)[1] in _OWN_GENERAL
        if not key.startswith(("tokenizer.", "general.")) or own:
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        items.append((key, _value(f), f.types[0], sub))
    return Vocab(tuple(items))


def vocab_from_tokenizer(tok, vocab_size: int, **special: Any) -> Vocab:
    """A byte-level BPE `tokenizers.Tokenizer` (an HF folder's or a run's tokenizer.json) as
    llama.cpp's converter writes it: tokenizer.py `gguf_vocab_items`, whose keywords
    (chat_template, bos, eos, pad, pre) `special` passes on."""
    from gguf import GGUFValueType as V

    from .tokenizer import gguf_vocab_items

    kinds = {
        "str": (V.STRING, None), "u32": (V.UINT32, None), "bool": (V.BOOL, None),
        "[str]": (V.ARRAY, V.STRING), "[i32]": (V.ARRAY, V.INT32),
    }  # fmt: skip
    items = gguf_vocab_items(tok, vocab_size, **special)
    return Vocab(tuple((k, v, *kinds[kind]) for k, v, kind in items))


# --- metadata: the architecture's set_gguf_parameters --------------------------------------------


def hparams(hf: dict) -> dict:
    """config.json as `TextModel.__init__` (conversion/base.py) sees it: top-level
    original_max_position_embeddings / partial_rotary_factor copied into rope_parameters."""
    rope = dict(hf.get("rope_parameters") or {})
    if "full_attention" not in rope:
        for key in ("original_max_position_embeddings", "partial_rotary_factor"):
            if key not in rope and hf.get(key) is not None:
                rope[key] = hf[key]
    return dict(hf, rope_parameters=rope)


def config_json(spec: Arch, model_type: str, hf: dict) -> dict:
    """attnlab's config dict for `model_type` as the converter reads transformers' config.json
    (the entry's `config_json` says where they differ) and sees it (`hparams`)."""
    hf = dict(hf, model_type=model_type)
    return hparams(spec.config_json(hf) if spec.config_json else hf)


def parameters(w, hp: dict, arch: str) -> None:
    """The `<arch>.*` keys llama.cpp's converter writes for `arch` from config.json `hp`."""
    ARCHITECTURES[arch].parameters(w, hp)


# --- tensors -------------------------------------------------------------------------------------


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (conversion/llama.py), written from its definition:
    each head's rows from "rotate half" order to interleaved pairs."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def to_file(spec: Arch, name: str, a: np.ndarray, hp: dict) -> np.ndarray:
    """GGUF tensor `name`'s values as the converter changes them: the value changes the entry
    names (the reader's `from_file` undoes them). LlamaModel.permute takes the q/k biases too."""
    heads = hp.get("num_attention_heads") or hp.get("n_head")
    if spec.permuted and ".attn_q." in name:
        a = permute(a, heads)
    elif spec.permuted and ".attn_k." in name:
        a = permute(a, hp.get("num_key_value_heads") or heads)
    if spec.norm_offset and name.endswith("norm.weight"):
        a = a + 1  # Gemma2Model / Gemma3Model.modify_tensors: (1 + w) stored
    if a.ndim == 2 and name.endswith(".weight") and name.split(".")[-2] in spec.conv1d:
        a = a.T  # GPT2Model.modify_tensors: Conv1D's (in, out) as (out, in)
    if spec.interleaved_qkv and ".attn_qkv." in name:  # per head (H, 3, D) -> [q | k | v]
        a = a.reshape(heads, 3, -1, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
    return a


def tensors(hp: dict, sd: dict[str, torch.Tensor], arch: str) -> Tensors:
    """(GGUF name, fp32 array) of the transformers state dict `sd` in llama.cpp's layout, before
    any quantization: what the converter's generate_extra_tensors and modify_tensors yield."""
    import gguf

    spec = ARCHITECTURES[arch]
    n_layers = hp.get("num_hidden_layers") or hp.get("n_layer") or hp.get("n_layers")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[spec.enum], n_layers)
    out = list(spec.extra_tensors(hp)) if spec.extra_tensors else []
    tied = hp.get("tie_word_embeddings", False)
    for name, p in sd.items():
        a = p.detach().float().cpu().numpy()
        if name == "lm_head.weight" and tied:
            continue  # llama.cpp writes no output tensor for a tied head
        bid = next((int(x) for x in name.split(".") if x.isdecimal()), None)
        if spec.modify is not None and (own := spec.modify(name, a, hp, bid)) is not None:
            out += own
            continue
        new = names.get_name(name.removeprefix(spec.strip), try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ConversionError(f"llama.cpp's {arch} converter has no name for {name}")
        out.append((new, to_file(spec, new, a, hp)))
    return out


def storage_type(name: str, a: np.ndarray, outtype: str):
    """The converter's choice (`prepare_tensors`): F32 for 1-D tensors, norms, biases and MoE
    routers, else `outtype`'s type."""
    import gguf

    Q = gguf.GGMLQuantizationType
    stays_f32 = (
        a.ndim <= 1
        or name.endswith("_norm.weight")
        or not name.endswith(".weight")
        or ".ffn_gate_inp." in name
        or name.startswith(("position_embd.", "token_types."))
    )
    return Q.F32 if stays_f32 else Q[outtype.upper()]


def encode(a: np.ndarray, qtype) -> tuple[np.ndarray, Any]:
    """a in storage type qtype (the gguf package's quantizers); rows that are not whole blocks
    fall back to F16, as the converter does."""
    import gguf

    Q = gguf.GGMLQuantizationType
    a = np.ascontiguousarray(a, dtype=np.float32)
    if qtype == Q.F32:
        return a, Q.F32
    try:
        return gguf.quants.quantize(a, qtype), qtype
    except gguf.QuantError:
        return gguf.quants.quantize(a, Q.F16), Q.F16


def check_outtype(outtype: str) -> None:
    if outtype in _REFUSED:
        raise ValueError(
            f"outtype {outtype!r}: {_REFUSED[outtype]}; write f16 and run llama.cpp's "
            f"`llama-quantize model-f16.gguf model-{outtype}.gguf {outtype.upper()}`"
        )
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")


def gguf_architecture(model: nn.Module, model_type: str | None = None) -> tuple[str, str]:
    """(transformers model_type, llama.cpp architecture) of `model`, or a ConversionError naming
    what llama.cpp cannot run and what would."""
    model_type = model_type_of(model, model_type)
    if model_type not in WRITTEN_AS:
        raise ConversionError(
            f"no GGUF writer for model_type {model_type!r}: attnlab writes "
            f"{', '.join(sorted(WRITTEN_AS))}; save an HF folder instead (`attnlab convert SRC "
            "DIR --to hf`), which transformers and vLLM read"
        )
    return model_type, WRITTEN_AS[model_type].name


def save_gguf(
    model: nn.Module,
    path: str | Path,
    *,
    vocab: Vocab,
    outtype: str = "f32",
    model_type: str | None = None,
    name: str | None = None,
    types: Callable[[str], Any] | None = None,
    file_type: int | None = None,
    progress: bool = False,
) -> Path:
    """Write `model` to the GGUF file `path`, whole or not at all (src/attnlab/atomic.py).
    vocab: the tokenizer.* keys (vocab_from_gguf); outtype: the weights' storage (OUTTYPES);
    types: a tensor name -> storage type that overrides outtype (None to keep it), for files
    that keep a source's per-tensor types (`source_types`), with that source's file_type;
    progress: a bar per tensor."""
    import gguf

    from ...atomic import atomic_file

    check_outtype(outtype)
    model_type, arch = gguf_architecture(model, model_type)
    spec = ARCHITECTURES[arch]
    conv = converter_for(model_type)
    hp = config_json(spec, model_type, config_to_hf(conv, model))
    if spec.fit is not None:  # what llama.cpp's graph does not compute: refused or warned
        spec.fit(hp)
    sd = conv.weights_to_hf(dict(model.state_dict()), model.config)
    w = writer_class()(path=None, arch=arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or Path(path).stem)
    w.add_file_type(
        file_type if file_type is not None else gguf.LlamaFileType[_FILE_TYPES[outtype]]
    )
    parameters(w, hp, arch)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, vtype, sub in vocab.items:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for tname, a in tensors(hp, sd, arch):
        qtype = (types(tname) if types is not None else None) or storage_type(tname, a, outtype)
        data, qtype = encode(a, qtype)
        w.add_tensor(
            tname, data, raw_dtype=None if qtype == gguf.GGMLQuantizationType.F32 else qtype
        )
    with atomic_file(path) as tmp:
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=progress)
        w.close()
    return Path(path)


@cache
def writer_class() -> type:
    """gguf's GGUFWriter with two checks of its own: an integer key whose value does not fit its
    type is a ConversionError naming the key, the value and the range (gguf's struct.error names
    neither, and a wider type is not what llama.cpp reads: its loader wants each key's own
    type); and an empty array is written (count 0, its element type stated), which gguf
    refuses although the format allows it and llama.cpp reads it (a vocabulary without merges
    still needs `tokenizer.ggml.merges`)."""
    import gguf

    V = gguf.GGUFValueType
    widths = {V.UINT8: (0, 8), V.INT8: (1, 8), V.UINT16: (0, 16), V.INT16: (1, 16),
              V.UINT32: (0, 32), V.INT32: (1, 32), V.UINT64: (0, 64), V.INT64: (1, 64)}  # fmt: skip

    def check(key: str, value: Any, vtype) -> None:
        if vtype not in widths or isinstance(value, bool):
            return
        signed, bits = widths[vtype]
        low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
        if not low <= value <= high:
            raise ConversionError(
                f"{key} = {value} does not fit GGUF's {vtype.name} ({low} to {high}), the type "
                "llama.cpp reads it as: the source states a size no .gguf file can hold (a "
                "damaged or hostile source?); nothing was written"
            )

    class Writer(gguf.GGUFWriter):
        def add_key_value(self, key: str, val: Any, vtype, sub_type=None) -> None:
            if vtype == V.ARRAY and not isinstance(val, (str, bytes)):
                kind = sub_type or (V.get_type(val[0]) if len(val) else None)
                for x in val if kind in widths else ():
                    check(key, x, kind)
            else:
                check(key, val, vtype)
            super().add_key_value(key, val, vtype, sub_type=sub_type)

        def _pack_val(self, val: Any, vtype, add_vtype: bool, sub_type=None) -> bytes:
            if vtype == V.ARRAY and sub_type is not None and len(val) == 0:
                head = self._pack("I", vtype) if add_vtype else b""
                return head + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type=sub_type)

    return Writer


def source_types(path: str | Path) -> tuple[Callable[[str], Any], int | None]:
    """(tensor name -> its storage type in the GGUF file at path, the file's general.file_type):
    to write a model read from that file with every tensor as it was. Types attnlab cannot
    write (K-quants, i-quants) are refused, naming them and what to pass instead."""
    import gguf

    from .reader import open_gguf

    reader = open_gguf(path)
    kinds = {t.name: t.tensor_type for t in reader.tensors}
    writable = {gguf.GGMLQuantizationType[t.upper()] for t in OUTTYPES}
    other = sorted({k.name for k in kinds.values() if k not in writable})
    if other:
        raise ValueError(
            f"{path} stores tensors as {', '.join(other)}, which attnlab cannot write (the gguf "
            "package has no quantizer for them): pass --quant q8_0 / q4_0 / q4_1 or --dtype f16"
        )
    f = reader.fields.get("general.file_type")
    return kinds.get, (int(f.parts[f.data[0]][0]) if f is not None else None)


_FILE_TYPES = {  # outtype -> gguf.LlamaFileType (general.file_type)
    "f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1", "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1",
}  # fmt: skip
