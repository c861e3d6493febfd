"""Gemma 2 (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical Size",
arXiv:2408.00118) and Gemma 3 text (Gemma Team 2025, "Gemma 3 Technical Report",
arXiv:2503.19786) <-> attnlab: transformers' model_types gemma2 and gemma3_text.

Gemma's layout (src/attnlab/interop/gemma.py: unit-offset RMSNorm, embeddings × sqrt(d_model)
rounded to their dtype, GeGLU, Llama's tensor names), and what Gemma 2 adds, each an attnlab
component:

- sandwich norms (section 2.2, "Post-norm and pre-norm with RMSNorm"): x + post(f(pre(x))) around
  both sublayers, `norm_placement` "sandwich"; input_layernorm / post_attention_layernorm /
  pre_feedforward_layernorm / post_feedforward_layernorm are attn_norm / attn_post_norm /
  ffn_norm / ffn_post_norm (src/attnlab/nn/block.py);
- logit soft-capping (section 2.2, "Logit soft-capping"): attn_logit_softcapping (50) is
  `attention.softcap`, c · tanh(s / c) on the scaled scores before the mask
  (src/attnlab/nn/attention/kernels/base.py), final_logit_softcapping (30) `final_logit_softcap`;
- query_pre_attn_scalar: the scores are scaled by its -1/2 power, `attention.scale` (None where it
  equals head_dim, the usual 1/sqrt(head_dim));
- local and global layers (section 2.2, "Local Sliding Window and Global Attention"): layer_types
  ("sliding_attention" / "full_attention"; by default every other layer slides, from the first)
  as a `layer_pattern` of LayerSpec(sliding_window=...) / LayerSpec(), the shortest that repeats
  (src/attnlab/config/layer_pattern.py).

Gemma 3 (section 2, "Model Architecture") drops the soft-capping (both None by default;
transformers' Gemma3Attention never applies attn_logit_softcapping even when it is set, so it is
read as no soft-capping, and an attnlab config with `attention.softcap` is refused), adds
qk-norm (a unit-offset RMSNorm over head_dim on each query / key head before the rotation, eps
rms_norm_eps: `attention.qk_norm`), five local layers per global one (sliding_window_pattern 6,
or layer_types), and a RoPE per layer type: rope_parameters {"sliding_attention": ...,
"full_attention": ...} (transformers 5), or the released config.json's rope_theta (global, 1M),
rope_local_base_freq (local, 10k) and rope_scaling (global layers only, e.g. linear × 8 on the 4B
and larger). attnlab's form: the model's `positional` is the global layers' RoPE, and each local
layer's LayerSpec carries the local one (None where both are the same).

Gemma3ForConditionalGeneration (model_type gemma3, with the vision tower) is not converted: its
language model is this gemma3_text under another prefix, and attnlab has no SigLIP frontend.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..config import GLUFFN, AttentionConfig, LayerSpec, ModelConfig, RoPE, UnitOffsetRMSNormConfig
from .converter import CONVERTERS
from .hf_config import ACT_TO_HF, Fit, HFConfig, common_sizes, confirmed, special_tokens
from .layouts import DecoderWeights
from .llama import DENSE, QK_NORM
from .rope_params import rope_from_hf, rope_to_hf

SLIDING, FULL = "sliding_attention", "full_attention"
PAIRS = [  # (attnlab module, HF module under "model.")
    ("embed_tokens", "embed_tokens"),
    ("decoder.final_norm", "norm"),
    ("decoder.blocks.{i}.attn_norm", "layers.{i}.input_layernorm"),
    ("decoder.blocks.{i}.attn_post_norm", "layers.{i}.post_attention_layernorm"),
    ("decoder.blocks.{i}.ffn_norm", "layers.{i}.pre_feedforward_layernorm"),
    ("decoder.blocks.{i}.ffn_post_norm", "layers.{i}.post_feedforward_layernorm"),
] + [
    (f"decoder.blocks.{{i}}.self_attn.{p}", f"layers.{{i}}.self_attn.{p}")
    for p in ("q_proj", "k_proj", "v_proj", "o_proj")
]
NEEDS = (  # Fit: what every Gemma 2 / 3 config has (the round trip in `confirmed` checks the rest)
    ("arch", "decoder"),
    ("norm_placement", "sandwich"),
    ("norm.kind", "rmsnorm-unit-offset"),
    ("residual", "sequential"),
    ("final_norm", True),
    ("embedding_norm", False),
    ("scale_embeddings", True),
    ("round_embed_scale", True),
    ("scale_tied_logits", False),
    ("ffn.kind", "glu"),
)
_COMMON = dict(
    hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
    pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    attention_bias=False, attention_dropout=0.0, query_pre_attn_scalar=256, sliding_window=4096,
    layer_types=None, use_bidirectional_attention=None,
)  # fmt: skip


def period(specs: list[LayerSpec]) -> tuple[LayerSpec, ...]:
    """The shortest pattern p with specs[i] == p[i % len(p)] for every layer."""
    for n in range(1, len(specs) + 1):
        if all(s == specs[i % n] for i, s in enumerate(specs)):
            return tuple(specs[:n])
    return tuple(specs)


class Gemma2Converter(DecoderWeights):
    model_type, hf_class = "gemma2", "Gemma2ForCausalLM"
    prefix, pairs = "model.", PAIRS + DENSE
    defaults: ClassVar[dict] = dict(
        _COMMON, vocab_size=256000, max_position_embeddings=8192, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    )  # fmt: skip
    qk_norm: ClassVar[bool] = False
    attention_softcap: ClassVar[bool] = True  # whether attn_logit_softcapping is applied
    sliding_every: ClassVar[int] = 2  # default layer_types: layer i slides unless (i + 1) % it == 0
    default_theta: ClassVar[float] = 10000.0

    # --- RoPE: one for every layer (Gemma 2), or one per layer type (Gemma 3) ------------------

    def _ropes(self, hf: HFConfig) -> tuple[RoPE, RoPE | None]:
        """(the model's RoPE, the local layers' own or None when they use the model's)."""
        return rope_from_hf(hf, self.default_theta), None

    def _ropes_to_hf(self, fit: Fit, local: RoPE | None) -> dict:
        if local is not None:
            fit.fail(
                "layer_pattern.positional",
                local.kind,
                f"transformers' {self.model_type} has one RoPE for every layer (Gemma 3's "
                "gemma3_text has one per layer type)",
            )
        out = rope_to_hf(fit, self.defaults["max_position_embeddings"])
        out.pop("rope_theta", None)  # rope_parameters holds it
        return out

    # --- layer types <-> layer_pattern ----------------------------------------------------------

    def _pattern(self, hf: HFConfig, local: RoPE | None) -> tuple[LayerSpec, ...] | None:
        n, window = hf["num_hidden_layers"], hf["sliding_window"]
        every = hf.get("sliding_window_pattern", self.sliding_every)
        kinds = hf["layer_types"] or [SLIDING if (i + 1) % every else FULL for i in range(n)]
        if len(kinds) != n or not set(kinds) <= {SLIDING, FULL}:
            hf.reject("layer_types", kinds, f"needs {n} entries, each {SLIDING!r} or {FULL!r}")
            return None
        if SLIDING in kinds and window is None:
            hf.reject("sliding_window", None, "layer_types names sliding layers: give its width")
            return None
        specs = [
            LayerSpec(sliding_window=window, positional=local) if k == SLIDING else LayerSpec()
            for k in kinds
        ]
        return None if all(s == LayerSpec() for s in specs) else period(specs)

    def _pattern_to_hf(self, fit: Fit) -> tuple[dict, RoPE | None]:
        """layer_types and sliding_window; and the local layers' RoPE (None: the model's)."""
        cfg = fit.cfg
        uniform = LayerSpec(sliding_window=getattr(cfg.attention, "sliding_window", None))
        pattern = cfg.layer_pattern or (uniform,)
        specs = [pattern[i % len(pattern)] for i in range(cfg.n_layers)]
        windows = {s.sliding_window for s in specs} - {None}
        locals_ = {s.positional for s in specs if s.sliding_window is not None}
        for j, s in enumerate(pattern):
            if s.sliding_window is None and s.positional is not None:
                fit.fail(
                    f"layer_pattern.{j}.positional",
                    s.positional.kind,
                    f"transformers' {self.model_type} global layers use the model's RoPE",
                )
            if s.positional is not None and not isinstance(s.positional, RoPE):
                fit.fail(f"layer_pattern.{j}.positional.kind", s.positional.kind, "needs 'rope'")
        if len(windows) > 1:
            fit.fail("layer_pattern", sorted(windows), f"{self.model_type} has one sliding_window")
        if len(locals_) > 1:
            fit.fail("layer_pattern", "local RoPEs differ", "one RoPE for every local layer")
        local = next(iter(locals_), None)
        kinds = [SLIDING if s.sliding_window else FULL for s in specs]
        window = min(windows) if windows else None
        return dict(layer_types=kinds, sliding_window=window), local

    # --- config -------------------------------------------------------------------------------

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig(self.model_type, data, self.defaults)
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf["head_dim"] or d // heads
        kv = hf["num_key_value_heads"] or heads
        hf.require("use_bidirectional_attention", (None, False), "attnlab's decoders are causal")
        act = hf.activation("hidden_activation")
        scalar = hf["query_pre_attn_scalar"]
        bias = hf["attention_bias"]
        rope, local = self._ropes(hf)
        pattern = self._pattern(hf, local)
        attention = AttentionConfig(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=self.qk_norm,
            scale=None if scalar == head_dim else scalar**-0.5,
            dropout=hf["attention_dropout"],
            softcap=hf["attn_logit_softcapping"] if self.attention_softcap else None,
        )
        hf.done()
        return ModelConfig(
            arch="decoder",
            **hf.vocabulary(),
            d_model=d,
            n_layers=hf["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=None if kv == heads else kv,
            head_dim=None if head_dim * heads == d else head_dim,
            d_ff=hf["intermediate_size"],
            positional=rope,
            attention=attention,
            norm=UnitOffsetRMSNormConfig(eps=hf["rms_norm_eps"]),
            norm_placement="sandwich",
            ffn=GLUFFN(activation=act, bias=False),
            scale_embeddings=True,
            round_embed_scale=True,
            final_logit_softcap=hf["final_logit_softcapping"],
            layer_pattern=pattern,
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        fit = Fit(cfg, self.model_type, (*NEEDS, ("attention.qk_norm", self.qk_norm)))
        a = cfg.attention
        fit.need("attention.o_bias", getattr(a, "qkv_bias", None), " (attention_bias: all four)")
        if not self.attention_softcap:
            why = f" (transformers' {self.model_type} attention applies no soft-capping)"
            fit.need("attention.softcap", None, why)
        if isinstance(cfg.ffn, GLUFFN):
            fit.need("ffn.bias", False)
            fit.need("ffn.activation", tuple(ACT_TO_HF))
        layers, local = self._pattern_to_hf(fit)
        rope = self._ropes_to_hf(fit, local)
        scalar = self._scalar(fit)
        fit.done()  # before reading fields a misfit config may not have
        out: dict[str, Any] = dict(
            **common_sizes(cfg),
            intermediate_size=cfg.ffn_dim,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.attn_head_dim,
            hidden_activation=ACT_TO_HF[cfg.ffn.activation],
            rms_norm_eps=cfg.norm.eps,
            attention_bias=a.qkv_bias,
            attention_dropout=a.dropout,
            query_pre_attn_scalar=scalar,
            attn_logit_softcapping=a.softcap,
            final_logit_softcapping=cfg.final_logit_softcap,
            tie_word_embeddings=cfg.tie_embeddings,
            **layers,
            **rope,
            **special_tokens(cfg, self.defaults),
        )
        return confirmed(self, cfg, out)

    def _scalar(self, fit: Fit) -> int | None:
        """query_pre_attn_scalar: head_dim for the usual scale, else the integer s with
        scale = s^(-1/2) exactly."""
        scale, head_dim = getattr(fit.cfg.attention, "scale", None), fit.cfg.attn_head_dim
        if scale is None:
            return head_dim
        s = round(scale**-2)
        if s < 1 or s**-0.5 != scale:
            fit.fail(
                "attention.scale",
                scale,
                f"transformers' {self.model_type} scales by query_pre_attn_scalar ** -0.5 with an "
                f"integer query_pre_attn_scalar (nearest: {s} gives {max(s, 1) ** -0.5!r})",
            )
        return s


class Gemma3TextConverter(Gemma2Converter):
    model_type, hf_class = "gemma3_text", "Gemma3ForCausalLM"
    pairs = PAIRS + QK_NORM + DENSE
    defaults: ClassVar[dict] = dict(
        _COMMON, vocab_size=262208, max_position_embeddings=131072, final_logit_softcapping=None,
        attn_logit_softcapping=None, use_bidirectional_attention=False, rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
    )  # fmt: skip
    qk_norm: ClassVar[bool] = True
    attention_softcap: ClassVar[bool] = False
    sliding_every: ClassVar[int] = 6

    def _ropes(self, hf: HFConfig) -> tuple[RoPE, RoPE | None]:
        """transformers' Gemma3TextConfig.convert_rope_params_to_dict: rope_parameters per layer
        type, else rope_scaling on the global layers, each type's theta filled in."""
        params = hf.get("rope_parameters")
        if params is not None and not all(isinstance(v, dict) for v in params.values()):
            hf.reject(
                "rope_parameters",
                params,
                f"{self.model_type} gives one dict per layer type ({SLIDING!r}, {FULL!r})",
            )
            return RoPE(), None
        params = {k: dict(v) for k, v in (params or {}).items()}
        full = params.get(FULL) or {"rope_type": "default"}
        if params.get(FULL) is None and hf.get("rope_scaling"):
            full.update(hf.get("rope_scaling"))
        full.setdefault("rope_theta", hf["rope_theta"])
        sliding = params.get(SLIDING) or {"rope_type": "default"}
        sliding.setdefault("rope_theta", hf["rope_local_base_freq"])
        rope, local = (
            self._one_rope(hf, kind, p) for kind, p in ((FULL, full), (SLIDING, sliding))
        )
        return rope, None if local == rope else local

    def _one_rope(self, hf: HFConfig, kind: str, params: dict) -> RoPE:
        data = {"rope_parameters": params, "max_position_embeddings": hf["max_position_embeddings"]}
        one = HFConfig(self.model_type, data, {})
        rope = rope_from_hf(one, params["rope_theta"])
        for line in one.problems.lines:  # each named by its layer type
            hf.problems.add(f"{kind}: {line}")
        return rope

    def _ropes_to_hf(self, fit: Fit, local: RoPE | None) -> dict:
        default_max = self.defaults["max_position_embeddings"]
        full = rope_to_hf(fit, default_max)
        if not full:
            return {}
        mine = fit.cfg if local is None else fit.cfg.model_copy(update={"positional": local})
        one = Fit(mine, self.model_type, ())
        sliding = rope_to_hf(one, default_max)
        for line in one.problems.lines:  # the local layers' RoPE, named as theirs
            fit.problems.add(f"layer_pattern (local layers' RoPE): {line}")
        params = {SLIDING: sliding.get("rope_parameters"), FULL: full["rope_parameters"]}
        return dict(rope_parameters=params, max_position_embeddings=full["max_position_embeddings"])


for _conv in (Gemma2Converter(), Gemma3TextConverter()):
    CONVERTERS.register(_conv.model_type)(_conv)
