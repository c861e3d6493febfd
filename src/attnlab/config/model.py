"""`ModelConfig`, a whole model: its fields (one sub-config per component kind), the rules that
concern the model as a whole (each kind's own are collected from it, never tested by class), the
derived sizes, computed here only, and serialisation to and from JSON and YAML.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from .attention import AttentionConfig, AttentionKind
from .base import Frozen, _divisors, load_yaml
from .ffn import FFN, DenseFFN
from .frontends import Frontend, StagesConfig
from .layer_pattern import LayerSpec
from .norms import LayerNormConfig, NormConfig
from .positional import Positional, Sinusoidal


class ModelConfig(Frozen):
    """A whole model. Sizes follow the papers' names; `None` means "derive" (see properties)."""

    arch: Literal["encoder", "decoder", "encoder-decoder"]
    vocab_size: int = Field(ge=0)  # 0: no token table (a model with a frontend)
    d_model: int = Field(gt=0)
    n_layers: int = Field(gt=0)
    n_decoder_layers: int | None = Field(None, gt=0)  # encoder-decoder only; None = n_layers
    n_heads: int = Field(gt=0)
    n_kv_heads: int | None = Field(None, gt=0)  # None = n_heads (MHA); 1 = MQA; else GQA
    head_dim: int | None = Field(None, gt=0)  # None = d_model // n_heads
    d_ff: int | None = Field(None, gt=0)  # None = 4·d_model (dense) or the GLU rule

    positional: Positional = Sinusoidal()
    attention: AttentionKind = AttentionConfig()
    norm: NormConfig = LayerNormConfig()
    ffn: FFN = DenseFFN()
    # "sandwich": x + norm2(f(norm1(x))) (Gemma 2/3); "post-sublayer": x + norm(f(x)), the stream
    # never normalised (OLMo 2); both keep the final norm (src/attnlab/nn/block.py)
    norm_placement: Literal["pre", "post", "sandwich", "post-sublayer"] = "pre"
    # "parallel": x + attn(norm1(x)) + ffn(norm2(x)) (GPT-NeoX); "parallel-shared-norm": one norm
    # feeds both branches (GPT-J, Falcon-7B, PaLM).
    residual: Literal["sequential", "parallel", "parallel-shared-norm"] = "sequential"
    final_norm: bool = True
    embedding_norm: bool = False  # LayerNorm right after the embeddings (BERT, BLOOM, BART)
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(d_model) (2017, Marian)
    # round that sqrt(d_model) to the embeddings' dtype before multiplying (Gemma: bf16 45.25, not
    # 45.2548...); without it the factor stays a Python float, as in BART and Marian
    round_embed_scale: bool = False
    # multipliers (Granite; 1.0: none): token embeddings × m (with scale_embeddings, after its
    # sqrt(d_model)), x + m·sublayer(x) in every block, logits × m (tied or not; Granite's is
    # 1 / logits_scaling, Cohere's its logit_scale). Granite's attention_multiplier is
    # attention.scale
    embedding_multiplier: float = Field(1.0, gt=0)
    residual_multiplier: float = Field(1.0, gt=0)
    logit_multiplier: float = Field(1.0, gt=0)
    # logits = cap·tanh(logits / cap), after logit_multiplier (Gemma 2: 30.0); None: uncapped
    final_logit_softcap: float | None = Field(None, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)  # on embeddings and every residual branch
    activation_dropout: float = Field(0.0, ge=0, lt=1)  # on the FFN hidden activation (T5, fairseq)
    type_vocab_size: int = Field(0, ge=0)  # token-type (segment) embeddings; encoder only
    pad_token_id: int | None = Field(None, ge=0)

    tie_embeddings: bool = True  # output projection shares the token embedding matrix
    share_encoder_decoder_embeddings: bool = True  # encoder-decoder only
    scale_tied_logits: bool = False  # multiply the last hidden by d_model^-0.5 first (T5)
    mlm_head: bool = False  # encoder only: dense + act + norm + tied decoder (BERT)
    num_labels: int = Field(0, ge=0)  # encoder only: sequence-classification head when > 0
    # the classification head's dense + tanh on the first token before the linear map (BERT's
    # pooler); False: the first token's (final-normed) state straight to it (ViT). Without
    # num_labels it says which head adding labels builds (load_pretrained(..., num_labels=...))
    classifier_pooler: bool = True
    # encoder only: turns non-token inputs (pixel_values) into the sequence; None = token ids
    frontend: Frontend | None = None
    # per-layer attention: layer i of each stack attends as layer_pattern[i % len(layer_pattern)]
    # (window, own positional scheme); None: every layer as `attention` and `positional` say.
    # ModernBERT: one global layer, then two local ones with a 128-token window and their own RoPE
    layer_pattern: tuple[LayerSpec, ...] | None = None
    # False: the first block has no norm before its attention, whose input the embedding norm has
    # just normalised (ModernBERT); pre-norm, sequential residual only
    first_attn_norm: bool = True
    # the MLM head's dense layer has a bias (BERT); ModernBERT's has none
    mlm_dense_bias: bool = True
    # a hierarchical image encoder (Swin): stages of windowed blocks at halving resolution after a
    # patch-grid frontend; d_model, n_heads and d_ff are the first stage's, n_layers their sum; a
    # classifier (num_labels) maps the mean final token to the labels (classifier_pooler False)
    stages: StagesConfig | None = None
    init: Literal["xavier", "normal", "gpt2", "t5"] = "gpt2"

    @model_validator(mode="before")
    @classmethod
    def _softmax_by_default(cls, data: Any) -> Any:
        """`attention` given as a dict without `kind` is softmax attention, as before kinds."""
        att = data.get("attention") if isinstance(data, dict) else None
        if isinstance(att, dict) and "kind" not in att:
            data = {**data, "attention": {"kind": "softmax", **att}}
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        problems = self._problems()
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _problems(self) -> list[str]:
        p: list[str] = []
        kv = self.kv_heads
        if self.n_heads % kv:
            p.append(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({kv}): "
                f"choose n_kv_heads in {_divisors(self.n_heads)}"
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            p.append(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) when "
                f"head_dim is not set: choose n_heads in {_divisors(self.d_model)} or set head_dim"
            )
        p += self._kind_problems()
        if self.residual != "sequential" and self.norm_placement != "pre":
            p.append(
                f"residual ({self.residual!r}) needs norm_placement 'pre' (got "
                f"{self.norm_placement!r}): the parallel branches share one pre-norm input and "
                f"have no published form with norms after them; use residual 'sequential' or "
                f"placement 'pre'"
            )
        if self.residual != "sequential" and self.arch == "encoder-decoder":
            p.append(
                f"residual ({self.residual!r}) is not defined with cross-attention: "
                f"use residual 'sequential' for arch 'encoder-decoder'"
            )
        if self.arch != "encoder-decoder":
            for name in ("n_decoder_layers",):
                if getattr(self, name) is not None:
                    p.append(
                        f"{name} ({getattr(self, name)}) is only for arch 'encoder-decoder': remove it"
                    )
        if self.arch != "encoder":
            for name in ("type_vocab_size", "num_labels"):
                if getattr(self, name):
                    p.append(
                        f"{name} ({getattr(self, name)}) is only for arch 'encoder': set it to 0"
                    )
            if self.mlm_head:
                p.append("mlm_head (True) is only for arch 'encoder': set it to False")
        if self.mlm_head and self.num_labels:
            p.append(
                f"mlm_head (True) and num_labels ({self.num_labels}) exclude each other: a model has one "
                f"head; build one model per task (they can share the encoder weights)"
            )
        p += self._frontend_problems()
        p += self._layer_problems()
        p += self.stages.problems(self) if self.stages is not None else []
        if self.round_embed_scale and not self.scale_embeddings:
            p.append(
                "round_embed_scale (True) needs scale_embeddings (True): enable it or drop the rounding"
            )
        if self.arch == "encoder":
            for name, off in (("logit_multiplier", 1.0), ("final_logit_softcap", None)):
                if getattr(self, name) != off:
                    p.append(
                        f"{name} ({getattr(self, name)}) acts on a language model's next-token "
                        f"logits, which arch 'encoder' has none of (its heads are the MLM "
                        f"transform and the classifier): remove it"
                    )
        if self.scale_tied_logits and not self.tie_embeddings:
            p.append(
                "scale_tied_logits (True) needs tie_embeddings (True): enable it or drop the scaling"
            )
        if (
            self.pad_token_id is not None
            and self.pad_token_id >= self.vocab_size
            # an encoder with a frontend refuses a padding id outright; Whisper's is the decoder's
            and (self.frontend is None or self.arch == "encoder-decoder")
        ):
            p.append(
                f"pad_token_id ({self.pad_token_id}) must be < vocab_size ({self.vocab_size}): "
                f"fix the id or enlarge the vocabulary"
            )
        return p

    def _kind_problems(self) -> list[str]:
        """Each kind's own rules (`Kind.problems`): the model asks every node, never its class."""
        nodes = dict(positional=self.positional, attention=self.attention, ffn=self.ffn)
        nodes.update(norm=self.norm, frontend=self.frontend)
        return [m for where, n in nodes.items() if n is not None for m in n.problems(self, where)]

    def _layer_problems(self) -> list[str]:
        """The per-layer fields: `layer_pattern`, `first_attn_norm`, `mlm_dense_bias`."""
        p: list[str] = []
        if not self.first_attn_norm and (
            self.norm_placement != "pre" or self.residual != "sequential"
        ):
            p.append(
                f"first_attn_norm (False) needs norm_placement 'pre' and residual 'sequential' "
                f"(got {self.norm_placement!r}, {self.residual!r}): it drops the norm in front "
                f"of the first attention; set first_attn_norm True"
            )
        if not self.mlm_dense_bias and not self.mlm_head:
            p.append("mlm_dense_bias (False) describes the MLM head: set mlm_head True or drop it")
        pattern = self.layer_pattern
        if pattern is None:
            return p
        if not pattern:
            p.append("layer_pattern (()) is empty: give at least one LayerSpec, or None")
        if not self.attention.per_layer:
            p.append(
                f"layer_pattern needs attention.kind 'softmax' (got {self.attention.kind!r}): "
                f"per-layer windows and positions are defined for softmax attention; drop it"
            )
        if self.attention.sliding_window is not None:
            p.append(
                f"attention.sliding_window ({self.attention.sliding_window}) and layer_pattern "
                f"exclude each other: the pattern gives every layer its window; move the window "
                f"into the pattern's entries"
            )
        for i, spec in enumerate(pattern):  # a layer's own scheme, by its own rules
            if spec.positional is not None:
                p += spec.positional.problems(self, f"layer_pattern.{i}.positional")
        return p

    def _frontend_problems(self) -> list[str]:
        """Token ids and frontends: a model without a frontend needs a vocabulary; an encoder
        with a frontend (ViT) has no token embeddings, and its frontend adds the positions; an
        encoder-decoder's frontend (Whisper) feeds the encoder, whose positions it adds, and the
        one token table, `vocab_size` and `positional` are the decoder's."""
        p: list[str] = []
        f = self.frontend
        if f is None and self.vocab_size == 0:
            p.append(
                "vocab_size (0) must be > 0: a model reads token ids unless it has a frontend; "
                "set vocab_size, or a frontend (e.g. {'kind': 'patches', ...} for images)"
            )
        if f is None:
            return p
        if self.arch != f.arch:
            p.append(
                f"frontend ({f.kind!r}) is only for arch {f.arch!r} (got {self.arch!r}): use arch "
                f"{f.arch!r} or drop the frontend"
            )
            return p
        if self.arch == "encoder-decoder":
            if self.vocab_size == 0:
                p.append(
                    f"vocab_size (0) must be > 0 with frontend {f.kind!r}: the decoder reads and "
                    f"predicts token ids; set vocab_size"
                )
            if not self.share_encoder_decoder_embeddings:
                p.append(
                    f"share_encoder_decoder_embeddings (False) needs two token tables; with "
                    f"frontend {f.kind!r} the encoder has none and the decoder's is the only one: "
                    f"set it to True"
                )
            return p
        if self.vocab_size:
            p.append(
                f"vocab_size ({self.vocab_size}) must be 0 with frontend {f.kind!r}, whose inputs "
                f"are not token ids: set vocab_size to 0 (no token table is built)"
            )
        if self.positional.kind != "none":
            p.append(
                f"positional ({self.positional.kind!r}) must be 'none' with frontend {f.kind!r}, "
                f"which adds its own learned positions (class token included): set positional "
                f"to {{'kind': 'none'}}"
            )
        token_fields = dict(
            type_vocab_size=self.type_vocab_size,
            mlm_head=self.mlm_head,
            pad_token_id=self.pad_token_id is not None,  # 0 is an id too
            scale_embeddings=self.scale_embeddings,
            embedding_multiplier=self.embedding_multiplier != 1.0,
        )
        for name in [k for k, v in token_fields.items() if v]:
            p.append(
                f"{name} ({getattr(self, name)!r}) describes token embeddings, which a model "
                f"with frontend {f.kind!r} has none of: remove it"
            )
        return p

    # --- derived values: the only place they are computed ---------------------------------------

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (0 without RoPE)."""
        return self.positional.rotary_dim(self.attention.rope_head_dim(self.attn_head_dim))

    @property
    def ffn_dim(self) -> int:
        """Hidden size of the FFN (of each expert for MoE)."""
        return self.d_ff if self.d_ff is not None else self.ffn.hidden_dim(self.d_model)

    @property
    def decoder_layers(self) -> int:
        return self.n_decoder_layers if self.n_decoder_layers is not None else self.n_layers

    @property
    def is_causal(self) -> bool:
        """Whether the (main) stack is causal: decoder-only models are."""
        return self.arch == "decoder"

    # --- serialisation ------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        return cls.from_dict(json.loads(text))

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> ModelConfig:
        return cls.from_dict(load_yaml(text, "ModelConfig YAML"))

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        text = path.read_text()
        return cls.from_yaml(text) if path.suffix in (".yaml", ".yml") else cls.from_json(text)
