"""OLMo 2 (Team OLMo 2024, "2 OLMo 2 Furious", arXiv:2501.00656) <-> attnlab.

Llama's tensor layout (src/attnlab/interop/llama.py: RoPE in the "half" layout, GQA, SwiGLU,
separate q/k/v/o) with the two changes the paper makes for stability, each an attnlab component:

- the norms sit after the sublayers, on their outputs only, x + RMSNorm(f(x)), the residual
  stream never normalised until the final norm: `norm_placement` "post-sublayer"
  (src/attnlab/nn/block.py). transformers names them post_attention_layernorm and
  post_feedforward_layernorm; they are attnlab's `attn_norm` and `ffn_norm`, moved;
- qk-norm over the whole projection: Olmo2Attention's q_norm is an RMSNorm over
  num_attention_heads·head_dim (k_norm over num_key_value_heads·head_dim), applied before the
  heads split, then the rotation: `attention.qk_norm` with `qk_norm_scope` "projection"
  (src/attnlab/nn/attention/heads.py). Qwen3's is per head; the two differ whenever H > 1.

Olmo2RMSNorm multiplies its weight in fp32 before casting back (Gemma's order); attnlab's
`rmsnorm` casts first (Llama's). The two agree in fp32, where the parity tests run; in bf16 they
round the product once in a different place. Biases: `attention_bias` on all four projections
(off on every release); the MLP has none.
"""

from __future__ import annotations

from typing import ClassVar

from ..config import GLUFFN
from .converter import CONVERTERS
from .hf_config import DECODER_ONLY, Fit, HFConfig, qkv_bias
from .llama import LlamaConverter

# (attnlab module, HF module under "model."): the norms after the sublayers
PAIRS = [
    ("embed_tokens", "embed_tokens"),
    ("decoder.final_norm", "norm"),
    ("decoder.blocks.{i}.attn_norm", "layers.{i}.post_attention_layernorm"),
    ("decoder.blocks.{i}.ffn_norm", "layers.{i}.post_feedforward_layernorm"),
] + [
    (f"decoder.blocks.{{i}}.self_attn.{p}", f"layers.{{i}}.self_attn.{p}")
    for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
]
_PLACEMENT = dict(norm_placement="post-sublayer")
_QK = dict(qk_norm=True, qk_norm_scope="projection")


class Olmo2Converter(LlamaConverter):
    model_type, hf_class = "olmo2", "Olmo2ForCausalLM"
    pairs = PAIRS
    needs: ClassVar[tuple] = (
        *(n for n in DECODER_ONLY if n[0] not in ("norm_placement", "attention.qk_norm")),
        ("norm_placement", "post-sublayer"),
        ("attention.qk_norm", True),
        ("attention.qk_norm_scope", "projection"),
    )
    defaults: ClassVar[dict] = dict(
        vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attention_bias=False, attention_dropout=0.0, pad_token_id=1, bos_token_id=None,
        eos_token_id=50279,
    )  # fmt: skip

    def _attention(self, hf: HFConfig) -> dict:
        bias = hf["attention_bias"]
        return dict(qkv_bias=bias, o_bias=bias, **_QK)

    def _attention_to_hf(self, fit: Fit) -> dict:
        bias = qkv_bias(fit.cfg)
        fit.need("attention.o_bias", bias, " (attention_bias covers q, k, v and o)")
        fit.need("attention.sliding_window", None)
        return dict(attention_bias=bias)

    def _ffn(self, hf: HFConfig, act: str):
        return GLUFFN(activation=act, bias=False)

    def _ffn_to_hf(self, fit: Fit) -> dict:
        if fit.need("ffn.kind", "glu") == "glu":
            fit.need("ffn.bias", False, " (Olmo2MLP has no biases)")
        return {}

    def _extra(self, hf: HFConfig) -> dict:
        return dict(_PLACEMENT)


CONVERTERS.register("olmo2")(Olmo2Converter())
