"""T5 <-> attnlab encoder-decoder models.

Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer", arXiv:1910.10683: pre-norm RMSNorm ("T5LayerNorm"), no biases anywhere, no 1/sqrt(d)
in attention, a learned relative-position bias (section 2.1) shared by the layers of a stack.
v1.0 (`feed_forward_proj` "relu") ties the LM head to the embedding and rescales the decoder output
by d_model^-0.5; v1.1 ("gated-gelu": GeGLU with the tanh GELU, Shazeer 2020, arXiv:2002.05202)
unties it and drops the rescale.

Where the tensors live: transformers keeps each stack's relative-bias table in block 0's
self-attention; attnlab keeps it in the stack's positional module. Tied vs untied: before
transformers 5, config.json's tie_word_embeddings said both (tied + rescaled, or neither);
transformers 5 writes tie_word_embeddings true always and `scale_decoder_outputs` for the
rescale, and unties lm_head only when the checkpoint holds a different one. attnlab reads the
rescale from either and ties exactly when it rescales; a tied-and-unscaled (or untied-and-scaled)
checkpoint is rejected. A bare T5Model without lm_head gets the embedding as its head.
"""

from __future__ import annotations

import re

import torch

from ..config import GLUFFN, AttentionConfig, DenseFFN, ModelConfig, RMSNormConfig, T5RelativeBias
from .base import CONVERTERS, ConversionError, StateDict, require_same
from .bert import ACT_TO_HF, HF_TO_ACT

# configuration_t5.py defaults (transformers 5), for keys config.json omits
_DEFAULTS = dict(
    vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=None, num_heads=8,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
    layer_norm_epsilon=1e-6, feed_forward_proj="relu", pad_token_id=0, tie_word_embeddings=True,
)  # fmt: skip

_ATTN = {
    f"{hf}.{x}": f"{al}.{x}_proj"
    for x in "qkvo"
    for hf, al in (("SelfAttention", "self_attn"), ("EncDecAttention", "cross_attn"))
}
_FFN = {"wi": "up_proj", "wi_0": "gate_proj", "wi_1": "up_proj", "wo": "down_proj"}


def _layer_table(decoder: bool, glu: bool | None = None) -> dict[str, str]:
    """{hf suffix after "block.i.": attnlab suffix after "blocks.i."} for one stack's blocks
    (both FFN spellings when `glu` is None)."""
    ffn = 2 if decoder else 1
    t = {f"layer.0.{k}": v for k, v in _ATTN.items() if v.startswith("self")}
    t["layer.0.layer_norm"] = "attn_norm"
    if decoder:
        t.update({f"layer.1.{k}": v for k, v in _ATTN.items() if v.startswith("cross")})
        t["layer.1.layer_norm"] = "cross_norm"
    skip = () if glu is None else ("wi",) if glu else ("wi_0", "wi_1")
    names = {k: v for k, v in _FFN.items() if k not in skip}
    t.update({f"layer.{ffn}.DenseReluDense.{k}": f"ffn.{v}" for k, v in names.items()})
    t[f"layer.{ffn}.layer_norm"] = "ffn_norm"
    return {f"{k}.weight": f"{v}.weight" for k, v in t.items()}


_TABLES = {stack: _layer_table(stack == "decoder") for stack in ("encoder", "decoder")}
_BLOCK = re.compile(r"(encoder|decoder)\.blocks?\.(\d+)\.(.+)")
_REL = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"


class T5Converter:
    model_type = "t5"
    hf_class = "T5ForConditionalGeneration"

    def config_from_hf(self, hf: dict) -> ModelConfig:
        d = {**_DEFAULTS, **hf}
        arch = (hf.get("architectures") or [""])[0]
        proj = d["feed_forward_proj"]
        gated, act = proj.startswith("gated-"), proj.split("-")[-1]
        act = "gelu_new" if proj == "gated-gelu" else act  # as T5Config.__post_init__ does
        scale = d.get("scale_decoder_outputs", d["tie_word_embeddings"] is not False)
        problems = []
        if arch and arch not in ("T5ForConditionalGeneration", "T5Model"):
            problems.append(
                f"architectures = {arch!r}: only T5ForConditionalGeneration / T5Model (encoder-decoder)"
            )
        if act not in HF_TO_ACT or proj.count("-") > int(gated):
            problems.append(
                f"feed_forward_proj = {proj!r}: supported [gated-]{{{', '.join(sorted(HF_TO_ACT))}}}"
            )
        if d.get("is_decoder"):
            problems.append("is_decoder = True: a decoder-only T5 stack is not modelled")
        if problems:
            raise ConversionError("t5 config:\n  - " + "\n  - ".join(problems))
        dec = d["num_decoder_layers"]
        return ModelConfig(
            arch="encoder-decoder",
            vocab_size=d["vocab_size"],
            d_model=d["d_model"],
            n_layers=d["num_layers"],
            n_decoder_layers=dec if dec not in (None, d["num_layers"]) else None,
            n_heads=d["num_heads"],
            head_dim=d["d_kv"] if d["d_kv"] * d["num_heads"] != d["d_model"] else None,
            d_ff=d["d_ff"],
            positional=T5RelativeBias(
                num_buckets=d["relative_attention_num_buckets"],
                max_distance=d["relative_attention_max_distance"],
            ),
            attention=AttentionConfig(scale=1.0, dropout=d["dropout_rate"]),
            norm=RMSNormConfig(eps=d["layer_norm_epsilon"]),
            ffn=(GLUFFN if gated else DenseFFN)(activation=HF_TO_ACT[act], bias=False),
            dropout=d["dropout_rate"],
            activation_dropout=d["dropout_rate"],
            tie_embeddings=scale,
            scale_tied_logits=scale,
            pad_token_id=d["pad_token_id"],
            init="t5",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        if not isinstance(cfg.positional, T5RelativeBias) or not isinstance(
            cfg.ffn, (DenseFFN, GLUFFN)
        ):
            raise ConversionError(
                f"t5 needs positional 't5-relative' and a dense or GLU FFN "
                f"(positional {cfg.positional.kind!r}, ffn {cfg.ffn.kind!r})"
            )
        act, glu = cfg.ffn.activation, isinstance(cfg.ffn, GLUFFN)
        if glu and act == "gelu":
            raise ConversionError(
                "ffn: GLU with exact gelu; T5's 'gated-gelu' is the tanh GELU (gelu-tanh)"
            )
        proj = (
            "gated-gelu"
            if glu and act == "gelu-tanh"
            else ("gated-" if glu else "") + ACT_TO_HF[act]
        )
        hf = dict(
            architectures=[self.hf_class],
            vocab_size=cfg.vocab_size,
            d_model=cfg.d_model,
            d_kv=cfg.attn_head_dim,
            d_ff=cfg.ffn_dim,
            num_layers=cfg.n_layers,
            num_decoder_layers=cfg.decoder_layers,
            num_heads=cfg.n_heads,
            relative_attention_num_buckets=cfg.positional.num_buckets,
            relative_attention_max_distance=cfg.positional.max_distance,
            dropout_rate=cfg.dropout,
            layer_norm_epsilon=cfg.norm.eps,
            feed_forward_proj=proj,
            tie_word_embeddings=cfg.scale_tied_logits,
            pad_token_id=cfg.pad_token_id,
            decoder_start_token_id=cfg.pad_token_id,
            is_encoder_decoder=True,
        )
        # T5 drops attention probabilities at dropout_rate: attention.dropout is not carried
        require_same(cfg, self.config_from_hf(hf), "t5", ignore=("init", "attention.dropout"))
        return hf

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        shared = next(sd[k] for k in ("shared.weight", "encoder.embed_tokens.weight") if k in sd)
        out: StateDict = {"embed_tokens.weight": shared}
        for k, v in sd.items():
            m = _BLOCK.fullmatch(k)
            if k in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
                if not torch.equal(v, shared):
                    raise ConversionError(
                        f"t5: {k} differs from shared.weight; attnlab shares one embedding"
                    )
            elif k == "lm_head.weight":
                if not cfg.tie_embeddings:
                    out[k] = v
                elif not torch.equal(v, shared):
                    raise ConversionError(
                        "t5: lm_head.weight differs from shared.weight but the config rescales the decoder "
                        "output (tied T5): set tie_word_embeddings false / scale_decoder_outputs false"
                    )
            elif k.endswith("final_layer_norm.weight"):
                out[k.replace("final_layer_norm", "final_norm")] = v
            elif k in ("encoder." + _REL, "decoder." + _REL):
                out[f"{k.split('.')[0]}.positional.relative_attention_bias.weight"] = v
            elif k.endswith("EncDecAttention.relative_attention_bias.weight"):
                pass  # unused by transformers too (_keys_to_ignore_on_load_unexpected)
            elif m and m[3] in _TABLES[m[1]]:
                out[f"{m[1]}.blocks.{m[2]}.{_TABLES[m[1]][m[3]]}"] = v
            else:
                out[k] = v  # unknown: _load_exact reports it
        if not cfg.tie_embeddings and "lm_head.weight" not in out:  # bare T5Model
            out["lm_head.weight"] = shared.clone()
        return out

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        glu = isinstance(cfg.ffn, GLUFFN)
        inverse = {s: {v: k for k, v in _layer_table(s == "decoder", glu).items()} for s in _TABLES}
        out: StateDict = {}
        for k, v in sd.items():
            m = _BLOCK.fullmatch(k)
            if k == "embed_tokens.weight":
                out["shared.weight"] = v
            elif k.endswith("final_norm.weight"):
                out[k.replace("final_norm", "final_layer_norm")] = v
            elif k.endswith("positional.relative_attention_bias.weight"):
                out[f"{k.split('.')[0]}.{_REL}"] = v
            elif m:
                out[f"{m[1]}.block.{m[2]}.{inverse[m[1]][m[3]]}"] = v
            else:
                out[k] = v  # lm_head.weight
        return out


CONVERTERS.register("t5")(T5Converter())
