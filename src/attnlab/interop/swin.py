"""Swin <-> attnlab hierarchical encoders (`stages`, src/attnlab/nn/swin.py).

Swin Transformer: Liu et al. 2021, arXiv:2103.14030. transformers' SwinModel: SwinEmbeddings
(Conv2d patches + LayerNorm), SwinEncoder (stages of SwinLayer: layernorm_before, window
attention with relative_position_bias_table, layernorm_after, mlp fc1 / fc2; SwinPatchMerging
between stages), a final layernorm and a parameter-free mean pooler (pooler_output is
`hidden.mean(1)` of attnlab's output).

    transformers                                   attnlab
    embeddings.patch_embeddings.projection / norm  frontend.proj / frontend.norm
    encoder.layers.{s}.blocks.{i}.                 stages.{s}.blocks.{i}.
      layernorm_before / layernorm_after             attn_norm / ffn_norm
      attention.{q,k,v,o}_proj                       self_attn.{q,k,v,o}_proj
      attention.relative_position_bias.            self_attn.relative_position_bias_table
        relative_position_bias_table
      mlp.fc1 / mlp.fc2                              ffn.up_proj / ffn.down_proj
    encoder.layers.{s}.downsample.{norm,reduction} stages.{s}.merge.{norm,reduction}
    layernorm                                      final_norm
    classifier (SwinForImageClassification, the    classifier (num_labels; the mean final token)
      body under "swin.")

Checkpoints on the Hub keep the older names (attention.self.query, attention.output.dense,
intermediate.dense, output.dense, the relative_position_index buffers), which are read too.
Not modelled: SwinForMaskedImageModeling, absolute position embeddings
(use_absolute_embeddings), and stochastic depth (drop_path_rate, training only: accepted, and
written back as 0.0).
"""

from __future__ import annotations

import re

from ..config import (
    AttentionConfig,
    DenseFFN,
    LayerNormConfig,
    ModelConfig,
    NoPositions,
    PatchGridFrontend,
    StagesConfig,
)
from .converter import CONVERTERS, ConversionError, StateDict
from .hf_config import ACT_TO_HF, Fit, HFConfig, confirmed

# configuration_swin.py defaults (transformers 5), for keys config.json omits
_DEFAULTS = dict(
    image_size=224, patch_size=4, num_channels=3, embed_dim=96, depths=[2, 2, 6, 2],
    num_heads=[3, 6, 12, 24], window_size=7, mlp_ratio=4.0, qkv_bias=True, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0, drop_path_rate=0.1, hidden_act="gelu",
    use_absolute_embeddings=False, layer_norm_eps=1e-5,
)  # fmt: skip

# (HF name pattern, attnlab name); "{s}" a stage, "{i}" a block; applied in this order
_NAMES = [
    (r"embeddings\.patch_embeddings\.projection\.", "frontend.proj."),
    (r"embeddings\.norm\.", "frontend.norm."),
    (r"encoder\.layers\.(\d+)\.blocks\.(\d+)\.", r"stages.\1.blocks.\2."),
    (r"encoder\.layers\.(\d+)\.downsample\.", r"stages.\1.merge."),
    (r"^layernorm\.", "final_norm."),
    (r"\.layernorm_before\.", ".attn_norm."),
    (r"\.layernorm_after\.", ".ffn_norm."),
    (r"\.attention\.relative_position_bias\.", ".self_attn."),
    (r"\.attention\.", ".self_attn."),
    (r"\.mlp\.fc1\.", ".ffn.up_proj."),
    (r"\.mlp\.fc2\.", ".ffn.down_proj."),
]
_LEGACY = [  # the Hub's names -> transformers 5's (transformers' conversion_mapping, "swin")
    (r"\.attention\.self\.query\.", ".attention.q_proj."),
    (r"\.attention\.self\.key\.", ".attention.k_proj."),
    (r"\.attention\.self\.value\.", ".attention.v_proj."),
    (
        r"\.attention\.self\.relative_position_bias_table",
        ".attention.relative_position_bias.relative_position_bias_table",
    ),
    (r"\.attention\.output\.dense\.", ".attention.o_proj."),
    (r"\.intermediate\.dense\.", ".mlp.fc1."),
    (r"\.output\.dense\.", ".mlp.fc2."),
]
_BACK = [  # attnlab -> transformers 5, whole-name prefixes and leaves
    (r"^frontend\.proj\.", "embeddings.patch_embeddings.projection."),
    (r"^frontend\.norm\.", "embeddings.norm."),
    (r"^final_norm\.", "layernorm."),
    (r"^stages\.(\d+)\.merge\.", r"encoder.layers.\1.downsample."),
    (r"^stages\.(\d+)\.blocks\.(\d+)\.", r"encoder.layers.\1.blocks.\2."),
    (r"\.attn_norm\.", ".layernorm_before."),
    (r"\.ffn_norm\.", ".layernorm_after."),
    (
        r"\.self_attn\.relative_position_bias_table$",
        ".attention.relative_position_bias.relative_position_bias_table",
    ),
    (r"\.self_attn\.", ".attention."),
    (r"\.ffn\.up_proj\.", ".mlp.fc1."),
    (r"\.ffn\.down_proj\.", ".mlp.fc2."),
]


def _rename(name: str, table: list[tuple[str, str]]) -> str:
    for pattern, repl in table:
        name = re.sub(pattern, repl, name)
    return name


class SwinConverter:
    model_type = "swin"
    hf_class = "SwinModel"

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig(self.model_type, data, _DEFAULTS)
        arch = hf.architecture()
        classify = arch == "SwinForImageClassification"
        if arch and not (classify or arch == "SwinModel"):
            hf.reject("architectures", arch, "only SwinModel and SwinForImageClassification")
        if hf["use_absolute_embeddings"]:
            hf.reject("use_absolute_embeddings", True, "Swin's positions are the relative bias")
        sizes = {k: hf[k] for k in ("image_size", "patch_size")}
        for key, value in sizes.items():
            if not isinstance(value, int):
                hf.reject(key, value, "square images and patches (one int)")
        act = hf.activation("hidden_act")
        d, ratio = hf["embed_dim"], hf["mlp_ratio"]
        if d * ratio != int(d * ratio):
            hf.reject("mlp_ratio", ratio, f"embed_dim·mlp_ratio ({d * ratio}) must be whole")
        hf.done()
        depths, heads = tuple(hf["depths"]), tuple(hf["num_heads"])
        return ModelConfig(
            arch="encoder",
            vocab_size=0,
            d_model=d,
            n_layers=sum(depths),
            n_heads=heads[0],
            d_ff=int(d * ratio),
            positional=NoPositions(),
            attention=AttentionConfig(
                qkv_bias=hf["qkv_bias"], o_bias=True, dropout=hf["attention_probs_dropout_prob"]
            ),
            norm=LayerNormConfig(eps=hf["layer_norm_eps"]),
            ffn=DenseFFN(activation=act),
            norm_placement="pre",
            dropout=hf["hidden_dropout_prob"],
            num_labels=(hf.get("num_labels") or len(hf.get("id2label") or {})) if classify else 0,
            classifier_pooler=False,
            frontend=PatchGridFrontend(
                image_size=sizes["image_size"],
                patch_size=sizes["patch_size"],
                num_channels=hf["num_channels"],
            ),
            stages=StagesConfig(depths=depths, heads=heads, window_size=hf["window_size"]),
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        fit = Fit(cfg, self.model_type, needs=(("frontend.kind", "patch-grid"),))
        fit.need("attention.o_bias", True, " (the output projection has a bias)")
        fit.need("ffn.bias", True)
        fit.need("norm.bias", True)
        if cfg.stages is None:
            fit.fail("stages", None, "transformers' swin is a staged encoder: set stages")
        fit.done()
        st, f = cfg.stages, cfg.frontend
        hf = dict(
            architectures=["SwinForImageClassification" if cfg.num_labels else "SwinModel"],
            image_size=f.image_size,
            patch_size=f.patch_size,
            num_channels=f.num_channels,
            embed_dim=cfg.d_model,
            depths=list(st.depths),
            num_heads=list(st.heads),
            window_size=st.window_size,
            mlp_ratio=cfg.ffn_dim / cfg.d_model,
            qkv_bias=cfg.attention.qkv_bias,
            hidden_dropout_prob=cfg.dropout,
            attention_probs_dropout_prob=cfg.attention.dropout,
            drop_path_rate=0.0,
            hidden_act=ACT_TO_HF[cfg.ffn.activation],
            use_absolute_embeddings=False,
            layer_norm_eps=cfg.norm.eps,
        )
        if cfg.num_labels:
            hf["id2label"] = {str(i): f"LABEL_{i}" for i in range(cfg.num_labels)}
            hf["label2id"] = {f"LABEL_{i}": i for i in range(cfg.num_labels)}
        return confirmed(self, cfg, hf)

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        out: StateDict = {}
        for name, t in sd.items():
            name = name.removeprefix("swin.")
            if name.endswith("relative_position_index"):
                continue  # a buffer older checkpoints carry; attnlab recomputes it
            new = _rename(_rename(name, _LEGACY), _NAMES)
            if new in out:
                raise ConversionError(f"swin checkpoint: {name} lands on {new} twice")
            out[new] = t
        return out  # what found no place, load_state_dict reports by name

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        body = "swin." if cfg.num_labels else ""  # SwinForImageClassification's SwinModel
        return {
            (name if name.startswith("classifier.") else body + _rename(name, _BACK)): t
            for name, t in sd.items()
        }


CONVERTERS.register("swin")(SwinConverter())
