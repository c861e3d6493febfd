"""Output heads of encoder-only models (Devlin et al. 2019, BERT, section 3.1 and appendix A).

MLMHead: transform (dense, activation, norm), then the tied token embedding as decoder plus a
per-token bias. ClassificationHead: the first token's state through dense + tanh (BERT's pooler,
RoBERTa's classification head), dropout, then a linear map to the labels. With `pooler` off it is
the linear map alone on the first token's final-normed state: ViT's classifier (Dosovitskiy et al.
2021, arXiv:2010.11929, section 3.1: "the classification head is implemented by ... a single
linear layer at fine-tuning time"; transformers' ViTForImageClassification, no dropout).

ViTModel's pooler (dense + tanh on the class token, `add_pooling_layer`) is not a head here: the
ViT classifier never reads it, so src/attnlab/interop/vit.py drops it on import and writes zeros
on export, as src/attnlab/interop/bert.py does for a bare BertModel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .activations import ACTIVATIONS


class MLMHead(nn.Module):
    def __init__(
        self,
        *,
        d_model: int,
        vocab_size: int,
        activation: str,
        norm: nn.Module,
        dense_bias: bool = True,
    ) -> None:
        """activation: a name in src/attnlab/nn/activations.py; norm: the transform's norm;
        dense_bias: the transform's dense layer has a bias (BERT; ModernBERT's has none)."""
        super().__init__()
        self.dense = nn.Linear(d_model, d_model, bias=dense_bias)
        self.act = ACTIVATIONS.get(activation)
        self.norm = norm
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, h: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(self.act(self.dense(h))), embedding, self.bias)


class ClassificationHead(nn.Module):
    def __init__(
        self, *, d_model: int, num_labels: int, dropout: float = 0.0, pooler: bool = True
    ) -> None:
        """pooler: dense + tanh, then dropout, before the linear map (BERT); without it the first
        token goes straight to the linear map and `dropout` is not used (ViT has none there)."""
        super().__init__()
        self.dense = nn.Linear(d_model, d_model) if pooler else None
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(d_model, num_labels)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        first = h[:, 0]  # (B, T, d_model) -> (B, d_model): [CLS] / the class token
        if self.dense is not None:
            first = self.dropout(torch.tanh(self.dense(first)))
        return self.out_proj(first)  # (B, num_labels)
