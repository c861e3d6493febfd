"""The three architectures (Vaswani et al. 2017, figure 1, and its two halves).

    EncoderOnlyModel     BERT, RoBERTa: bidirectional stack, MLM or classification head;
                         with a frontend (nn/frontends/), other inputs: ViT reads images
    DecoderOnlyModel     GPT, Llama, Mistral, ...: causal stack, LM head (tied or not)
    EncoderDecoderModel  2017, T5, BART: encoder, causal decoder with cross-attention, LM head;
                         with a frontend, the encoder reads other inputs: Whisper reads log-mel

Models hold parameters only; decoding state is a cache the caller gets from `new_cache` and
passes back in (src/attnlab/cache/). Inputs are checked here, at the edge
(src/attnlab/nn/inputs.py), so that a wrong dtype, an out-of-range id or a misshapen mask fails
with a message instead of an index error deep inside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..cache import CacheGeometry, ForwardCache, KVCache, new_cache
from . import matvec
from .frontends import Frontend
from .heads import ClassificationHead, MLMHead
from .inputs import check_ids, check_mask
from .stack import Stack, default_positions


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # (B, T, vocab) or (B, num_labels); None without a head
    hidden: torch.Tensor  # (B, T, d_model) after the final norm
    aux_loss: torch.Tensor | None = None  # mixture-of-experts load-balancing loss
    cache: KVCache | None = None
    encoder_hidden: torch.Tensor | None = None  # encoder-decoder only


class _LM(nn.Module):
    """Shared pieces: the token embedding (scaled) and the output projection (tied or not)."""

    vocab_size: int

    def _setup_io(
        self,
        vocab_size: int,
        d_model: int,
        embed_scale: float,
        tied: bool,
        logit_scale: float,
        round_embed_scale: bool = False,
        logit_multiplier: float = 1.0,
        final_logit_softcap: float | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        # vocab_size 0: no token table (an encoder whose frontend embeds its inputs)
        self.embed_tokens = nn.Embedding(vocab_size, d_model) if vocab_size else None
        self.embed_scale, self.logit_scale = embed_scale, logit_scale
        self.round_embed_scale = round_embed_scale
        self.lm_head = None if tied else nn.Linear(d_model, vocab_size, bias=False)
        if final_logit_softcap is not None and final_logit_softcap <= 0:
            raise ValueError(
                f"final_logit_softcap ({final_logit_softcap}) must be > 0 (logits become "
                f"cap·tanh(logits / cap)): pass a positive cap, or None for no capping"
            )
        self.logit_multiplier, self.final_logit_softcap = logit_multiplier, final_logit_softcap

    def _finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What follows the output projection: the multiplier (Granite divides by its
        logits_scaling, Cohere multiplies by logit_scale), then Gemma 2's soft cap
        cap·tanh(logits / cap) (arXiv:2408.00118, section 2), which bounds every logit by
        ±cap. Both are off by default, and then no operation runs."""
        if self.logit_multiplier != 1.0:
            logits = logits * self.logit_multiplier
        cap = self.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _embed(self, ids: torch.Tensor, table: nn.Embedding | None = None) -> torch.Tensor:
        x = (table or self.embed_tokens)(ids)
        if self.embed_scale == 1.0:
            return x
        if self.round_embed_scale:  # Gemma: the factor itself in x's dtype (bf16 45.25 at d 2048)
            return x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        return x * self.embed_scale  # a Python float: multiplied in the kernel's compute precision


class _Decoding(_LM):
    """Models with a causal decoder, which hand out decoding caches.

    Inference API (what decoding loops and the engine call; `forward` is their composition):

        embed(ids)                        (B, T) -> (B, T, d_model) decoder input embeddings
        run(x, positions, valid, cache)   the decoder stack on a cache -> (B, T, d_model)
        logits(hidden)                    the output head at the positions the caller picked
        cache_geometry()                  the sizes and kind a cache is built from
        max_positions                     the decoder's position limit (None: unbounded)
    """

    decoder: Stack
    _cross_attention = False  # encoder-decoder caches also hold the encoder's K/V

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, d_model): the decoder's scaled token embeddings. Ids are
        not checked here (forward checks them)."""
        return self._embed(ids)

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor | None = None,
        cache: ForwardCache | None = None,
        *,
        aligned: bool = False,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder stack on embeddings x (B, T, d_model) at explicit positions (B, T).

        valid (B, T) bool, True = a real token (None: all real); cache: where the new K/V go and
        what the tokens attend to besides themselves (None: x alone). aligned: no cache and
        positions 0..T-1 in every row, which lets kernels take their causal fast path.
        Encoder-decoder: memory (B, S, d_model) the encoder states, memory_mask (B, S) their
        padding. Returns the final hidden states (B, T, d_model), after the final norm, and the
        MoE load-balancing loss (or None)."""
        return self.decoder(x, positions, valid, aligned, cache, memory, memory_mask)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head: hidden states (..., d_model) -> logits (..., vocab). Index the
        positions you need first: on every position of a long prefill the head costs a large
        share of a small model's work, and decoding needs one per row. The logit multiplier and
        soft cap apply here, so every caller (forward, the decoding loops, the engine) gets
        them."""
        return self._finish_logits(self._project(hidden, self.embed_tokens))

    def _project(self, hidden: torch.Tensor, table: nn.Embedding) -> torch.Tensor:
        """The output projection alone: lm_head, or the tied `table` (after T5's scaling)."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        h = hidden * self.logit_scale if self.logit_scale != 1.0 else hidden
        return matvec.linear(h, table.weight)  # a decode step's rows: the matvec kernel

    def cache_geometry(self) -> CacheGeometry:
        """What a cache for this decoder is built from: layers, KV heads and head dim of its
        self-attention, its sliding window, the cache kind the attention declares (softmax:
        "static", linear: "recurrent", Transformer-XL: "memory") with that kind's options,
        and the embeddings' dtype and device. `new_cache` uses it; so does a caller sizing a
        cache of its own (the engine's ragged cache, a benchmark)."""
        attn = self.decoder.blocks[0].self_attn
        emb = self.embed_tokens
        if isinstance(emb, nn.Embedding):
            dtype, device = emb.weight.dtype, emb.weight.device
        else:  # a PackedEmbedding (src/attnlab/nn/quant_blocks.py): blocks, a float dtype
            dtype, device = emb.float_dtype, next(emb.buffers()).device
        return CacheGeometry(
            n_layers=len(self.decoder.blocks),
            n_kv_heads=attn.n_kv_heads,
            head_dim=attn.head_dim,
            kind=attn.cache_kind,
            options=dict(attn.cache_options),
            window=self.decoder.window,
            dtype=dtype,
            device=device,
            cross_attention=self._cross_attention,
        )

    @property
    def max_positions(self) -> int | None:
        """The positions the decoder's scheme can embed (a learned table's size); None when
        any position works (RoPE, ALiBi, ...)."""
        return self.decoder.positional.max_positions

    @property
    def reprefill_after(self) -> int | None:
        """A length past which a cache filled before is stale: decoding loops rerun the whole
        sequence once it grows past it (LongRoPE, as transformers' Phi-3 generate does); None for
        every other scheme (nn/positional/base.py)."""
        return self.decoder.positional.reprefill_after

    def new_cache(
        self,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype | None = None,
        device=None,
        kind: str | None = None,
        **options,
    ) -> KVCache:
        """A decoding cache of `kind` ("static", "fixed", "sliding", "paged", "recurrent", "memory";
        src/attnlab/cache/) with room for `max_len` tokens per row; `options` go to the
        kind (e.g. block_size, mem_len). None: the attention layer's `cache_kind` ("static" for
        softmax attention, "recurrent" for linear attention, "memory" for Transformer-XL, with
        its attention.mem_len and segment_len unless `options` say otherwise)."""
        g = self.cache_geometry()
        # None: the kind the attention layer declares, with the options it declares for it
        # (Transformer-XL: mem_len, segment_len) under the caller's
        if kind in (None, g.kind):
            options = {**g.options, **options}
        return new_cache(g.shape(batch_size, max_len, dtype, device), kind or g.kind, **options)


class DecoderOnlyModel(_Decoding):
    def __init__(
        self,
        *,
        decoder: Stack,
        vocab_size: int,
        d_model: int,
        tie_embeddings: bool = True,
        embed_scale: float = 1.0,
        logit_scale: float = 1.0,
        round_embed_scale: bool = False,
        logit_multiplier: float = 1.0,
        final_logit_softcap: float | None = None,
    ) -> None:
        """Args:
        decoder: the causal stack.
        vocab_size, d_model: the token embedding's size.
        tie_embeddings: the output projection is the token embedding matrix (else an lm_head).
        embed_scale: multiplies the token embeddings (sqrt(d_model) in the 2017 paper, Granite's
            embedding_multiplier).
        logit_scale: multiplies the last hidden state before tied logits (T5: d_model^-0.5).
        round_embed_scale: round embed_scale to the embeddings' dtype first (Gemma).
        logit_multiplier: multiplies the logits, tied or not (Granite: 1 / logits_scaling;
            Cohere: logit_scale).
        final_logit_softcap: logits become cap·tanh(logits / cap) (Gemma 2); None: uncapped.
        """
        super().__init__()
        self._setup_io(
            vocab_size,
            d_model,
            embed_scale,
            tie_embeddings,
            logit_scale,
            round_embed_scale,
            logit_multiplier,
            final_logit_softcap,
        )
        self.decoder = decoder

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> ModelOutput:
        check_ids(input_ids, self.vocab_size)
        mask = check_mask(attention_mask, input_ids)
        aligned = positions is None and cache is None
        if positions is None:
            start = cache.next_position if cache is not None else None
            positions = default_positions(mask, input_ids.shape, start, input_ids.device)
        hidden, aux = self.run(self.embed(input_ids), positions, mask, cache, aligned=aligned)
        return ModelOutput(self.logits(hidden), hidden, aux, cache)


class EncoderOnlyModel(_LM):
    def __init__(
        self,
        *,
        encoder: Stack,
        vocab_size: int,
        d_model: int,
        type_vocab_size: int = 0,
        embed_scale: float = 1.0,
        mlm_head: MLMHead | None = None,
        classifier: ClassificationHead | None = None,
        round_embed_scale: bool = False,
        frontend: Frontend | None = None,
    ) -> None:
        """Args:
        encoder: the bidirectional stack.
        vocab_size, d_model: the token embedding's size (vocab_size 0: none, with a frontend).
        type_vocab_size: token-type (segment) embeddings, 0 for none (BERT: 2).
        embed_scale: multiplies the token embeddings.
        mlm_head, classifier: at most one output head (heads.py); with neither, logits is None.
        round_embed_scale: as in DecoderOnlyModel.
        frontend: turns `pixel_values` into the sequence instead of token ids, adding its own
            positions (src/attnlab/nn/frontends/); excludes token and token-type embeddings.
        """
        super().__init__()
        if mlm_head is not None and classifier is not None:
            raise ValueError("an encoder has one head: pass mlm_head or classifier, not both")
        if frontend is not None and (vocab_size or type_vocab_size or mlm_head is not None):
            raise ValueError(
                "a frontend replaces the token embeddings: pass vocab_size 0, type_vocab_size 0 "
                "and no mlm_head (its decoder is the token table)"
            )
        self.frontend = frontend
        self._setup_io(vocab_size, d_model, embed_scale, True, 1.0, round_embed_scale)
        self.token_type_embeddings = (
            nn.Embedding(type_vocab_size, d_model) if type_vocab_size else None
        )
        self.encoder = encoder
        self.mlm_head, self.classifier = mlm_head, classifier

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        **frontend_options,
    ) -> ModelOutput:
        """input_ids (B, T); attention_mask (B, T), 1 = real token; global_attention_mask
        (B, T), 1 = a global token (Longformer, transformers' argument of the same name): it
        sees every token and every token sees it, beyond the window.

        A model with a frontend reads `pixel_values` (B, C, H, W) instead of input_ids; T is then
        the number of tokens the frontend makes (ViT: patches + 1), and `frontend_options` go to
        it (ViT: interpolate_pos_encoding=True for images of another size)."""
        if self.frontend is not None:
            x = self._frontend(input_ids, pixel_values, frontend_options)  # (B, T, d_model)
            tokens = x[..., 0]  # (B, T): what the masks below are checked against
        else:
            self._no_frontend(pixel_values, frontend_options)
            check_ids(input_ids, self.vocab_size)
            x, tokens = self._embed(input_ids), input_ids
        mask = check_mask(attention_mask, tokens)
        global_tokens = None
        if global_attention_mask is not None:
            global_tokens = check_mask(global_attention_mask, tokens, "global_attention_mask")
        if self.token_type_embeddings is not None:
            n_types = self.token_type_embeddings.num_embeddings
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            check_ids(
                token_type_ids,
                n_types,
                "token_type_ids",
                "type_vocab_size",
                "segment ids must be smaller than the number of token types",
            )
            if token_type_ids.shape != input_ids.shape:
                raise ValueError(
                    f"token_type_ids must have the shape of input_ids {tuple(input_ids.shape)}, "
                    f"got {tuple(token_type_ids.shape)}"
                )
            x = x + self.token_type_embeddings(token_type_ids)
        elif token_type_ids is not None:
            raise ValueError(
                "token_type_ids given but the model has no token-type embeddings (type_vocab_size 0): "
                "drop token_type_ids, or build the model with type_vocab_size > 0"
            )
        aligned = positions is None
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=x.device).expand(tokens.shape[:2])
        hidden, aux = self.encoder(x, positions, mask, aligned, global_tokens=global_tokens)
        logits = None
        if self.mlm_head is not None:
            logits = self.mlm_head(hidden, self.embed_tokens.weight)
        elif self.classifier is not None:
            logits = self.classifier(hidden)
        return ModelOutput(logits, hidden, aux)

    def _frontend(
        self, input_ids: torch.Tensor | None, pixel_values: torch.Tensor | None, options: dict
    ) -> torch.Tensor:
        name = type(self.frontend).input_name
        if input_ids is not None:
            raise ValueError(
                f"this model embeds {name} through its frontend ({type(self.frontend).__name__}) "
                f"and has no token table: call model({name}=...) instead of passing input_ids"
            )
        if pixel_values is None:
            raise ValueError(f"this model reads {name}: call model({name}=...)")
        return self.frontend(pixel_values, **options)

    def _no_frontend(self, pixel_values: torch.Tensor | None, options: dict) -> None:
        if pixel_values is not None:
            raise ValueError(
                "pixel_values given, but this model has no frontend and reads input_ids: build "
                "it with a frontend (ModelConfig.frontend, e.g. the vit-base-patch16-224 preset)"
            )
        if options:
            raise TypeError(
                f"unexpected arguments {sorted(options)}: options such as "
                f"interpolate_pos_encoding are for a model with a frontend"
            )


class EncoderDecoderModel(_Decoding):
    _cross_attention = True

    def __init__(
        self,
        *,
        encoder: Stack,
        decoder: Stack,
        vocab_size: int,
        d_model: int,
        tie_embeddings: bool = True,
        share_embeddings: bool = True,
        embed_scale: float = 1.0,
        logit_scale: float = 1.0,
        round_embed_scale: bool = False,
        frontend: Frontend | None = None,
        logit_multiplier: float = 1.0,
        final_logit_softcap: float | None = None,
    ) -> None:
        """Args:
        encoder, decoder: the two stacks (the decoder causal, with cross-attention).
        vocab_size, d_model: the token embedding's size.
        tie_embeddings: the output projection is the (target-side) embedding matrix.
        share_embeddings: one embedding table for source and target (else a second one).
        embed_scale, logit_scale, round_embed_scale, logit_multiplier, final_logit_softcap: as
            in DecoderOnlyModel.
        frontend: the encoder reads `input_features` through it instead of token ids, and it
            adds the encoder's positions (Whisper, src/attnlab/nn/frontends/audio.py); the
            token table is then the decoder's alone (share_embeddings True).
        """
        super().__init__()
        if frontend is not None and not share_embeddings:
            raise ValueError("with a frontend the encoder has no token table: share_embeddings")
        self._setup_io(
            vocab_size,
            d_model,
            embed_scale,
            tie_embeddings,
            logit_scale,
            round_embed_scale,
            logit_multiplier,
            final_logit_softcap,
        )
        self.decoder_embed_tokens = None if share_embeddings else nn.Embedding(vocab_size, d_model)
        self.encoder, self.decoder = encoder, decoder
        self.frontend = frontend

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) target ids -> (B, T, d_model), from the target-side table when it has one."""
        return self._embed(ids, self.decoder_embed_tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head (..., d_model) -> (..., vocab), tied to the target-side table when
        it has one."""
        own = self.decoder_embed_tokens
        table = own if own is not None else self.embed_tokens
        return self._finish_logits(self._project(hidden, table))

    def _encode(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        input_features: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.frontend is not None:
            x = self.frontend(self._features(input_ids, input_features, attention_mask))
            positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[:2])  # (B, T)
            return self.encoder(x, positions, None, aligned=True)
        if input_features is not None:
            raise ValueError(
                "input_features given, but this model has no frontend and reads input_ids: "
                "build it with one (ModelConfig.frontend, e.g. the whisper-tiny preset)"
            )
        check_ids(input_ids, self.vocab_size)
        mask = check_mask(attention_mask, input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return self.encoder(self._embed(input_ids), positions, mask, aligned=True)

    def _features(
        self, input_ids: torch.Tensor | None, features: torch.Tensor | None, mask
    ) -> torch.Tensor:
        """The frontend's input: `input_features`, or floats passed where ids go (positionally,
        as attnlab.generate(model, input_features) does)."""
        name, kind = type(self.frontend).input_name, type(self.frontend).__name__
        if features is None and input_ids is not None and input_ids.is_floating_point():
            features, input_ids = input_ids, None
        if input_ids is not None:
            raise ValueError(
                f"this model's encoder reads {name} through its frontend ({kind}), not token "
                f"ids: call model({name}=..., decoder_input_ids=...)"
            )
        if features is None:
            raise ValueError(f"this model's encoder reads {name}: call model({name}=...)")
        if mask is not None:
            raise ValueError(
                f"attention_mask given, but the encoder behind {kind} attends to every frame "
                f"(Whisper pads audio with silence, not with a mask): pass attention_mask=None"
            )
        return features

    def encode(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        input_features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, S) source ids -> (B, S, d_model) encoder states; with a frontend, its input
        (Whisper: input_features (B, n_mels, frames)) -> (B, T, d_model)."""
        return self._encode(input_ids, attention_mask, input_features)[0]

    def decode(
        self,
        decoder_input_ids: torch.Tensor,
        memory: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> ModelOutput:
        """Decoder over target ids given encoder states `memory` and the source mask."""
        check_ids(decoder_input_ids, self.vocab_size, "decoder_input_ids")
        d_model = self.embed_tokens.embedding_dim
        if (
            memory.dim() != 3
            or memory.shape[-1] != d_model
            or memory.shape[0] != decoder_input_ids.shape[0]
        ):
            raise ValueError(
                f"memory must be the encoder output (batch {decoder_input_ids.shape[0]}, src_len, "
                f"d_model {d_model}), got shape {tuple(memory.shape)}: pass model.encode(input_ids)"
            )
        mask = check_mask(decoder_attention_mask, decoder_input_ids, "decoder_attention_mask")
        aligned = positions is None and cache is None
        if positions is None:
            start = cache.next_position if cache is not None else None
            positions = default_positions(
                mask, decoder_input_ids.shape, start, decoder_input_ids.device
            )
        src_mask = check_mask(attention_mask, memory[..., 0], "attention_mask (source)")
        x = self.embed(decoder_input_ids)
        hidden, aux = self.run(
            x, positions, mask, cache, aligned=aligned, memory=memory, memory_mask=src_mask
        )
        return ModelOutput(self.logits(hidden), hidden, aux, cache, encoder_hidden=memory)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        input_features: torch.Tensor | None = None,
    ) -> ModelOutput:
        """input_ids (B, S) source; decoder_input_ids (B, T) target, shifted right. A model with
        a frontend reads `input_features` instead of input_ids (Whisper: (B, n_mels, frames))."""
        if decoder_input_ids is None:
            raise ValueError(
                "EncoderDecoderModel needs decoder_input_ids: for training pass the targets shifted "
                "right (attnlab.shift_right(labels, decoder_start_id)); to generate use attnlab.generate"
            )
        memory, enc_aux = self._encode(input_ids, attention_mask, input_features)
        out = self.decode(
            decoder_input_ids, memory, attention_mask, decoder_attention_mask, cache=cache
        )
        if enc_aux is not None:
            out.aux_loss = enc_aux if out.aux_loss is None else out.aux_loss + enc_aux
        return out
