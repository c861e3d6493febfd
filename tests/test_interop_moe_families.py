"""The MoE families of issue 19 (src/attnlab/interop/qwen3_moe.py, deepseek_v3.py, gpt_oss.py)
proven equal to transformers 5.24 on tiny random-weight models built from configs (no
downloads), fp32, eval mode, with transformers' eager attention and its eager experts loop
(`experts_implementation="eager"`: the reference one, not the grouped-mm kernel):

- from_hf(hf): logits within 1e-4 on a right-padded batch (transformers does not derive
  positions from the mask), at 4x the original context where the family scales RoPE (YaRN);
- to_hf(from_hf(hf)) reproduces the state dict exactly, and computes the same logits;
- cached greedy generation on a left-padded batch equals transformers' generate;
- the presets' configs read from the model cards' config.json, their parameter counts equal to
  transformers' on the meta device;
- what the families cannot express is refused, naming the field.
"""

from __future__ import annotations

import pytest
import torch

import attnlab as al
from attnlab.interop import ConversionError, from_hf, to_hf
from attnlab.interop.converter import converter_for

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf
transformers.logging.set_verbosity_error()

TOL = 1e-4
V = 128
_Q = dict(vocab_size=V, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, intermediate_size=80, moe_intermediate_size=24)  # fmt: skip
_V3 = dict(
    vocab_size=V, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, intermediate_size=48,
    moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
    n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=32,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32,
                         beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
                         original_max_position_embeddings=8),
)  # fmt: skip
CASES = {
    # Qwen3-30B-A3B's shape: qk-norm, every block sparse, top-k renormalised
    "qwen3_moe": ("qwen3_moe", dict(_Q, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    # dense blocks among sparse ones, unnormalised top-k, biases, a window in every layer
    "qwen3_moe-sparse-step-window": ("qwen3_moe", dict(
        _Q, num_hidden_layers=4, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
        decoder_sparse_step=2, mlp_only_layers=[3], attention_bias=True, use_sliding_window=True,
        sliding_window=5,
    )),
    # DeepSeek-V3's shape: query latent, YaRN with V3's mscales (at 4x its original 8 positions),
    # a dense first block, sigmoid routing with the selection bias over 4 groups, shared expert
    "deepseek_v3": ("deepseek_v3", dict(_V3)),
    # no query latent, half-layout RoPE, unnormalised weights, no groups, biases, no YaRN
    "deepseek_v3-plain": ("deepseek_v3", dict(
        _V3, q_lora_rank=None, rope_interleave=False, norm_topk_prob=False, n_group=1,
        topk_group=1, attention_bias=True, first_k_dense_replace=0, n_shared_experts=2,
        rope_parameters=dict(rope_type="default", rope_theta=500.0), routed_scaling_factor=1.0,
    )),
    # gpt-oss-20b's shape: sinks, sliding / full layers, YaRN without truncation (4x its 8
    # positions), clamped-SwiGLU experts with biases, a router with a bias
    "gpt_oss": ("gpt_oss", dict(
        vocab_size=V, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=24, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=6, max_position_embeddings=32, swiglu_limit=1.5,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                             beta_slow=1.0, truncate=False, original_max_position_embeddings=8),
    )),
    # every layer full, no attention biases, untruncated YaRN kept
    "gpt_oss-full-nobias": ("gpt_oss", dict(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=24, intermediate_size=16, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["full_attention"] * 2, attention_bias=False,
        max_position_embeddings=32, swiglu_limit=2.0,
        rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, beta_fast=32.0,
                             beta_slow=1.0, truncate=False, original_max_position_embeddings=8),
    )),
}  # fmt: skip
_BUILT: dict[str, torch.nn.Module] = {}


def randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter random and far from its init (norm weights 1 + noise, biases noise),
    routers and selection biases spread so that routing is decided by them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith(("mlp.gate.weight", "mlp.router.weight", "sinks")):
                p.copy_(noise)
            elif p.dim() == 1:
                p.add_(noise * 0.1)
            else:
                p.copy_(noise * 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    return model.eval()


def hf_model(case: str) -> torch.nn.Module:
    if case not in _BUILT:
        model_type, kwargs = CASES[case]
        config = transformers.AutoConfig.for_model(
            model_type, **kwargs, bos_token_id=0, eos_token_id=0
        )
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(config)
        _BUILT[case] = randomise(model, seed=list(CASES).index(case))
    return _BUILT[case]


def eager(model: torch.nn.Module) -> torch.nn.Module:
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    return model


def batch(length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, length) ids; right padding of 0, 3 and 7 tokens."""
    ids = torch.randint(0, V, (3, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, length - 3 :], mask[2, length - 7 :] = 0, 0
    return ids, mask


def length_of(case: str) -> int:
    """4x the original context where RoPE is scaled (YaRN), else 12 tokens."""
    params = CASES[case][1].get("rope_parameters") or {}
    original = params.get("original_max_position_embeddings")
    return 4 * original if original else 12


@torch.no_grad()
def max_logit_diff(hf, ours, ids, mask) -> float:
    real = mask.bool()
    theirs = hf(ids, attention_mask=mask).logits
    assert theirs.abs().amax() > 1.0  # outputs far from zero: an absolute tolerance means something
    return (ours(ids, attention_mask=mask).logits - theirs)[real].abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_from_hf_matches_transformers_on_padded_batch(case: str) -> None:
    hf = hf_model(case)
    ids, mask = batch(length_of(case))
    assert max_logit_diff(hf, from_hf(hf).eval(), ids, mask) < TOL


@pytest.mark.parametrize("case", CASES)
def test_to_hf_reproduces_the_state_dict_and_logits(case: str) -> None:
    hf = hf_model(case)
    back = eager(to_hf(from_hf(hf)))
    assert type(back) is type(hf)
    a, b = hf.state_dict(), back.state_dict()
    assert sorted(a) == sorted(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    ids, mask = batch(length_of(case))
    with torch.no_grad():
        assert torch.equal(
            back(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits
        )


@pytest.mark.parametrize("case", CASES)
def test_cached_greedy_generation_equals_transformers(case: str) -> None:
    hf = hf_model(case)
    ours = from_hf(hf).eval()
    ids, mask = batch(length_of(case) - 10)
    left = torch.flip(mask, dims=[1])  # left padding: transformers derives positions from it
    want = hf.generate(ids, attention_mask=left, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(al.generate(ours, ids, 10, attention_mask=left), want)


# --- configs -------------------------------------------------------------------------------------


def test_qwen3_moe_dense_blocks_are_placed_as_transformers_places_them() -> None:
    hf = hf_model("qwen3_moe-sparse-step-window")
    ours = from_hf(hf)
    sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert sparse == [False, True, False, False]
    assert [b.ffn.dense is None for b in ours.decoder.blocks] == sparse


@pytest.mark.parametrize(
    ("model_type", "changes", "field"),
    [
        ("qwen3_moe", dict(ffn=dict(selection_bias=True)), "ffn.selection_bias"),
        ("qwen3_moe", dict(ffn=dict(routing="sigmoid-topk")), "ffn.routing"),
        ("qwen3_moe", dict(ffn=dict(n_shared_experts=1)), "ffn.n_shared_experts"),
    ],
)
def test_what_a_family_cannot_compute_is_refused(model_type, changes, field) -> None:
    cfg = from_hf(hf_model(model_type)).config.merged(**changes)
    with pytest.raises(ConversionError, match=field):
        converter_for(model_type).config_to_hf(cfg)


@pytest.mark.parametrize(
    ("model_type", "changes", "key"),
    [("qwen3_moe", dict(num_local_experts=0), "num_local_experts")],
)
def test_unmodelled_configs_are_refused(model_type, changes, key) -> None:
    data = {**hf_model(model_type).config.to_dict(), **changes}
    with pytest.raises(ConversionError, match=key):
        converter_for(model_type).config_from_hf(data)
