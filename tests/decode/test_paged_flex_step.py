"""The engine's compiled decode step reads the pool in place (src/attnlab/decode/batch_step.py,
the cache's graph view in src/attnlab/cache/ragged.py, paged-flex in
src/attnlab/nn/attention/kernels/paged_flex.py): compiled by inductor on the CPU, every layer of
every decode step attends through paged-flex, nothing gathers the pool, and each request gets
the tokens `generate` gives it alone — for a plain decoder, for Gemma 2's soft-capping and
alternating sliding window, and for GPT-OSS's sinks and window."""

from __future__ import annotations

import pytest
import torch

import attnlab as al
from attnlab.cache import ragged
from attnlab.decode.batch_step import BatchStep
from attnlab.decode.engine import Engine, Request
from attnlab.nn.attention.layer import record_choices


def _tiny(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return al.build_model(al.presets.tiny(al.presets.get(name))).eval()


def _alone(model, prompt: list[int], n: int) -> list[int]:
    out = al.generate(model, torch.tensor([prompt]), n, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", ["llama3.2-1b", "gemma2-2b", "gpt-oss-20b"])
def test_the_compiled_batch_step_attends_through_paged_flex_with_no_gather(name, monkeypatch):
    model = _tiny(name)
    window = model.decoder.window or max(
        (v.window or 0 for v in model.decoder.variants or ()), default=0
    )
    # blocks of 4 and prompts past the window: the window cuts keys inside the row's blocks
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=4)
    engine.runner.step = BatchStep(model, engine.cache)  # CUDA's default, inductor here
    gathers = []
    real = ragged.gather
    monkeypatch.setattr(ragged, "gather", lambda *a: gathers.append(1) or real(*a))
    g = torch.Generator().manual_seed(7)
    lengths = (3, 9, 14) if not window else (3, window + 2, window + 5)
    reqs = [Request(torch.randint(1, model.vocab_size, (n,), generator=g).tolist(), max_tokens=6)
            for n in lengths]  # fmt: skip
    layers = record_choices(model)
    got = engine.run(reqs)
    record_choices(model, on=False)
    assert engine.runner.step.fn is not None  # compiled, not fallen back to eager
    assert engine.runner.step.fn.compiles >= 1
    # every one-token attention call (the batch step's, traced) went through paged-flex: the
    # graph was traced with the pool in place; no layer asked for the gathered pair
    decode_calls = {c.name for _, cs in layers for c in cs if c.name.startswith("paged")}
    assert decode_calls == {"paged-flex"}, layers
    assert gathers == []
    assert got == [_alone(model, r.prompt, r.max_tokens) for r in reqs]
    if name != "llama3.2-1b":  # the functions paged-flex maps through the table are there
        attn = model.decoder.blocks[0].self_attn
        assert attn.softcap is not None or attn.sinks is not None
        assert window and max(lengths) > window
