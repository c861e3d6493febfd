"""Collate token-id examples into right-padded tensors with padding masks (1 real, 0 padding).

Translation (teacher forcing, Vaswani et al. 2017 section 3; fairseq's layout)::

    input_ids          x1 x2 x3 </s> <pad>          source, eos appended (src_eos)
    decoder_input_ids  <s> y1 y2 <pad> <pad>        bos + target
    labels             y1 y2 </s> -100 -100         target + eos, -100 where padded

Classification: ``[bos] x1 .. xn [eos]`` — `attnlab.nn.heads.ClassificationHead` pools the first
token, so pass the bos (``[CLS]``-like) id.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index


def pad(seqs: Sequence[Sequence[int]], value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids right-padded with `value`, and the (B, T) mask: 1 real token, 0 padding."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), value, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[b, : len(s)] = 1
    return ids, mask


def translation_lengths(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    src_eos: bool = True,
    src_bos: bool = False,
) -> list[int]:
    """Per example, the longer of its collated source and target rows: fairseq's ``num_tokens``,
    the length `TokenBudgetBatcher` needs so that B * max(T_src, T_tgt) <= max_tokens."""
    return [max(len(s) + src_eos + src_bos, len(t) + 1) for s, t in examples]


def collate_translation(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    bos_id: int,
    eos_id: int,
    src_eos: bool = True,
    src_bos: bool = False,
) -> dict[str, torch.Tensor]:
    """(source ids, target ids) pairs -> input_ids, attention_mask, decoder_input_ids,
    decoder_attention_mask, labels (all (B, T) long tensors)."""
    src = [[bos_id] * src_bos + list(s) + [eos_id] * src_eos for s, _ in examples]
    input_ids, attention_mask = pad(src, pad_id)
    decoder_input_ids, decoder_attention_mask = pad([[bos_id, *t] for _, t in examples], pad_id)
    labels, _ = pad([[*t, eos_id] for _, t in examples], IGNORE_INDEX)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "decoder_input_ids": decoder_input_ids,
        "decoder_attention_mask": decoder_attention_mask,
        "labels": labels,
    }


def collate_classification(
    examples: Sequence[tuple[Sequence[int], int]],
    pad_id: int,
    bos_id: int | None = None,
    eos_id: int | None = None,
    max_len: int | None = None,
) -> dict[str, torch.Tensor]:
    """(token ids, label) pairs -> input_ids, attention_mask (B, T) and labels (B,).

    With `max_len`, the text is cut so that the row, bos and eos included, has at most max_len."""
    extra = (bos_id is not None) + (eos_id is not None)
    if max_len is not None and max_len <= extra:
        raise ValueError(f"max_len ({max_len}) leaves no room for text beside bos/eos")
    room = None if max_len is None else max_len - extra
    rows = [
        ([bos_id] if bos_id is not None else [])
        + list(ids)[:room]
        + ([eos_id] if eos_id is not None else [])
        for ids, _ in examples
    ]
    input_ids, attention_mask = pad(rows, pad_id)
    labels = torch.tensor([label for _, label in examples], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def classification_lengths(
    examples: Sequence[tuple[Sequence[int], int]],
    bos: bool = True,
    eos: bool = False,
    max_len: int | None = None,
) -> list[int]:
    """Collated row lengths, for `TokenBudgetBatcher`."""
    n = [len(ids) + bos + eos for ids, _ in examples]
    return n if max_len is None else [min(x, max_len) for x in n]
