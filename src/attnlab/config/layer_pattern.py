"""Per-layer variation, `ModelConfig.layer_pattern`: the window and positional scheme of the
layers at one place of the pattern.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from .base import Frozen, _union_kinds
from .positional import Positional


class LayerSpec(Frozen):
    """How the layers at one place of `ModelConfig.layer_pattern` attend: their window and,
    optionally, a positional scheme of their own (src/attnlab/nn/stack.py, `LayerVariant`).

    sliding_window: as `AttentionConfig.sliding_window` (causal: the window-1 tokens before;
    bidirectional: |q - k| < window); None is full attention. positional: replaces the model's
    rotation or score bias in these layers (a RoPE base of their own: ModernBERT's and Gemma 3's
    local layers; "none": NoPE layers), None keeps the model's. Embedding-side schemes act once,
    before any layer, so a layer cannot have one of its own.
    """

    sliding_window: int | None = Field(None, gt=0)
    positional: Positional | None = None

    @model_validator(mode="after")
    def _inside_attention(self) -> LayerSpec:
        pos = self.positional
        if pos is not None and not pos.per_layer:  # only a scheme acting inside attention
            ok = [c.model_fields["kind"].default for c in _union_kinds(Positional) if c.per_layer]
            raise ValueError(
                f"positional ({pos.kind!r}) adds to the embeddings once, before any layer, so "
                f"one layer cannot have its own: use one of {', '.join(ok)} "
                f"here, or set it as ModelConfig.positional"
            )
        return self
