"""`attnlab inspect MODEL --kernels`: which attention kernel each layer gets, and why.

The selector (src/attnlab/nn/attention/kernels/select.py) chooses per call from what the call
needs (mask, bias, softcap, sinks, dropout, weights, layout) and where it runs (device, dtype,
gradients), never from the sizes. So the model is built at test size (`presets.tiny`: the same
components) on the device asked for, one batch of two rows runs through it — the second padded
when `--padded` — with gradients when `--train`, and each layer's choices are recorded
(`record_choices`). Layers with the same story are listed together. For a decoder-only model
(in inference) the report ends with the decode step each caller gets (src/attnlab/decode/picker.py):
a `generate` loop of one row on its default cache, and the serving engine's decode batches.
"""

from __future__ import annotations

from collections import defaultdict

from ..config import ModelConfig


def kernel_report(
    cfg: ModelConfig, tokens: int, device: str, train: bool, padded: bool, dtype: str
) -> list[str]:
    import torch

    from .. import presets
    from ..build import build_model
    from ..nn.attention import record_choices

    small = presets.tiny(cfg)
    model = build_model(small).to(device=device, dtype=getattr(torch, dtype)).train(train)
    layers = record_choices(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, small.vocab_size, (2, tokens), generator=g).to(device)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, : tokens // 4] = 0
    kwargs: dict = {"attention_mask": mask}
    if small.arch == "encoder-decoder":
        kwargs["decoder_input_ids"] = ids
    if small.frontend is not None:
        raise ValueError(
            f"--kernels feeds token ids; {cfg.frontend.kind} models take other inputs: "
            "inspect their text decoder's preset instead"
        )
    with torch.set_grad_enabled(train):
        model(ids, **kwargs)
    record_choices(model, on=False)
    stories: dict[str, list[str]] = defaultdict(list)
    for name, choices in layers:
        for story in dict.fromkeys(c.explain() for c in choices):  # in order, once each
            stories[story].append(name)
    head = (
        f"kernels on {device} ({dtype}, {'training' if train else 'inference'}, "
        f"{'padded' if padded else 'unpadded'} batch of 2 x {tokens} tokens, test size)"
    )
    lines = [head] + [f"  {_names(names)}: {story}" for story, names in stories.items()]
    return lines + ([] if train else _decode_steps(model, tokens))


def _decode_steps(model, tokens: int) -> list[str]:
    """The decode step picker.py gives a one-row `generate` loop (its default cache) and the
    engine's decode batches (its paged pool), with why the providers before it did not serve."""
    from ..cache.ragged import RaggedPagedCache
    from ..decode.picker import pick
    from ..decode.steps import default_kind
    from ..nn.model import DecoderOnlyModel

    if not isinstance(model, DecoderOnlyModel):
        return []
    geometry = model.cache_geometry()
    kind = default_kind(model, geometry.device or "cpu")
    loop = model.new_cache(1, tokens + 1, kind=kind)
    out = ["decode steps (decode/picker.py)", f"  generate, one row: {pick(model, loop).explain()}"]
    if geometry.kind == "static":  # the engine serves softmax attention with a KV cache
        pool = RaggedPagedCache(geometry.shape(0, 0), block_size=16, num_blocks=8)
        out.append(f"  engine decode batches: {pick(model, pool).explain()}")
    return out


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more like it"
