"""DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437; huggingface.co/deepseek-ai/DeepSeek-V3)
<-> attnlab, as transformers 5.24's DeepseekV3ForCausalLM computes it: DeepSeek-V2's layout
(src/attnlab/interop/deepseek_v2.py: MLA with the query latent, YaRN with mscale in the cos /
sin and the softmax scale, dense first layers, shared experts) with V3's router.

- Router (section 2.1.2, eq. 12-16): sigmoid scores s = σ(x·W_gate) in fp32; the experts are
  chosen on s + b, b the `mlp.gate.e_score_correction_bias` buffer (auxiliary-loss-free
  balancing, arXiv:2408.15664; attnlab's `selection_bias`), among the experts of the
  `topk_group` best of `n_group` groups, a group scored by the sum of its two best s + b
  (group_score "top2-sum"); the weights are s of the chosen experts (no bias), divided by their
  sum when `norm_topk_prob` ("sigmoid-topk-norm", else "sigmoid-topk"), times
  routed_scaling_factor. transformers 5.24 always computes this (topk_method, scoring_func,
  ep_size, moe_layer_freq are read and ignored, as there) and no auxiliary loss; attnlab's is
  V3's complementary sequence-wise loss (eq. 17-20) with `aux_loss_alpha` (0.001 unless
  config.json says otherwise; `seq_aux` False: the whole-batch Switch form).
- RoPE on q_pe / k_pe: `rope_interleave` (True, DeepSeek's checkpoints) rotates pairs
  (2i, 2i+1): layout "interleaved" (transformers writes the rotated halves de-interleaved, which
  permutes q and k alike and leaves their dot product as it is); False: "half".
- Shared experts: always (DeepseekV3MoE builds one FFN of n_shared_experts x
  moe_intermediate_size), so n_shared_experts 0 is refused.
- The multi-token-prediction module (`num_mtp_layers`, layer 61 on the Hub) is not part of the
  causal LM transformers builds: its tensors are dropped on reading, as transformers ignores
  them. FP8 checkpoints (weight_scale_inv tensors) are refused by name.
"""

from __future__ import annotations

from typing import ClassVar

from ..config import GLUFFN, ModelConfig, MoEFFN, RoPE
from .converter import CONVERTERS, StateDict
from .deepseek_v2 import DeepseekV2Converter
from .hf_config import ACT_TO_HF, Fit, HFConfig, fits_glu_experts

SELECTION_BIAS = ("ffn.selection_bias", "mlp.gate.e_score_correction_bias")


class DeepseekV3Converter(DeepseekV2Converter):
    model_type, hf_class = "deepseek_v3", "DeepseekV3ForCausalLM"
    defaults: ClassVar[dict] = dict(  # DeepseekV3Config's, and DeepSeek's aux-loss keys
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
        topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
        hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=0,
        eos_token_id=1, tie_word_embeddings=False, rope_interleave=True, attention_bias=False,
        attention_dropout=0.0, mlp_bias=False, aux_loss_alpha=0.001, seq_aux=True,
    )  # fmt: skip

    # --- config -------------------------------------------------------------------------------

    def _rope(self, hf: HFConfig) -> RoPE:
        rope = super()._rope(hf)  # V2's: interleaved pairs
        return rope if hf["rope_interleave"] else rope.replace(layout="half")

    def _ffn(self, hf: HFConfig) -> MoEFFN:
        d_ff, dense = hf["moe_intermediate_size"], hf["intermediate_size"]
        if not hf["num_experts_per_tok"]:
            hf.reject("num_experts_per_tok", hf["num_experts_per_tok"], "the router needs a top-k")
        if not hf["n_shared_experts"]:
            hf.reject(
                "n_shared_experts",
                hf["n_shared_experts"],
                "transformers' DeepseekV3MoE always has shared experts (>= 1)",
            )
        groups, keep = hf["n_group"] or 1, hf["topk_group"] or 1
        if groups > 1 and hf["n_routed_experts"] // groups < 2:
            hf.reject("n_group", groups, "each group needs two experts (its top-2 score)")
            groups = keep = 1
        return MoEFFN(
            expert=GLUFFN(activation=hf.activation("hidden_act"), bias=False),
            n_experts=hf["n_routed_experts"],
            top_k=hf["num_experts_per_tok"] or 1,
            routing="sigmoid-topk-norm" if hf["norm_topk_prob"] else "sigmoid-topk",
            selection_bias=True,
            n_shared_experts=hf["n_shared_experts"] or 1,
            aux_loss_coef=hf["aux_loss_alpha"],
            balance_loss="sequence" if hf["seq_aux"] else "switch",
            routed_scale=hf["routed_scaling_factor"],
            n_groups=groups,
            top_k_groups=keep if groups > 1 else 1,
            group_score="top2-sum",
            dense_layers=hf["first_k_dense_replace"],
            dense_d_ff=None if dense == d_ff else dense,
        )

    def _rope_to_hf(self, fit: Fit) -> dict:
        """V2's rope_parameters; the layout as `rope_interleave`."""
        pos = fit.cfg.positional
        half = isinstance(pos, RoPE) and pos.layout == "half"
        if not half:
            return dict(super()._rope_to_hf(fit), rope_interleave=True)
        cfg, fit.cfg = fit.cfg, fit.cfg.merged(positional=dict(layout="interleaved"))
        try:  # V2 checks the interleaved layout: V3 writes either
            return dict(super()._rope_to_hf(fit), rope_interleave=False)
        finally:
            fit.cfg = cfg

    def _ffn_to_hf(self, fit: Fit) -> dict:
        f = fit.cfg.ffn
        why = " (sigmoid scores; transformers' DeepseekV3 router)"
        if not fits_glu_experts(fit, ("sigmoid-topk-norm", "sigmoid-topk"), why):
            return {}
        fit.need("ffn.expert.activation", tuple(ACT_TO_HF))
        fit.need("ffn.selection_bias", True, " (e_score_correction_bias, zeros for none)")
        fit.need("ffn.router_bias", False)
        if f.dense_at:
            fit.fail(
                "ffn.dense_at", f.dense_at, "transformers' deepseek_v3 has dense first blocks only"
            )
        fit.need("ffn.sparse_step", 1)
        if f.n_groups > 1:
            fit.need("ffn.group_score", "top2-sum")
        if f.n_shared_experts < 1:
            fit.fail("ffn.n_shared_experts", 0, "transformers' DeepseekV3MoE always has them")
        return dict(
            intermediate_size=f.dense_d_ff or fit.cfg.ffn_dim,
            moe_intermediate_size=fit.cfg.ffn_dim,
            first_k_dense_replace=f.dense_layers,
            n_routed_experts=f.n_experts,
            num_experts_per_tok=f.top_k,
            n_shared_experts=f.n_shared_experts,
            routed_scaling_factor=f.routed_scale,
            n_group=f.n_groups,
            topk_group=f.top_k_groups,
            norm_topk_prob=f.routing == "sigmoid-topk-norm",
            aux_loss_alpha=f.aux_loss_coef,
            seq_aux=f.balance_loss == "sequence",
        )

    # --- weights ------------------------------------------------------------------------------

    def _sparse(self, cfg: ModelConfig) -> range:
        return range(min(cfg.ffn.dense_layers, cfg.n_layers), cfg.n_layers)

    def _more_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        out = super()._more_from_hf(sd, cfg)
        ours, theirs = SELECTION_BIAS
        for i in self._sparse(cfg):
            out[f"decoder.blocks.{i}.{ours}"] = sd.pop(f"layers.{i}.{theirs}")
        for key in [k for k in sd if k.startswith("layers.")]:  # the MTP module's layers
            if int(key.split(".")[1]) >= cfg.n_layers:
                sd.pop(key)
        return out

    def _more_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        out = super()._more_to_hf(sd, cfg)
        ours, theirs = SELECTION_BIAS
        for i in self._sparse(cfg):
            out[f"layers.{i}.{theirs}"] = sd.pop(f"decoder.blocks.{i}.{ours}")
        return out


CONVERTERS.register("deepseek_v3")(DeepseekV3Converter())
