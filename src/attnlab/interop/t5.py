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

import torch

from ..config import GLUFFN, AttentionConfig, DenseFFN, ModelConfig, RMSNormConfig, T5RelativeBias
from ..errors import Problems
from .converter import CONVERTERS, ConversionError, StateDict
from .hf_config import ACT_FROM_HF, ACT_TO_HF, Fit, HFConfig, confirmed
from .layouts import Pairs, check_consumed, drop, move, swap, with_lm_head

# configuration_t5.py defaults (transformers 5), for keys config.json omits
_DEFAULTS = dict(
    vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=None, num_heads=8,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
    layer_norm_epsilon=1e-6, feed_forward_proj="relu", pad_token_id=0, tie_word_embeddings=True,
)  # fmt: skip
_FFN = {  # DenseReluDense's (HF name, attnlab name): dense, gated, and either (reading)
    False: [("wi", "up_proj"), ("wo", "down_proj")],
    True: [("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")],
}
_FFN[None] = _FFN[False] + _FFN[True]
_EMBEDDINGS = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def _stack(stack: str, glu: bool | None) -> Pairs:
    """(attnlab module, HF module) of one stack: "{i}" runs over its blocks, whose layers are
    self-attention, cross-attention (decoder only) and the FFN, each with its norm."""
    ours, theirs = f"{stack}.blocks.{{i}}", f"{stack}.block.{{i}}.layer"
    layers = [("self_attn", "attn_norm", "SelfAttention")]
    if stack == "decoder":
        layers.append(("cross_attn", "cross_norm", "EncDecAttention"))
    pairs = [(f"{stack}.final_norm", f"{stack}.final_layer_norm")]
    # transformers keeps the stack's relative-bias table in block 0's self-attention
    table = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias"
    pairs.append((f"{stack}.positional.relative_attention_bias", table))
    for j, (attn, norm, hf) in enumerate(layers):
        pairs += [(f"{ours}.{attn}.{x}_proj", f"{theirs}.{j}.{hf}.{x}") for x in "qkvo"]
        pairs.append((f"{ours}.{norm}", f"{theirs}.{j}.layer_norm"))
    ffn = f"{theirs}.{len(layers)}"
    pairs += [(f"{ours}.ffn.{al}", f"{ffn}.DenseReluDense.{hf}") for hf, al in _FFN[glu]]
    pairs.append((f"{ours}.ffn_norm", f"{ffn}.layer_norm"))
    return pairs


class T5Converter:
    model_type = "t5"
    hf_class = "T5ForConditionalGeneration"

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig("t5", data, _DEFAULTS)
        arch = hf.architecture()
        if arch and arch not in ("T5ForConditionalGeneration", "T5Model"):
            hf.reject(
                "architectures", arch, "only T5ForConditionalGeneration / T5Model (encoder-decoder)"
            )
        proj = hf["feed_forward_proj"]
        gated, name = proj.startswith("gated-"), proj.split("-")[-1]
        name = "gelu_new" if proj == "gated-gelu" else name  # as T5Config.__post_init__ does
        if name not in ACT_FROM_HF or proj.count("-") > int(gated):
            hf.reject("feed_forward_proj", proj, f"supported: [gated-]{{{', '.join(ACT_FROM_HF)}}}")
        if hf.get("is_decoder"):
            hf.reject("is_decoder", True, "a decoder-only T5 stack is not modelled")
        hf.done()
        scale = hf.get("scale_decoder_outputs", hf["tie_word_embeddings"] is not False)
        dec = hf["num_decoder_layers"]
        return ModelConfig(
            arch="encoder-decoder",
            vocab_size=hf["vocab_size"],
            d_model=hf["d_model"],
            n_layers=hf["num_layers"],
            n_decoder_layers=dec if dec not in (None, hf["num_layers"]) else None,
            n_heads=hf["num_heads"],
            head_dim=hf["d_kv"] if hf["d_kv"] * hf["num_heads"] != hf["d_model"] else None,
            d_ff=hf["d_ff"],
            positional=T5RelativeBias(
                num_buckets=hf["relative_attention_num_buckets"],
                max_distance=hf["relative_attention_max_distance"],
            ),
            attention=AttentionConfig(scale=1.0, dropout=hf["dropout_rate"]),
            norm=RMSNormConfig(eps=hf["layer_norm_epsilon"]),
            ffn=(GLUFFN if gated else DenseFFN)(activation=ACT_FROM_HF[name], bias=False),
            dropout=hf["dropout_rate"],
            activation_dropout=hf["dropout_rate"],
            tie_embeddings=scale,
            scale_tied_logits=scale,
            pad_token_id=hf["pad_token_id"],
            init="t5",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        fit = Fit(
            cfg, "t5", needs=(("positional.kind", "t5-relative"), ("ffn.kind", ("dense", "glu")))
        )
        glu = isinstance(cfg.ffn, GLUFFN)
        if glu and cfg.ffn.activation == "gelu":
            fit.fail("ffn.activation", "gelu", "T5's 'gated-gelu' is the tanh GELU (gelu-tanh)")
        fit.done()
        act = cfg.ffn.activation
        # The GeGLU of T5 v1.1, mT5 and Flan-T5 is written with T5Config's own name, "gated-gelu"
        # (T5Config reads it as gelu_new): the value those checkpoints' config.json files carry.
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
        return confirmed(self, cfg, hf, ignore=("attention.dropout",))

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        # cross-attention's relative-bias table is unused by transformers too
        sd = drop(sd, suffixes=("EncDecAttention.relative_attention_bias.weight",))
        shared = next(sd[k] for k in _EMBEDDINGS[:2] if k in sd)
        problems = Problems()
        for k in [k for k in _EMBEDDINGS if k in sd]:
            if not torch.equal(sd.pop(k), shared):
                problems.add(f"{k} differs from shared.weight: attnlab shares one embedding")
        out: StateDict = {"embed_tokens.weight": shared}
        head = sd.pop("lm_head.weight", None)
        if not cfg.tie_embeddings:  # a bare T5Model has no head: the embedding is its head
            out["lm_head.weight"] = shared.clone() if head is None else head
        elif head is not None and not torch.equal(head, shared):
            problems.add(
                "lm_head.weight differs from shared.weight but the config rescales the decoder "
                "output (tied T5): set tie_word_embeddings false / scale_decoder_outputs false"
            )
        problems.raise_as(ConversionError, "t5 checkpoint for an exact conversion")
        out.update(move(sd, swap(_stack("encoder", None)), cfg.n_layers))
        out.update(move(sd, swap(_stack("decoder", None)), cfg.decoder_layers))
        return {**out, **sd}  # what is left, _load_exact reports

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd, glu = dict(sd), isinstance(cfg.ffn, GLUFFN)
        out = move(sd, with_lm_head([("embed_tokens", "shared")], cfg), 1)
        out.update(move(sd, _stack("encoder", glu), cfg.n_layers))
        out.update(move(sd, _stack("decoder", glu), cfg.decoder_layers))
        check_consumed(sd, "t5 (attnlab side)")
        return out


CONVERTERS.register("t5")(T5Converter())
