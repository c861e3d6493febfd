"""Parity against transformers: random weights far from their init, and the largest
differences of the hidden states and logits over the real tokens (the converter tests of
tests/interop/)."""

from __future__ import annotations

import torch


def randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter random and far from its init (norm weights 1 + noise, biases noise)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                p.add_(noise * 0.1)
            else:
                p.copy_(noise * 0.15)
    return model.eval()


def max_diffs(hf, ours, ids, mask) -> tuple[float, float]:
    """Max |difference| of the last hidden state and of the logits over the real tokens."""
    real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    theirs_h = hf.base_model(ids, attention_mask=mask).last_hidden_state
    theirs = hf(ids, attention_mask=mask).logits
    out = ours(ids, attention_mask=mask)
    assert theirs.abs().amax() > 1.0  # outputs far from zero: an absolute tolerance means something
    hidden = (out.hidden - theirs_h)[real].abs().max().item()
    return hidden, (out.logits - theirs)[real].abs().max().item()


def state_dicts_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
