"""Multi-head latent attention (src/attnlab/nn/attention/mla.py) and its latent cache
(src/attnlab/cache/latent.py): the layer against a float64 per-head loop of the paper's
equations (DeepSeek-V2, arXiv:2405.04434, eq. 9-19), the absorbed form against the expanded one,
cached decoding against recomputation with every cache kind, and the cache's size."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab as al
from attnlab.cache.base import kv_bytes
from attnlab.config import (
    GLUFFN,
    AttentionConfig,
    ConfigError,
    MLAConfig,
    ModelConfig,
    RMSNormConfig,
    RoPE,
)
from attnlab.nn.attention import AttnContext, MaskSpec, MultiHeadLatentAttention
from attnlab.nn.positional.rope import RotaryEmbedding

R, DN, DR, DV, H, D = 12, 6, 4, 5, 3, 16  # kv_lora_rank, nope, rope, value widths; heads; d_model


def layer(q_lora_rank: int | None, **kw) -> MultiHeadLatentAttention:
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(
        d_model=D,
        n_heads=H,
        kv_lora_rank=R,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=DN,
        qk_rope_head_dim=DR,
        v_head_dim=DV,
        bias=True,
        **kw,
    ).double()
    with torch.no_grad():  # norms and biases away from their identity, so a slip shows
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    return m


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rotate(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE on pairs (2i, 2i+1) of x (..., T, DR) as complex numbers, float64."""
    theta = base ** (-torch.arange(0, DR, 2, dtype=torch.float64) / DR)
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], DR // 2, 2).contiguous())
    return torch.view_as_real(
        z * torch.polar(torch.ones_like(theta), pos[:, None] * theta)
    ).flatten(-2)


def reference(m: MultiHeadLatentAttention, x: torch.Tensor) -> torch.Tensor:
    """The paper's equations for one sequence x (T, D), head by head, causal, float64."""
    T = x.shape[0]
    pos = torch.arange(T, dtype=torch.float64)
    if m.q_lora_rank is None:
        q_all = x @ m.q_proj.weight.T
    else:
        c_q = rms(x @ m.q_a_proj.weight.T + m.q_a_proj.bias, m.q_a_norm.weight)  # eq. 12
        q_all = c_q @ m.q_b_proj.weight.T  # eq. 13, 15 (W^UQ and W^QR in one matrix)
    kv = x @ m.kv_a_proj.weight.T + m.kv_a_proj.bias
    c_kv = rms(kv[:, :R], m.kv_a_norm.weight)  # eq. 9: the cached latent
    k_rope = rotate(kv[:, R:], pos)  # eq. 17: the shared, cached RoPE key
    w_b = m.kv_b_proj.weight.view(H, DN + DV, R)
    heads = []
    for h in range(H):
        q = q_all.view(T, H, DN + DR)[:, h]
        q = torch.cat([q[:, :DN], rotate(q[:, DN:], pos)], dim=-1)  # eq. 16, 18
        k = torch.cat([c_kv @ w_b[h, :DN].T, k_rope], dim=-1)  # eq. 10, 19
        v = c_kv @ w_b[h, DN:].T  # eq. 11
        scores = (q @ k.T) * (DN + DR) ** -0.5
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), -math.inf)
        heads.append(scores.softmax(-1) @ v)
    return torch.cat(heads, dim=-1) @ m.o_proj.weight.T + m.o_proj.bias  # eq. 19's u_t


@pytest.mark.parametrize("q_lora_rank", [None, 8])
@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("kernel", ["naive", "auto"])
def test_layer_equals_the_papers_equations(q_lora_rank, absorb, kernel) -> None:
    m = layer(q_lora_rank, absorb=absorb, kernel=kernel)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    pos = torch.arange(7).expand(2, 7)
    rot = RotaryEmbedding(rotary_dim=DR, layout="interleaved").double().rotation(pos)
    ctx = AttnContext(mask=MaskSpec(causal=True, q_positions=pos, k_positions=pos), rotation=rot)
    out, _ = m(x, ctx)
    # 1e-6: RoPE's cos/sin tables are fp32 (rope.py), as are the naive kernel's scores
    for b in range(2):
        torch.testing.assert_close(out[b], reference(m, x[b]), rtol=0, atol=1e-6)


def test_weights_are_the_same_in_both_forms() -> None:
    x = torch.randn(1, 5, D, dtype=torch.float64)
    pos = torch.arange(5)[None]
    ctx = AttnContext(mask=MaskSpec(causal=True, q_positions=pos, k_positions=pos))
    w = [layer(None, absorb=a, kernel="naive")(x, ctx, need_weights=True)[1] for a in (0, 1)]
    assert w[0].shape == (1, H, 5, 5)
    torch.testing.assert_close(w[0], w[1], rtol=0, atol=1e-6)  # fp32 scores (naive kernel)


def mla_model(**changes) -> torch.nn.Module:
    base = dict(
        arch="decoder",
        vocab_size=61,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=48,
        positional=RoPE(layout="interleaved"),
        attention=MLAConfig(
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, bias=True
        ),
        norm=RMSNormConfig(),
        ffn=GLUFFN(multiple_of=16),
        tie_embeddings=False,
        init="normal",
    )
    cfg = ModelConfig(**{**base, **changes})
    torch.manual_seed(0)
    return al.build_model(cfg).eval()


@pytest.mark.parametrize("absorb", [None, True, False])
@pytest.mark.parametrize("kind", ["latent", "static", "paged"])
def test_cached_decoding_equals_recomputation(kind: str, absorb: bool | None) -> None:
    """Left-padded prompts, a 4-token prefill then one token at a time, against the whole
    sequence at once without a cache (expanded). absorb None: the prefill expanded, each
    one-token step absorbed; True / False: every cached call in that form."""
    model = mla_model()
    for m in model.modules():
        if isinstance(m, MultiHeadLatentAttention):
            m.absorb = absorb
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        full = al.set_kernel(mla_model(), "naive")(ids, attention_mask=mask).logits
        cache = model.new_cache(2, 12, kind=kind)
        steps = [model(ids[:, :4], attention_mask=mask[:, :4], cache=cache).logits]
        for t in range(4, 9):
            step = model(ids[:, t : t + 1], attention_mask=mask[:, t : t + 1], cache=cache)
            steps.append(step.logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_generation_is_the_same_with_every_cache_kind(strategy: str) -> None:
    model = mla_model()
    ids = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(num_beams=3) if strategy == "beam" else {}
    out = {
        kind: al.generate(model, ids, 6, strategy=strategy, cache_kind=kind, **kw)
        for kind in ("latent", "static", "paged")
    }
    assert torch.equal(out["latent"], out["static"]) and torch.equal(out["latent"], out["paged"])
    # and equal to recomputing the whole prefix at each step (greedy, no cache at all)
    if strategy == "greedy":
        seq = ids
        with torch.no_grad():
            for _ in range(6):
                nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, nxt], dim=1)
        assert torch.equal(out["latent"], seq)


def test_the_latent_cache_is_the_default_and_stores_one_entry_per_token() -> None:
    model = mla_model()
    cache = model.new_cache(3, 10)
    assert type(cache).__name__ == "LatentKVCache"
    assert cache.k.shape == (2, 3, 1, 10, 16 + 4) and cache.v is None
    # L · (kv_lora_rank + qk_rope_head_dim) · 4 bytes: half of what K and V caches of that shape hold
    assert cache.bytes_per_token() == 2 * 20 * 4 == kv_bytes(2, 1, 20, 4) // 2
    assert model.new_cache(3, 10, kind="static").bytes_per_token() == kv_bytes(2, 1, 20, 4)
    assert cache.stats()["allocated_bytes"] == 3 * 10 * cache.bytes_per_token()


def test_softmax_attention_cannot_use_the_latent_cache() -> None:
    cfg = ModelConfig(arch="decoder", vocab_size=20, d_model=16, n_layers=1, n_heads=2)
    model = al.build_model(cfg).eval()
    cache = model.new_cache(1, 4, kind="latent")
    with pytest.raises(ValueError, match=r"separate keys and values.*'static'"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache)
    assert isinstance(cfg.attention, AttentionConfig)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(n_kv_heads=2), "n_kv_heads"),
        (dict(head_dim=8), "head_dim"),
        (dict(arch="encoder-decoder"), "cross-attention"),
    ],
)
def test_config_refuses_what_mla_does_not_have(changes: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        mla_model(**changes)


def test_rotary_dim_is_the_rope_part() -> None:
    cfg = mla_model().config
    assert cfg.rotary_dim == 4
    assert mla_model().decoder.positional.rot_dim == 4


def test_inspect_reports_the_latent_next_to_mha_gqa_mqa(capsys) -> None:
    """DeepSeek-V2-Lite: 27 layers x (512 + 64) values per token against MHA's 2 x 16 heads x
    128 (the paper's d_h) per layer (DeepSeek-V2, Table 1), in bf16."""
    from attnlab.cli import main
    from attnlab.cli.inspect import kv_bytes_compared, kv_bytes_per_token

    cfg = al.presets.get("deepseek-v2-lite")
    assert kv_bytes_per_token(cfg, 2) == 27 * (512 + 64) * 2 == 31_104
    same = kv_bytes_compared(cfg, 2)
    assert same == {
        "MHA": 2 * 27 * 16 * 128 * 2,
        "GQA (8 K/V heads)": 2 * 27 * 8 * 128 * 2,
        "MQA": 2 * 27 * 1 * 128 * 2,
        "MLA": 31_104,
    }
    # MLA's cache is that of MQA with 2.25 K/V heads (the paper's "equal to GQA with only 2.25
    # groups"): (512 + 64) / (2 · 128)
    assert same["MLA"] / same["MQA"] == 2.25
    assert main(["inspect", "deepseek-v2-lite"]) == 0
    out = capsys.readouterr().out
    assert "31,104 B in bf16" in out and "MHA 221,184 B" in out and "MLA 31,104 B" in out
    # a softmax model gets the same comparison, MLA at DeepSeek-V2's proportions (4.5 d_h)
    assert kv_bytes_compared(al.presets.get("llama2-7b"), 2)["MLA"] == 32 * (4 * 128 + 64) * 2


@pytest.mark.parametrize("absorb", [False, True])
def test_every_kernel_computes_the_same_mla(absorb: bool) -> None:
    """Values narrower than queries and keys (v_head_dim, or the latent against [latent; rope]):
    every kernel that serves these calls (and the selector) agrees with the naive one on a padded
    batch, gradients included (sdpa too: 9 query rows take the mask dense); the kernels that
    exploit one structure (ALiBi, BigBird's blocks, the paged pool) or run forward-only here
    (flex) refuse with a reason."""
    from attnlab.nn.attention import KERNELS
    from attnlab.nn.attention.kernels import NoKernelError

    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    results = {}
    for name in ["auto", *KERNELS.names()]:
        model = al.set_kernel(mla_model(), name)
        for m in model.modules():
            if isinstance(m, MultiHeadLatentAttention):
                m.absorb = absorb
        if name in ("alibi-sdpa", "block-gather", "paged", "paged-flex", "flex"):
            with pytest.raises(NoKernelError, match=f"'{name}' cannot serve this call"):
                model(ids, attention_mask=mask)
            continue
        logits = model(ids, attention_mask=mask).logits
        (logits[mask.bool()] ** 2).mean().backward()
        grad = model.decoder.blocks[0].self_attn.kv_b_proj.weight.grad
        results[name] = (logits[mask.bool()].detach(), grad)
    want = results["naive"]
    for name, (logits, grad) in results.items():
        torch.testing.assert_close(logits, want[0], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(grad, want[1], rtol=1e-4, atol=1e-6, msg=name)


def test_values_wider_than_keys() -> None:
    """v_head_dim above qk_nope + qk_rope: the expanded form pads q and k with zero channels
    (scores unchanged); the absorbed form pads nothing. Both give the same outputs."""
    torch.manual_seed(0)
    args = dict(d_model=D, n_heads=H, kv_lora_rank=R, qk_nope_head_dim=3, qk_rope_head_dim=2)
    m = MultiHeadLatentAttention(**args, v_head_dim=9, kernel="tiled").double()
    x = torch.randn(2, 6, D, dtype=torch.float64)
    pos = torch.arange(6).expand(2, 6)
    ctx = AttnContext(mask=MaskSpec(causal=True, q_positions=pos, k_positions=pos))
    outs = []
    for absorb in (False, True):
        m.absorb = absorb
        outs.append(m(x, ctx)[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)
