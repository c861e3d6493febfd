"""RoPE settings of transformers configs <-> attnlab's `RoPE` (transformers'
`modeling_rope_utils`: Su et al. 2021, arXiv:2104.09864; linear scaling, Chen et al. 2023,
arXiv:2306.15595; dynamic NTK, Emozilla 2023; YaRN, Peng et al. 2023, arXiv:2309.00071).

Read from the transformers-5 `rope_parameters` dict or the older `rope_theta` + `rope_scaling`
keys, with transformers' precedence. Scalings other than linear, dynamic and yarn (llama3,
longrope, ...) and YaRN variants attnlab does not compute (another attention factor, no
truncation) are refused; attnlab's static NTK scaling has no transformers form.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import DynamicNTKScaling, LinearScaling, RoPE, YaRNScaling
from .hf_config import Fit, HFConfig


def rope_from_hf(
    hf: HFConfig,
    default_theta: float = 10000.0,
    theta_keys: tuple[str, ...] = ("rope_theta",),
    fraction_keys: tuple[str, ...] = ("partial_rotary_factor",),
    default_fraction: float = 1.0,
    partial_ok: bool = False,
) -> RoPE:
    """RoPE from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older),
    with the precedence of transformers' `convert_rope_params_to_dict`."""
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
    if fraction != 1.0 and not partial_ok:
        hf.reject(
            "partial_rotary_factor", fraction, f"transformers' {hf.family} rotates whole heads"
        )
    kind = params.get("rope_type", params.get("type", "default"))
    return RoPE(base=theta, fraction=fraction, scaling=_scaling_from_hf(hf, kind, params))


def _scaling_from_hf(hf: HFConfig, kind: str, p: dict):
    max_pos = hf["max_position_embeddings"]
    if kind == "default":
        return None
    if kind in ("linear", "dynamic") and not isinstance(p.get("factor"), (int, float)):
        hf.reject("rope_parameters.factor", p.get("factor"), f"{kind} scaling needs a number")
        return None
    if kind == "linear":
        return LinearScaling(factor=p["factor"])
    if kind == "dynamic":  # transformers grows the base from max_position_embeddings
        return DynamicNTKScaling(factor=p["factor"], original_max_len=max_pos)
    if kind != "yarn":
        hf.reject(
            "rope_parameters.rope_type", kind, "supported RoPE scalings: linear, dynamic, yarn"
        )
        return None
    original = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor") or max_pos / original
    default_temp = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    temp = p.get("attention_factor")
    if temp is None and p.get("mscale") and p.get("mscale_all_dim"):
        temp = (0.1 * p["mscale"] * math.log(factor) + 1) / (
            0.1 * p["mscale_all_dim"] * math.log(factor) + 1
        )
    if temp is not None and not math.isclose(temp, default_temp, rel_tol=1e-12):
        hf.reject(
            "rope_parameters.attention_factor",
            temp,
            f"attnlab's YaRN uses 0.1·ln(factor)+1 = {default_temp}",
        )
    if p.get("truncate", True) is not True:
        hf.reject("rope_parameters.truncate", p["truncate"], "attnlab's YaRN truncates the ramp")
    if factor <= 1:
        hf.reject("rope_parameters.factor", factor, "YaRN needs factor > 1")
        return None
    return YaRNScaling(
        factor=factor,
        original_max_len=original,
        beta_fast=p.get("beta_fast") or 32.0,
        beta_slow=p.get("beta_slow") or 1.0,
    )


def rope_to_hf(fit: Fit, default_max_pos: int, partial_ok: bool = False) -> dict:
    """`rope_parameters` (+ max_position_embeddings) for a RoPE config; misfits go to `fit`."""
    fit.need("positional.kind", "rope")
    pos = fit.cfg.positional
    if not isinstance(pos, RoPE):
        return {}
    fit.need("positional.layout", "half", " (rotate_half pairs channel i with i + d/2)")
    if not partial_ok:
        fit.need("positional.fraction", 1.0)
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": pos.base}
    if pos.fraction != 1.0:
        params["partial_rotary_factor"] = pos.fraction
    max_pos, s = default_max_pos, pos.scaling
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
        max_pos = int(s.original_max_len * s.factor)
    elif s is not None:
        fit.fail("positional.scaling.kind", s.kind, "transformers has no static NTK scaling")
    return {"rope_parameters": params, "rope_theta": pos.base, "max_position_embeddings": max_pos}
