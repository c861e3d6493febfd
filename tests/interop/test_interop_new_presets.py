"""The issue-19 presets whose families' test files convert hand-written configs only (Gemma 2 / 3,
OLMo 2, Granite, Command R) at test size go to transformers and back: `to_hf` builds the family's
transformers model with the same logits, and `from_hf` of that model has the same weights. (The
Llama 3, Phi, SmolLM3 and MoE presets: tests/interop/test_interop_llama3_phi3.py and
tests/interop/test_interop_moe_families.py.)"""

from __future__ import annotations

import pytest
import torch

import attnlab as al
from attnlab.interop import from_hf, to_hf

pytest.importorskip("transformers")

PRESETS = {  # preset -> transformers model_type
    "gemma2-2b": "gemma2", "gemma3-1b": "gemma3_text", "olmo2-1b": "olmo2",
    "granite-3.1-2b": "granite", "command-r": "cohere",
}  # fmt: skip


@pytest.mark.hf
@pytest.mark.parametrize("name", list(PRESETS))
@torch.no_grad()
def test_tiny_preset_round_trips_through_transformers(name: str) -> None:
    cfg = al.presets.tiny(al.presets.get(name))
    cfg = cfg.merged(dropout=0.0, attention={"dropout": 0.0}) if cfg.attention.dropout else cfg
    torch.manual_seed(0)
    ours = al.build_model(cfg).eval()
    with torch.no_grad():  # weights away from their init, so a misplaced one shows
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours.hf_model_type = PRESETS[name]
    theirs = to_hf(ours)
    if hasattr(theirs.config, "_attn_implementation"):
        theirs.config._attn_implementation = "eager"
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    want = theirs(ids, attention_mask=mask).logits
    got = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    scale = want[real].abs().max().item()
    assert (got - want)[real].abs().max().item() <= 1e-4 * max(scale, 1.0), name
    back = from_hf(theirs).eval()
    assert back.state_dict().keys() == ours.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ours.state_dict().items())
    assert torch.equal(back(ids, attention_mask=mask).logits, got)
