"""The MoE families of issue 19 (src/attnlab/interop/qwen3_moe.py, deepseek_v3.py, gpt_oss.py)
proven equal to transformers 5.24 on tiny random-weight models built from configs (no
downloads), fp32, eval mode, with transformers' eager attention and its eager experts loop
(`experts_implementation="eager"`: the reference one, not the grouped-mm kernel):

- from_hf(hf): logits within 1e-4 on a right-padded batch (transformers does not derive
  positions from the mask), at 4x the original context where the family scales RoPE (YaRN);
- to_hf(from_hf(hf)) reproduces the state dict exactly, and computes the same logits;
  checkpoint folders both ways (save_pretrained / load_pretrained, transformers' own);
- cached greedy generation on a left-padded batch equals transformers' generate;
- the presets' configs read from the model cards' config.json, their parameter counts equal to
  transformers' on the meta device;
- what the families cannot express is refused, naming the field.
"""

from __future__ import annotations

import pytest
import torch

import attnlab as al
from attnlab.interop import ConversionError, from_hf, load_pretrained, save_pretrained, to_hf
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
    """4x the original context where RoPE is scaled (YaRN), else 24 tokens."""
    params = CASES[case][1].get("rope_parameters") or {}
    original = params.get("original_max_position_embeddings")
    return 4 * original if original else 24


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
    ids, mask = batch(max(length_of(case) - 10, 12))  # every row keeps real prompt tokens
    left = torch.flip(mask, dims=[1])  # left padding: transformers derives positions from it
    kw = dict(attention_mask=left, pad_token_id=0, eos_token_id=None)
    want = hf.generate(ids, max_new_tokens=10, do_sample=False, **kw)
    got = al.generate(ours, ids, 10, **kw)
    assert torch.equal(got, want)
    assert len({tuple(r) for r in got[:, ids.shape[1] :].tolist()}) > 1  # rows differ


@pytest.mark.parametrize("case", ["qwen3_moe-sparse-step-window", "deepseek_v3", "gpt_oss"])
def test_checkpoint_folders_round_trip(case: str, tmp_path) -> None:
    """save_pretrained -> load_pretrained; the folder loads in transformers, and transformers'
    own folder loads here."""
    hf = hf_model(case)
    ids, mask = batch(length_of(case))
    save_pretrained(from_hf(hf), tmp_path / "ours")
    loaded = load_pretrained(tmp_path / "ours").eval()
    assert max_logit_diff(hf, loaded, ids, mask) < TOL
    again = eager(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")).eval()
    assert max_logit_diff(again, loaded, ids, mask) < TOL
    hf.save_pretrained(tmp_path / "theirs")
    assert max_logit_diff(hf, load_pretrained(tmp_path / "theirs").eval(), ids, mask) < TOL


# --- the model cards -----------------------------------------------------------------------------

# the architecture keys of each model card's config.json (quantization_config aside)
CARDS = {
    # huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], attention_bias=False,
        attention_dropout=0.0, bos_token_id=151643, decoder_sparse_step=1, eos_token_id=151645,
        head_dim=128, hidden_act="silu", hidden_size=2048, intermediate_size=6144,
        max_position_embeddings=40960, max_window_layers=48, mlp_only_layers=[],
        moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4, rms_norm_eps=1e-6,
        rope_scaling=None, rope_theta=1000000.0, router_aux_loss_coef=0.001, sliding_window=None,
        tie_word_embeddings=False, use_sliding_window=False, vocab_size=151936,
    ),
    # huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json
    "deepseek-v3": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], attention_bias=False,
        attention_dropout=0.0, aux_loss_alpha=0.001, bos_token_id=0, eos_token_id=1, ep_size=1,
        first_k_dense_replace=3, hidden_act="silu", hidden_size=7168, intermediate_size=18432,
        kv_lora_rank=512, max_position_embeddings=163840, moe_intermediate_size=2048,
        moe_layer_freq=1, n_group=8, n_routed_experts=256, n_shared_experts=1,
        norm_topk_prob=True, num_attention_heads=128, num_experts_per_tok=8,
        num_hidden_layers=61, num_key_value_heads=128, num_nextn_predict_layers=1,
        q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-6,
        rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                          original_max_position_embeddings=4096, type="yarn"),
        rope_theta=10000, routed_scaling_factor=2.5, scoring_func="sigmoid", seq_aux=True,
        tie_word_embeddings=False, topk_group=4, topk_method="noaux_tc", v_head_dim=128,
        vocab_size=129280,
    ),
    # huggingface.co/openai/gpt-oss-20b/blob/main/config.json
    "gpt-oss-20b": dict(
        model_type="gpt_oss", architectures=["GptOssForCausalLM"], attention_bias=True,
        attention_dropout=0.0, eos_token_id=200002, experts_per_token=4, head_dim=64,
        hidden_act="silu", hidden_size=2880, initial_context_length=4096, intermediate_size=2880,
        layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
        num_attention_heads=64, num_experts_per_tok=4, num_hidden_layers=24,
        num_key_value_heads=8, num_local_experts=32, pad_token_id=199999, rms_norm_eps=1e-5,
        rope_scaling=dict(beta_fast=32.0, beta_slow=1.0, factor=32.0,
                          original_max_position_embeddings=4096, rope_type="yarn", truncate=False),
        rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0,
        tie_word_embeddings=False, vocab_size=201088,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", CARDS)
def test_cards_read_as_the_presets(name: str) -> None:
    """config.json -> the preset (whose parameter count tests/test_presets.py checks against
    transformers on the meta device: 30,532,122,624 / 671,026,404,352 / 20,914,757,184) and
    back to the card's architecture."""
    card = CARDS[name]
    conv = converter_for(card["model_type"])
    cfg = conv.config_from_hf(card)
    config = transformers.AutoConfig.for_model(
        card["model_type"],
        **{k: v for k, v in card.items() if k not in ("model_type", "architectures")},
    )
    preset = al.presets.get(name)
    if name == "deepseek-v3":  # the preset keeps the paper's α (section 4.2), not config.json's
        cfg = cfg.merged(ffn=dict(aux_loss_coef=preset.ffn.aux_loss_coef))
    assert cfg == preset
    # and back: the card's architecture, as transformers reads it
    back = transformers.AutoConfig.for_model(card["model_type"], **conv.config_to_hf(cfg))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert getattr(back, key) == getattr(config, key), key
    want, got = config.rope_parameters, back.rope_parameters
    assert got["rope_type"] == want["rope_type"] and got.get("factor") == want.get("factor")


@pytest.mark.parametrize("name", CARDS)
def test_tiny_preset_to_hf_matches(name: str) -> None:
    """tiny(preset) -> to_hf: the config_to_hf direction, at the preset's own architecture."""
    cfg = al.presets.tiny(al.presets.get(name)).replace(dropout=0.0)
    model = randomise(al.build_model(cfg), seed=1)
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "selection_bias", None) is not None:
                m.selection_bias.normal_(0, 0.3)
            if getattr(m, "router", None) is not None:
                m.router.weight.normal_()
    hf = eager(to_hf(model, CARDS[name]["model_type"]))
    ids, mask = batch(cfg.vocab_size if cfg.vocab_size < V else V)
    assert max_logit_diff(hf, model, ids, mask) < TOL


def test_qwen3_moe_hub_per_expert_tensors_read_like_fused_ones() -> None:
    """The Hub's Qwen3-MoE checkpoints keep one tensor per expert; transformers 5 fuses them."""
    hf = hf_model("qwen3_moe")
    conv = converter_for("qwen3_moe")
    cfg = from_hf(hf).config
    fused, hub = dict(hf.state_dict()), {}
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


def test_gpt_oss_layer_types_become_the_shortest_pattern() -> None:
    from attnlab.interop.gpt_oss import pattern_of

    s, f = "sliding_attention", "full_attention"
    assert pattern_of([s, f] * 3) == [s, f]
    assert pattern_of([s, s, f] * 2) == [s, s, f]
    assert pattern_of([s, f, f]) == [s, f, f]
    ours = from_hf(hf_model("gpt_oss"))
    assert [p.sliding_window for p in ours.config.layer_pattern] == [6, None]
    assert hf_model("gpt_oss").config.layer_types == [s, f, s]


def test_deepseek_v3_drops_the_mtp_layers_and_refuses_fp8() -> None:
    hf = hf_model("deepseek_v3")
    conv = converter_for("deepseek_v3")
    cfg = from_hf(hf).config
    sd = dict(hf.state_dict())
    extra = {k.replace("layers.2.", "layers.3."): v for k, v in sd.items() if ".layers.2." in k}
    got = conv.weights_from_hf({**sd, **extra}, cfg)
    assert got.keys() == conv.weights_from_hf(sd, cfg).keys()
    fp8 = {**sd, "model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1)}
    with pytest.raises(ConversionError, match="weight_scale_inv"):
        conv.weights_from_hf(fp8, cfg)


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
        ("deepseek_v3", dict(ffn=dict(routing="softmax-topk")), "ffn.routing"),
        ("deepseek_v3", dict(ffn=dict(selection_bias=False)), "ffn.selection_bias"),
        ("deepseek_v3", dict(ffn=dict(group_score="max")), "ffn.group_score"),
        ("deepseek_v3", dict(ffn=dict(n_shared_experts=0)), "ffn.n_shared_experts"),
        ("gpt_oss", dict(ffn=dict(router_bias=False)), "ffn.router_bias"),
        ("gpt_oss", dict(ffn=dict(expert=dict(limit=None))), "ffn.expert.limit"),
        ("gpt_oss", dict(ffn=dict(expert=dict(activation="silu"))), "ffn.expert.activation"),
        ("gpt_oss", dict(attention=dict(sinks=False)), "attention.sinks"),
        (
            "gpt_oss",
            dict(layer_pattern=[dict(sliding_window=4), dict(sliding_window=6)]),
            "layer_pattern",
        ),
    ],
)
def test_what_a_family_cannot_compute_is_refused(model_type, changes, field) -> None:
    cfg = from_hf(hf_model(model_type)).config.merged(**changes)
    with pytest.raises(ConversionError, match=field):
        converter_for(model_type).config_to_hf(cfg)


@pytest.mark.parametrize(
    ("model_type", "changes", "key"),
    [
        ("qwen3_moe", dict(num_local_experts=0), "num_local_experts"),
        ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step"),
        ("deepseek_v3", dict(n_shared_experts=0), "n_shared_experts"),
        ("deepseek_v3", dict(n_group=8), "n_group"),  # 8 experts in 8 groups: no top-2
        ("gpt_oss", dict(swiglu_alpha=1.5), "swiglu_alpha"),
        (
            "gpt_oss",
            dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
            "layer_types",
        ),
    ],
)
def test_unmodelled_configs_are_refused(model_type, changes, key) -> None:
    data = {**hf_model(model_type).config.to_dict(), **changes}
    with pytest.raises(ConversionError, match=key):
        converter_for(model_type).config_from_hf(data)
