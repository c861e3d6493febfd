"""ModernBERT (Warner et al. 2024, arXiv:2412.13663) and the per-layer attention it needs
(`ModelConfig.layer_pattern`, src/attnlab/nn/stack.py `LayerVariant`): the `modernbert`
converter against transformers' ModernBertModel / ModernBertForMaskedLM on tiny random-weight
models built from configs (fp32, eval, a right-padded batch, eager and sdpa on the HF side), and
the pattern itself against a per-layer reference, in an encoder and in a cached decoder."""

from __future__ import annotations

import pytest
import torch

import attnlab as al
from attnlab.config import ConfigError, LayerSpec, ModelConfig, RoPE
from attnlab.interop import ConversionError, from_hf, to_hf
from attnlab.interop.modernbert import ModernBertConverter

TOL = 1e-4
# local_attention 6: |q - k| <= 3, so a 14-token batch is windowed in the local layers
SIZES = dict(
    vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, global_attn_every_n_layers=3, local_attention=6, pad_token_id=0,
    global_rope_theta=1000.0, local_rope_theta=50.0,
)  # fmt: skip
CLASSES = ("ModernBertModel", "ModernBertForMaskedLM")


def _transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def hf_model(cls: str, impl: str = "eager", **changes) -> torch.nn.Module:
    """Norms and biases moved off their initial 1 and 0, so a swapped tensor shows; q/k/v
    weights 10x their init (std 0.2), so that attention is far from uniform and a wrong window or
    RoPE base moves the outputs well past the tolerance."""
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.ModernBertConfig(**{**SIZES, **changes}, attn_implementation=impl)
    model = getattr(transformers, cls)(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            if "Wqkv" in name:
                p.mul_(10.0)
    return model.eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 14 tokens, two of them right-padded (to 9 and 4 real tokens)."""
    ids = torch.randint(1, SIZES["vocab_size"], (3, 14), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    return ids, mask


def compare(hf: torch.nn.Module, ours: torch.nn.Module) -> dict[str, float]:
    """Max |difference| at real tokens: final hidden states, and MLM logits with the head."""
    ids, mask = batch()
    real = mask.bool()
    with torch.no_grad():
        base = getattr(hf, "model", hf)
        hidden = base(input_ids=ids, attention_mask=mask).last_hidden_state
        out = ours(ids, attention_mask=mask)
        res = {"hidden": (out.hidden - hidden)[real].abs().max().item()}
        if out.logits is not None:
            logits = hf(input_ids=ids, attention_mask=mask).logits
            res["logits"] = (out.logits - logits)[real].abs().max().item()
    return res


# --- parity through the converter ---------------------------------------------------------------


@pytest.mark.hf
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("cls", CLASSES)
def test_from_hf_equals_transformers_on_a_padded_batch(cls: str, impl: str) -> None:
    hf = hf_model(cls, impl)
    ours = from_hf(hf).eval()
    assert ours.config.layer_pattern[1].sliding_window == 4  # local_attention 6: |q - k| <= 3
    assert ours.config.mlm_head == (cls == "ModernBertForMaskedLM")
    diffs = compare(hf, ours)
    assert max(diffs.values()) <= TOL, diffs


@pytest.mark.hf
@pytest.mark.parametrize("cls", CLASSES)
def test_to_hf_round_trip_is_exact(cls: str) -> None:
    hf = hf_model(cls)
    ours = from_hf(hf)
    back = to_hf(ours)
    assert type(back).__name__ == cls
    ref = hf.state_dict()
    got = back.state_dict()
    assert sorted(got) == sorted(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert back.config.layer_types == hf.config.layer_types
    assert back.config.rope_parameters == hf.config.rope_parameters
    assert max(compare(back, ours).values()) <= TOL


@pytest.mark.hf
def test_a_tiny_preset_goes_to_transformers_and_agrees() -> None:
    """tiny(modernbert-base) keeps the 3-layer pattern on 2 layers (global, local): to_hf writes
    it as layer_types, which reads back as the same per-layer attention."""
    cfg = al.presets.tiny(al.presets.get("modernbert-base"))
    torch.manual_seed(3)
    ours = al.build_model(cfg).eval()
    ours.hf_model_type = "modernbert"
    hf = to_hf(ours)
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    assert hf.config.local_attention == 2 * (8 - 1)  # tiny's window 8: |q - k| <= 7
    assert max(compare(hf, ours).values()) <= TOL


@pytest.mark.hf
def test_exact_parameter_counts_of_the_bare_model() -> None:
    """The preset (with its MLM head) is counted in tests/test_presets.py; without the head it
    is ModernBertModel's count, from the card's config on the meta device."""
    transformers = _transformers()
    config = transformers.ModernBertConfig(pad_token_id=50283)  # the card's sizes are the defaults
    with torch.device("meta"):
        ref = transformers.ModernBertModel(config)
    bare = al.presets.get("modernbert-base").replace(mlm_head=False, mlm_dense_bias=True)
    assert al.count_parameters(bare) == sum(p.numel() for p in ref.parameters()) == 149_014_272


@pytest.mark.hf
@pytest.mark.parametrize(
    ("what", "change"),
    [
        ("window one wider", lambda s: s.merged(sliding_window=s.sliding_window + 1)),
        ("window one narrower", lambda s: s.merged(sliding_window=s.sliding_window - 1)),
        ("local RoPE base = global", lambda s: LayerSpec(sliding_window=s.sliding_window)),
        ("no local layers", lambda s: LayerSpec()),
    ],
)
def test_parity_fails_when_the_pattern_is_wrong(what: str, change) -> None:
    """The parity above rests on every part of the local layers: each variant breaks it."""
    hf = hf_model("ModernBertModel")
    ours = from_hf(hf)
    pattern = ours.config.layer_pattern
    wrong_cfg = ours.config.replace(layer_pattern=[pattern[0]] + [change(s) for s in pattern[1:]])
    wrong = al.build_model(wrong_cfg).eval()
    wrong.load_state_dict(ours.state_dict())
    assert compare(hf, wrong)["hidden"] > 1e-3, what


@pytest.mark.hf
def test_parity_fails_with_a_norm_before_the_first_attention() -> None:
    hf = hf_model("ModernBertModel")
    ours = from_hf(hf)
    wrong = al.build_model(ours.config.replace(first_attn_norm=True)).eval()
    sd = ours.state_dict()
    with torch.no_grad():
        wrong.load_state_dict(sd, strict=False)
        wrong.encoder.blocks[0].attn_norm.weight.fill_(1.0)  # an untrained LayerNorm
    assert compare(hf, wrong)["hidden"] > 1e-3


# --- config.json both ways ----------------------------------------------------------------------


def test_config_from_the_card_and_back() -> None:
    """The card's keys (older spelling: global/local_rope_theta, global_attn_every_n_layers) give
    the preset; the preset gives transformers-5 keys that read back the same."""
    conv = ModernBertConverter()
    card = dict(
        architectures=["ModernBertForMaskedLM"], global_rope_theta=160000.0,
        local_rope_theta=10000.0, global_attn_every_n_layers=3, local_attention=128,
        classifier_bias=False, decoder_bias=True, pad_token_id=50283,
    )  # fmt: skip
    preset = al.presets.get("modernbert-base")
    assert conv.config_from_hf(card) == preset
    hf = conv.config_to_hf(preset)
    assert hf["layer_types"][:4] == ["full_attention", "sliding_attention"] * 1 + [
        "sliding_attention",
        "full_attention",
    ]
    assert hf["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert hf["local_attention"] == 128
    assert conv.config_from_hf(hf) == preset


@pytest.mark.parametrize(
    ("key", "value", "hint"),
    [
        ("embedding_dropout", 0.1, "not modelled"),
        ("decoder_bias", False, "decoder has a bias"),
        ("classifier_activation", "relu", "FFN's activation"),
        ("architectures", ["ModernBertForSequenceClassification"], "only ModernBertModel"),
        ("layer_types", ["full_attention", "chunked_attention"], "one of"),
        (
            "rope_parameters",
            {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "only 'default'",
        ),
        ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "not modelled here"),
    ],
)
def test_unsupported_configs_are_refused_by_name(key: str, value, hint: str) -> None:
    data = {"architectures": ["ModernBertForMaskedLM"], "num_hidden_layers": 2, key: value}
    with pytest.raises(ConversionError, match=hint):
        ModernBertConverter().config_from_hf(data)


def test_what_modernbert_cannot_express_is_refused() -> None:
    conv = ModernBertConverter()
    cfg = al.presets.tiny(al.presets.get("modernbert-base"))
    two_windows = (LayerSpec(), LayerSpec(sliding_window=4), LayerSpec(sliding_window=6))
    with pytest.raises(ConversionError, match="one local window"):
        conv.config_to_hf(cfg.replace(n_layers=3, layer_pattern=two_windows))
    nope_global = (LayerSpec(positional={"kind": "none"}), LayerSpec(sliding_window=4))
    with pytest.raises(ConversionError, match="global layers use the model's RoPE"):
        conv.config_to_hf(cfg.replace(layer_pattern=nope_global))
    with pytest.raises(ConversionError, match="first_attn_norm"):
        conv.config_to_hf(cfg.replace(first_attn_norm=True))


# --- the layer pattern as config ----------------------------------------------------------------


def _encoder(**changes) -> ModelConfig:
    base = dict(arch="encoder", vocab_size=50, d_model=32, n_layers=3, n_heads=4)
    return ModelConfig(**{**base, "positional": RoPE(base=500.0), **changes})


@pytest.mark.parametrize(
    ("changes", "hint"),
    [
        (
            dict(layer_pattern=[{"sliding_window": 3}], attention={"sliding_window": 5}),
            "exclude each other",
        ),
        (dict(layer_pattern=[{"positional": {"kind": "learned", "max_len": 8}}]), "embeddings"),
        (dict(layer_pattern=[]), "is empty"),
        (
            dict(layer_pattern=[{"sliding_window": 3}], attention={"kind": "linear"}),
            "softmax",
        ),
        (dict(first_attn_norm=False, norm_placement="post"), "first_attn_norm"),
        (dict(mlm_dense_bias=False), "mlm_dense_bias"),
        (
            dict(layer_pattern=[{"positional": {"kind": "rope", "fraction": 0.1}}]),
            "layer_pattern.0.positional.fraction",
        ),
        (
            dict(layer_pattern=[{"positional": {"kind": "t5-relative", "max_distance": 8}}]),
            "layer_pattern.0.positional.max_distance",
        ),
    ],
)
def test_bad_layer_settings_fail_with_the_fix(changes: dict, hint: str) -> None:
    with pytest.raises(ConfigError, match=hint) as info:
        _encoder(**changes)
    assert len(info.value.problems) == 1, info.value.problems  # this rule and no other


def test_every_layer_rule_has_a_case() -> None:
    """One `p.append(` per rule of ModelConfig._layer_problems, each a case above (the other
    case is LayerSpec's own validator), as tests/config/test_config.py does for _problems."""
    import inspect

    rules = inspect.getsource(ModelConfig._layer_problems).count("p.append(")
    cases = test_bad_layer_settings_fail_with_the_fix.pytestmark[0].args[1]
    # the others: LayerSpec's validator and a layer's own RoPE / T5 rules (their problems())
    assert rules == len(cases) - 3


def test_pattern_round_trips_through_json() -> None:
    cfg = _encoder(layer_pattern=[{}, {"sliding_window": 3, "positional": {"kind": "none"}}])
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert isinstance(cfg.layer_pattern[1], LayerSpec)


def _layer_reference(cfg: ModelConfig, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The pattern spelled out: layer i of the patterned model equals layer i of a model built
    without a pattern, with layer i's window and RoPE as the whole model's. Runs the blocks one
    by one, each through a one-layer stack of its own configuration."""
    torch.manual_seed(0)
    model = al.build_model(cfg).eval()
    pattern = cfg.layer_pattern
    x = model.encoder.embedding_norm(model._embed(ids)) if cfg.embedding_norm else model._embed(ids)
    positions = torch.arange(ids.shape[1]).expand(ids.shape)
    for i, block in enumerate(model.encoder.blocks):
        spec = pattern[i % len(pattern)]
        single = cfg.replace(
            n_layers=1,
            layer_pattern=None,
            positional=(spec.positional or cfg.positional).to_dict(),
            attention={**cfg.attention.to_dict(), "sliding_window": spec.sliding_window},
            embedding_norm=False,
            final_norm=False,
            mlm_head=False,
            first_attn_norm=True,
        )
        one = al.build_model(single).eval()
        one.encoder.blocks[0] = block
        x, _ = one.encoder(x, positions, mask.bool())
    return model.encoder.final_norm(x), model


def test_each_layer_attends_as_its_pattern_entry() -> None:
    cfg = _encoder(
        n_layers=4,
        layer_pattern=[
            {"sliding_window": 2, "positional": {"kind": "rope", "base": 20.0}},
            {},
            {"sliding_window": 4, "positional": {"kind": "none"}},
        ],
    )
    ids = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 7:] = 0
    with torch.no_grad():
        ref, model = _layer_reference(cfg, ids, mask)
        out = model(ids, attention_mask=mask).hidden
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], rtol=0, atol=1e-5)
    # and the pattern matters: all layers global differ
    with torch.no_grad():
        plain = al.build_model(cfg.replace(layer_pattern=None)).eval()
        plain.load_state_dict(model.state_dict())
        assert (plain(ids, attention_mask=mask).hidden - out)[real].abs().max() > 1e-3


def test_a_padded_row_equals_the_row_alone() -> None:
    cfg = al.presets.tiny(al.presets.get("modernbert-base"))
    torch.manual_seed(5)
    model = al.build_model(cfg).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    with torch.no_grad():
        both = model(ids, attention_mask=mask).logits
        alone = model(ids[1:, :8]).logits
    torch.testing.assert_close(both[1, :8], alone[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kernel", ["naive", "auto"])
def test_cached_decoding_equals_recomputation_with_a_pattern(kernel: str) -> None:
    """A decoder alternating a 3-token window (own RoPE base) with global layers: logits of a
    prompt then one token at a time through the cache equal one full forward pass."""
    cfg = ModelConfig(
        arch="decoder",
        vocab_size=40,
        d_model=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        positional=RoPE(),
        layer_pattern=[{"sliding_window": 3, "positional": {"kind": "rope", "base": 30.0}}, {}],
    )
    torch.manual_seed(7)
    model = al.set_kernel(al.build_model(cfg).eval(), kernel)
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(2, 10)
        steps = [model(ids[:, :4], cache=cache).logits]
        for t in range(4, 10):
            steps.append(model(ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.hf
@pytest.mark.parametrize("cls", CLASSES)
def test_save_pretrained_is_read_by_transformers_and_back(tmp_path, cls: str) -> None:
    """save_pretrained writes a folder transformers' from_pretrained loads with the same outputs,
    and load_pretrained (no transformers) reads the same model back."""
    transformers = _transformers()
    hf = hf_model(cls)
    ours = from_hf(hf).eval()
    al.interop.save_pretrained(ours, tmp_path)
    loaded = getattr(transformers, cls).from_pretrained(tmp_path).eval()
    assert max(compare(loaded, ours).values()) <= TOL
    again = al.interop.load_pretrained(tmp_path).eval()
    assert again.config == ours.config
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in ours.state_dict().items())
