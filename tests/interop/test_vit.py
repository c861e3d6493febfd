"""ViT (Dosovitskiy et al. 2021, arXiv:2010.11929): the patch frontend, the pooler-free classifier
and the `vit` converter against transformers' ViTModel / ViTForImageClassification — tiny
random-weight models built from configs (no downloads), fp32, eval mode."""

from __future__ import annotations

import sys

import pytest
import torch

import attnlab as al
from attnlab.config import ConfigError, ModelConfig
from attnlab.interop import ConversionError
from attnlab.interop.vit import _LEGACY

TOL = 1e-4
SIZES = dict(
    image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=128,
)  # fmt: skip
CASES = {"bare": ("ViTModel", {}), "cls": ("ViTForImageClassification", {"num_labels": 5})}


def _transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def hf_model(case: str) -> torch.nn.Module:
    """Norms and biases moved off their initial 1 and 0, so a swapped tensor shows."""
    transformers = _transformers()
    cls, extra = CASES[case]
    torch.manual_seed(0)
    config = transformers.ViTConfig(**SIZES, **extra, attn_implementation="eager")
    model = getattr(transformers, cls)(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def images(h: int = 32, w: int = 32, b: int = 3) -> torch.Tensor:
    return torch.randn(b, 3, h, w, generator=torch.Generator().manual_seed(2))


def compare(hf: torch.nn.Module, ours: torch.nn.Module, px: torch.Tensor, **kw) -> dict:
    """Max |difference| of the final-normed hidden states (and logits, with a classifier)."""
    with torch.no_grad():
        ref = hf(pixel_values=px, output_hidden_states=True, **kw)
        out = ours(pixel_values=px, **kw)
    base = getattr(hf, "vit", hf)
    hidden = base.layernorm(ref.hidden_states[-1])  # last_hidden_state of the bare model
    res = {"hidden": (out.hidden - hidden).abs().max().item()}
    if getattr(ref, "logits", None) is not None:
        res["logits"] = (out.logits - ref.logits).abs().max().item()
    return res


@pytest.mark.hf
@pytest.mark.parametrize("case", CASES)
def test_from_hf_matches_transformers(case: str) -> None:
    hf = hf_model(case)
    ours = al.interop.from_hf(hf).eval()
    res = compare(hf, ours, images())
    assert len(res) == (2 if case == "cls" else 1)
    assert max(res.values()) < TOL, res
    if case == "bare":  # the bare model's output is last_hidden_state itself
        with torch.no_grad():
            ref = hf(pixel_values=images()).last_hidden_state
        torch.testing.assert_close(ours(pixel_values=images()).hidden, ref, atol=TOL, rtol=0)


@pytest.mark.hf
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    "size", [(48, 48), (48, 40), (24, 32)], ids=["larger", "non-square", "smaller"]
)
def test_interpolated_positions_match_transformers(case: str, size: tuple[int, int]) -> None:
    """interpolate_pos_encoding: the table resized bicubically to the new patch grid."""
    hf = hf_model(case)
    ours = al.interop.from_hf(hf).eval()
    px = images(*size)
    res = compare(hf, ours, px, interpolate_pos_encoding=True)
    assert max(res.values()) < TOL, res
    tokens = (size[0] // 8) * (size[1] // 8) + 1
    assert ours(pixel_values=px, interpolate_pos_encoding=True).hidden.shape == (3, tokens, 64)


def test_same_grid_is_not_interpolated() -> None:
    """transformers' no-op condition: same patch count and a square image use the table as is."""
    model = al.build_model(al.presets.tiny(al.presets.get("vit-base-patch16-224"))).eval()
    table = model.frontend.position_embeddings
    assert model.frontend.interpolated_positions(4, 4) is table
    assert model.frontend.interpolated_positions(2, 8).shape == table.shape  # 16 patches, resized
    assert not torch.equal(model.frontend.interpolated_positions(2, 8), table)
    with torch.no_grad():
        px = images()
        torch.testing.assert_close(
            model(pixel_values=px).hidden,
            model(pixel_values=px, interpolate_pos_encoding=True).hidden,
        )


@pytest.mark.hf
@pytest.mark.parametrize("case", CASES)
def test_to_hf_of_from_hf_is_exact(case: str) -> None:
    hf = hf_model(case)
    back = al.interop.to_hf(al.interop.from_hf(hf))
    a, b = dict(hf.state_dict()), dict(back.state_dict())
    assert set(a) == set(b), set(a) ^ set(b)
    pooler = ("pooler.dense.weight", "pooler.dense.bias")
    assert [k for k in a if not torch.equal(a[k], b[k]) and k not in pooler] == []
    if case == "bare":  # documented: the pooler is dropped on import and written as zeros
        assert all(not b[k].any() for k in pooler)
        with torch.no_grad():
            assert not back(pixel_values=images()).pooler_output.any()
    res = compare(back, al.interop.from_hf(back).eval(), images())
    assert max(res.values()) < TOL, res


@pytest.mark.hf
@pytest.mark.parametrize("case", CASES)
def test_save_load_round_trip(case: str, tmp_path, monkeypatch) -> None:
    transformers = _transformers()
    hf = hf_model(case)
    ours = al.interop.from_hf(hf).eval()
    al.interop.save_pretrained(ours, tmp_path)
    reread = getattr(transformers, type(hf).__name__).from_pretrained(tmp_path).eval()
    res = compare(reread, ours, images())
    assert max(res.values()) < TOL, res
    monkeypatch.setitem(sys.modules, "transformers", None)  # attnlab reads it alone
    loaded = al.interop.load_pretrained(tmp_path)
    assert loaded.config == ours.config
    sd, back = ours.state_dict(), loaded.state_dict()
    assert set(sd) == set(back) and all(torch.equal(sd[k], back[k]) for k in sd)


@pytest.mark.hf
def test_fine_tuning_start_equals_transformers_from_pretrained(tmp_path, monkeypatch) -> None:
    """load_pretrained(bare ViTModel folder, num_labels=3) builds what transformers'
    ViTForImageClassification.from_pretrained builds from it: the body from the checkpoint (its
    pooler unused), only the linear classifier new; with that layer copied across, the logits
    agree."""
    transformers = _transformers()
    hf = hf_model("bare")
    hf.save_pretrained(tmp_path)  # transformers' own folder, pooler included
    monkeypatch.setitem(sys.modules, "transformers", None)
    ours = al.interop.load_pretrained(tmp_path, num_labels=3)
    monkeypatch.undo()
    assert sorted(ours.new_tensors) == ["classifier.out_proj.bias", "classifier.out_proj.weight"]
    ref = transformers.ViTForImageClassification.from_pretrained(
        tmp_path, num_labels=3, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ref.classifier.weight.copy_(ours.classifier.out_proj.weight)
        ref.classifier.bias.copy_(ours.classifier.out_proj.bias)
    res = compare(ref, ours, images())
    assert max(res.values()) < TOL, res


def _legacy(key: str) -> str:
    """A transformers 5 name -> the Hub checkpoints' older one (the inverse of `_LEGACY`)."""
    for new, old in [
        ("vit.layers.", "vit.encoder.layer."),
        ("mlp.fc1", "intermediate.dense"),
        ("mlp.fc2", "output.dense"),
        ("attention.o_proj", "attention.output.dense"),
        ("attention.q_proj", "attention.attention.query"),
        ("attention.k_proj", "attention.attention.key"),
        ("attention.v_proj", "attention.attention.value"),
    ]:
        key = key.replace(new, old)
    return key


@pytest.mark.hf
def test_hub_checkpoint_names_are_read() -> None:
    """Hub checkpoints keep ViT's older tensor names (transformers renames them on load)."""
    hf = hf_model("cls")
    cfg = al.interop.from_hf(hf).config
    conv = al.interop.CONVERTERS.get("vit")
    sd = dict(hf.state_dict())
    old = {_legacy(k): v for k, v in sd.items()}
    assert "vit.encoder.layer.0.attention.attention.query.weight" in old
    assert "vit.encoder.layer.1.output.dense.bias" in old and len(_LEGACY) == 5
    new, legacy = conv.weights_from_hf(sd, cfg), conv.weights_from_hf(old, cfg)
    assert set(new) == set(legacy) and all(torch.equal(new[k], legacy[k]) for k in new)


def test_preset_tables_and_head() -> None:
    """ViT-B/16: 196 patches + the class token, a 1000-label linear head without pooler, and
    no token table."""
    with torch.device("meta"):
        model = al.build_model(al.presets.get("vit-base-patch16-224"))
    assert model.embed_tokens is None and model.classifier.dense is None
    assert model.frontend.position_embeddings.shape == (1, 197, 768)
    assert model.frontend.proj.weight.shape == (768, 3, 16, 16)
    assert model.classifier.out_proj.weight.shape == (1000, 768)


# --- inputs and configs that cannot work fail with their reason ---------------------------------


def tiny_vit() -> torch.nn.Module:
    return al.build_model(al.presets.tiny(al.presets.get("vit-base-patch16-224"))).eval()


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda m: m(pixel_values=images().to(torch.uint8)), TypeError, "floating point"),
        (lambda m: m(pixel_values=images()[0]), ValueError, "4-D"),
        (lambda m: m(pixel_values=images()[:, :1]), ValueError, "1 channels.*num_channels 3"),
        (lambda m: m(pixel_values=images(48, 48)), ValueError, "interpolate_pos_encoding=True"),
        (
            lambda m: m(pixel_values=images(4, 4), interpolate_pos_encoding=True),
            ValueError,
            "no 8x8",
        ),
        (lambda m: m(torch.zeros(2, 5, dtype=torch.long)), ValueError, "model\\(pixel_values="),
        (lambda m: m(), ValueError, "reads pixel_values"),
        (lambda m: m(pixel_values=images(), attention_mask=torch.ones(3, 5)), ValueError, "shape"),
    ],
    ids=["uint8", "3-d", "channels", "size", "too-small", "input_ids", "nothing", "mask"],
)
def test_bad_pixel_inputs_say_why(call, error, message) -> None:
    with pytest.raises(error, match=message):
        call(tiny_vit())


def test_a_token_model_refuses_pixels() -> None:
    bert = al.build_model(al.presets.tiny(al.presets.get("bert-base")))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="no frontend"):
        bert(ids, pixel_values=images())
    with pytest.raises(TypeError, match="interpolate_pos_encoding"):
        bert(ids, interpolate_pos_encoding=True)


VIT = al.presets.get("vit-base-patch16-224").to_dict()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(frontend={"kind": "patches", "image_size": 224, "patch_size": 15}), "divisible by"),
        (dict(frontend={"kind": "patchs", "image_size": 224, "patch_size": 16}), "'patches'"),
        (dict(vocab_size=100), "vocab_size \\(100\\) must be 0"),
        (dict(positional={"kind": "learned", "max_len": 197}), "positional \\('learned'\\)"),
        (dict(pad_token_id=0), "pad_token_id \\(0\\)"),
        (dict(frontend=None), "vocab_size \\(0\\) must be > 0"),
        (dict(arch="decoder", num_labels=0), "only for arch 'encoder'"),
    ],
)
def test_frontend_config_errors_name_field_and_fix(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**VIT, **change})


@pytest.mark.hf
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(architectures=["ViTForMaskedImageModeling"]), "ViTForMaskedImageModeling"),
        (dict(image_size=[32, 48]), "square"),
        (dict(hidden_act="gelu_10"), "hidden_act"),
    ],
)
def test_unmodelled_vit_config_is_rejected(change: dict, message: str) -> None:
    hf = {**_transformers().ViTConfig(**SIZES).to_dict(), "architectures": ["ViTModel"], **change}
    with pytest.raises(ConversionError, match=message):
        al.interop.CONVERTERS.get("vit").config_from_hf(hf)


def test_writing_needs_what_vit_computes() -> None:
    conv = al.interop.CONVERTERS.get("vit")
    cfg = al.presets.tiny(al.presets.get("vit-base-patch16-224"))
    with pytest.raises(ConversionError, match="classifier_pooler"):
        conv.config_to_hf(cfg.replace(classifier_pooler=True))
    with pytest.raises(ConversionError, match="norm_placement"):
        conv.config_to_hf(cfg.replace(norm_placement="post", final_norm=False))
    bert = al.presets.tiny(al.presets.get("bert-base")).replace(mlm_head=False, num_labels=2)
    with pytest.raises(ConversionError, match="classifier_pooler"):  # BERT's head has a pooler
        al.interop.CONVERTERS.get("bert").config_to_hf(bert.replace(classifier_pooler=False))
