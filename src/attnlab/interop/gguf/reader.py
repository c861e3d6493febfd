"""GGUF files (llama.cpp's single-file format) -> an attnlab model and its tokenizer, without
`transformers`.

    g = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    g.model, g.tokenizer, g.chat_template, g.bos_token_id, g.eos_token_ids, g.name
    text = g.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

A GGUF file holds key/value metadata (the architecture's sizes under `<arch>.*`, the tokenizer
under `tokenizer.*`) and tensors under llama.cpp's names, each stored whole-precision (F32, F16,
BF16) or block-quantized (Q4_0 ... Q8_0, the K-quants Q4_K / Q5_K / Q6_K, ...). The `gguf` package
(llama.cpp's own reader, the `gguf` extra) reads both; its `gguf.quants.dequantize` turns every
quantized type it knows into float32, which is what attnlab computes with here: the model is the
dequantized checkpoint, exactly what transformers' GGUF loading builds.

Reading is table-driven (src/attnlab/interop/gguf/table.py, one entry per `general.architecture`
with what llama.cpp's converter changed on the way): the metadata becomes the config.json dict of
the transformers family it was converted from (src/attnlab/interop/gguf/config.py), and the
tensors transformers' names and layouts (src/attnlab/interop/gguf/tensors.py), so a GGUF
checkpoint and an HF folder go through the same converter (src/attnlab/interop/<family>.py). The
tokenizer is built in src/attnlab/interop/gguf/tokenizer.py; the record returned is
src/attnlab/interop/loaded.py's; tests/helpers/gguf_writing.py writes test files as llama.cpp
does.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...errors import FileFormatError, reading
from ..converter import converter_for
from ..hf_config import parameters_beyond
from ..layouts import check_finite, check_loaded
from ..loaded import LoadedModel
from .archs.base import shortest
from .config import gguf_config
from .layout import check_layout
from .tensors import ROPE_TENSORS, dequantized, read_weights

if TYPE_CHECKING:
    from ...config import ModelConfig as ModelConfigT

_FIX = "the file is truncated, damaged or not a model llama.cpp wrote: download or convert it again"


# --- metadata ------------------------------------------------------------------------------------


def _value(f) -> Any:
    """A `gguf.ReaderField` as a Python value (str, int, float, bool, or a list of them). A
    float32 is given as the shortest decimal that rounds to it (1e-05, not 9.99999974e-06), the
    number config.json held."""
    from gguf import GGUFValueType

    def one(part, kind) -> Any:
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        if kind == GGUFValueType.FLOAT32:
            return shortest(part[0])
        return part[0].item()

    if f.types[0] == GGUFValueType.ARRAY:
        if f.types[-1] == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        if not f.data:
            return []
        return [one(f.parts[i], f.types[-1]) for i in f.data]
    return one(f.parts[f.data[0]], f.types[0])


def read_metadata(reader) -> dict[str, Any]:
    """Every key of a `gguf.GGUFReader` except the file-format ones (GGUF.version, ...)."""
    return {k: _value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


# --- the whole file ------------------------------------------------------------------------------


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` of the file at `path`, its layout checked first (layout.py: every
    count, offset and size against the file's length, the metadata arrays against this
    machine's memory): every failure is a FileFormatError naming the file."""
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise ImportError(
            "reading GGUF files needs the gguf package: pip install 'attnlab[gguf]' (or gguf)"
        ) from err
    from ...build import available_memory

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file {path}")
    fix = "it is not a GGUF file the gguf package can read, or it is truncated: download or convert it again"
    with reading(path, "a GGUF file", fix):
        check_layout(path, available_memory())
        return GGUFReader(path)


def _tensor_facts(reader) -> dict[str, Any]:
    """Each tensor's (out, in) shape, the RoPE tensors' values."""
    return {
        t.name: dequantized(t).numpy()
        if t.name in ROPE_TENSORS
        else tuple(reversed(t.shape.tolist()))
        for t in reader.tensors
    }


def _described(path: str | Path, reader) -> tuple[dict[str, Any], dict[str, Any], ModelConfigT]:
    """(the metadata, the transformers config dict, the attnlab config) of an opened file, the
    sizes the metadata states checked against its tensors (`_check_sizes`) before anything is
    built from them."""
    with reading(path, "the GGUF metadata", _FIX):
        meta = read_metadata(reader)
        facts = _tensor_facts(reader)
    _check_blocks(path, meta, facts)
    with reading(path, "the GGUF metadata", _FIX):
        hf = gguf_config(meta, facts)
        cfg = converter_for(hf["model_type"]).config_from_hf(hf)
    _check_sizes(path, meta, cfg, sum(int(t.n_elements) for t in reader.tensors))
    return meta, hf, cfg


def _check_blocks(path: str | Path, meta: dict[str, Any], facts: dict[str, Any]) -> None:
    """`<arch>.block_count` and `embedding_length` against the tensors, which state them too:
    first, as the architecture's config rules loop over the blocks (a count of 10^9 hung)."""
    arch = meta.get("general.architecture")
    blocks = {n.split(".")[1] for n in facts if n.startswith("blk.")}
    count = meta.get(f"{arch}.block_count")
    problems = []
    if isinstance(count, int) and count > len(blocks):
        problems.append(
            f"{arch}.block_count = {count:,} but the tensors are of {len(blocks)} block(s)"
        )
    width = meta.get(f"{arch}.embedding_length")
    embed = facts.get("token_embd.weight")
    if (
        isinstance(width, int)
        and isinstance(embed, tuple)
        and len(embed) == 2
        and width != embed[1]
    ):
        problems.append(
            f"{arch}.embedding_length = {width:,} but token_embd.weight is {embed[1]:,} wide"
        )
    if problems:
        raise FileFormatError(
            f"{path}: the metadata does not describe the tensors ({'; '.join(problems)}): {_FIX}"
        )


def _check_sizes(path: str | Path, meta: dict[str, Any], cfg: ModelConfigT, held: int) -> None:
    """Refuse a config whose parameters the file's tensors (`held` values) cannot hold, before the
    model is built: a 235 KB file claiming feed_forward_length 10^6 built 1.5 GB first. A file
    holds every parameter (the families' test files: 0.9998 to 1.0 of the count), so the slack
    is small."""
    n = parameters_beyond(cfg, 1.05 * held + 2**16)
    if n is None:
        return
    arch = meta.get("general.architecture")
    keys = ", ".join(
        f"{arch}.{k} = {meta[f'{arch}.{k}']:,}"
        for k in ("embedding_length", "block_count", "feed_forward_length", "expert_count")
        if isinstance(meta.get(f"{arch}.{k}"), int)
    )
    raise FileFormatError(
        f"{path}: the metadata describes a model of about {n:,} parameters ({keys}) but the "
        f"file's tensors hold {held:,} values: {_FIX}"
    )


def _check_memory(path: str | Path, held: int) -> None:
    """Loading holds the tensors dequantized to float32 beside the model built from them (as
    many values again): refuse, before either, a file this machine cannot hold twice."""
    from ...build import available_memory

    need, available = 2 * 4 * held, available_memory()
    if available is not None and need > available:
        raise FileFormatError(
            f"{path}: its {held:,} values take {need / 2**30:.1f} GiB to load (dequantized to "
            f"float32, and the model built from them) but this machine has "
            f"{available / 2**30:.1f} GiB available: load it on a machine with more memory"
        )


def gguf_file_config(path: str | Path) -> tuple[dict[str, Any], ModelConfigT]:
    """(the transformers config dict, the attnlab config) a GGUF file's metadata describes,
    without reading its weights."""
    _, hf, cfg = _described(path, open_gguf(path))
    return hf, cfg


def gguf_file_tokenizer(path: str | Path):
    """The `tokenizers.Tokenizer` a GGUF file's tokenizer.* metadata describes."""
    from .tokenizer import tokenizer_from_gguf

    reader = open_gguf(path)
    with reading(path, "the GGUF metadata", _FIX):
        return tokenizer_from_gguf(read_metadata(reader))


def load_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    *,
    packed: bool = False,
    allow_nonfinite: bool = False,
) -> LoadedModel:
    """A GGUF file -> LoadedModel (src/attnlab/interop/loaded.py): the attnlab model with the dequantized weights (eval mode, in
    `dtype`), the tokenizer and chat template its metadata describes. Needs the `gguf` package,
    not `transformers`. Every failure of reading the file is an attnlab error naming it (a
    truncated or hostile file included); NaN or infinite weights are refused unless
    `allow_nonfinite`.

    packed: keep the file's Q4_0 / Q4_1 / Q4_K weights as 4-bit blocks and its Q8_0 / Q5_0 /
    Q6_K weights as 8-bit ones (fp32 models only): the projections fused (`al.fuse`, where the
    parts are of one block kind), then every weight that is exactly such blocks stored as them
    (`pack_exact` with the scales the file states, src/attnlab/nn/quant_blocks.py), a tied token
    table included, so the loaded model holds about the file's bytes and a decode step reads
    them; it computes the same weights (the dequantized model's, up to fp32 summation order).
    Other types (Q5_1, Q5_K, F16, ...) stay float. `LoadedModel.packed` counts the maps of each
    kind."""
    from ...build import build_model
    from .tokenizer import tokenizer_from_gguf

    reader = open_gguf(path)
    meta, hf, cfg = _described(path, reader)
    arch = meta["general.architecture"]
    conv = converter_for(hf["model_type"])
    _check_memory(path, sum(int(t.n_elements) for t in reader.tensors))
    model = build_model(cfg)  # refuses sizes this machine cannot hold (build.py)
    if packed and dtype != torch.float32:
        raise ValueError(f"load_gguf(packed=True) keeps blocks for fp32 models; got {dtype}")
    scales = None
    if packed:
        from ...nn.quant_blocks import BlockScales

        scales = BlockScales()
    with reading(path, "the GGUF tensors", _FIX):
        raw = read_weights(reader, hf, arch, scales)
    if not allow_nonfinite:
        check_finite(raw, f"the tensors of {path}")
    with reading(path, "the GGUF tensors", _FIX):
        sd = conv.weights_from_hf(raw, cfg)
        check_loaded(f"load_gguf({path})", *model.load_state_dict(sd, strict=False))
    model.hf_model_type = conv.model_type  # for to_hf / save_pretrained
    model.context_length = hf["max_position_embeddings"]  # context_length, written back out
    eos = [
        meta[k]
        for k in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        )
        if k in meta
    ]
    model = model.to(dtype).eval()
    counts = None
    if packed:
        from ...nn.fuse import fuse
        from ...nn.quant_blocks import pack_exact, same_block_kind

        # q/k/v (gate/up) fused only where one block kind holds them all: Q4_K_M files store
        # attn_v as Q6_K beside Q4_K q and k in half the layers
        counts = pack_exact(fuse(model, alike=same_block_kind(scales)), scales)
    out = LoadedModel(
        model=model,
        tokenizer=tokenizer_from_gguf(meta),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)),
        name=meta.get("general.name") or Path(path).stem,
        metadata=meta,
        packed=counts,
        context_length=meta.get(f"{arch}.context_length"),
    )
    _attach_generation(out)
    return out


def _attach_generation(g: LoadedModel) -> None:
    """`model.generation` (src/attnlab/decode/settings.py) from the file's special tokens, so
    `al.generate(g.model, ids)` stops where llama.cpp and transformers stop."""
    try:
        from ...decode.settings import GenerationSettings
    except ImportError:  # an attnlab without per-model generation settings
        return
    eos = g.eos_token_ids
    g.model.generation = GenerationSettings(
        bos_token_id=g.bos_token_id,
        eos_token_id=(eos[0] if len(eos) == 1 else tuple(eos)) if eos else None,
        pad_token_id=g.model.config.pad_token_id,
    )
