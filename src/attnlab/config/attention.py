"""The attention kinds, `ModelConfig.attention`: softmax (MHA/GQA/MQA, windows), linear,
Longformer, BigBird's block-sparse, DeepSeek's latent (MLA) and Transformer-XL's, each with its
rules on the model it sits in, its test size and its words for the preset tables.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

from pydantic import Field, model_validator

from .base import ConfigError, Kind, TinySize

if TYPE_CHECKING:
    from .model import ModelConfig


class AttentionBase(Kind):
    """Base of the attention kinds; what a kind is, for the rules of other kinds to ask."""

    per_layer: ClassVar[bool] = False  # layer_pattern may vary its window and positions per layer
    # computes Transformer-XL's relative term with its own W_R, from 'xl-relative' positions
    takes_xl_terms: ClassVar[bool] = False

    def rope_head_dim(self, head_dim: int) -> int:
        """Channels of each head that RoPE acts on, given the model's head_dim: all of them."""
        return head_dim

    # --- in words: presets.describe and presets.components_table (docs/components.md) ---

    def label(self, heads: str) -> str:
        """describe()'s name for it, given the head layout ("MHA", "GQA(8)"): "linear MHA"."""
        return f"{self.kind} {heads}"

    def summary(self, heads: str, n_heads: int) -> str:
        """The components table's cell, given the head layout ("GQA 32/8") and the head count."""
        return f"{heads}{', qk-norm' if self.qk_norm else ''}{self._table_note()}"

    def _table_note(self) -> str:
        w = self.sliding_window
        return f", window {w}" if w else ""


class AttentionConfig(AttentionBase):
    """Multi-head softmax attention (Vaswani et al. 2017, 3.2); MQA/GQA come from
    ModelConfig.n_kv_heads. The default `attention`; a dict without `kind` means this one.

    scale None means 1/sqrt(head_dim); T5 folds it into its init and uses 1.0.
    sliding_window: each query sees itself and the window-1 tokens before it (Mistral); for a
    bidirectional stack, tokens within window-1 on either side (Longformer's local attention).
    softcap: logit soft-capping, c · tanh(s / c) on the scaled scores before any bias or mask
    (Gemma 2, arXiv:2408.00118, section 2.2: c = 50); None: none. Torch's fused sdpa cannot apply
    it, so such layers run the chunked kernel (src/attnlab/nn/attention/kernels/base.py).
    sinks: a learned logit per head in every softmax denominator, with no value (GPT-OSS,
    arXiv:2508.10925; the parameter `sinks`, (n_heads,), of src/attnlab/nn/attention/layer.py).
    """

    kind: Literal["softmax"] = "softmax"
    per_layer: ClassVar[bool] = True
    qkv_bias: bool = False
    # with qkv_bias, False drops the key projection's bias only (Whisper): it adds q·b_k, the
    # same for every key of a query, which softmax cancels, so it is a parameter that does nothing
    k_bias: bool = True
    o_bias: bool = False
    qk_norm: bool = False
    # "head": the qk-norm acts on each head over head_dim (Qwen3, Gemma 3); "projection": on the
    # whole q / k projection, over n_heads·head_dim and n_kv_heads·head_dim (OLMo 2)
    qk_norm_scope: Literal["head", "projection"] = "head"
    scale: float | None = Field(None, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    sliding_window: int | None = Field(None, gt=0)
    softcap: float | None = Field(None, gt=0)
    sinks: bool = False

    @model_validator(mode="after")
    def _k_bias_needs_qkv_bias(self) -> AttentionConfig:
        if not self.k_bias and not self.qkv_bias:
            raise ValueError(
                "k_bias (False) drops the key bias of qkv_bias, which is False: there is no "
                "bias to drop; remove k_bias"
            )
        if self.qk_norm_scope != "head" and not self.qk_norm:
            raise ValueError(
                f"qk_norm_scope ({self.qk_norm_scope!r}) says what the qk-norm normalises, and "
                f"qk_norm is False: set qk_norm True or remove qk_norm_scope"
            )
        return self

    def label(self, heads: str) -> str:
        return heads  # the default attention goes by its heads alone

    def _table_note(self) -> str:
        note = super()._table_note()
        if self.softcap is not None:
            note += f", softcap {self.softcap:g}"
        return note + (", sinks" if self.sinks else "")

    def tiny(self, size: TinySize) -> AttentionConfig:
        """A window of at most 8 tokens, so tests see it."""
        w = self.sliding_window
        return self if w is None else self.merged(sliding_window=min(w, 8))


FeatureMap = Literal["elu+1", "relu"]

# softmax-only fields, with why linear attention has no use for them
_NOT_LINEAR = {
    "scale": "the feature map replaces exp(q·k·scale); there is no score to scale",
    "dropout": "no attention weights are formed, so none can be dropped (ModelConfig.dropout "
    "still applies to the residual branches)",
    "sliding_window": "its running state summarises the whole prefix; it has no window",
}


class LinearAttentionConfig(AttentionBase):
    """Linear attention (Katharopoulos et al. 2020, arXiv:2006.16236, "Transformers are RNNs"):
    softmax(q·k) replaced by φ(q)·φ(k), so a causal decoder keeps a (D, D) running state instead
    of a growing KV cache. `feature_map` φ: "elu+1" (the paper's, 3.2.1) or "relu". Same
    projections as softmax attention (qkv_bias, o_bias, qk_norm); positions: RoPE rotates q and k
    before φ, sinusoidal / learned add to the embeddings; score biases (ALiBi, T5) are refused.
    """

    kind: Literal["linear"] = "linear"
    feature_map: FeatureMap = "elu+1"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    @model_validator(mode="before")
    @classmethod
    def _softmax_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            wrong = [
                f"{k} ({data[k]!r}) is for softmax attention only: {why}: remove it"
                for k, why in _NOT_LINEAR.items()
                if k in data
            ]
            if wrong:
                raise ConfigError(cls.__name__, wrong)
        return data

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        pos, p = model.positional, []
        if pos.biases_scores:
            p.append(
                f"positional ({pos.kind!r}) adds a bias to the attention scores, which "
                f"{where}.kind 'linear' never forms: use positional 'rope', 'sinusoidal', "
                f"'learned' or 'none', or {where}.kind 'softmax'"
            )
        return p

    @property
    def sliding_window(self) -> None:
        """Always None: the stack asks every attention config for its window."""
        return None


class LongformerAttentionConfig(AttentionBase):
    """Longformer attention (Beltagy et al. 2020, arXiv:2004.05150, section 3.1): a sliding
    window plus global tokens, chosen at run time (`global_attention_mask` of the encoder's
    forward). A global token sees every token and every token sees it; global rows use their own
    q/k/v projections (section 3.1, "Linear Projections for Global Attention").

    attention_window: transformers' even window width W, |q - k| <= W / 2; the mask's window is
    the derived `sliding_window` = W / 2 + 1 (MaskSpec counts |q - k| < window). One width for
    the whole stack: transformers allows one per layer, which is not modelled.
    """

    kind: Literal["longformer"] = "longformer"
    attention_window: int = Field(gt=0)
    qkv_bias: bool = True
    o_bias: bool = True
    qk_norm: bool = False
    scale: float | None = Field(None, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _even(self) -> LongformerAttentionConfig:
        if self.attention_window % 2:
            w = self.attention_window
            raise ValueError(
                f"attention_window ({w}) must be even: it spans W / 2 tokens on each side "
                f"(transformers' rule); use {w - 1} or {w + 1}"
            )
        return self

    @property
    def sliding_window(self) -> int:
        """The mask's window: |q - k| <= attention_window / 2 is |q - k| < W / 2 + 1."""
        return self.attention_window // 2 + 1

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        pos, p = model.positional, []
        if pos.biases_scores:
            p.append(
                f"positional ({pos.kind!r}) biases the scores of every row, and "
                f"{where}.kind 'longformer' computes its global rows apart, where no bias "
                f"is evaluated: use positional 'learned', 'sinusoidal', 'rope' or 'none'"
            )
        if model.arch != "encoder":
            p.append(
                f"{where}.kind 'longformer' needs arch 'encoder' (got {model.arch!r}): its "
                f"global tokens see the whole sequence, which a causal stack cannot; use "
                f"{where}.kind 'softmax' with sliding_window for a windowed decoder"
            )
        return p

    def _table_note(self) -> str:  # transformers' width W
        return f", longformer window {self.attention_window} + global tokens"

    def tiny(self, size: TinySize) -> LongformerAttentionConfig:
        """A width W of at most 12: a window W / 2 + 1 of at most 7."""
        return self.merged(attention_window=min(self.attention_window, 12))


class BlockSparseAttentionConfig(AttentionBase):
    """BigBird's block-sparse attention (Zaheer et al. 2020, arXiv:2007.14062, section 2, "ITC"),
    as transformers computes it: blocks of `block_size` tokens; each query block sees a 3-block
    window, the first and last blocks and `num_random_blocks` random blocks per head, and the
    first and last query blocks see everything (src/attnlab/nn/attention/block_sparse.py lists
    every way transformers differs from the paper). Sequences of at most
    (5 + 2·num_random_blocks)·block_size tokens use full attention, as transformers does.

    dropout: on the weights of that full-attention fallback only (transformers' block-sparse path
    has none). seed: added to each layer's index, which seeds transformers' training-mode plan.
    legacy_plan_len: transformers' max_position_embeddings, the length of the plan it draws from
    for sequences of 1024, 3072 and 4096 tokens in training mode.
    """

    kind: Literal["block-sparse"] = "block-sparse"
    block_size: int = Field(64, gt=0)
    num_random_blocks: int = Field(3, ge=0)
    seed: int = Field(0, ge=0)
    legacy_plan_len: int = Field(4096, gt=0)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    scale: float | None = Field(None, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)

    @property
    def sliding_window(self) -> None:
        """Always None: the window is the pattern's, not the stack's mask."""
        return None

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        p = []
        if model.arch != "encoder":
            p.append(
                f"{where}.kind 'block-sparse' needs arch 'encoder' (got {model.arch!r}): its "
                f"global and random blocks look both ways and it keeps no cache (transformers' "
                f"BigBird decoder falls back to full attention); use {where}.kind 'softmax'"
            )
        return p

    def _table_note(self) -> str:
        return f", block-sparse: blocks of {self.block_size}, {self.num_random_blocks} random"


class _NoWindowNoQKNorm:
    """For attention kinds without a window or qk-norm fields: the stack, tiny() and the preset
    tables ask every attention config for both. (MLA normalises its latents inside the layer,
    Transformer-XL no heads; the memory, not a window, bounds what an XL query sees.)"""

    @property
    def sliding_window(self) -> None:
        return None

    @property
    def qk_norm(self) -> bool:
        return False


class MLAConfig(_NoWindowNoQKNorm, AttentionBase):
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, section 2.1): keys and values
    are decompressed from one shared latent of `kv_lora_rank` channels per token, and a small
    decoupled key of `qk_rope_head_dim` channels, shared by all heads, carries RoPE. A decoder
    caches only those two (src/attnlab/cache/latent.py), not per-head K/V.

    Each head's query/key is [nope (qk_nope_head_dim); rope (qk_rope_head_dim)] and its value
    has v_head_dim channels; q_lora_rank None projects q directly (V2-Lite), else through its own
    low-rank latent (V2). bias: on the down projections and o_proj (attention_bias). scale None:
    1/sqrt(qk_nope_head_dim + qk_rope_head_dim). latent_norm_eps: the RMSNorms on the latents.
    ModelConfig.n_kv_heads and head_dim do not apply (src/attnlab/nn/attention/mla.py).
    """

    kind: Literal["mla"] = "mla"
    kv_lora_rank: int = Field(gt=0)
    q_lora_rank: int | None = Field(None, gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    bias: bool = False
    scale: float | None = Field(None, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    latent_norm_eps: float = Field(1e-6, gt=0)

    def rope_head_dim(self, head_dim: int) -> int:
        """Only the decoupled rope part of each head rotates."""
        return self.qk_rope_head_dim

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        """MLA sizes its heads itself and has no per-head K/V to share or cross-attend with."""
        p = []
        if model.n_kv_heads not in (None, model.n_heads):
            p.append(
                f"n_kv_heads ({model.n_kv_heads}) must be unset with {where}.kind 'mla': every "
                f"head decompresses its own K/V from the shared latent; remove n_kv_heads"
            )
        if model.head_dim is not None:
            p.append(
                f"head_dim ({model.head_dim}) does not apply to {where}.kind 'mla': set "
                f"{where}.qk_nope_head_dim, qk_rope_head_dim and v_head_dim; remove head_dim"
            )
        if model.arch == "encoder-decoder":
            p.append(
                f"{where}.kind 'mla' has no cross-attention form: use arch 'decoder' (DeepSeek) "
                f"or 'encoder'"
            )
        return p

    def label(self, heads: str) -> str:
        return "MLA"  # no K/V heads to count: one shared latent

    def summary(self, heads: str, n_heads: int) -> str:  # no per-head K/V cached
        return f"MLA {n_heads} heads, latent {self.kv_lora_rank}"

    def tiny(self, size: TinySize) -> MLAConfig:
        """Latents of 32, heads of the test head_dim (its rope part half of it)."""
        d = size.head_dim
        # an explicit scale keeps its YaRN factor: rescaled from the full qk width to 1.5·d
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.merged(
            scale=None if self.scale is None else self.scale * (qk / (d * 1.5)) ** 0.5,
            kv_lora_rank=32,
            q_lora_rank=None if self.q_lora_rank is None else 32,
            qk_nope_head_dim=d,
            qk_rope_head_dim=d // 2,
            v_head_dim=d,
        )


class XLAttentionConfig(_NoWindowNoQKNorm, AttentionBase):
    """Transformer-XL attention (Dai et al. 2019, arXiv:1901.02860, sections 3.2-3.3): softmax
    attention with the 'xl-relative' position term (this layer's W_R, no projection biases),
    over a memory of earlier segments: the `memory` cache kind keeps the K/V of the last
    `mem_len` positions, detached (src/attnlab/cache/memory.py), and a segment ends after
    `segment_len` tokens (the paper's tgt_len; None: after every forward call). Both are the
    defaults of `model.new_cache`, which a caller may override; no parameter depends on them.
    dropout: on the attention weights (the original code's dropatt)."""

    kind: Literal["xl"] = "xl"
    takes_xl_terms: ClassVar[bool] = True
    mem_len: int = Field(ge=0)
    segment_len: int | None = Field(None, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        p = []
        if not model.positional.supplies_xl_terms:
            p.append(
                f"{where}.kind 'xl' needs positional 'xl-relative' (got "
                f"{model.positional.kind!r}), which supplies R, u and v: set positional "
                f"{{'kind': 'xl-relative'}}"
            )
        if model.arch != "decoder":  # the scheme alone is refused above: this is the pair's rule
            p.append(
                f"Transformer-XL ({where}.kind 'xl') needs arch 'decoder' (got {model.arch!r}): "
                f"its memory holds earlier segments of one causal stream, and it has no "
                f"cross-attention form"
            )
        return p

    def _table_note(self) -> str:  # relative scores over a memory
        return f", XL relative, memory {self.mem_len}, segment {self.segment_len}"

    def tiny(self, size: TinySize) -> XLAttentionConfig:
        """Memory and segment of at most 16 positions."""
        seg = self.segment_len
        return self.merged(
            mem_len=min(self.mem_len, 16), segment_len=None if seg is None else min(seg, 16)
        )


AttentionKind = Annotated[
    Union[
        AttentionConfig,
        LinearAttentionConfig,
        LongformerAttentionConfig,
        BlockSparseAttentionConfig,
        MLAConfig,
        XLAttentionConfig,
    ],
    Field(discriminator="kind"),
]
