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

Pegasus: Zhang et al. 2020, "PEGASUS: Pre-training with Extracted Gap-sentences", arXiv:1912.08777:
Marian's layers and sinusoids with pre-norm (Xiong et al. 2020, arXiv:2002.04745) and a final
LayerNorm closing each stack; one embedding table for both stacks. It is the target of a pre-norm
attnlab encoder-decoder, as Marian is of a post-norm one (`export_family`; transformers' other
pre-norm translation families do not compute it: M2M100 / NLLB space the sinusoid frequencies as
10000^(-i/(d/2 - 1)) from position pad+1, mBART adds a LayerNorm on the embeddings).

Written from a model attnlab trained (the 2017 recipe of configs/multi30k-de-en.yaml), two
differences are the same function in other coordinates, so they are written, not refused:
attention projections without biases get zero biases (x·W + 0 = x·W), and the paper's
interleaved sinusoids (sin, cos, sin, ...) become the split ones by permuting the model's
d_model channels, the same permutation on every tensor that reads or writes the residual stream
(embeddings and tied head, the input columns of q/k/v and fc1, the output rows of o_proj and fc2,
every LayerNorm): each dot product sums the same terms in another order, so the outputs agree to
float rounding. LayerNorm's eps is not such a difference: these families fix it at 1e-5, the
2017 preset's 1e-6 (tensor2tensor's) is refused, with the recipe change that exports.
"""

from __future__ import annotations

from operator import attrgetter

import torch

from ..config import (
    AttentionConfig,
    DenseFFN,
    LayerNormConfig,
    LearnedPositions,
    ModelConfig,
    Sinusoidal,
)
from ..errors import Problems
from .converter import CONVERTERS, ConversionError, StateDict
from .hf_config import ACT_TO_HF, Fit, HFConfig, confirmed
from .layouts import Pairs, add_prefix, check_consumed, move, strip, swap, with_lm_head

# configuration_{bart,marian,pegasus}.py defaults (transformers 5), for keys config.json omits
_COMMON = dict(
    max_position_embeddings=1024, encoder_layers=12, encoder_ffn_dim=4096, encoder_attention_heads=16,
    decoder_layers=12, decoder_ffn_dim=4096, decoder_attention_heads=16, activation_function="gelu",
    d_model=1024, dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, scale_embedding=False,
    tie_word_embeddings=True,
)  # fmt: skip
_DEFAULTS = {
    "bart": {**_COMMON, "vocab_size": 50265, "pad_token_id": 1},
    "marian": {**_COMMON, "vocab_size": 58101, "pad_token_id": 58100, "share_encoder_decoder_embeddings": True},
    "pegasus": {**_COMMON, "vocab_size": 50265, "pad_token_id": 0},
}  # fmt: skip
# keys of fairseq-era config.json files that transformers 5 ignores: refuse a value it would ignore
_LEGACY = {
    "bart": dict(normalize_before=False, add_final_layer_norm=False, normalize_embedding=True,
                 static_position_embeddings=False, add_bias_logits=False, extra_pos_embeddings=2),
    "marian": dict(normalize_before=False, add_final_layer_norm=False, normalize_embedding=False,
                   static_position_embeddings=True, add_bias_logits=False),
    "pegasus": dict(normalize_before=True, add_final_layer_norm=True, normalize_embedding=False,
                    static_position_embeddings=True, add_bias_logits=False),
}  # fmt: skip
_LAYER = {  # HF module under "{stack}.layers.{i}." -> attnlab's under "{stack}.blocks.{i}."
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
_LINEARS = [hf for hf in _LAYER if not hf.endswith("norm")]  # every one has a bias in HF
_EMBEDDINGS = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# the config fields of biases these families always have: written as zeros where attnlab has none
_BIASES = ("attention.qkv_bias", "attention.k_bias", "attention.o_bias", "ffn.bias")


def _stack(stack: str) -> Pairs:
    """(attnlab module, HF module under "model.") of one stack; "{i}" runs over its layers."""
    pairs = [
        (f"{stack}.blocks.{{i}}.{al}", f"{stack}.layers.{{i}}.{hf}") for hf, al in _LAYER.items()
    ]
    pairs.append((f"{stack}.positional", f"{stack}.embed_positions"))  # BART's learned table
    pairs.append((f"{stack}.embedding_norm", f"{stack}.layernorm_embedding"))
    pairs.append((f"{stack}.final_norm", f"{stack}.layer_norm"))  # Pegasus's
    return pairs


def marian_sinusoids(n_pos: int, dim: int) -> torch.Tensor:
    """MarianSinusoidalPositionalEmbedding.create_weight (float64, then fp32; the test checks it
    bit for bit against transformers' numpy version): sines of pos / 10000^(2i/dim), then cosines.
    Pegasus's table is the same function."""
    i = torch.arange(dim // 2, dtype=torch.float64)
    angle = torch.arange(n_pos, dtype=torch.float64)[:, None] / torch.pow(10000.0, 2 * i / dim)
    return torch.cat((angle.sin(), angle.cos()), dim=1).float()


class BartConverter:
    def __init__(self, model_type: str, hf_class: str) -> None:
        self.model_type, self.hf_class = model_type, hf_class
        self.sinusoids = model_type in ("marian", "pegasus")
        self.pre_norm = model_type == "pegasus"

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig(self.model_type, data, _DEFAULTS[self.model_type])
        arch = hf.architecture()
        bare = self.hf_class.replace("ForConditionalGeneration", "").replace("MTModel", "")
        if arch and arch not in (self.hf_class, bare + "Model"):
            hf.reject("architectures", arch, f"only {self.hf_class} or the bare model")
        for key, want in _LEGACY[self.model_type].items():
            if hf.get(key, want) != want:
                hf.reject(key, hf[key], f"transformers' {self.model_type} fixes it to {want!r}")
        for a, b in (
            ("encoder_attention_heads", "decoder_attention_heads"),
            ("encoder_ffn_dim", "decoder_ffn_dim"),
        ):
            if hf[a] != hf[b]:
                hf.reject(b, hf[b], f"{a} is {hf[a]}: attnlab's stacks share n_heads and d_ff")
        act = hf.activation("activation_function")
        if (hf.get("decoder_vocab_size") or hf["vocab_size"]) != hf["vocab_size"]:
            hf.reject(
                "decoder_vocab_size",
                hf["decoder_vocab_size"],
                f"vocab_size is {hf['vocab_size']}: attnlab's stacks share one vocabulary",
            )
        hf.done()
        n_dec = hf["decoder_layers"]
        pos = (
            Sinusoidal(layout="split")
            if self.sinusoids
            else LearnedPositions(max_len=hf["max_position_embeddings"] + 2, offset=2)
        )
        return ModelConfig(
            arch="encoder-decoder",
            vocab_size=hf["vocab_size"],
            d_model=hf["d_model"],
            n_layers=hf["encoder_layers"],
            n_decoder_layers=n_dec if n_dec != hf["encoder_layers"] else None,
            n_heads=hf["encoder_attention_heads"],
            d_ff=hf["encoder_ffn_dim"],
            positional=pos,
            attention=AttentionConfig(qkv_bias=True, o_bias=True, dropout=hf["attention_dropout"]),
            norm=LayerNormConfig(eps=1e-5),
            ffn=DenseFFN(activation=act),
            norm_placement="pre" if self.pre_norm else "post",
            final_norm=self.pre_norm,
            embedding_norm=not self.sinusoids,
            scale_embeddings=bool(hf["scale_embedding"]),
            dropout=hf["dropout"],
            activation_dropout=hf["activation_dropout"],
            pad_token_id=hf["pad_token_id"],
            tie_embeddings=hf["tie_word_embeddings"],
            share_encoder_decoder_embeddings=hf.get("share_encoder_decoder_embeddings", True),
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        self._fit(cfg)  # before reading fields a misfit may not have
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
            activation_function=ACT_TO_HF.get(act, "gelu"),
            d_model=cfg.d_model,
            dropout=cfg.dropout,
            attention_dropout=cfg.attention.dropout,
            activation_dropout=cfg.activation_dropout,
            scale_embedding=cfg.scale_embeddings,
            pad_token_id=cfg.pad_token_id,
            decoder_start_token_id=cfg.pad_token_id,
            tie_word_embeddings=cfg.tie_embeddings,
        )
        if self.model_type == "marian":
            hf["share_encoder_decoder_embeddings"] = cfg.share_encoder_decoder_embeddings
        ignore = tuple(f for f in _BIASES if not attrgetter(f)(cfg))  # zero biases: the same model
        if self._permuted(cfg):  # the split layout in permuted channels: the same model
            ignore += ("positional.layout",)
        return confirmed(self, cfg, hf, ignore=ignore)

    def _fit(self, cfg: ModelConfig) -> None:
        """The misfits `confirmed` would find, each with this family's rule and the fix."""
        other = {"bart": "", "marian": "pegasus", "pegasus": "marian"}[self.model_type]
        fit = Fit(cfg, self.model_type, needs=(("arch", "encoder-decoder"),))
        placement = "pre" if self.pre_norm else "post"
        why = f" ({other} is the {'post' if self.pre_norm else 'pre'}-norm one)" if other else ""
        fit.need("norm_placement", placement, why)
        fit.need("final_norm", self.pre_norm, why)
        fit.need("ffn.kind", "dense")
        if fit.need("norm.kind", "layernorm") == "layernorm":
            fit.need(
                "norm.eps",
                1e-5,
                " (nn.LayerNorm's default, fixed in its code: no config key changes it); "
                "train with --set model.overrides.norm.eps=1e-5",
            )
        if self.sinusoids:
            fit.need("positional.kind", "sinusoidal")
            fit.need("positional.base", 10000.0)
        fit.done()

    def _permuted(self, cfg: ModelConfig) -> bool:
        return self.sinusoids and getattr(cfg.positional, "layout", None) == "interleaved"

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd, shared = strip(sd, "model."), cfg.share_encoder_decoder_embeddings
        enc = next(sd[k] for k in _EMBEDDINGS[:2] if k in sd)
        dec = enc if shared else sd["decoder.embed_tokens.weight"]
        out: StateDict = {"embed_tokens.weight": enc}
        if not shared:
            out["decoder_embed_tokens.weight"] = dec
        problems = Problems()
        for k in [k for k in _EMBEDDINGS if k in sd]:
            if not torch.equal(sd.pop(k), dec if k.startswith("decoder.") else enc):
                problems.add(f"{k} differs from the embedding it shares")
        if bool(sd.pop("final_logits_bias", torch.zeros(1)).any()):
            problems.add("final_logits_bias is nonzero; attnlab has no logits bias")
        if cfg.tie_embeddings and not torch.equal(sd.pop("lm_head.weight", dec), dec):
            problems.add("lm_head.weight differs from the tied embedding")
        tables = [k for k in sd if k.endswith("embed_positions.weight")] if self.sinusoids else []
        for k in tables:  # the sinusoids: checked, then dropped (attnlab computes them)
            table = sd.pop(k)
            ref = marian_sinusoids(*table.shape).to(table.dtype)
            eps = float(torch.finfo(table.dtype).eps)
            if not torch.allclose(table.float(), ref.float(), rtol=0, atol=eps):
                problems.add(f"{k} is not the sinusoid table attnlab computes")
        problems.raise_as(ConversionError, f"{self.model_type} checkpoint for an exact conversion")
        out.update(move(sd, swap(_stack("encoder")), cfg.n_layers))
        out.update(move(sd, swap(_stack("decoder")), cfg.decoder_layers))
        return {**out, **sd}  # lm_head.weight when untied; anything else, _load_exact reports

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd = split_channels(sd, cfg.d_model) if self._permuted(cfg) else dict(sd)
        w = sd["embed_tokens.weight"]
        embed = "shared" if cfg.share_encoder_decoder_embeddings else "encoder.embed_tokens"
        pairs = [("embed_tokens", embed), ("decoder_embed_tokens", "decoder.embed_tokens")]
        out = move(sd, with_lm_head(pairs, cfg), 1)
        for stack, n in (("encoder", cfg.n_layers), ("decoder", cfg.decoder_layers)):
            out.update(move(sd, _stack(stack), n))
            out.update(_zero_biases(out, stack, n))
        check_consumed(sd, f"{self.model_type} (attnlab side)")
        out = add_prefix(out, "model.")
        out["final_logits_bias"] = w.new_zeros(1, cfg.vocab_size)
        if self.sinusoids:
            table = marian_sinusoids(self.config_to_hf(cfg)["max_position_embeddings"], cfg.d_model)
            for stack in ("encoder", "decoder"):
                out[f"model.{stack}.embed_positions.weight"] = table.to(w).clone()
        return out


def _zero_biases(out: StateDict, stack: str, n_layers: int) -> StateDict:
    """A zero bias for each linear layer of `stack` that has none in `out` (HF names): these
    families give every projection one."""
    zeros: StateDict = {}
    for i in range(n_layers):
        for hf in _LINEARS:
            w = out.get(f"{stack}.layers.{i}.{hf}.weight")
            if w is not None and f"{stack}.layers.{i}.{hf}.bias" not in out:
                zeros[f"{stack}.layers.{i}.{hf}.bias"] = w.new_zeros(w.shape[0])
    return zeros


# attnlab tensor names by the axis that runs over the residual stream's d_model channels
_READS = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".up_proj.weight",
          ".gate_proj.weight", "embed_tokens.weight", "lm_head.weight")  # fmt: skip
_WRITES = (".o_proj.weight", ".o_proj.bias", ".down_proj.weight", ".down_proj.bias")
_NORMS = ("_norm.weight", "_norm.bias")


def split_channels(sd: StateDict, d_model: int) -> StateDict:
    """attnlab weights of a model with interleaved sinusoids (channel 2i: sin, 2i + 1: cos) as
    the same model with split ones (channel i: sin, d/2 + i: cos): every tensor's d_model axis
    indexed by perm = [0, 2, 4, ..., 1, 3, 5, ...], so that the residual stream of the result is
    the original's, permuted (module docstring). A tensor with no such axis is kept; one that
    the rules do not place is refused rather than guessed."""
    perm = torch.cat((torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)))
    out: StateDict = {}
    for k, t in sd.items():
        if k.endswith(_READS):
            out[k] = t[:, perm]  # (out, d_model): the input columns
        elif k.endswith(_WRITES + _NORMS):
            out[k] = t[perm]  # (d_model, ...) rows, or a (d_model,) vector
        elif k.endswith((".q_proj.bias", ".k_proj.bias", ".v_proj.bias", ".up_proj.bias")):
            out[k] = t  # the heads' / FFN's own axis
        else:
            raise ConversionError(
                f"{k}: no rule says which of its axes is d_model, so the interleaved sinusoids "
                "cannot be rewritten as split ones; train with "
                "--set model.overrides.positional.layout=split"
            )
    return out


def export_family(cfg: ModelConfig, target: str) -> str:
    """The transformers model_type an encoder-decoder attnlab trained is written as: "marian"
    (post-norm, the 2017 paper's) or "pegasus" (pre-norm with final norms), whichever writes it
    exactly; otherwise a ConversionError naming the misfits of the nearer one. Target "gguf":
    refused, llama.cpp has no such graph."""
    if target == "gguf":
        raise ConversionError(
            "llama.cpp has no Marian or Pegasus graph (its one encoder-decoder is T5, which this "
            "model is not: T5 uses bias-free RMSNorm and relative position buckets, not LayerNorm "
            "and sinusoids): write an HF folder instead (`attnlab convert SRC DIR --to hf`), "
            "which transformers translates with"
        )
    misfits: dict[str, str] = {}
    for family in ("marian", "pegasus"):
        try:
            CONVERTERS.get(family).config_to_hf(cfg)
            return family
        except ConversionError as err:
            misfits[family] = str(err)
    nearest = min(misfits, key=lambda f: misfits[f].count("\n"))  # the fewest misfit lines
    raise ConversionError(
        f"no transformers family computes this encoder-decoder exactly; nearest: {misfits[nearest]}"
    )


CONVERTERS.register("bart")(BartConverter("bart", "BartForConditionalGeneration"))
CONVERTERS.register("marian")(BartConverter("marian", "MarianMTModel"))
CONVERTERS.register("pegasus")(BartConverter("pegasus", "PegasusForConditionalGeneration"))
