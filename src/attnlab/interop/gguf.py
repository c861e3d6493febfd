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

Supported: the llama layout, `general.architecture` llama (SmolLM, Llama 1 and 2), qwen2 and
qwen3. Reading is table-driven: the metadata becomes the config.json dict that family's
converter already reads (src/attnlab/interop/llama.py), and the tensor names become the
transformers names it renames, so a GGUF checkpoint and an HF folder go through the same code. Anything the converter cannot compute exactly (experts, per-layer head
counts, partial rotary, RoPE scalings but linear, Llama 3's rope_freqs) is refused by name. One
difference from the HF layout: llama.cpp's converter (convert_hf_to_gguf.py, `LlamaModel.permute`)
reorders the rows of each attention head of q_proj and k_proj from transformers' "rotate half"
RoPE layout ([x_0..x_{D/2-1} | x_{D/2}..x_{D-1}]) to its interleaved one ([x_0, x_{D/2}, x_1, ...]);
`_unpermute` undoes it. The tokenizer is built in src/attnlab/interop/gguf_tokenizer.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import Problems
from .converter import ConversionError, converter_for
from .layouts import check_loaded

# GGUF tensor names -> transformers names: the whole-model ones, then the ones of block {i}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's qk-norm
    "attn_k_norm": "self_attn.k_norm",
}


@dataclass
class GGUFModel:
    """What a GGUF file holds: the model (eval mode), its tokenizer and chat template, and the
    token ids generation needs (`eos_token_ids`: every id that ends a turn, first the EOS)."""

    model: nn.Module
    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    name: str
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = False, **kwargs: Any
    ) -> str:
        """The conversation as the prompt text the model was trained on (the file's Jinja
        template, rendered as transformers' `apply_chat_template(tokenize=False)` does)."""
        from .gguf_tokenizer import render_chat

        if self.chat_template is None:
            raise ValueError(
                f"{self.name} has no tokenizer.chat_template: format the prompt yourself"
            )
        return render_chat(
            self.chat_template, messages, self.metadata, add_generation_prompt, **kwargs
        )


# --- metadata ------------------------------------------------------------------------------------


def _value(f) -> Any:
    """A `gguf.ReaderField` as a Python value (str, int, float, bool, or a list of them)."""
    from gguf import GGUFValueType

    def one(part, kind) -> Any:
        return bytes(part).decode("utf-8") if kind == GGUFValueType.STRING else part[0].item()

    if f.types[0] == GGUFValueType.ARRAY:
        if f.types[-1] == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        if not f.data:
            return []
        return np.concatenate([f.parts[i] for i in f.data]).tolist()
    return one(f.parts[f.data[0]], f.types[0])


def read_metadata(reader) -> dict[str, Any]:
    """Every key of a `gguf.GGUFReader` except the file-format ones (GGUF.version, ...)."""
    return {k: _value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


# --- config --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """How one GGUF architecture maps onto a transformers family (its converter reads it)."""

    model_type: str  # the converter (src/attnlab/interop/llama.py) that reads the config dict
    permuted: bool  # llama.cpp reordered the q/k rows (convert_hf_to_gguf.py, LlamaModel only)


# general.architecture -> its family: the llama layout, whose tensors share one naming scheme
ARCHITECTURES = {
    "llama": Arch("llama", permuted=True),
    "qwen2": Arch("qwen2", permuted=False),
    "qwen3": Arch("qwen3", permuted=False),
}


def _decoder_config(
    arch: str, meta: dict[str, Any], names: set[str], problems: Problems
) -> dict[str, Any]:
    """llama.cpp's `<arch>.*` keys as the transformers config dict they were written from
    (convert_hf_to_gguf.py); features attnlab does not compute go to `problems`."""

    def key(name: str, default: Any = ...) -> Any:
        if f"{arch}.{name}" in meta:
            return meta[f"{arch}.{name}"]
        if default is ...:
            problems.add(f"{arch}.{name} is missing: the file does not describe a whole model")
            return 1
        return default

    heads = key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    d_model = key("embedding_length")
    head_dim = key("attention.key_length", d_model // heads if isinstance(heads, int) else 0)
    if isinstance(kv_heads, list) or isinstance(heads, list):
        problems.add(f"{arch}.attention.head_count(_kv): a count per layer is not supported")
    if key("attention.value_length", head_dim) != head_dim:
        problems.add(f"{arch}.attention.value_length differs from key_length: not supported")
    if key("rope.dimension_count", head_dim) != head_dim:
        problems.add(
            f"{arch}.rope.dimension_count ({key('rope.dimension_count')}) is not the head size "
            f"({head_dim}): partial rotary models are not supported"
        )
    if key("expert_count", 0):
        problems.add(f"{arch}.expert_count: mixture-of-experts GGUF files are not supported")
    scaling = key("rope.scaling.type", "none")
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    elif scaling != "none":
        problems.add(f"{arch}.rope.scaling.type {scaling!r}: supported are 'none' and 'linear'")
    return dict(
        model_type=ARCHITECTURES[arch].model_type,
        vocab_size=key("vocab_size", len(meta.get("tokenizer.ggml.tokens", ())) or None),
        hidden_size=d_model,
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=key("feed_forward_length"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        rope_theta=key("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=key("context_length", 2048),
        sliding_window=None,  # llama.cpp keeps none for these families
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_output.bias" in names,  # Llama / Qwen3: all four or none
        mlp_bias="blk.0.ffn_up.bias" in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )


# --- tensors -------------------------------------------------------------------------------------


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows [0, D/2, 1, D/2+1, ...] -> [0, 1, ..., D-1]
    (its permute reshapes to (H, 2, D/2, ...) and swaps axes 1 and 2; this is the inverse)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def _dequantize(t) -> torch.Tensor:
    """One `gguf.ReaderTensor` as a float32 tensor in transformers' (out, in) layout."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    if t.tensor_type in (Q.F32, Q.F16, Q.F64):  # the reader already gives them typed
        data = np.array(t.data, dtype=np.float32)  # a copy: the file is mapped read-only
    else:
        try:
            data = dequantize(t.data, t.tensor_type)
        except NotImplementedError as err:
            raise ConversionError(
                f"tensor {t.name} is stored as {t.tensor_type.name}, which the installed gguf "
                f"package cannot dequantize ({err}); upgrade it (pip install -U gguf) or "
                "re-quantize the model to a common type (Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, F16)"
            ) from err
    return torch.from_numpy(np.ascontiguousarray(data).reshape(tuple(reversed(t.shape.tolist()))))


def _hf_name(name: str) -> str | None:
    """A GGUF tensor name as transformers'; None when attnlab has no place for it."""
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK:
        return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}.{kind}"
    return None


def read_weights(reader, hf: dict[str, Any], permuted: bool) -> dict[str, torch.Tensor]:
    """The file's tensors, dequantized, under transformers' names and in its layouts."""
    unknown = [t.name for t in reader.tensors if _hf_name(t.name) is None]
    if unknown:
        raise ConversionError(
            f"GGUF tensors attnlab cannot place: {', '.join(unknown[:8])}"
            + (
                " (rope_freqs: Llama 3's RoPE scaling is not supported)"
                if "rope_freqs.weight" in unknown
                else ""
            )
        )
    sd = {}
    for t in reader.tensors:
        w = _dequantize(t)
        if permuted and ".attn_q." in t.name:
            w = _unpermute(w, hf["num_attention_heads"])
        elif permuted and ".attn_k." in t.name:
            w = _unpermute(w, hf["num_key_value_heads"])
        sd[_hf_name(t.name)] = w
    return sd


# --- the whole file ------------------------------------------------------------------------------


def _reader(path: str | Path):
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise ImportError(
            "reading GGUF files needs the gguf package: pip install 'attnlab[gguf]' (or gguf)"
        ) from err
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file {path}")
    try:
        return GGUFReader(path)
    except ValueError as err:  # the reader checks the magic and the version
        raise ValueError(f"{path} is not a GGUF file the gguf package can read: {err}") from err


def gguf_config(meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The transformers config dict of a GGUF file's metadata (tensor `names` tell whether the
    output head is tied and whether projections carry biases)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConversionError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    problems = Problems()
    hf = _decoder_config(arch, meta, names, problems)
    problems.raise_as(ConversionError, f"GGUF {arch} metadata for an exact conversion")
    return hf


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> GGUFModel:
    """A GGUF file -> GGUFModel: the attnlab model with the dequantized weights (eval mode, in
    `dtype`), the tokenizer and chat template its metadata describes. Needs the `gguf` package,
    not `transformers`."""
    from ..build import build_model
    from .gguf_tokenizer import tokenizer_from_gguf

    reader = _reader(path)
    meta = read_metadata(reader)
    hf = gguf_config(meta, {t.name for t in reader.tensors})
    conv = converter_for(hf["model_type"])
    cfg = conv.config_from_hf(hf)
    model = build_model(cfg)
    sd = conv.weights_from_hf(
        read_weights(reader, hf, ARCHITECTURES[meta["general.architecture"]].permuted), cfg
    )
    check_loaded(f"load_gguf({path})", *model.load_state_dict(sd, strict=False))
    model.hf_model_type = conv.model_type  # for to_hf / save_pretrained
    eos = [
        meta[k]
        for k in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        )
        if k in meta
    ]
    out = GGUFModel(
        model=model.to(dtype).eval(),
        tokenizer=tokenizer_from_gguf(meta),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)),
        name=meta.get("general.name") or Path(path).stem,
        metadata=meta,
    )
    _attach_generation(out)
    return out


def _attach_generation(g: GGUFModel) -> None:
    """`model.generation` (src/attnlab/decode/settings.py) from the file's special tokens, so
    `al.generate(g.model, ids)` stops where llama.cpp and transformers stop."""
    try:
        from ..decode.settings import GenerationSettings
    except ImportError:  # an attnlab without per-model generation settings
        return
    eos = g.eos_token_ids
    g.model.generation = GenerationSettings(
        bos_token_id=g.bos_token_id,
        eos_token_id=(eos[0] if len(eos) == 1 else tuple(eos)) if eos else None,
        pad_token_id=g.model.config.pad_token_id,
    )
