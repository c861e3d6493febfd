"""One forward pass's inputs for any config (tests/test_sweep.py runs every preset and registry
entry on them, tests/decode/test_cuda_paths.py every preset in bf16)."""

from __future__ import annotations

import torch

import attnlab as al
from attnlab.config import ModelConfig


def inputs_for(cfg: ModelConfig, seed: int = 0) -> tuple[tuple, dict, torch.Tensor]:
    """(args, kwargs, labels) for one forward pass; encoders get a padded row and token types,
    a model with a frontend gets images (pixel_values) and one label per image, or log-mel
    features (input_features) and a target sequence (Whisper)."""
    g = torch.Generator().manual_seed(seed)
    if cfg.frontend is not None and cfg.frontend.kind == "audio":
        f = cfg.frontend
        x = torch.randn(2, f.num_mel_bins, 2 * f.max_source_positions, generator=g)
        tgt = torch.randint(0, cfg.vocab_size, (2, 7), generator=g)
        return (), {"input_features": x, "decoder_input_ids": al.shift_right(tgt, 0)}, tgt
    if cfg.frontend is not None:
        f = cfg.frontend
        px = torch.randn(2, f.num_channels, f.image_size, f.image_size, generator=g)
        if not cfg.num_labels:  # a backbone without head (SwinModel): labels are not read
            return (), {"pixel_values": px}, torch.zeros(2, dtype=torch.long)
        return (), {"pixel_values": px}, torch.randint(0, cfg.num_labels, (2,), generator=g)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    if cfg.arch == "decoder":
        return (ids,), {}, ids
    if cfg.arch == "encoder":
        mask = torch.ones_like(ids)
        mask[1, 9:] = 0
        kwargs: dict = {"attention_mask": mask}
        if cfg.type_vocab_size:
            kwargs["token_type_ids"] = torch.randint(0, cfg.type_vocab_size, (2, 12), generator=g)
        if cfg.attention.kind == "longformer":  # the first token global, so its projections learn
            kwargs["global_attention_mask"] = (torch.arange(12) == 0).long().expand(2, 12)
        labels = ids.masked_fill(mask == 0, -100)
        if cfg.num_labels:
            labels = torch.randint(0, cfg.num_labels, (2,), generator=g)
        return (ids,), kwargs, labels
    tgt = torch.randint(0, cfg.vocab_size, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 10:] = 0
    return (ids, al.shift_right(tgt, 0)), {"attention_mask": mask}, tgt
