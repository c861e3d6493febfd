"""Qwen3 and Gemma: what their parity in tests/interop/test_interop_decoders.py rests on, checked
piece by piece, and cached greedy decoding equal to transformers' `generate`.

- `rmsnorm-unit-offset` (src/attnlab/nn/norms_offset.py) is x / rms(x) · (1 + w): the formula in
  fp64, transformers' GemmaRMSNorm bit for bit in bf16 (where multiplying before or after the
  cast gives different numbers, so the order is checked, not assumed), identity at init;
- `round_embed_scale` multiplies by sqrt(d_model) rounded to the embeddings' dtype, which is
  transformers' GemmaTextScaledWordEmbedding bit for bit in bf16 (a Python-float factor is not);
- qk-norm sits before the rotation as in Qwen3Attention (the parity test fails with it after);
- greedy generation through attnlab's cache equals `generate` of the transformers model on a
  left-padded batch, with GQA (Qwen3) and MQA with head_dim != d_model / n_heads (Gemma).
"""

from __future__ import annotations

import pytest
import torch

import attnlab as al
from attnlab.config import ModelConfig, UnitOffsetRMSNormConfig
from attnlab.interop import from_hf
from attnlab.nn.norms import RMSNorm
from attnlab.nn.norms_offset import UnitOffsetRMSNorm

F64 = torch.float64


def _randomise_weight(norm: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(norm.weight.shape, generator=g) * 0.5)
    return norm


# --- the unit-offset RMSNorm --------------------------------------------------------------------


@pytest.mark.parametrize("eps", [1e-6, 1e-1])
def test_unit_offset_rms_norm_matches_formula(eps):
    norm = _randomise_weight(UnitOffsetRMSNorm(dim=24, eps=eps))
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(1)) * 0.5 + 0.3
    x64 = x.to(F64)
    ref = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * (1 + norm.weight.to(F64))
    torch.testing.assert_close(norm(x).to(F64), ref, rtol=1e-5, atol=1e-6)


def test_unit_offset_rms_norm_is_the_identity_scaling_when_built():
    """Zero weight is gain 1, in the module and after every init scheme (init.py sets norm
    weights to the module's identity_weight, not to 1)."""
    x = torch.randn(4, 16)
    plain = RMSNorm(dim=16)
    torch.testing.assert_close(UnitOffsetRMSNorm(dim=16)(x), plain(x), rtol=0, atol=0)
    for init in ("xavier", "normal", "gpt2", "t5"):
        cfg = ModelConfig(
            arch="decoder",
            vocab_size=32,
            d_model=16,
            n_layers=1,
            n_heads=2,
            norm=UnitOffsetRMSNormConfig(),
            attention={"qk_norm": True},
            init=init,
        )
        model = al.build_model(cfg)
        norms = [m for m in model.modules() if isinstance(m, UnitOffsetRMSNorm)]
        assert len(norms) == 5  # attn, ffn, q, k, final
        assert all(torch.count_nonzero(n.weight) == 0 for n in norms), init


def test_unit_offset_rms_norm_bf16_equals_gemma_and_not_llamas_order():
    pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    d = 256
    ours = _randomise_weight(UnitOffsetRMSNorm(dim=d)).to(torch.bfloat16)
    theirs = GemmaRMSNorm(d, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
    x = (torch.randn(8, d, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    with torch.no_grad():
        got = ours(x)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, theirs(x))
        # Llama's order (cast x̂ to bf16, then multiply by a bf16 gain) rounds twice: it differs
        x32 = x.float()
        xhat = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        llama_order = (1.0 + ours.weight) * xhat
    assert not torch.equal(got, llama_order)


# --- the embedding scale ------------------------------------------------------------------------


def test_rounded_embedding_scale_equals_gemma_in_bf16():
    pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding

    d, vocab = 2048, 64  # gemma-2b's width: sqrt(2048) = 45.2548..., 45.25 in bf16
    base = dict(arch="decoder", vocab_size=vocab, d_model=d, n_layers=1, n_heads=8)
    rounded = al.build_model(ModelConfig(**base, scale_embeddings=True, round_embed_scale=True))
    plain = al.build_model(ModelConfig(**base, scale_embeddings=True))
    plain.load_state_dict(rounded.state_dict())
    theirs = GemmaTextScaledWordEmbedding(vocab, d, 0, embed_scale=d**0.5)
    with torch.no_grad():
        theirs.weight.copy_(rounded.embed_tokens.weight)
        ids = torch.arange(vocab)[None]
        assert torch.equal(rounded._embed(ids), theirs(ids))  # fp32
        for model in (rounded, plain, theirs):
            model.to(torch.bfloat16)
        want = theirs(ids)
        assert torch.equal(rounded._embed(ids), want)
        assert not torch.equal(plain._embed(ids), want)  # a Python float is not rounded first


# --- against transformers: qk-norm placement, generation ----------------------------------------

_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
             vocab_size=96, bos_token_id=0, eos_token_id=0)  # fmt: skip
HF_CASES = {
    "qwen3": dict(_TINY, num_key_value_heads=2, head_dim=24),
    "gemma": dict(_TINY, num_key_value_heads=1, head_dim=32),
}


def _hf(model_type: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(model_type, **HF_CASES[model_type])
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # peaked logits (no near-ties for greedy), norm weights far from init
        for p in hf.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.add_(noise * 0.2) if p.dim() == 1 else p.copy_(noise * 0.3)
    return hf.eval()


@pytest.mark.hf
def test_qwen3_qk_norm_is_before_the_rotation(monkeypatch):
    """from_hf(Qwen3) equals transformers with norm-then-rotate; the same weights with each head
    rotated first and normed after do not (the norm's per-channel weight does not commute with
    the rotation), so the parity tests see the order."""
    from attnlab.nn.positional.base import Rotation

    hf = _hf("qwen3")
    ours = from_hf(hf).eval()
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(ids).logits
        assert (ours(ids).logits - want).abs().max() < 1e-4
        # the other order: the layers keep no norm, the rotation applies it afterwards; each
        # layer rotates q then k, layer after layer, so the norms are queued in that order
        queue = []
        for block in ours.decoder.blocks:
            a = block.self_attn
            queue += [a.q_norm, a.k_norm]
            a.q_norm = a.k_norm = None
        rotate = Rotation.__call__
        monkeypatch.setattr(Rotation, "__call__", lambda self, x: queue.pop(0)(rotate(self, x)))
        wrong = ours(ids).logits
    assert queue == []
    assert (wrong - want).abs().max() > 1e-2


@pytest.mark.hf
@pytest.mark.parametrize("model_type", list(HF_CASES))
def test_cached_greedy_generation_equals_transformers(model_type):
    hf = _hf(model_type)
    ours = from_hf(hf).eval()
    pad = 1
    rows = [
        torch.randint(2, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 4, 2)
    ]
    ids = torch.full((3, 7), pad)
    mask = torch.zeros(3, 7, dtype=torch.long)
    for i, r in enumerate(rows):  # left padding: generation's layout
        ids[i, 7 - len(r) :], mask[i, 7 - len(r) :] = r, 1
    kw = dict(attention_mask=mask, pad_token_id=pad, eos_token_id=None)
    want = hf.generate(ids, do_sample=False, max_new_tokens=10, **kw)
    got = al.generate(ours, ids, 10, **kw)
    assert got.tolist() == want.tolist()
    assert len({tuple(r) for r in got[:, 7:].tolist()}) > 1  # rows differ: not one stuck token
