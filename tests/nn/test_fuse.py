"""Fused projections (src/attnlab/nn/fuse.py): one matmul for q/k/v and for gate/up.

- For every decoder-style preset family (GQA, qk-norm, q/k/v biases, MoE experts, encoder-decoder
  self-attention): the fused model's logits equal the unfused model's (the same dot products, up
  to the matmul's blocking order), cached greedy decoding gives the same tokens, and the fused
  weight is exactly the concatenation of the parts.
- state dicts keep the unfused names and values; an unfused state dict loads into a fused model;
  `unfuse` gives back the original modules' weights exactly.
- what is not fused: cross-attention, attention classes with their own forward (MLA, Longformer).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import attnlab as al
from attnlab.nn.fuse import FusedGLUFFN, FusedLinear, is_fused


def _tiny(preset: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = al.presets.tiny(al.presets.get(preset)).replace(init="xavier")
    return al.build_model(cfg).eval()


def _ids(model, b: int = 2, t: int = 9, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.vocab_size, (b, t), generator=g)


DECODERS = ["llama2-7b", "qwen2-7b", "qwen3-0.6b", "mixtral-8x7b", "gemma-2b", "gpt2-small"]


@pytest.mark.parametrize("preset", DECODERS)
def test_fused_decoder_computes_what_the_unfused_one_does(preset):
    model = _tiny(preset)
    fused = al.fuse(copy.deepcopy(model))
    assert is_fused(fused)
    ids = _ids(model)
    with torch.no_grad():
        want, got = model(ids).logits, fused(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(al.generate(fused, ids, 10), al.generate(model, ids, 10))


def test_fused_weights_are_the_concatenated_parts_and_keep_their_names():
    model = _tiny("qwen2-7b")  # q/k/v biases, GQA
    fused = al.fuse(copy.deepcopy(model))
    a0, f0 = model.decoder.blocks[0].self_attn, fused.decoder.blocks[0].self_attn
    assert isinstance(f0.qkv_proj, FusedLinear) and not hasattr(f0, "q_proj")
    assert torch.equal(
        f0.qkv_proj.weight, torch.cat([a0.q_proj.weight, a0.k_proj.weight, a0.v_proj.weight])
    )
    assert torch.equal(
        f0.qkv_proj.bias, torch.cat([a0.q_proj.bias, a0.k_proj.bias, a0.v_proj.bias])
    )
    want, got = model.state_dict(), fused.state_dict()
    assert list(got) == list(want)  # the same names in the same order
    for key in want:
        assert torch.equal(got[key], want[key]), key
    other = al.fuse(_tiny("qwen2-7b", seed=3))
    other.load_state_dict(want)  # unfused names load into a fused model
    ids = _ids(model)
    with torch.no_grad():
        assert torch.equal(other(ids).logits, fused(ids).logits)


def test_unfuse_gives_back_the_original_weights():
    model = _tiny("mixtral-8x7b")
    back = al.unfuse(al.fuse(copy.deepcopy(model)))
    assert not is_fused(back)
    assert not any(isinstance(m, FusedGLUFFN) for m in back.modules())
    assert [n for n, _ in back.named_parameters()] == [n for n, _ in model.named_parameters()]
    for (n, a), (_, b) in zip(model.named_parameters(), back.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_a_missing_key_bias_is_a_zero_slice():
    """Whisper's key projection has no bias while q and v do (k_bias=False)."""
    model = _tiny("whisper-tiny")
    fused = al.fuse(copy.deepcopy(model))
    sd = fused.state_dict()
    assert list(sd) == list(model.state_dict())
    attn = next(m for n, m in fused.named_modules() if n.endswith("self_attn"))
    h = attn.n_heads * attn.head_dim
    assert torch.equal(attn.qkv_proj.bias[h : 2 * h], torch.zeros(h))


def test_encoder_decoder_fuses_self_attention_only():
    model = _tiny("bart-base")
    fused = al.fuse(copy.deepcopy(model))
    crosses = [m for n, m in fused.named_modules() if n.endswith("cross_attn")]
    assert crosses and all(hasattr(c, "q_proj") and not hasattr(c, "qkv_proj") for c in crosses)
    selfs = [m for n, m in fused.named_modules() if n.endswith("self_attn")]
    assert selfs and all(hasattr(s, "qkv_proj") for s in selfs)
    src, tgt = _ids(model, t=7), _ids(model, t=5, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(
            fused(src, tgt).logits, model(src, tgt).logits, rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("preset", ["deepseek-v2-lite", "longformer-base-4096"])
def test_attention_with_its_own_forward_is_left_alone(preset):
    model = _tiny(preset)
    fused = al.fuse(copy.deepcopy(model))
    assert not any(hasattr(m, "qkv_proj") for m in fused.modules())
    ids = _ids(model)
    with torch.no_grad():
        want, got = model(ids).logits, fused(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fuse_refuses_what_it_cannot_fuse():
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        al.fuse("model")
