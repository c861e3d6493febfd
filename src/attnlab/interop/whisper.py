"""Whisper <-> attnlab encoder-decoder models with an audio frontend.

Radford et al. 2022, "Robust Speech Recognition via Large-Scale Weak Supervision",
arXiv:2212.04356 (transformers' WhisperForConditionalGeneration). The encoder reads log-mel
features through two Conv1d + GELU and a sinusoid table (the "audio" frontend,
src/attnlab/nn/frontends/audio.py); the decoder has learned positions from 0; both stacks are
pre-norm with a final LayerNorm (eps 1e-5), exact GELU, and attention with biases on q, v and
the output but none on k (`k_bias` False); the LM head (`proj_out`) is tied to the decoder's
token embedding.

The encoder's sinusoid table is a parameter in the checkpoint (frozen): it is copied as it is,
both ways. `scale_embedding` is stored by WhisperConfig but never applied by its modules, and
spec augment and layerdrop act in training only; the converter refuses a checkpoint that turns
them on rather than silently differ. The generation settings (start token, suppressed tokens,
forced ids) are carried by `from_hf` / `load_pretrained` as `model.generation`
(src/attnlab/decode/settings.py); Whisper's own generate() additionally inserts language and task
tokens and handles timestamps and long-form audio, which attnlab does not model: give the
decoder prompt explicitly (tests/interop/test_whisper.py).
"""

from __future__ import annotations

import torch

from ..config import (
    AttentionConfig,
    AudioFrontend,
    DenseFFN,
    LayerNormConfig,
    LearnedPositions,
    ModelConfig,
)
from ..errors import Problems
from .converter import CONVERTERS, ConversionError, StateDict
from .hf_config import ACT_TO_HF, Fit, HFConfig, confirmed
from .layouts import Pairs, add_prefix, check_consumed, move, strip, swap, with_lm_head

# configuration_whisper.py defaults (transformers 5), for keys a config.json omits
_DEFAULTS = dict(
    vocab_size=51865, num_mel_bins=80, encoder_layers=4, encoder_attention_heads=6,
    decoder_layers=4, decoder_attention_heads=6, decoder_ffn_dim=1536, encoder_ffn_dim=1536,
    activation_function="gelu", d_model=384, dropout=0.0, attention_dropout=0.0,
    activation_dropout=0.0, scale_embedding=False, max_source_positions=1500,
    max_target_positions=448, pad_token_id=50256, bos_token_id=50256, eos_token_id=50256,
    decoder_start_token_id=50257, tie_word_embeddings=True, apply_spec_augment=False,
    encoder_layerdrop=0.0, decoder_layerdrop=0.0,
)  # fmt: skip
# keys whose other values transformers' Whisper would act on (or ignore) in ways attnlab does not
_FIXED = dict(
    scale_embedding=(False, "WhisperConfig stores it but its modules never apply it"),
    apply_spec_augment=(False, "SpecAugment masking in training is not modelled"),
    use_weighted_layer_sum=(False, "only WhisperForAudioClassification uses it"),
)
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
_POSITIONS = ("frontend.embed_positions", "encoder.embed_positions.weight")  # a bare parameter
_NEEDS = (  # what WhisperForConditionalGeneration computes; anything else is a misfit
    ("arch", "encoder-decoder"),
    ("positional.kind", "learned"),
    ("positional.offset", 0),
    ("norm_placement", "pre"),
    ("residual", "sequential"),
    ("final_norm", True),
    ("embedding_norm", False),
    ("scale_embeddings", False),
    ("scale_tied_logits", False),
    ("share_encoder_decoder_embeddings", True),
    ("norm.kind", "layernorm"),
    ("norm.eps", 1e-5),
    ("norm.bias", True),
    ("ffn.kind", "dense"),
    ("ffn.bias", True),
    ("attention.qkv_bias", True),
    ("attention.k_bias", False),
    ("attention.o_bias", True),
    ("attention.qk_norm", False),
    ("attention.sliding_window", None),
)


def _pairs(cfg: ModelConfig) -> Pairs:
    """(attnlab module, HF module under "model.") for the whole model; "{i}" runs over layers."""
    pairs: Pairs = [("frontend.conv1", "encoder.conv1"), ("frontend.conv2", "encoder.conv2")]
    for stack in ("encoder", "decoder"):
        pairs += [
            (f"{stack}.blocks.{{i}}.{a}", f"{stack}.layers.{{i}}.{h}") for h, a in _LAYER.items()
        ]
        pairs.append((f"{stack}.final_norm", f"{stack}.layer_norm"))
    pairs += [("decoder.positional", "decoder.embed_positions")]
    return with_lm_head([*pairs, ("embed_tokens", "decoder.embed_tokens")], cfg)


class WhisperConverter:
    model_type = "whisper"
    hf_class = "WhisperForConditionalGeneration"

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig(self.model_type, data, _DEFAULTS)
        arch = hf.architecture()
        if arch and arch not in (self.hf_class, "WhisperModel"):
            hf.reject("architectures", arch, f"only {self.hf_class} or the bare WhisperModel")
        for a, b in (
            ("encoder_attention_heads", "decoder_attention_heads"),
            ("encoder_ffn_dim", "decoder_ffn_dim"),
        ):
            if hf[a] != hf[b]:
                hf.reject(b, hf[b], f"{a} is {hf[a]}: attnlab's stacks share n_heads and d_ff")
        for key, (want, why) in _FIXED.items():
            if hf.get(key, want) != want:
                hf.reject(key, hf[key], f"must be {want!r}: {why}")
        act = hf.activation("activation_function")
        hf.done()
        n_enc, n_dec = hf["encoder_layers"], hf["decoder_layers"]
        pad = hf.get("pad_token_id")
        return ModelConfig(
            arch="encoder-decoder",
            vocab_size=hf["vocab_size"],
            d_model=hf["d_model"],
            n_layers=n_enc,
            n_decoder_layers=n_dec if n_dec != n_enc else None,
            n_heads=hf["encoder_attention_heads"],
            d_ff=hf["encoder_ffn_dim"],
            positional=LearnedPositions(max_len=hf["max_target_positions"]),
            attention=AttentionConfig(
                qkv_bias=True, k_bias=False, o_bias=True, dropout=hf["attention_dropout"]
            ),
            norm=LayerNormConfig(eps=1e-5),  # nn.LayerNorm's default, as modeling_whisper.py
            ffn=DenseFFN(activation=act),
            norm_placement="pre",
            dropout=hf["dropout"],
            activation_dropout=hf["activation_dropout"],
            # only generation and padding use it; out-of-vocabulary ids mean none
            pad_token_id=pad if isinstance(pad, int) and 0 <= pad < hf["vocab_size"] else None,
            tie_embeddings=hf["tie_word_embeddings"],
            frontend=AudioFrontend(
                num_mel_bins=hf["num_mel_bins"], max_source_positions=hf["max_source_positions"]
            ),
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        fit = Fit(cfg, self.model_type, needs=_NEEDS)
        fit.mha()
        fit.plain_heads()
        if getattr(cfg.frontend, "kind", None) != "audio":
            kind = getattr(cfg.frontend, "kind", None)
            fit.fail("frontend.kind", kind, "Whisper's encoder reads log-mel through 'audio'")
        fit.done()
        act = cfg.ffn.activation
        vocab = cfg.vocab_size
        # ids that only generation reads are model.generation's (to_hf writes them into the
        # generation config), so none here; WhisperConfig wants an int decoder start: its default
        # where it fits the vocabulary, else 0
        hf = dict(
            architectures=[self.hf_class],
            vocab_size=vocab,
            num_mel_bins=cfg.frontend.num_mel_bins,
            max_source_positions=cfg.frontend.max_source_positions,
            max_target_positions=cfg.positional.max_len,
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
            scale_embedding=False,
            pad_token_id=cfg.pad_token_id,
            bos_token_id=None,
            eos_token_id=None,
            decoder_start_token_id=50257 if vocab > 50257 else 0,
            begin_suppress_tokens=None,
            tie_word_embeddings=cfg.tie_embeddings,
        )
        return confirmed(self, cfg, hf)

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd = strip(sd, "model.")
        dec = sd["decoder.embed_tokens.weight"]
        problems = Problems()
        if cfg.tie_embeddings and not torch.equal(sd.pop("proj_out.weight", dec), dec):
            problems.add("proj_out.weight differs from the tied decoder embedding")
        problems.raise_as(ConversionError, f"{self.model_type} checkpoint for an exact conversion")
        sd = {("lm_head.weight" if k == "proj_out.weight" else k): v for k, v in sd.items()}
        out = move(sd, swap(_pairs(cfg)), max(cfg.n_layers, cfg.decoder_layers))
        out[_POSITIONS[0]] = sd.pop(_POSITIONS[1])
        check_consumed(sd, self.model_type)
        return out

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd = dict(sd)
        out = move(sd, _pairs(cfg), max(cfg.n_layers, cfg.decoder_layers))
        out[_POSITIONS[1]] = sd.pop(_POSITIONS[0])
        check_consumed(sd, f"{self.model_type} (attnlab side)")
        out = add_prefix(out, "model.")
        out["proj_out.weight"] = out.pop("lm_head.weight", out["model.decoder.embed_tokens.weight"])
        return out


CONVERTERS.register("whisper")(WhisperConverter())
