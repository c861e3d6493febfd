"""RoPE settings of transformers configs <-> attnlab's `RoPE` (transformers'
`modeling_rope_utils`: Su et al. 2021, arXiv:2104.09864; linear scaling, Chen et al. 2023,
arXiv:2306.15595; dynamic NTK, Emozilla 2023; YaRN, Peng et al. 2023, arXiv:2309.00071; Llama
3.1's `llama3`, arXiv:2407.21783; LongRoPE, Ding et al. 2024, arXiv:2402.13753; p-RoPE's
`proportional`, Barbero et al. 2025, arXiv:2410.06205).

Read from the transformers-5 `rope_parameters` dict or the older `rope_theta` + `rope_scaling`
keys, with transformers' precedence. Every `rope_type` of transformers' ROPE_INIT_FUNCTIONS has
an attnlab scaling (config/scaling.py), read with transformers' defaults:

    default  -> no scaling             linear       -> linear
    dynamic  -> dynamic-ntk            yarn         -> yarn (attention_factor, mscale /
    llama3   -> llama3                                mscale_all_dim, truncate)
    longrope -> longrope               proportional -> proportional (partial_rotary_factor is
                                                       its fraction; RoPE.fraction stays 1)

Anything else (per-layer-type dicts, unknown types, missing required keys) is refused, naming
the key. attnlab's static NTK scaling has no transformers form and is refused when writing.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import DynamicNTKScaling, LinearScaling, RoPE, YaRNScaling
from ..config.scaling import Llama3Scaling, LongRoPEScaling, ProportionalScaling
from .hf_config import Fit, HFConfig

# transformers' rope_type names, in ROPE_INIT_FUNCTIONS' order, with "default"
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
_ORIGINAL = "original_max_position_embeddings"


def rope_from_hf(
    hf: HFConfig,
    default_theta: float = 10000.0,
    theta_keys: tuple[str, ...] = ("rope_theta",),
    fraction_keys: tuple[str, ...] = ("partial_rotary_factor",),
    default_fraction: float = 1.0,
    partial_ok: bool = False,
    original_key: str | None = None,
    type_aliases: dict[str, str] | None = None,
) -> RoPE:
    """RoPE from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older),
    with the precedence of transformers' `convert_rope_params_to_dict`.

    original_key: a top-level key that overrides rope_parameters' original length for the types
    that have one (Phi-3's `original_max_position_embeddings`, a config attribute there, which
    transformers' `standardize_rope_params` puts first). type_aliases: old rope_type names of the
    family (Phi-3: "su" and "yarn" mean longrope)."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        hf.reject("rope_parameters", params, "per-layer-type RoPE is not modelled")
        return RoPE()
    theta = params.get("rope_theta")
    for key in theta_keys:
        theta = hf.data.get(key) if theta is None else theta
    fraction = params.get("partial_rotary_factor")
    for key in fraction_keys:
        fraction = hf.data.get(key) if fraction is None else fraction
    theta = default_theta if theta is None else float(theta)
    fraction = default_fraction if fraction is None else float(fraction)
    kind = params.get("rope_type", params.get("type", "default"))
    kind = (type_aliases or {}).get(kind, kind)
    if kind in ("llama3", "yarn", "longrope"):
        top = hf.get(original_key) if original_key else None
        params[_ORIGINAL] = top or params.get(_ORIGINAL) or hf["max_position_embeddings"]
    if kind == "proportional":  # the fraction is the scaling's: every pair of the head rotates
        return RoPE(base=theta, scaling=_proportional(hf, params, fraction))
    if fraction != 1.0 and not partial_ok:
        hf.reject(
            "partial_rotary_factor", fraction, f"transformers' {hf.family} rotates whole heads"
        )
    return RoPE(base=theta, fraction=fraction, scaling=_scaling_from_hf(hf, kind, params))


def _number(hf: HFConfig, kind: str, p: dict, key: str) -> float | None:
    """p[key] when it is a number, else None with the problem recorded (transformers fails on a
    missing required key of the type)."""
    value = p.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hf.reject(f"rope_parameters.{key}", value, f"rope_type {kind!r} needs a number here")
        return None
    return value


def _factors(hf: HFConfig, p: dict, key: str) -> tuple[float, ...] | None:
    value = p.get(key)
    ok = isinstance(value, (list, tuple)) and value
    if not ok or not all(isinstance(x, (int, float)) and x > 0 for x in value):
        hf.reject(
            f"rope_parameters.{key}",
            value,
            "rope_type 'longrope' needs a list of positive numbers, one per rotated pair",
        )
        return None
    return tuple(float(x) for x in value)


def _scaling_from_hf(hf: HFConfig, kind: str, p: dict):
    max_pos = hf["max_position_embeddings"]
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        hf.reject(
            "rope_parameters.rope_type",
            kind,
            f"supported RoPE scalings: {', '.join(ROPE_TYPES[1:])} (transformers' rope types)",
        )
        return None
    if kind == "linear":
        factor = _number(hf, kind, p, "factor")
        return None if factor is None else LinearScaling(factor=factor)
    if kind == "dynamic":  # transformers grows the base from max_position_embeddings
        factor = _number(hf, kind, p, "factor")
        return (
            None if factor is None else DynamicNTKScaling(factor=factor, original_max_len=max_pos)
        )
    original = p[_ORIGINAL]
    if kind == "llama3":
        values = {
            k: _number(hf, kind, p, k) for k in ("factor", "low_freq_factor", "high_freq_factor")
        }
        if None in values.values():
            return None
        if values["high_freq_factor"] <= values["low_freq_factor"]:
            hf.reject(
                "rope_parameters.high_freq_factor",
                values["high_freq_factor"],
                f"must exceed low_freq_factor ({values['low_freq_factor']})",
            )
            return None
        return Llama3Scaling(original_max_len=original, **values)
    if kind == "longrope":
        return _longrope(hf, p, original, max_pos)
    return _yarn(hf, p, original, max_pos)


def _longrope(hf: HFConfig, p: dict, original: int, max_pos: int) -> LongRoPEScaling | None:
    short, long = _factors(hf, p, "short_factor"), _factors(hf, p, "long_factor")
    # transformers: no factor -> max_position_embeddings / original (Phi-3's configs)
    factor = p.get("factor") or max_pos / original
    temp = p.get("attention_factor")
    if short is None or long is None:
        return None
    if len(short) != len(long):
        hf.reject(
            "rope_parameters.long_factor",
            f"{len(long)} entries",
            f"short_factor has {len(short)}: one entry per rotated pair in each",
        )
        return None
    return LongRoPEScaling(
        short_factor=short,
        long_factor=long,
        original_max_len=original,
        factor=factor,
        attention_factor=None if temp is None else float(temp),
    )


def _yarn(hf: HFConfig, p: dict, original: int, max_pos: int) -> YaRNScaling | None:
    factor = p.get("factor") or max_pos / original
    if factor <= 1:
        hf.reject("rope_parameters.factor", factor, "YaRN needs factor > 1")
        return None
    default_temp = 0.1 * math.log(factor) + 1.0
    temp = p.get("attention_factor")
    if temp is None and p.get("mscale") and p.get("mscale_all_dim"):  # transformers' order
        temp = (0.1 * p["mscale"] * math.log(factor) + 1) / (
            0.1 * p["mscale_all_dim"] * math.log(factor) + 1
        )
    if temp is not None and math.isclose(temp, default_temp, rel_tol=1e-12):
        temp = None  # the paper's: one spelling per config
    truncate = p.get("truncate", True)
    if not isinstance(truncate, bool):
        hf.reject("rope_parameters.truncate", truncate, "must be true or false")
        truncate = True
    return YaRNScaling(
        factor=factor,
        original_max_len=original,
        beta_fast=p.get("beta_fast") or 32.0,
        beta_slow=p.get("beta_slow") or 1.0,
        attention_factor=None if temp is None else float(temp),
        truncate=truncate,
    )


def _proportional(hf: HFConfig, p: dict, fraction: float) -> ProportionalScaling | None:
    factor = p.get("factor", 1.0)
    if not 0 <= fraction <= 1:
        hf.reject("partial_rotary_factor", fraction, "proportional RoPE needs 0 <= it <= 1")
        return None
    return ProportionalScaling(fraction=fraction, factor=1.0 if factor is None else factor)


def rope_to_hf(fit: Fit, default_max_pos: int, partial_ok: bool = False) -> dict:
    """`rope_parameters` (+ max_position_embeddings) for a RoPE config; misfits go to `fit`."""
    fit.need("positional.kind", "rope")
    pos = fit.cfg.positional
    if not isinstance(pos, RoPE):
        return {}
    fit.need("positional.layout", "half", " (rotate_half pairs channel i with i + d/2)")
    s = pos.scaling
    if isinstance(s, ProportionalScaling):
        fit.need("positional.fraction", 1.0, " (proportional RoPE's fraction is the scaling's)")
    elif not partial_ok:
        fit.need("positional.fraction", 1.0)
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": pos.base}
    if pos.fraction != 1.0:
        params["partial_rotary_factor"] = pos.fraction
    max_pos = default_max_pos
    if isinstance(s, LinearScaling):
        params.update(rope_type="linear", factor=s.factor)
    elif isinstance(s, DynamicNTKScaling):
        params.update(rope_type="dynamic", factor=s.factor)
        max_pos = s.original_max_len
    elif isinstance(s, YaRNScaling):
        params.update(
            rope_type="yarn",
            factor=s.factor,
            original_max_position_embeddings=s.original_max_len,
            beta_fast=s.beta_fast,
            beta_slow=s.beta_slow,
        )
        if s.attention_factor is not None:  # DeepSeek-V2's (src/attnlab/interop/deepseek_v2.py)
            params["attention_factor"] = s.attention_factor
        if not s.truncate:
            params["truncate"] = False
        max_pos = int(s.original_max_len * s.factor)
    elif isinstance(s, Llama3Scaling):
        params.update(
            rope_type="llama3",
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_len,
        )
        max_pos = max(int(s.original_max_len * s.factor), s.original_max_len + 1)
    elif isinstance(s, LongRoPEScaling):
        params.update(
            rope_type="longrope",
            short_factor=list(s.short_factor),
            long_factor=list(s.long_factor),
            factor=s.factor,
            original_max_position_embeddings=s.original_max_len,
        )
        if s.attention_factor is not None:
            params["attention_factor"] = s.attention_factor
        max_pos = int(s.original_max_len * s.factor)
    elif isinstance(s, ProportionalScaling):
        params.update(rope_type="proportional", partial_rotary_factor=s.fraction, factor=s.factor)
    elif s is not None:
        fit.fail("positional.scaling.kind", s.kind, "transformers has no static NTK scaling")
    return {"rope_parameters": params, "rope_theta": pos.base, "max_position_embeddings": max_pos}
