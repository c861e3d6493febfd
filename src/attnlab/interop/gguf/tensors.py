"""A GGUF file's tensors -> a transformers state dict: each tensor dequantized to float32 (the
`gguf` package's `gguf.quants.dequantize`, what transformers' GGUF loading builds), its stated
block scales collected for packed loading (`_block_scales`), the architecture's changes undone
(its table entry, src/attnlab/interop/gguf/table.py: `unmodify`, then the value changes by GGUF
name: q/k un-permuted, Gemma's 1 + w, GPT-2's Conv1D transposed, fused q/k/v re-ordered) and the
names made transformers' (llama.cpp's gguf-py/gguf/tensor_mapping.py read backwards).

The q/k permutation: llama.cpp's `LlamaModel.permute` reorders the rows of each attention head
of q_proj and k_proj (weights and biases) from transformers' "rotate half" RoPE layout
([x_0..x_{D/2-1} | x_{D/2}..x_{D-1}]) to its interleaved one ([x_0, x_{D/2}, x_1, ...]) for the
classes derived from it (llama, smollm3, granite); `_unpermute` undoes it. Command R and DeepSeek
are interleaved in transformers too, so llama.cpp leaves them as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..converter import ConversionError
from .archs.base import Arch
from .table import ARCHITECTURES

if TYPE_CHECKING:
    from ...nn.quant_blocks import BlockScales

# the tensors llama.cpp generates for RoPE, read into the config instead
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def qkv_per_head(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Fused q/k/v rows [q | k | v] (3·H·D, ...) -> transformers' GPT-NeoX / BLOOM order, each
    head's q, k, v together ((H, 3, D) rows): the inverse of the converters' re-format."""
    rows = w.shape[0]
    return w.reshape(3, heads, rows // 3 // heads, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows [0, D/2, 1, D/2+1, ...] -> [0, 1, ..., D-1]
    (its permute reshapes to (H, 2, D/2, ...) and swaps axes 1 and 2; this is the inverse)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def dequantized(t) -> torch.Tensor:
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


# bytes per block of the types whose scales `_block_scales` reads (gguf-py `quants.py`)
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}


def _fp16(b: np.ndarray, at: int) -> np.ndarray:
    """Column `at` .. at + 2 of byte rows b as fp16 values, widened to fp32."""
    return np.ascontiguousarray(b[:, at : at + 2]).view(np.float16)[:, 0].astype(np.float32)


def _block_scales(t) -> tuple[str, np.ndarray, np.ndarray | None] | None:
    """The scales a quantized tensor states per block of 32 weights, in memory order, as
    quant_blocks.BlockScales takes them: ("q4", d, m) for w = d·q + m, ("q8", d, None) for
    w = d·q, ("q8", d of the first 16, d of the second) for Q6_K; None for a type without such
    blocks (Q5_1, Q5_K, floats, ...). Q4_K's 256 weights have fp16 d, dmin and 6-bit sc, mn per
    sub-block of 32 (12 bytes: sc[j] and mn[j] are the low 6 bits of bytes j and j + 4 for j < 4;
    for j >= 4 the nibbles of byte j + 4 with the top 2 bits of bytes j − 4 and j above them):
    w = (d·sc)·q − dmin·mn. Q6_K's 256 have 192 bytes of 6-bit quants, an int8 sc per 16 and an
    fp16 d: w = (d·sc)·(q − 32). The products are exact in fp32, as the gguf package's
    dequantization forms them."""
    kind = t.tensor_type.name
    if kind not in _BLOCK_BYTES:
        return None
    b = np.asarray(t.data).view(np.uint8).reshape(-1, _BLOCK_BYTES[kind])
    if kind == "Q6_K":
        sc = b[:, 192:208].copy().view(np.int8).astype(np.float32).reshape(-1, 8, 2)
        half = _fp16(b, 208)[:, None, None] * sc
        return "q8", half[..., 0].ravel(), half[..., 1].ravel()
    d = _fp16(b, 0)
    if kind == "Q4_0":  # w = d·(q − 8)
        return "q4", d, -8 * d
    if kind == "Q4_1":
        return "q4", d, _fp16(b, 2)
    if kind in ("Q5_0", "Q8_0"):  # Q5_0: w = d·(q − 16) with q − 16 in [−16, 15]
        return "q8", d, None
    dmin = _fp16(b, 2)
    s = b[:, 4:16].astype(np.uint8).reshape(-1, 3, 4)
    low, high, mixed = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([low & 63, (mixed & 15) | ((low >> 6) << 4)], axis=1)
    mn = np.concatenate([high & 63, (mixed >> 4) | ((high >> 6) << 4)], axis=1)
    return (
        "q4",
        (d[:, None] * sc.astype(np.float32)).ravel(),
        -(dmin[:, None] * mn.astype(np.float32)).ravel(),
    )


def _hf_name(name: str, spec: Arch, block: dict[str, str]) -> str | None:
    """A GGUF tensor name as transformers'; None when attnlab has no place for it."""
    stem, _, kind = name.rpartition(".")
    if stem in spec.global_names:
        return f"{spec.global_names[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in block:
        hf = f"{spec.block_prefix}.{parts[1]}.{block[parts[2]]}"
        if parts[2] == "attn_sinks":  # a bare parameter (GptOssModel.filter_tensors adds .weight)
            return hf
        if parts[2] == "exp_probs_b":  # DeepSeek-V3's routing bias correction
            return f"{hf}.e_score_correction_bias"
        return f"{hf}.{kind}"
    return None


def from_file(spec: Arch, name: str, w: torch.Tensor, hf: dict[str, Any]) -> torch.Tensor:
    """GGUF tensor `name`'s values as transformers holds them: the value changes its table entry
    names undone (the writer's `to_file` makes them)."""
    if spec.permuted and ".attn_q." in name:
        w = _unpermute(w, hf["num_attention_heads"])
    elif spec.permuted and ".attn_k." in name:
        w = _unpermute(w, hf["num_key_value_heads"])
    if spec.norm_offset and name.endswith("norm.weight"):
        w = w - 1  # exact: fl(1 + w) - 1 has no rounding for |w| <= 1 (Sterbenz)
    if w.dim() == 2 and name.endswith(".weight") and name.split(".")[-2] in spec.conv1d:
        w = w.t().contiguous()
    if spec.interleaved_qkv and ".attn_qkv." in name:
        w = qkv_per_head(w, hf.get("num_attention_heads") or hf["n_head"])
    return w


def read_weights(
    reader, hf: dict[str, Any], arch: str = "llama", scales: BlockScales | None = None
) -> dict[str, torch.Tensor]:
    """The file's tensors, dequantized, under transformers' names and in its layouts; `scales`
    (a quant_blocks.BlockScales) collects the blocks' stated scales (`_block_scales`)."""
    from tqdm.auto import tqdm

    spec = ARCHITECTURES[arch]
    sd = {}
    big = sum(int(t.n_bytes) for t in reader.tensors) > 256 * 2**20
    bar = tqdm(  # a bar on a terminal for files that take seconds; nothing elsewhere
        reader.tensors, desc="reading", unit=" tensors", leave=False, disable=None if big else True
    )
    for t in bar:
        if t.name in ROPE_TENSORS:
            continue
        sd[t.name] = dequantized(t)
        stated = _block_scales(t) if scales is not None else None
        if stated is not None:
            kind, d, m = stated
            scales.add(
                kind, sd[t.name], torch.from_numpy(d), None if m is None else torch.from_numpy(m)
            )
    if spec.unmodify is not None:
        spec.unmodify(sd, hf)
    block = spec.block_names(sd)
    unknown = [k for k in sd if _hf_name(k, spec, block) is None and ".mlp.experts." not in k]
    if unknown:
        raise ConversionError(
            f"GGUF {arch} tensors attnlab cannot place: {', '.join(unknown[:8])} (a variant of "
            f"the architecture attnlab does not read; supported tensors: "
            f"{', '.join(sorted(spec.block_names()))} per block)"
        )
    return {
        name if ".mlp.experts." in name else _hf_name(name, spec, block): from_file(
            spec, name, w, hf
        )
        for name, w in sd.items()
    }
