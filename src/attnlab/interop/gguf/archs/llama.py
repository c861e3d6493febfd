"""llama, smollm3, granite: LlamaModel and the classes derived from it (conversion/llama.py,
smollm3.py, granite.py). Their q/k rows are permuted (`permuted`); Llama 3.1's RoPE scaling is
written only as the `rope_freqs` tensor (LlamaModel.generate_extra_tensors) and read back as the
llama3 parameters that reproduce it (`llama3_from_factors`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .base import Arch, Keys, Tensors, text_parameters

# --- reading -------------------------------------------------------------------------------------


def _llama(k: Keys, meta, hf, tensors) -> dict:
    """Llama 3's scaling from `rope_freqs` (LlamaModel.generate_extra_tensors writes no scaling
    keys, only that tensor): recovered as the llama3 parameters that reproduce it."""
    if "rope_freqs.weight" not in tensors:
        return {}
    rope = dict(hf["rope_parameters"])
    rope.update(
        llama3_from_factors(tensors["rope_freqs.weight"], rope["rope_theta"], hf["head_dim"], k)
    )
    return {"rope_parameters": rope}


def _smollm3(k: Keys, meta, hf, tensors) -> dict:
    """No RoPE in every 4th layer: llama.cpp has no key for it, its loader hard-codes
    `hparams.n_no_rope_layer_step = 4` (src/llama-model.cpp, LLM_ARCH_SMOLLM3) and rotates layer
    il unless (il + 1) % 4 == 0, as SmolLM3Config's no_rope_layer_interval = 4."""
    n = hf["num_hidden_layers"]
    return dict(
        _llama(k, meta, hf, tensors),
        no_rope_layer_interval=4,
        no_rope_layers=[int((i + 1) % 4 != 0) for i in range(n)],
        use_sliding_window=False,
    )


def _granite(k: Keys, meta, hf, tensors) -> dict:
    """GraniteModel.set_gguf_parameters's four multipliers (conversion/granite.py)."""
    return dict(
        _llama(k, meta, hf, tensors),
        embedding_multiplier=k("embedding_scale", 1.0),
        residual_multiplier=k("residual_scale", 1.0),
        attention_multiplier=k("attention.scale", 1.0 / hf["head_dim"] ** 0.5),
        logits_scaling=k("logit_scale", 1.0),
    )


def llama3_from_factors(
    factors: np.ndarray, base: float, head_dim: int, k: Keys | None = None
) -> dict[str, Any]:
    """Llama 3's scaling parameters from the `rope_freqs` llama.cpp wrote (the divisor of each
    frequency: 1 above the band, `factor` below, 1/((1 - s)/factor + s) in it, s linear in the
    frequency). Only original_max_len / low_freq_factor and / high_freq_factor are identifiable,
    so low_freq_factor is taken as 1 (Meta's value); the parameters are then checked to give
    back every factor of the file (to float32 rounding), else refused."""
    r = np.asarray(factors, dtype=np.float64)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factor = float(r.max())
    inner = np.flatnonzero((r > 1 + 1e-6) & (r < factor * (1 - 1e-6)))
    candidates = [(8192.0, 4.0)]  # llama.cpp's defaults (Llama 3.1, lf 1, hf 4)
    if len(inner) >= 2 and factor > 1:  # s = a·freq + b with a = L/(2π(hf - 1)), b = -1/(hf - 1)
        s = (1 / r[inner] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(freqs[inner], s, 1)
        if b < 0:
            high = 1 - 1 / b
            candidates.insert(0, (a * 2 * math.pi * (high - 1), high))
    elif len(inner) == 1:  # with hf = 4: s = (L/λ - 1)/3
        wavelen = 2 * math.pi / freqs[inner[0]]
        s = (1 / r[inner[0]] - 1 / factor) / (1 - 1 / factor)
        candidates.insert(0, (wavelen * (3 * s + 1), 4.0))
    for length, high in candidates:
        length = round(length) if abs(length - round(length)) < 1e-3 * length else length
        if factor == 1 or length != int(length):
            continue
        high = float(f"{high:.6g}")
        if np.allclose(_llama3_factors(freqs, factor, 1.0, high, length), r, rtol=1e-5, atol=0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(length),
            }
    if k is not None:
        k.problems.add(
            f"rope_freqs.weight = {np.round(r, 4).tolist()}: these frequency divisors are not "
            "Llama 3's RoPE scaling (no factor, low/high_freq_factor and original context give "
            "them), the one kind of rope_freqs attnlab computes"
        )
    return {}


def _llama3_factors(freqs, factor, low, high, length) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors formula (the divisor of each frequency)."""
    wavelen = 2 * math.pi / freqs
    smooth = (length / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < length / high, 1.0, np.where(wavelen > length / low, factor, mid))


# --- writing -------------------------------------------------------------------------------------


def _parameters(w, hp: dict) -> None:
    """LlamaModel.set_gguf_parameters (conversion/llama.py): the base, vocab_size, rope dims;
    SmolLM3Model(LlamaModel) adds nothing."""
    text_parameters(w, hp)
    w.add_vocab_size(hp["vocab_size"])
    w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])


def _granite_parameters(w, hp: dict) -> None:
    """GraniteModel (conversion/granite.py): head_dim popped, the four multipliers."""
    _parameters(w, {k: v for k, v in hp.items() if k != "head_dim"})
    w.add_attention_scale(hp["attention_multiplier"])
    w.add_embedding_scale(hp["embedding_multiplier"])
    w.add_residual_scale(hp["residual_multiplier"])
    w.add_logit_scale(hp["logits_scaling"])


def llama3_rope_factors(hp: dict) -> np.ndarray:
    """LlamaModel.generate_extra_tensors (conversion/llama.py), line by line: the divisor of each
    frequency, for the original context the model was trained with. (The converter reads it
    from config.json's top level only, so for a transformers-5 config, which keeps it in
    rope_parameters, it uses 8192; that would change the model, so the parameter is read first.)"""
    rope = hp["rope_parameters"]
    base = rope.get("rope_theta", 10000.0)
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings") or hp.get(
        "original_max_position_embeddings", 8192
    )
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def _rope_freqs(hp: dict) -> Tensors:
    if (hp.get("rope_parameters") or {}).get("rope_type") != "llama3":
        return []
    return [("rope_freqs.weight", llama3_rope_factors(hp))]


def no_head_dim(hf: dict) -> dict:
    """No head_dim where transformers' config class has none (SmolLM3, OLMo 2): the converter
    then writes no key_length."""
    if hf.get("head_dim") in (None, hf["hidden_size"] // hf["num_attention_heads"]):
        hf = {k: v for k, v in hf.items() if k != "head_dim"}
    return hf


_LLAMA = dict(permuted=True, extra_tensors=_rope_freqs)
LLAMA = Arch("llama", "llama", "LLAMA", _parameters, config=_llama, bias_from=("attn_output",),
             **_LLAMA)  # fmt: skip
SMOLLM3 = Arch("smollm3", "smollm3", "SMOLLM3", _parameters, config=_smollm3,
               config_json=no_head_dim, **_LLAMA)  # fmt: skip
GRANITE = Arch("granite", "granite", "GRANITE", _granite_parameters, config=_granite, **_LLAMA)
