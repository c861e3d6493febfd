"""DeepSeek-V2 (DeepSeek-AI 2024, arXiv:2405.04434; huggingface.co/deepseek-ai/DeepSeek-V2-Lite)
<-> attnlab, as transformers 5.24's DeepseekV2ForCausalLM computes it.

- Attention: multi-head latent attention (src/attnlab/nn/attention/mla.py), tensor for tensor:
  q_proj or q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm (eps 1e-6
  whatever rms_norm_eps is), kv_b_proj, o_proj; `attention_bias` on the down projections and
  o_proj only.
- RoPE on the decoupled q_pe / k_pe only, pairs (2i, 2i+1) (its complex rotation): layout
  "interleaved", rotary_dim qk_rope_head_dim. YaRN: cos and sin carry transformers' attention
  factor (given, or mscale / mscale_all_dim's ratio: 1.0 on V2-Lite), and the softmax scale is
  (qk_nope_head_dim + qk_rope_head_dim)^-0.5 · (0.1·mscale_all_dim·ln(factor) + 1)², which
  attnlab keeps as `attention.scale`.
- FFN: the first `first_k_dense_replace` blocks are a dense SwiGLU of intermediate_size; the
  others route to n_routed_experts SwiGLU experts of moe_intermediate_size (softmax over all
  experts in fp32, top-k of the probabilities, "greedy" or "group_limited_greedy" by n_group /
  topk_group, times routed_scaling_factor) plus n_shared_experts always-on experts merged into
  one FFN (src/attnlab/nn/ffn/moe.py). transformers 5.24's router ignores `norm_topk_prob`
  (and `scoring_func`, `moe_layer_freq`), so they are read and ignored here too; it computes no
  auxiliary loss, and attnlab's is DeepSeek's sequence-wise balance loss with `aux_loss_alpha`
  (0.001 unless config.json says otherwise, as in the released configs; `seq_aux` False: the
  whole-batch Switch form).
- The router weight is `mlp.gate.weight`; experts are the fused `mlp.experts.gate_up_proj`
  (E, 2·d_ff, d) and `down_proj` (E, d, d_ff) of transformers 5, or the Hub's per-expert
  `mlp.experts.{e}.gate_proj / up_proj / down_proj`; both are read, the fused form is written.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from ..config import GLUFFN, MLAConfig, ModelConfig, MoEFFN, RMSNormConfig, RoPE, YaRNScaling
from .converter import CONVERTERS, StateDict
from .hf_config import (
    ACT_TO_HF,
    DECODER_ONLY,
    Fit,
    HFConfig,
    common_sizes,
    confirmed,
    fits_glu_experts,
)
from .layouts import DecoderWeights, move, stack_experts, swap, unstack_experts
from .rope_params import rope_from_hf

ATTN = "decoder.blocks.{i}.self_attn"
PAIRS = [  # (attnlab module, HF module under "model.")
    ("embed_tokens", "embed_tokens"),
    ("decoder.final_norm", "norm"),
    ("decoder.blocks.{i}.attn_norm", "layers.{i}.input_layernorm"),
    ("decoder.blocks.{i}.ffn_norm", "layers.{i}.post_attention_layernorm"),
    (f"{ATTN}.kv_a_proj", "layers.{i}.self_attn.kv_a_proj_with_mqa"),
    (f"{ATTN}.kv_a_norm", "layers.{i}.self_attn.kv_a_layernorm"),
    (f"{ATTN}.kv_b_proj", "layers.{i}.self_attn.kv_b_proj"),
    (f"{ATTN}.o_proj", "layers.{i}.self_attn.o_proj"),
]
Q_FULL = [(f"{ATTN}.q_proj", "layers.{i}.self_attn.q_proj")]
Q_LORA = [
    (f"{ATTN}.q_a_proj", "layers.{i}.self_attn.q_a_proj"),
    (f"{ATTN}.q_a_norm", "layers.{i}.self_attn.q_a_layernorm"),
    (f"{ATTN}.q_b_proj", "layers.{i}.self_attn.q_b_proj"),
]
GLU = ("gate_proj", "up_proj", "down_proj")
TOPK_METHODS = ("greedy", "group_limited_greedy")


def _mscale(factor: float, m: float) -> float:
    """YaRN's 0.1·m·ln(factor) + 1 (1 for factor <= 1), transformers' `yarn_get_mscale`."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


class DeepseekV2Converter(DecoderWeights):
    model_type, hf_class = "deepseek_v2", "DeepseekV2ForCausalLM"
    prefix, buffers = "model.", ("rotary_emb.inv_freq",)
    defaults: ClassVar[dict] = dict(  # DeepseekV2Config's
        vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
        max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_bias=False, attention_dropout=0.0, mlp_bias=False, first_k_dense_replace=0,
        kv_lora_rank=512, q_lora_rank=1536, n_group=None, n_routed_experts=64,
        n_shared_experts=2, qk_nope_head_dim=128, qk_rope_head_dim=64, routed_scaling_factor=1.0,
        topk_group=None, topk_method="greedy", v_head_dim=128, num_experts_per_tok=None,
        moe_intermediate_size=1407, aux_loss_alpha=0.001, seq_aux=True, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip

    # --- config -------------------------------------------------------------------------------

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig(self.model_type, data, self.defaults, {"num_experts": "n_routed_experts"})
        heads = hf["num_attention_heads"]
        if (hf["num_key_value_heads"] or heads) != heads:
            hf.reject("num_key_value_heads", hf["num_key_value_heads"], "MLA has one K/V per head")
        if hf["mlp_bias"]:
            hf.reject("mlp_bias", True, "the routed experts have no biases, the dense FFNs would")
        attention = self._attention(hf)
        rope = self._rope(hf)
        ffn = self._ffn(hf)
        hf.done()
        return ModelConfig(
            arch="decoder",
            **hf.vocabulary(),
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=heads,
            d_ff=hf["moe_intermediate_size"],
            positional=rope,
            attention=attention,
            norm=RMSNormConfig(eps=hf["rms_norm_eps"]),
            ffn=ffn,
            init="normal",
        )

    def _attention(self, hf: HFConfig) -> MLAConfig:
        dn, dr = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
        scale = None
        p = self._rope_params(hf)
        if p.get("rope_type", p.get("type", "default")) != "default" and p.get("mscale_all_dim"):
            # transformers' yarn_apply_mscale, with rope_parameters' own factor
            m = _mscale(p["factor"], p["mscale_all_dim"])
            scale = (dn + dr) ** -0.5 * m * m  # in transformers' order: bit for bit its float
        return MLAConfig(
            kv_lora_rank=hf["kv_lora_rank"],
            q_lora_rank=hf["q_lora_rank"],
            qk_nope_head_dim=dn,
            qk_rope_head_dim=dr,
            v_head_dim=hf["v_head_dim"],
            bias=hf["attention_bias"],
            scale=scale,
            dropout=hf["attention_dropout"] or 0.0,
        )

    @staticmethod
    def _rope_params(hf: HFConfig) -> dict:
        return dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})

    def _rope(self, hf: HFConfig) -> RoPE:
        """rope_from_hf without YaRN's attention factor, which is then set as transformers'
        `_compute_yarn_parameters` computes it (the shared reader refuses a non-default one)."""
        p = self._rope_params(hf)
        given = {k: p.pop(k, None) for k in ("attention_factor", "mscale", "mscale_all_dim")}
        plain = HFConfig(self.model_type, {**hf.data, "rope_scaling": None}, self.defaults)
        plain.data["rope_parameters"] = p
        rope = rope_from_hf(plain, 10000.0)
        for line in plain.problems.lines:
            hf.problems.add(line)
        rope = rope.replace(layout="interleaved")
        s = rope.scaling
        if not isinstance(s, YaRNScaling):
            return rope
        temp, m, m_all = given["attention_factor"], given["mscale"], given["mscale_all_dim"]
        if temp is None and m and m_all:
            temp = _mscale(s.factor, m) / _mscale(s.factor, m_all)
        if temp is None or math.isclose(temp, _mscale(s.factor, 1.0), rel_tol=1e-12):
            return rope
        return rope.replace(scaling=dict(s.to_dict(), attention_factor=temp))

    def _ffn(self, hf: HFConfig) -> MoEFFN:
        method = hf.require("topk_method", TOPK_METHODS, "transformers' DeepseekV2 router")
        grouped = method == "group_limited_greedy"
        d_ff, dense = hf["moe_intermediate_size"], hf["intermediate_size"]
        if not hf["num_experts_per_tok"]:
            hf.reject("num_experts_per_tok", hf["num_experts_per_tok"], "the router needs a top-k")
        return MoEFFN(
            expert=GLUFFN(activation=hf.activation("hidden_act"), bias=False),
            n_experts=hf["n_routed_experts"],
            top_k=hf["num_experts_per_tok"] or 1,
            routing="softmax-topk",
            n_shared_experts=hf["n_shared_experts"] or 0,
            aux_loss_coef=hf["aux_loss_alpha"],
            balance_loss="sequence" if hf["seq_aux"] else "switch",
            routed_scale=hf["routed_scaling_factor"],
            n_groups=hf["n_group"] if grouped else 1,
            top_k_groups=hf["topk_group"] if grouped else 1,
            dense_layers=hf["first_k_dense_replace"],
            dense_d_ff=None if dense == d_ff else dense,
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        fit = Fit(cfg, self.model_type, DECODER_ONLY, attention="mla")
        for field, value in (
            ("norm.kind", "rmsnorm"),
            ("residual", "sequential"),
            ("embedding_norm", False),
            ("attention.latent_norm_eps", 1e-6),
        ):
            fit.need(field, value)
        out = dict(self._rope_to_hf(fit), **self._ffn_to_hf(fit))
        fit.done()  # before reading fields a misfit config may not have
        a, f = cfg.attention, cfg.ffn
        out.update(
            common_sizes(cfg),
            num_key_value_heads=cfg.n_heads,
            kv_lora_rank=a.kv_lora_rank,
            q_lora_rank=a.q_lora_rank,
            qk_nope_head_dim=a.qk_nope_head_dim,
            qk_rope_head_dim=a.qk_rope_head_dim,
            v_head_dim=a.v_head_dim,
            attention_bias=a.bias,
            attention_dropout=a.dropout,
            hidden_act=ACT_TO_HF[f.expert.activation],
            rms_norm_eps=cfg.norm.eps,
            tie_word_embeddings=cfg.tie_embeddings,
            pad_token_id=cfg.pad_token_id,
        )
        for key in ("bos_token_id", "eos_token_id"):  # unrecorded: the defaults where they fit
            if self.defaults[key] >= cfg.vocab_size:
                out[key] = None
        # scale and attention factor go through a square root and back: compared apart, closely
        ignore = ("attention.scale", "positional.scaling.attention_factor")
        self._check_close(cfg, self.config_from_hf(confirmed(self, cfg, out, ignore=ignore)))
        return out

    def _rope_to_hf(self, fit: Fit) -> dict:
        """rope_parameters in DeepSeek's form: YaRN with mscale / mscale_all_dim that give back
        this config's attention factor and softmax scale."""
        cfg, pos = fit.cfg, fit.cfg.positional
        fit.need("positional.kind", "rope")
        if not isinstance(pos, RoPE):
            return {}
        fit.need("positional.layout", "interleaved", " (pairs (2i, 2i+1), its complex rotation)")
        fit.need("positional.fraction", 1.0, " (all qk_rope_head_dim channels rotate)")
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": pos.base}
        a = cfg.attention
        plain = (a.qk_nope_head_dim + a.qk_rope_head_dim) ** -0.5 if hasattr(a, "v_head_dim") else 1
        ratio = (getattr(a, "scale", None) or plain) / plain  # mscale(factor, mscale_all_dim)²
        s = pos.scaling
        if not isinstance(s, YaRNScaling):
            if s is not None:
                fit.fail("positional.scaling.kind", s.kind, "DeepseekV2 reads default or yarn")
            fit.need("attention.scale", None, " (1/sqrt(qk head dim) without YaRN)")
            return {"rope_parameters": params, "max_position_embeddings": 2048}
        log = 0.1 * math.log(s.factor)
        m_all = math.sqrt(ratio)
        temp = s.attention_factor if s.attention_factor is not None else _mscale(s.factor, 1.0)
        params.update(
            rope_type="yarn",
            factor=s.factor,
            original_max_position_embeddings=s.original_max_len,
            beta_fast=s.beta_fast,
            beta_slow=s.beta_slow,
        )
        if m_all != 1.0:  # DeepSeek's form: both mscales
            params.update(mscale=(temp * m_all - 1) / log, mscale_all_dim=(m_all - 1) / log)
        elif s.attention_factor is not None:
            params["attention_factor"] = s.attention_factor
        max_pos = int(s.original_max_len * s.factor)
        return {"rope_parameters": params, "max_position_embeddings": max_pos}

    def _check_close(self, cfg: ModelConfig, back: ModelConfig) -> None:
        pairs = [(cfg.attention.scale, back.attention.scale)]
        if isinstance(cfg.positional.scaling, YaRNScaling):
            pairs.append(
                (cfg.positional.scaling.attention_factor, back.positional.scaling.attention_factor)
            )
        for ours, theirs in pairs:
            if (ours is None) != (theirs is None) or (
                ours is not None and not math.isclose(ours, theirs, rel_tol=1e-12)
            ):
                raise ValueError(f"deepseek_v2 config round trip changed {ours} to {theirs}")

    def _ffn_to_hf(self, fit: Fit) -> dict:
        f = fit.cfg.ffn
        if not fits_glu_experts(fit, "softmax-topk", " (top-k of the softmax, never renormalised)"):
            return {}
        fit.need("ffn.expert.activation", tuple(ACT_TO_HF))
        grouped = f.n_groups > 1
        return dict(
            intermediate_size=f.dense_d_ff or fit.cfg.ffn_dim,
            moe_intermediate_size=fit.cfg.ffn_dim,
            first_k_dense_replace=f.dense_layers,
            n_routed_experts=f.n_experts,
            num_experts_per_tok=f.top_k,
            n_shared_experts=f.n_shared_experts,
            routed_scaling_factor=f.routed_scale,
            topk_method="group_limited_greedy" if grouped else "greedy",
            n_group=f.n_groups if grouped else 1,
            topk_group=f.top_k_groups if grouped else 1,
            norm_topk_prob=False,
            aux_loss_alpha=f.aux_loss_coef,
            seq_aux=f.balance_loss == "sequence",
        )

    # --- weights ------------------------------------------------------------------------------

    def _pairs(self, cfg: ModelConfig):
        q = Q_FULL if cfg.attention.q_lora_rank is None else Q_LORA
        return PAIRS + q + ([] if cfg.tie_embeddings else [("lm_head", "lm_head")])

    def _dense(self, cfg: ModelConfig) -> range:
        return range(min(cfg.ffn.dense_layers, cfg.n_layers))

    def _more_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        out: StateDict = {}
        for i in self._dense(cfg):
            pairs = [(f"layers.{i}.mlp.{p}", f"decoder.blocks.{i}.ffn.dense.{p}") for p in GLU]
            out.update(move(sd, pairs, 1))
        d_ff, E = cfg.ffn_dim, cfg.ffn.n_experts
        for i in range(len(self._dense(cfg)), cfg.n_layers):
            ours, theirs = f"decoder.blocks.{i}.ffn", f"layers.{i}.mlp"
            pairs = [(f"{ours}.router", f"{theirs}.gate")]
            pairs += [(f"{ours}.shared_experts.{p}", f"{theirs}.shared_experts.{p}") for p in GLU]
            pairs += [
                (f"{ours}.experts.{e}.{p}", f"{theirs}.experts.{e}.{p}")
                for e in range(E)
                for p in GLU
            ]  # the Hub's per-expert tensors
            out.update(move(sd, swap(pairs), 1))
            out.update(unstack_experts(sd, theirs, ours, E, d_ff))
        return out

    def _more_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        out: StateDict = {}
        for i in self._dense(cfg):
            pairs = [(f"decoder.blocks.{i}.ffn.dense.{p}", f"layers.{i}.mlp.{p}") for p in GLU]
            out.update(move(sd, pairs, 1))
        for i in range(len(self._dense(cfg)), cfg.n_layers):
            ours, theirs = f"decoder.blocks.{i}.ffn", f"layers.{i}.mlp"
            pairs = [(f"{ours}.router", f"{theirs}.gate")]
            pairs += [(f"{ours}.shared_experts.{p}", f"{theirs}.shared_experts.{p}") for p in GLU]
            out.update(move(sd, pairs, 1))
            out.update(stack_experts(sd, ours, theirs, cfg.ffn.n_experts))
        return out


CONVERTERS.register("deepseek_v2")(DeepseekV2Converter())
