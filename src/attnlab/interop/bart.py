"""BART and Marian <-> attnlab encoder-decoder models.

BART: Lewis et al. 2020, "BART: Denoising Sequence-to-Sequence Pre-training", arXiv:1910.13461:
a post-norm encoder-decoder with learned positions offset by 2 (fairseq reserves two rows), a
LayerNorm on the embeddings ("layernorm_embedding") and GELU. Marian: Junczys-Dowmunt et al.
2018, "Marian: Fast Neural Machine Translation in C++", arXiv:1804.00344 (the OPUS-MT models):
the same layers with fixed sinusoids in the "split" layout (all sines, then all cosines), no
embedding norm, embeddings scaled by sqrt(d_model), usually swish (SiLU).

Both use nn.LayerNorm's eps 1e-5 and biased attention, and add a `final_logits_bias` buffer to
the logits; attnlab has no such bias, so it must be zero (ConversionError otherwise) and is
written as zeros. Marian's sinusoid table is a tensor in the checkpoint: it is checked against
the formula on import and regenerated on export, for max_position_embeddings positions (attnlab's
sinusoids have no length limit; config_to_hf writes MarianConfig's default, 1024). Marian may
give the decoder its own embedding (share_encoder_decoder_embeddings false); its LM head is then
tied to that one. Training-only settings attnlab does not model (layerdrop, classifier_dropout)
are not carried.
"""

from __future__ import annotations

import re

import torch

from ..config import (
    AttentionConfig,
    DenseFFN,
    LayerNormConfig,
    LearnedPositions,
    ModelConfig,
    Sinusoidal,
)
from .base import CONVERTERS, ConversionError, StateDict, require_same, strip_prefix
from .bert import ACT_TO_HF, HF_TO_ACT

# configuration_bart.py / configuration_marian.py defaults (transformers 5), for keys config.json omits
_COMMON = dict(
    max_position_embeddings=1024, encoder_layers=12, encoder_ffn_dim=4096, encoder_attention_heads=16,
    decoder_layers=12, decoder_ffn_dim=4096, decoder_attention_heads=16, activation_function="gelu",
    d_model=1024, dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, scale_embedding=False,
    tie_word_embeddings=True,
)  # fmt: skip
_DEFAULTS = {
    "bart": {**_COMMON, "vocab_size": 50265, "pad_token_id": 1},
    "marian": {**_COMMON, "vocab_size": 58101, "pad_token_id": 58100, "share_encoder_decoder_embeddings": True},
}  # fmt: skip
# keys of fairseq-era config.json files that transformers 5 ignores: refuse a value it would ignore
_LEGACY = {
    "bart": dict(normalize_before=False, add_final_layer_norm=False, normalize_embedding=True,
                 static_position_embeddings=False, add_bias_logits=False, extra_pos_embeddings=2),
    "marian": dict(normalize_before=False, add_final_layer_norm=False, normalize_embedding=False,
                   static_position_embeddings=True, add_bias_logits=False),
}  # fmt: skip
_LAYER = {
    **{f"self_attn.{x}_proj": f"self_attn.{x}_proj" for x in "qkv"},
    **{f"encoder_attn.{x}_proj": f"cross_attn.{x}_proj" for x in "qkv"},
    "self_attn.out_proj": "self_attn.o_proj",
    "encoder_attn.out_proj": "cross_attn.o_proj",
    "self_attn_layer_norm": "attn_norm",
    "encoder_attn_layer_norm": "cross_norm",
    "fc1": "ffn.up_proj",
    "fc2": "ffn.down_proj",
    "final_layer_norm": "ffn_norm",
}
_HF_LAYER = re.compile(r"(encoder|decoder)\.layers\.(\d+)\.(.+)\.(weight|bias)")
_AL_LAYER = re.compile(r"(encoder|decoder)\.blocks\.(\d+)\.(.+)\.(weight|bias)")


def marian_sinusoids(n_pos: int, dim: int) -> torch.Tensor:
    """MarianSinusoidalPositionalEmbedding.create_weight (float64, then fp32; the test checks it
    bit for bit against transformers' numpy version): sines of pos / 10000^(2i/dim), then cosines."""
    i = torch.arange(dim // 2, dtype=torch.float64)
    angle = torch.arange(n_pos, dtype=torch.float64)[:, None] / torch.pow(10000.0, 2 * i / dim)
    return torch.cat((angle.sin(), angle.cos()), dim=1).float()


class BartConverter:
    def __init__(self, model_type: str, hf_class: str) -> None:
        self.model_type, self.hf_class = model_type, hf_class
        self.marian = model_type == "marian"

    def config_from_hf(self, hf: dict) -> ModelConfig:
        d = {**_DEFAULTS[self.model_type], **hf}
        arch = (hf.get("architectures") or [""])[0]
        problems = []
        if arch and arch not in (self.hf_class, "MarianModel" if self.marian else "BartModel"):
            problems.append(f"architectures = {arch!r}: only {self.hf_class} or the bare model")
        for key, want in _LEGACY[self.model_type].items():
            if d.get(key, want) != want:
                problems.append(
                    f"{key} = {d[key]!r}: transformers' {self.model_type} fixes it to {want!r}"
                )
        for a, b in (
            ("encoder_attention_heads", "decoder_attention_heads"),
            ("encoder_ffn_dim", "decoder_ffn_dim"),
        ):
            if d[a] != d[b]:
                problems.append(
                    f"{a} = {d[a]} but {b} = {d[b]}: attnlab's stacks share n_heads and d_ff"
                )
        if d["activation_function"] not in HF_TO_ACT:
            problems.append(
                f"activation_function = {d['activation_function']!r}: supported {sorted(HF_TO_ACT)}"
            )
        if (d.get("decoder_vocab_size") or d["vocab_size"]) != d["vocab_size"]:
            problems.append(
                f"decoder_vocab_size = {d['decoder_vocab_size']} != vocab_size = {d['vocab_size']}"
            )
        if problems:
            raise ConversionError(f"{self.model_type} config:\n  - " + "\n  - ".join(problems))
        n_dec = d["decoder_layers"]
        pos = (
            Sinusoidal(layout="split")
            if self.marian
            else LearnedPositions(max_len=d["max_position_embeddings"] + 2, offset=2)
        )
        return ModelConfig(
            arch="encoder-decoder",
            vocab_size=d["vocab_size"],
            d_model=d["d_model"],
            n_layers=d["encoder_layers"],
            n_decoder_layers=n_dec if n_dec != d["encoder_layers"] else None,
            n_heads=d["encoder_attention_heads"],
            d_ff=d["encoder_ffn_dim"],
            positional=pos,
            attention=AttentionConfig(qkv_bias=True, o_bias=True, dropout=d["attention_dropout"]),
            norm=LayerNormConfig(eps=1e-5),
            ffn=DenseFFN(activation=HF_TO_ACT[d["activation_function"]]),
            norm_placement="post",
            final_norm=False,
            embedding_norm=not self.marian,
            scale_embeddings=bool(d["scale_embedding"]),
            dropout=d["dropout"],
            activation_dropout=d["activation_dropout"],
            pad_token_id=d["pad_token_id"],
            tie_embeddings=d["tie_word_embeddings"],
            share_encoder_decoder_embeddings=d.get("share_encoder_decoder_embeddings", True),
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        act = getattr(cfg.ffn, "activation", None)
        pos = cfg.positional
        hf = dict(
            architectures=[self.hf_class],
            vocab_size=cfg.vocab_size,
            max_position_embeddings=pos.max_len - 2 if isinstance(pos, LearnedPositions) else 1024,
            encoder_layers=cfg.n_layers,
            decoder_layers=cfg.decoder_layers,
            encoder_attention_heads=cfg.n_heads,
            decoder_attention_heads=cfg.n_heads,
            encoder_ffn_dim=cfg.ffn_dim,
            decoder_ffn_dim=cfg.ffn_dim,
            activation_function=(
                "swish" if self.marian and act == "silu" else ACT_TO_HF.get(act, "gelu")
            ),
            d_model=cfg.d_model,
            dropout=cfg.dropout,
            attention_dropout=cfg.attention.dropout,
            activation_dropout=cfg.activation_dropout,
            scale_embedding=cfg.scale_embeddings,
            pad_token_id=cfg.pad_token_id,
            decoder_start_token_id=cfg.pad_token_id,
            tie_word_embeddings=cfg.tie_embeddings,
        )
        if self.marian:
            hf["share_encoder_decoder_embeddings"] = cfg.share_encoder_decoder_embeddings
        require_same(cfg, self.config_from_hf(hf), self.model_type)
        return hf

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd = strip_prefix(sd, ("model.",))
        shared = cfg.share_encoder_decoder_embeddings
        enc = next(sd[k] for k in ("shared.weight", "encoder.embed_tokens.weight") if k in sd)
        dec = enc if shared else sd["decoder.embed_tokens.weight"]
        out: StateDict = {"embed_tokens.weight": enc}
        if not shared:
            out["decoder_embed_tokens.weight"] = dec
        for k, v in sd.items():
            m = _HF_LAYER.fullmatch(k)
            if k in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
                if not torch.equal(v, enc if k != "decoder.embed_tokens.weight" else dec):
                    raise ConversionError(
                        f"{self.model_type}: {k} differs from the embedding it shares"
                    )
            elif k == "final_logits_bias":
                if bool(v.any()):
                    raise ConversionError(
                        f"{self.model_type}: final_logits_bias is nonzero; attnlab has no logits bias"
                    )
            elif k == "lm_head.weight" and cfg.tie_embeddings:
                if not torch.equal(v, dec):
                    raise ConversionError(
                        f"{self.model_type}: lm_head.weight differs from the tied embedding"
                    )
            elif k.endswith("embed_positions.weight") and self.marian:
                ref = marian_sinusoids(v.shape[0], v.shape[1]).to(v.dtype)
                if not torch.allclose(
                    v.float(), ref.float(), rtol=0, atol=float(torch.finfo(v.dtype).eps)
                ):
                    raise ConversionError(f"marian: {k} is not the sinusoid table attnlab computes")
            elif k.endswith("embed_positions.weight"):
                out[k.replace("embed_positions", "positional")] = v
            elif k.endswith(("layernorm_embedding.weight", "layernorm_embedding.bias")):
                out[k.replace("layernorm_embedding", "embedding_norm")] = v
            elif m and m[3] in _LAYER:
                out[f"{m[1]}.blocks.{m[2]}.{_LAYER[m[3]]}.{m[4]}"] = v
            else:
                out[k] = (
                    v  # lm_head.weight when untied; anything unknown is reported by _load_exact
                )
        return out

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        inverse = {v: k for k, v in _LAYER.items()}
        out: StateDict = {}
        for k, v in sd.items():
            m = _AL_LAYER.fullmatch(k)
            if k == "embed_tokens.weight":
                name = "shared" if cfg.share_encoder_decoder_embeddings else "encoder.embed_tokens"
                out[f"model.{name}.weight"] = v
            elif k == "decoder_embed_tokens.weight":
                out["model.decoder.embed_tokens.weight"] = v
            elif k == "lm_head.weight":
                out[k] = v
            elif k.endswith("positional.weight"):
                out["model." + k.replace("positional", "embed_positions")] = v
            elif m:
                out[f"model.{m[1]}.layers.{m[2]}.{inverse[m[3]]}.{m[4]}"] = v
            else:
                out["model." + k.replace("embedding_norm", "layernorm_embedding")] = v
        w = sd["embed_tokens.weight"]
        out["final_logits_bias"] = w.new_zeros(1, cfg.vocab_size)
        if self.marian:
            table = marian_sinusoids(self.config_to_hf(cfg)["max_position_embeddings"], cfg.d_model)
            for stack in ("encoder", "decoder"):
                out[f"model.{stack}.embed_positions.weight"] = table.to(w).clone()
        return out


CONVERTERS.register("bart")(BartConverter("bart", "BartForConditionalGeneration"))
CONVERTERS.register("marian")(BartConverter("marian", "MarianMTModel"))
