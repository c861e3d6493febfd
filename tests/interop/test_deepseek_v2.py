"""DeepSeek-V2 (src/attnlab/interop/deepseek_v2.py, the deepseek-v2-lite preset, DeepSeek's
routing in src/attnlab/nn/ffn/moe.py): tiny random-weight transformers models converted both
ways, logits on padded batches and cached greedy generation equal to theirs; the preset equal to
what the converter reads from DeepSeek-V2-Lite's config.json, with transformers' parameter
count; routing and balance loss against loops over the paper's formulas."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab as al
from attnlab.config import GLUFFN, MoEFFN
from attnlab.interop.converter import ConversionError, converter_for
from attnlab.nn.ffn.moe import MoEFFN as MoELayer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

# huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json (architecture keys)
LITE = dict(
    model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], vocab_size=102400,
    hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=163840,
    rms_norm_eps=1e-6, rope_theta=10000, attention_bias=False, attention_dropout=0.0,
    hidden_act="silu", q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1, n_routed_experts=64,
    n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1, topk_method="greedy",
    norm_topk_prob=False, routed_scaling_factor=1.0, scoring_func="softmax", moe_layer_freq=1,
    aux_loss_alpha=0.001, seq_aux=True, tie_word_embeddings=False, bos_token_id=100000,
    eos_token_id=100001,
    rope_scaling=dict(
        type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
        mscale=0.707, mscale_all_dim=0.707,
    ),
)  # fmt: skip

TINY = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4)
VARIANTS = {
    # V2-Lite's shape: no query latent, YaRN with mscale, one dense layer, greedy top-k
    "lite": dict(
        TINY, intermediate_size=40, moe_intermediate_size=12, kv_lora_rank=16, q_lora_rank=None,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8,
        num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1,
        max_position_embeddings=640,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=16,
            beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707,
        ),
    ),
    # V2's: a query latent, group-limited routing, a routed scale, biases, plain RoPE, no dense layer
    "v2": dict(
        TINY, intermediate_size=24, moe_intermediate_size=8, kv_lora_rank=12, q_lora_rank=10,
        qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=12,
        num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=0,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.5,
        attention_bias=True, rope_parameters=dict(rope_type="default", rope_theta=500.0),
    ),
}  # fmt: skip


def hf_model(name: str):
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**VARIANTS[name]))
    with torch.no_grad():  # routers away from near-uniform (init std 0.02), norms from 1
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
            elif "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return ((a - b) * mask[..., None]).abs().max().item()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_equal_transformers_both_ways(name: str) -> None:
    hf = hf_model(name)
    ours = al.interop.from_hf(hf)
    ids, mask = batch()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).logits
        assert max_diff(ours(ids, attention_mask=mask).logits, want, mask) <= 1e-5
        back = al.interop.to_hf(ours)
        assert max_diff(back(ids, attention_mask=mask).logits, want, mask) <= 1e-5
    sd = hf.state_dict()
    assert all(torch.equal(v, sd[k]) for k, v in back.state_dict().items())


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cached_greedy_generation_equals_transformers(name: str) -> None:
    hf = hf_model(name)
    ours = al.interop.from_hf(hf)
    ids, mask = batch()
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    got = al.generate(ours, ids, 10, attention_mask=mask)  # latent cache; steps absorbed
    assert torch.equal(got, want)


def test_hub_per_expert_tensors_read_like_fused_ones() -> None:
    """The Hub's checkpoints keep one tensor per expert; transformers 5 fuses them."""
    hf = hf_model("lite")
    conv = converter_for("deepseek_v2")
    cfg = al.interop.from_hf(hf).config
    fused = dict(hf.state_dict())
    hub = {}
    for k, v in fused.items():
        if k.endswith("experts.gate_up_proj"):
            for e, w in enumerate(v):
                gate, up = w.chunk(2)
                hub[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                hub[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif k.endswith("experts.down_proj"):
            for e, w in enumerate(v):
                hub[k.replace("down_proj", f"{e}.down_proj.weight")] = w
        else:
            hub[k] = v
    a, b = conv.weights_from_hf(fused, cfg), conv.weights_from_hf(hub, cfg)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_preset_is_deepseek_v2_lite() -> None:
    """The preset equals what the converter reads from the model card's config.json, and its
    parameter count is transformers' DeepseekV2ForCausalLM's (on the meta device)."""
    preset = al.presets.get("deepseek-v2-lite")
    assert converter_for("deepseek_v2").config_from_hf(LITE) == preset
    config = transformers.DeepseekV2Config(
        **{k: v for k, v in LITE.items() if k not in ("model_type", "architectures")}
    )
    with torch.device("meta"):
        ref = transformers.DeepseekV2ForCausalLM(config)
    expected = sum(p.numel() for p in ref.parameters())
    assert al.count_parameters(preset) == expected == 15_706_484_224
    # transformers' softmax scale and YaRN factor, bit for bit
    assert preset.attention.scale == ref.model.layers[0].self_attn.scaling
    assert preset.positional.scaling.attention_factor == ref.model.rotary_emb.attention_scaling


def test_config_round_trip_keeps_the_mscales() -> None:
    conv = converter_for("deepseek_v2")
    out = conv.config_to_hf(al.presets.get("deepseek-v2-lite"))
    p = out["rope_parameters"]
    assert math.isclose(p["mscale"], 0.707) and math.isclose(p["mscale_all_dim"], 0.707)
    assert (out["first_k_dense_replace"], out["intermediate_size"]) == (1, 10944)
    assert out["max_position_embeddings"] == 163840


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(ffn=dict(routing="topk-softmax")), "ffn.routing"),
        (dict(positional=dict(layout="half")), "positional.layout"),
        (dict(attention=dict(latent_norm_eps=1e-5)), "attention.latent_norm_eps"),
    ],
)
def test_what_transformers_cannot_compute_is_refused(changes: dict, field: str) -> None:
    cfg = al.presets.tiny(al.presets.get("deepseek-v2-lite")).merged(**changes)
    with pytest.raises(ConversionError, match=field):
        converter_for("deepseek_v2").config_to_hf(cfg)


@pytest.mark.parametrize(
    ("changes", "field"),
    [(dict(topk_method="noaux_tc"), "topk_method"), (dict(num_key_value_heads=2), "num_key_v")],
)
def test_unmodelled_configs_are_refused(changes: dict, field: str) -> None:
    with pytest.raises(ConversionError, match=field):
        converter_for("deepseek_v2").config_from_hf({**LITE, **changes})


# --- DeepSeek's routing, against loops over the formulas ----------------------------------------


def moe(**kw) -> MoELayer:
    torch.manual_seed(0)
    args = dict(d_model=8, d_ff=6, expert={"kind": "glu"}, n_experts=12, top_k=3)
    layer = MoELayer(**{**args, "routing": "softmax-topk", **kw}).double()
    with torch.no_grad():
        layer.router.weight.normal_()
    return layer


def test_group_limited_routing_and_routed_scale_equal_a_loop() -> None:
    """Per token: groups of 3 experts scored by their best probability, the top 2 groups kept,
    the top 3 experts among them, weights = probability x 2.5 (no renormalisation)."""
    layer = moe(n_groups=4, top_k_groups=2, routed_scale=2.5)
    x = torch.randn(20, 8, dtype=torch.float64)
    _, ids, _ = layer.route(x)
    out, _ = layer(x)
    for t in range(20):
        p = torch.softmax(x[t] @ layer.router.weight.T, -1)
        best = sorted(range(4), key=lambda g: -p[3 * g : 3 * g + 3].max())[:2]
        allowed = [e for g in best for e in range(3 * g, 3 * g + 3)]
        top = sorted(allowed, key=lambda e: -p[e])[:3]
        assert sorted(ids[t].tolist()) == sorted(top)
        y = sum(2.5 * p[e] * layer.experts[e](x[t])[0] for e in top)
        torch.testing.assert_close(out[t], y, rtol=0, atol=1e-6)  # the router is fp32


def test_sequence_balance_loss_is_deepseeks_formula() -> None:
    """DeepSeek-V2 eq. 23-25 per sequence: α Σ_i f_i P_i, f_i = N/(K·T) · #tokens choosing i,
    P_i = mean probability of i over the sequence; averaged over the batch."""
    layer = moe(balance_loss="sequence", aux_loss_coef=0.001)
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    _, aux = layer(x)
    want = 0.0
    for b in range(2):
        _, ids, probs = layer.route(x[b])
        for e in range(12):
            f = 12 / (3 * 7) * (ids == e).sum().item()
            want += 0.001 * f * probs[:, e].mean().item() / 2
    assert math.isclose(aux.item(), want, rel_tol=1e-6)  # fp32 router probabilities
    # one sequence of all 14 tokens is the Switch loss (fractions summing to k) divided by k
    switch = moe(balance_loss="switch", aux_loss_coef=0.001)(x.reshape(1, 14, 8))[1]
    single = layer(x.reshape(1, 14, 8))[1]
    assert math.isclose(single.item(), switch.item() / 3, rel_tol=1e-12)


def test_dense_first_layers() -> None:
    cfg = al.presets.tiny(al.presets.get("deepseek-v2-lite"))
    model = al.build_model(cfg)
    first, second = (b.ffn for b in model.decoder.blocks)
    assert first.router is None and first.dense.gate_proj.out_features == cfg.ffn.dense_d_ff
    assert second.dense is None and len(second.experts) == cfg.ffn.n_experts
    ids = torch.randint(0, 256, (2, 6))
    out = model(ids)
    assert out.aux_loss is not None and out.aux_loss > 0  # from the second layer only
    assert isinstance(cfg.ffn, MoEFFN) and isinstance(cfg.ffn.expert, GLUFFN)
