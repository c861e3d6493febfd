"""Mixed precision for training: the autocast context of a forward pass, and the loss scaler
fp16 needs (bf16 has fp32's exponent range and needs none). Weights and optimizer state stay
fp32 either way; the loss is computed in fp32 (src/attnlab/train/losses.py)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # auto: bf16 on a CUDA device that has it


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse an unknown precision, and fp16 off CUDA (GradScaler is CUDA's)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose auto, fp32, bf16 or fp16")
    if precision == "fp16" and device.type != "cuda":
        raise ValueError(
            f"precision 'fp16' needs a CUDA device (loss scaling), not {device.type}: "
            f"use bf16 or fp32"
        )


def grad_scaler(precision: str) -> torch.amp.GradScaler | None:
    """fp16: a dynamic loss scaler (overflowing steps are skipped); otherwise none."""
    return torch.amp.GradScaler("cuda") if precision == "fp16" else None


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """The autocast context for a precision ("fp32", "bf16", "fp16", "auto")."""
    if precision == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        precision = "bf16" if cuda_bf16 else "fp32"
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)
