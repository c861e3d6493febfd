"""ModernBERT <-> attnlab encoder-only models.

ModernBERT: Warner et al. 2024, arXiv:2412.13663 (section 2.1.1). A pre-norm encoder without
biases: token embeddings and a LayerNorm (no position table), then layers whose attention is
global (RoPE base `rope_parameters.full_attention`) or local (|q - k| <= local_attention / 2, RoPE
base `rope_parameters.sliding_attention`) by `layer_types` (once `global_attn_every_n_layers`:
every n-th layer global, the first included), a GeGLU FFN, a final LayerNorm. The first layer has
no norm before its attention (`attn_norm` is an Identity in transformers' ModernBertEncoderLayer),
which is `first_attn_norm` False here.

    transformers                          attnlab
    layer_types (period P)                layer_pattern: P LayerSpecs, one per layer type:
      full_attention                        LayerSpec() (the model's window: none; its RoPE)
      sliding_attention                     LayerSpec(sliding_window = local_attention // 2 + 1,
                                                      positional = RoPE(local theta))
    Wqkv rows [q; k; v], each [head][D]   q_proj, k_proj, v_proj
    mlp.Wi rows [input; gate]             ffn.gate_proj (act applies to it), ffn.up_proj:
                                          Wo(act(input) · gate) = down(act(gate_proj) · up_proj)
    head.dense (no bias) / act / norm     mlm_head.dense (mlm_dense_bias False) / act / norm
    decoder (tied, with bias)             embed_tokens and mlm_head.bias

Heads, by `architectures` (from_hf passes the class it was given): ModernBertForMaskedLM ->
mlm_head; ModernBertModel -> none. The classification heads (pooling "cls" or "mean" through the
same dense + act + norm) are not modelled. transformers 5 keeps the padded layout and masks the
padding (sdpa / eager); the flash path unpads, with the same outputs at real tokens.
"""

from __future__ import annotations

import torch

from ..config import GLUFFN, AttentionConfig, LayerNormConfig, LayerSpec, ModelConfig, RoPE
from ..errors import Problems
from .converter import CONVERTERS, ConversionError, StateDict
from .hf_config import ACT_TO_HF, Fit, HFConfig, common_sizes, confirmed, qkv_bias
from .layouts import add_prefix, check_consumed, drop, move, strip, swap

# configuration_modernbert.py defaults (transformers 5), for keys config.json omits
_DEFAULTS = dict(
    vocab_size=50368, hidden_size=768, intermediate_size=1152, num_hidden_layers=22,
    num_attention_heads=12, hidden_activation="gelu", max_position_embeddings=8192, norm_eps=1e-5,
    norm_bias=False, pad_token_id=50283, attention_bias=False, attention_dropout=0.0,
    local_attention=128, embedding_dropout=0.0, mlp_bias=False, mlp_dropout=0.0, decoder_bias=True,
    classifier_bias=False, classifier_activation="gelu", tie_word_embeddings=True,
    global_attn_every_n_layers=3, global_rope_theta=160000.0, local_rope_theta=10000.0,
)  # fmt: skip
_FULL, _LOCAL = "full_attention", "sliding_attention"

_BODY = [  # (attnlab module, HF module under "model.")
    ("embed_tokens", "embeddings.tok_embeddings"),
    ("encoder.embedding_norm", "embeddings.norm"),
    ("encoder.blocks.{i}.attn_norm", "layers.{i}.attn_norm"),  # none in layer 0
    ("encoder.blocks.{i}.self_attn.o_proj", "layers.{i}.attn.Wo"),
    ("encoder.blocks.{i}.ffn_norm", "layers.{i}.mlp_norm"),
    ("encoder.blocks.{i}.ffn.down_proj", "layers.{i}.mlp.Wo"),
    ("encoder.final_norm", "final_norm"),
]
_MLM = [
    ("mlm_head.dense", "head.dense"),
    ("mlm_head.norm", "head.norm"),
]
_FUSED = {  # HF module under "model." -> the attnlab modules its rows stack, in order
    "layers.{i}.attn.Wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "layers.{i}.mlp.Wi": ("ffn.gate_proj", "ffn.up_proj"),
}


def _layer_types(hf: HFConfig) -> list[str]:
    types = hf.get("layer_types")
    if types is None:  # the older key: every n-th layer global, the first one included
        n = hf["global_attn_every_n_layers"]
        types = [_LOCAL if i % n else _FULL for i in range(hf["num_hidden_layers"])]
    bad = sorted(set(types) - {_FULL, _LOCAL})
    if bad or len(types) != hf["num_hidden_layers"]:
        hf.reject("layer_types", types, f"one of {_FULL!r}, {_LOCAL!r} per hidden layer")
    return list(types)


def _period(types: list[str]) -> list[str]:
    """The shortest prefix that `types` repeats (all of it when it repeats none)."""
    n = len(types)
    return next(
        types[:p] for p in range(1, n + 1) if all(types[i] == types[i % p] for i in range(n))
    )


def _thetas(hf: HFConfig) -> dict[str, float]:
    """RoPE base per layer type from `rope_parameters` (transformers 5) or the older
    global_rope_theta / local_rope_theta keys; scalings are not modelled."""
    params = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling"):  # transformers applies it to both layer types
        hf.reject("rope_scaling", hf.get("rope_scaling"), "RoPE scaling is not modelled here")
    old = {_FULL: hf["global_rope_theta"], _LOCAL: hf["local_rope_theta"]}
    out = {}
    for kind in (_FULL, _LOCAL):
        p = params.get(kind) or {}
        if p.get("rope_type", "default") != "default":
            hf.reject(f"rope_parameters.{kind}.rope_type", p["rope_type"], "only 'default'")
        out[kind] = float(p.get("rope_theta", old[kind]))
    return out


def _per_layer(cfg: ModelConfig) -> list[LayerSpec]:
    pattern = cfg.layer_pattern or (LayerSpec(),)
    return [pattern[i % len(pattern)] for i in range(cfg.n_layers)]


class ModernBertConverter:
    model_type = "modernbert"
    hf_class = "ModernBertForMaskedLM"

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig(self.model_type, data, _DEFAULTS)
        arch = hf.architecture()
        mlm = arch == "ModernBertForMaskedLM"
        if arch and not (mlm or arch == "ModernBertModel"):
            hf.reject("architectures", arch, "only ModernBertModel and ModernBertForMaskedLM")
        for key in ("embedding_dropout", "attention_dropout"):
            if hf[key]:  # embeddings and attention output: no attnlab dropout sits only there
                hf.reject(key, hf[key], "not modelled (attnlab's dropout covers every branch): 0")
        act = hf.activation("hidden_activation")
        if mlm:
            if hf.activation("classifier_activation") != act:
                hf.reject(
                    "classifier_activation",
                    hf["classifier_activation"],
                    f"attnlab's MLM head uses the FFN's activation ({hf['hidden_activation']!r})",
                )
            if not hf["decoder_bias"]:
                hf.reject("decoder_bias", False, "attnlab's MLM decoder has a bias")
            if not hf["tie_word_embeddings"]:
                hf.reject("tie_word_embeddings", False, "attnlab's MLM decoder is the embedding")
        hd = hf["hidden_size"] // hf["num_attention_heads"]
        thetas, types = _thetas(hf), _layer_types(hf)
        hf.done()
        local = LayerSpec(
            sliding_window=hf["local_attention"] // 2 + 1,  # |q - k| <= local_attention // 2
            positional=None if thetas[_LOCAL] == thetas[_FULL] else RoPE(base=thetas[_LOCAL]),
        )
        pattern = tuple(local if t == _LOCAL else LayerSpec() for t in _period(types))
        pad = hf["pad_token_id"]
        return ModelConfig(
            arch="encoder",
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            head_dim=None if hd * hf["num_attention_heads"] == hf["hidden_size"] else hd,
            d_ff=hf["intermediate_size"],
            positional=RoPE(base=thetas[_FULL]),
            attention=AttentionConfig(qkv_bias=hf["attention_bias"], o_bias=hf["attention_bias"]),
            norm=LayerNormConfig(eps=hf["norm_eps"], bias=hf["norm_bias"]),
            ffn=GLUFFN(activation=act, bias=hf["mlp_bias"]),
            norm_placement="pre",
            embedding_norm=True,
            activation_dropout=hf["mlp_dropout"],
            pad_token_id=pad if isinstance(pad, int) and 0 <= pad < hf["vocab_size"] else None,
            layer_pattern=None if pattern == (LayerSpec(),) else pattern,
            first_attn_norm=False,
            mlm_head=mlm,
            mlm_dense_bias=hf["classifier_bias"] if mlm else True,
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        needs = (
            ("arch", "encoder"),
            ("positional.kind", "rope"),
            ("positional.layout", "half"),
            ("positional.fraction", 1.0),
            ("positional.scaling", None),
            ("norm.kind", "layernorm"),
            ("ffn.kind", "glu"),
            ("norm_placement", "pre"),
            ("residual", "sequential"),
            ("embedding_norm", True),
            ("final_norm", True),
            ("first_attn_norm", False),
            ("num_labels", 0),
            ("type_vocab_size", 0),
            ("scale_embeddings", False),
            ("dropout", 0.0),
            ("attention.dropout", 0.0),
            ("attention.scale", None),
            ("attention.qk_norm", False),
            ("attention.sliding_window", None),
            ("tie_embeddings", True),
            ("frontend", None),
        )
        fit = Fit(cfg, self.model_type, needs=needs)
        fit.mha()
        fit.need("attn_head_dim", cfg.d_model // cfg.n_heads, " (d_model / n_heads)")
        if qkv_bias(cfg) != getattr(cfg.attention, "o_bias", False):
            fit.fail("attention.o_bias", cfg.attention.o_bias, "one attention_bias for all four")
        types, windows, local_rope = self._layers(cfg, fit)
        fit.done()
        hf = dict(
            architectures=["ModernBertForMaskedLM" if cfg.mlm_head else "ModernBertModel"],
            **common_sizes(cfg),
            intermediate_size=cfg.ffn_dim,
            hidden_activation=ACT_TO_HF[cfg.ffn.activation],
            classifier_activation=ACT_TO_HF[cfg.ffn.activation],
            norm_eps=cfg.norm.eps,
            norm_bias=cfg.norm.bias,
            attention_bias=qkv_bias(cfg),
            mlp_bias=cfg.ffn.bias,
            mlp_dropout=cfg.activation_dropout,
            classifier_bias=cfg.mlm_dense_bias if cfg.mlm_head else False,
            decoder_bias=True,
            layer_types=types,
            local_attention=2 * (windows.pop() - 1) if windows else _DEFAULTS["local_attention"],
            rope_parameters={
                _FULL: {"rope_type": "default", "rope_theta": cfg.positional.base},
                _LOCAL: {"rope_type": "default", "rope_theta": local_rope},
            },
            pad_token_id=cfg.pad_token_id,
            tie_word_embeddings=True,
        )
        back = self.config_from_hf(hf)  # the pattern is compared layer by layer (its period
        if _per_layer(back) != _per_layer(cfg):  # may read back shorter: (g, l, l) at 2 layers)
            raise ConversionError(
                f"layer_pattern {cfg.layer_pattern} reads back from modernbert's layer_types as "
                f"{back.layer_pattern}: ModernBERT has two layer types, global and local"
            )
        return confirmed(self, cfg, hf, ignore=("layer_pattern",))

    def _layers(self, cfg: ModelConfig, fit: Fit) -> tuple[list[str], set[int], float]:
        """layer_types, the local windows (one at most) and the local RoPE base; what
        ModernBERT's two layer types cannot express goes to `fit`."""
        pattern = cfg.layer_pattern or (LayerSpec(),)
        types = [_FULL if s.sliding_window is None else _LOCAL for s in _per_layer(cfg)]
        windows = {s.sliding_window for s in pattern if s.sliding_window is not None}
        if len(windows) > 1:
            fit.fail("layer_pattern", sorted(windows), "one local window (local_attention)")
        base = cfg.positional.base if isinstance(cfg.positional, RoPE) else 0.0
        local_rope = base
        for i, spec in enumerate(pattern):
            pos = spec.positional
            if spec.sliding_window is None and pos is not None:
                fit.fail(
                    f"layer_pattern.{i}.positional", pos.kind, "global layers use the model's RoPE"
                )
            elif pos is not None and not (
                isinstance(pos, RoPE)
                and (pos.layout, pos.fraction, pos.scaling) == ("half", 1.0, None)
            ):
                fit.fail(f"layer_pattern.{i}.positional", pos.kind, "a plain RoPE (its base only)")
            elif pos is not None:
                local_rope = pos.base
        return types, windows, local_rope

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd = strip(sd, "model.")
        problems = Problems()
        tied = sd.pop("decoder.weight", None)
        if tied is not None and not torch.equal(tied, sd["embeddings.tok_embeddings.weight"]):
            problems.add("decoder.weight differs from the token embedding it is tied to")
        problems.raise_as(ConversionError, "modernbert checkpoint for an exact conversion")
        pairs = _BODY + ([*_MLM, ("mlm_head", "decoder")] if cfg.mlm_head else [])
        out = move(sd, swap(pairs), cfg.n_layers)
        for src, names in _FUSED.items():
            for i in range(cfg.n_layers):
                for leaf in ("weight", "bias"):
                    key = f"{src.format(i=i)}.{leaf}"
                    if key in sd:
                        parts = sd.pop(key).chunk(len(names), dim=0)  # rows stacked in order
                        for name, t in zip(names, parts, strict=True):
                            out[f"encoder.blocks.{i}.{name}.{leaf}"] = t
        return {**out, **drop(sd, suffixes=("inv_freq",))}  # what is left, load reports

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd = dict(sd)
        out = move(sd, _BODY, cfg.n_layers)
        for dst, names in _FUSED.items():
            for i in range(cfg.n_layers):
                for leaf in ("weight", "bias"):
                    keys = [f"encoder.blocks.{i}.{name}.{leaf}" for name in names]
                    if keys[0] in sd:
                        out[f"{dst.format(i=i)}.{leaf}"] = torch.cat([sd.pop(k) for k in keys])
        if cfg.mlm_head:
            out = add_prefix(out, "model.")
            out.update(move(sd, _MLM, 0))
            out["decoder.bias"] = sd.pop("mlm_head.bias")  # decoder.weight: tied, left out
        check_consumed(sd, "modernbert (attnlab side)")
        return out


CONVERTERS.register("modernbert")(ModernBertConverter())
