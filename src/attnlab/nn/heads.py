"""Output heads of encoder-only models (Devlin et al. 2019, BERT, section 3.1 and appendix A).

MLMHead: transform (dense, activation, norm), then the tied token embedding as decoder plus a
per-token bias. ClassificationHead: the first token's state through dense + tanh (BERT's pooler,
RoBERTa's classification head), dropout, then a linear map to the labels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .activations import ACTIVATIONS


class MLMHead(nn.Module):
    def __init__(self, *, d_model: int, vocab_size: int, activation: str, norm: nn.Module) -> None:
        """activation: a name in src/attnlab/nn/activations.py; norm: the transform's norm."""
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.act = ACTIVATIONS.get(activation)
        self.norm = norm
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, h: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(self.act(self.dense(h))), embedding, self.bias)


class ClassificationHead(nn.Module):
    def __init__(self, *, d_model: int, num_labels: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(d_model, num_labels)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.dropout(torch.tanh(self.dense(h[:, 0]))))  # (B, num_labels)
