"""Gemma (Gemma Team 2024, "Gemma: Open Models Based on Gemini Research and Technology",
arXiv:2403.08295) <-> attnlab.

Llama's layout and tensor names (src/attnlab/interop/llama.py) with three differences, each an
attnlab component rather than a flag of this converter:

- GemmaRMSNorm computes x / rms(x) · (1 + w) in fp32 and casts at the end: attnlab's
  `rmsnorm-unit-offset` (src/attnlab/nn/norms_offset.py), whose weight is the stored w, so
  tensors move unchanged;
- the token embeddings are multiplied by sqrt(hidden_size) cast to the hidden dtype
  (GemmaTextScaledWordEmbedding): `scale_embeddings` with `round_embed_scale`;
- GeGLU: `hidden_act` "gelu_pytorch_tanh"; the legacy "gelu" of the released config.json files is
  read as the tanh form, as GemmaConfig itself rewrites it. A `hidden_activation` key (transformers
  4.38-4.41) is ignored, as transformers 5 ignores it.

head_dim is its own key (256 on gemma-2b and gemma-7b, where 2048 / 8 = 256 but 3072 / 16 = 192),
embeddings are tied by default, and gemma-2b has one K/V head (MQA).
"""

from __future__ import annotations

from typing import ClassVar

from ..config import GLUFFN, UnitOffsetRMSNormConfig
from .converter import CONVERTERS
from .hf_config import DECODER_ONLY, Fit, HFConfig
from .llama import LlamaConverter

_SCALED = dict(scale_embeddings=True, round_embed_scale=True)


class GemmaConverter(LlamaConverter):
    model_type, hf_class = "gemma", "GemmaForCausalLM"
    needs: ClassVar[tuple] = (
        *(n for n in DECODER_ONLY if n[0] != "scale_embeddings"),
        *_SCALED.items(),
    )
    norm_config: ClassVar[type] = UnitOffsetRMSNormConfig
    embedding: ClassVar[dict] = _SCALED
    defaults: ClassVar[dict] = dict(
        vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=16, head_dim=256,
        hidden_act="gelu_pytorch_tanh", max_position_embeddings=8192, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_bias=False, attention_dropout=0.0,
        use_bidirectional_attention=None, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip

    def _activation(self, hf: HFConfig) -> str:
        hf.require("use_bidirectional_attention", (None, False), "attnlab's decoders are causal")
        if hf["hidden_act"] == "gelu":  # GemmaConfig.__post_init__: "meant to target the tanh"
            return "gelu-tanh"
        return hf.activation("hidden_act")

    def _ffn(self, hf: HFConfig, act: str):
        return GLUFFN(activation=act, bias=False)

    def _ffn_to_hf(self, fit: Fit) -> dict:
        fit.need("ffn.kind", "glu")
        if isinstance(fit.cfg.ffn, GLUFFN):
            fit.need("ffn.bias", False)
        return {}


CONVERTERS.register(GemmaConverter.model_type)(GemmaConverter())
