"""Training losses.

Label smoothing (Szegedy et al. 2016, arXiv:1512.00567, section 7; used by Vaswani et al. 2017,
section 5.4, with epsilon 0.1): the target distribution is q = (1 - eps) · onehot(y) + eps / V,
and the loss is the cross-entropy -sum_v q_v log p_v. That is exactly torch's
`F.cross_entropy(label_smoothing=eps)`, which we use (fairseq spreads eps over the V - 1 wrong
classes instead: the same loss with a slightly different eps). Positions labelled -100 are
ignored. The loss is returned as a *sum* with its token count, so that gradient accumulation and
data-parallel workers can divide by the token count of the whole update (fairseq's
normalisation), not by each micro-batch's.

The mixture-of-experts load-balancing loss arrives already scaled by `aux_loss_coef` in
`ModelOutput.aux_loss` (src/attnlab/nn/ffn/moe.py); `with_aux` adds it, weighted by the tokens
of the batch so that it survives the later division.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def smoothed_cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (..., V), labels (...) with -100 = ignore -> (summed loss in fp32, counted labels
    as a tensor on the device: reading it would wait for the device)."""
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"label smoothing must be in [0, 1), got {smoothing}")
    flat = logits.reshape(-1, logits.shape[-1]).float()  # softmax in fp32 even under autocast
    target = labels.reshape(-1)
    loss = F.cross_entropy(
        flat, target, ignore_index=IGNORE_INDEX, label_smoothing=smoothing, reduction="sum"
    )
    return loss, (target != IGNORE_INDEX).sum()


def with_aux(
    loss_sum: torch.Tensor, n: torch.Tensor | int, aux: torch.Tensor | None
) -> torch.Tensor:
    """Add the MoE auxiliary loss (a per-token mean) to a summed loss over n tokens."""
    return loss_sum if aux is None else loss_sum + aux.float() * n
