"""Input checks at the model's edge, and teacher-forcing inputs.

A wrong dtype, an out-of-range id or a misshapen mask fails here with a message that names the
problem and the fix, instead of an index error deep inside an embedding or a matmul. The checks
that read tensor values (id ranges, a learned table's positions) are skipped while
torch.compile traces the model, so that they do not break its graph: compiled code trusts its
inputs (run it eagerly once to check them). They are also skipped inside `checked()`, which a
caller enters after checking the same values on the host before copying them to the device (the
trainer: src/attnlab/train/loop.py): on a GPU each such read waits for the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_CHECKED: ContextVar[bool] = ContextVar("attnlab_inputs_checked", default=False)


@contextmanager
def checked() -> Iterator[None]:
    """The inputs of the forward passes run inside were checked by the caller: no value reads."""
    token = _CHECKED.set(True)
    try:
        yield
    finally:
        _CHECKED.reset(token)


def reads_values(t: torch.Tensor) -> bool:
    """Whether a check may read `t`'s values: not on meta, not while compiling, not `checked`."""
    return (
        t.device.type != "meta"
        and t.numel() > 0
        and not torch.compiler.is_compiling()
        and not _CHECKED.get()
    )


def check_ids(
    ids: torch.Tensor,
    vocab_size: int,
    name: str = "input_ids",
    size_name: str = "vocab_size",
    hint: str = "check that the tokenizer matches the model",
) -> None:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise TypeError(
            f"{name} must hold integer token ids (torch.long), got {ids.dtype}: convert with .long()"
        )
    if ids.dim() != 2:
        raise ValueError(
            f"{name} must be 2-D (batch, seq_len), got shape {tuple(ids.shape)}: "
            f"add a batch dimension with ids[None] for one sequence"
        )
    if ids.shape[1] == 0:
        raise ValueError(f"{name} is empty (seq_len 0): pass at least one token")
    if reads_values(ids):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = hi if hi >= vocab_size else lo
            raise ValueError(
                f"{name} contains id {bad}, outside 0..{vocab_size - 1}: {hint} "
                f"({size_name} {vocab_size})"
            )


def check_mask(
    mask: torch.Tensor | None, ids: torch.Tensor, name: str = "attention_mask"
) -> torch.Tensor | None:
    if mask is None:
        return None
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(
            f"{name} must have the shape of its ids {tuple(ids.shape)} (1 = real token, 0 = padding), "
            f"got {tuple(mask.shape)}"
        )
    return mask.bool()


def shift_right(labels: torch.Tensor, start_id: int, pad_id: int | None = None) -> torch.Tensor:
    """Teacher-forcing decoder inputs: [start, y0, y1, ...] from labels [y0, y1, ...]; label
    positions set to -100 (ignored by the loss) become `pad_id`."""
    out = labels.new_full(labels.shape, start_id)
    out[:, 1:] = labels[:, :-1]
    if pad_id is not None:
        out = out.masked_fill(out == -100, pad_id)
    return out
