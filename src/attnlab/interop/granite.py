"""Granite 3 (IBM, "Granite 3.0 Language Models", 2024; huggingface.co/ibm-granite) <-> attnlab.

Llama's layout and tensor names (src/attnlab/interop/llama.py) with four multipliers, in the
spirit of μP (Yang et al. 2022, arXiv:2203.03466), each a ModelConfig field rather than a flag of
this converter (src/attnlab/nn/block.py, src/attnlab/nn/model.py):

    embedding_multiplier   token embeddings × m                  `embedding_multiplier`
    residual_multiplier    x + m·f(x) around every sublayer      `residual_multiplier`
    attention_multiplier   the score scale, replacing 1/√D       `attention.scale`
    logits_scaling         logits / s                            `logit_multiplier` = 1 / s

GraniteConfig's attention_multiplier defaults to 1.0, not 1/√D, so a Granite config always
states its scale; read back, a scale of exactly 1/√D is attnlab's default (None), and None is
written as 1/√D. attnlab multiplies the logits by 1 / s where transformers divides by s: the same
up to one rounding (exact for the released powers of two, s = 8 and 16). Written, s is the float
whose reciprocal is exactly the multiplier, so configs round-trip bit for bit.
"""

from __future__ import annotations

import math
from typing import ClassVar

from ..config import ModelConfig
from .converter import CONVERTERS
from .hf_config import Fit, HFConfig, confirmed
from .llama import LlamaConverter

MULTIPLIERS = {  # ModelConfig field -> GraniteConfig key, where both are multipliers
    "embedding_multiplier": "embedding_multiplier",
    "residual_multiplier": "residual_multiplier",
}
_PLAIN = dict(embedding_multiplier=1.0, residual_multiplier=1.0, logit_multiplier=1.0)


class _GraniteBody(LlamaConverter):
    """Granite's config.json read as Llama's, multipliers aside: what config_to_hf checks the
    rest of a config against before it adds them."""

    model_type, hf_class = "granite", "GraniteForCausalLM"
    defaults: ClassVar[dict] = dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
        max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_bias=False, attention_dropout=0.0, mlp_bias=False, pad_token_id=None,
        bos_token_id=1, eos_token_id=2, embedding_multiplier=1.0, logits_scaling=1.0,
        residual_multiplier=1.0, attention_multiplier=1.0,
    )  # fmt: skip


class GraniteConverter(_GraniteBody):
    def _attention(self, hf: HFConfig) -> dict:
        head_dim = hf["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]
        m = float(hf["attention_multiplier"])
        if m <= 0:
            hf.reject("attention_multiplier", m, "the score scale must be > 0")
        return dict(super()._attention(hf), scale=None if m == head_dim**-0.5 or m <= 0 else m)

    def _extra(self, hf: HFConfig) -> dict:
        out = {ours: float(hf[theirs]) for ours, theirs in MULTIPLIERS.items()}
        s = float(hf["logits_scaling"])
        if s <= 0:
            hf.reject("logits_scaling", s, "the logits' divisor must be > 0")
        out["logit_multiplier"] = 1.0 / s if s > 0 else 1.0
        for key, value in out.items():
            if value <= 0:
                hf.reject(key, value, "attnlab's multipliers are > 0")
                out[key] = 1.0
        return out

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        """Llama's config.json of the config without its multipliers (every other misfit named
        by Llama's rules), plus Granite's four keys; read back whole as the last check."""
        fit = Fit(cfg, self.model_type, needs=())
        fit.need("final_logit_softcap", None, " (Granite's logits are only divided)")
        fit.done()
        plain = cfg.merged(attention={"scale": None}, **_PLAIN)
        out = _BODY.config_to_hf(plain)
        out.update({theirs: getattr(cfg, ours) for ours, theirs in MULTIPLIERS.items()})
        scale = cfg.attention.scale
        out["attention_multiplier"] = scale if scale is not None else cfg.attn_head_dim**-0.5
        out["logits_scaling"] = divisor_of(cfg.logit_multiplier)
        return confirmed(self, cfg, out)


def divisor_of(m: float) -> float:
    """The s with 1 / s == m exactly (1 / m, or a float next to it), so that reading the
    written logits_scaling gives the multiplier back bit for bit."""
    s = 1.0 / m
    for candidate in (s, math.nextafter(s, 0.0), math.nextafter(s, math.inf)):
        if 1.0 / candidate == m:
            return candidate
    return s  # no float's reciprocal is m: confirmed() names the difference


_BODY = _GraniteBody()
CONVERTERS.register("granite")(GraniteConverter())
