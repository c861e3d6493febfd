"""Swin (Liu et al. 2021, arXiv:2103.14030): window attention with shifted windows and the
relative position bias against a float64 loop over tokens, and the `swin` converter against
transformers' SwinModel on tiny random-weight models built from configs (no downloads), fp32,
eval mode, eager and sdpa on the HF side, images whose grids need padding included."""

from __future__ import annotations

import re

import pytest
import torch

import attnlab as al
from attnlab.config import ConfigError, ModelConfig
from attnlab.interop import ConversionError, from_hf, to_hf
from attnlab.interop.swin import _LEGACY, SwinConverter
from attnlab.nn.swin import GridContext, WindowAttention

TOL = 1e-4
F64 = torch.float64
# a 16x16 grid for 32x32 images: stages at 16, 8 and 4 (the last one window, unshifted)
SIZES = dict(
    image_size=32, patch_size=2, embed_dim=16, depths=[2, 2, 2], num_heads=[2, 4, 8],
    window_size=4,
)  # fmt: skip


def _transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def hf_model(impl: str = "eager", cls: str = "SwinModel") -> torch.nn.Module:
    """A fresh SwinModel (transformers' SwinLayer keeps a shift it turned off for a small grid,
    so one model per image size), or SwinForImageClassification with 5 labels. Norms, biases
    and the bias tables moved off their init."""
    transformers = _transformers()
    torch.manual_seed(0)
    labels = {"num_labels": 5} if cls == "SwinForImageClassification" else {}
    config = transformers.SwinConfig(**SIZES, **labels, attn_implementation=impl)
    model = getattr(transformers, cls)(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "bias_table" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model.eval()


def images(side: int, b: int = 2) -> torch.Tensor:
    return torch.randn(b, 3, side, side, generator=torch.Generator().manual_seed(2))


def diff(hf: torch.nn.Module, ours: torch.nn.Module, px: torch.Tensor) -> dict[str, float]:
    """Max |difference| of the final hidden states and pooled output (and logits)."""
    with torch.no_grad():
        ref = getattr(hf, "swin", hf)(pixel_values=px)
        out = ours(pixel_values=px)
        res = {
            "hidden": (out.hidden - ref.last_hidden_state).abs().max().item(),
            "pooled": (out.hidden.mean(1) - ref.pooler_output).abs().max().item(),
        }
        if out.logits is not None:
            res["logits"] = (out.logits - hf(pixel_values=px).logits).abs().max().item()
    return res


# --- window attention against a loop over tokens ------------------------------------------------


def naive_window_attention(attn: WindowAttention, x: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """float64, one query token at a time: the grid rolled by -shift, a token sees the tokens of
    its w x w window of the rolled grid, with the table's bias for their (dy, dx) and -100 added
    where the two came from different regions of the unrolled grid (Swin's mask)."""
    w, s = attn.window_size, attn.shift
    B, T, C = x.shape
    nh, D = attn.n_heads, attn.head_dim
    x = x.to(F64)

    def proj(lin):  # (B, T, C) -> (B, heads, T, D)
        return (x @ lin.weight.to(F64).T + lin.bias.to(F64)).view(B, T, nh, D).transpose(1, 2)

    q, k, v = proj(attn.q_proj), proj(attn.k_proj), proj(attn.v_proj)
    table = attn.relative_position_bias_table.to(F64)

    def region(i: int, n: int) -> int:
        return int(i >= n - w) + int(i >= n - s) if s else 0

    out = torch.zeros(B, nh, T, D, dtype=F64)
    for t in range(T):
        r, c = divmod(t, W)
        rr, cc = (r - s) % H, (c - s) % W  # place in the rolled grid
        keys, bias = [], []
        for u in range(T):
            r2, c2 = divmod(u, W)
            rr2, cc2 = (r2 - s) % H, (c2 - s) % W
            if (rr // w, cc // w) != (rr2 // w, cc2 // w):
                continue
            dy, dx = rr % w - rr2 % w, cc % w - cc2 % w
            b = table[(dy + w - 1) * (2 * w - 1) + dx + w - 1]  # (heads,)
            same = (region(rr, H), region(cc, W)) == (region(rr2, H), region(cc2, W))
            keys.append(u)
            bias.append(b + (0.0 if same else -100.0))
        scores = (q[:, :, t : t + 1] @ k[:, :, keys].transpose(-1, -2))[:, :, 0] * D**-0.5
        p = torch.softmax(scores + torch.stack(bias, dim=-1), dim=-1)  # (B, heads, keys)
        out[:, :, t] = (p[..., None] * v[:, :, keys]).sum(2)
    out = out.transpose(1, 2).reshape(B, T, C)
    return out @ attn.o_proj.weight.to(F64).T + attn.o_proj.bias.to(F64)


@pytest.mark.parametrize("shift", [0, 2, 1])
@pytest.mark.parametrize("kernel", ["naive", "auto"])
def test_window_attention_equals_a_loop_over_tokens(shift: int, kernel: str) -> None:
    torch.manual_seed(3)
    attn = WindowAttention(d_model=12, n_heads=3, window_size=4, shift=shift, kernel=kernel)
    with torch.no_grad():
        attn.relative_position_bias_table.normal_(std=1.0)
    H, W = 8, 12
    x = torch.randn(2, H * W, 12, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = attn(x, GridContext(height=H, width=W))[0]
    torch.testing.assert_close(
        got.to(F64), naive_window_attention(attn, x, H, W), rtol=0, atol=1e-5
    )


def test_the_shift_and_the_bias_change_the_output() -> None:
    """The oracle above would pass a layer that ignored both: check each one moves the output."""
    torch.manual_seed(5)
    x = torch.randn(1, 64, 12)
    ctx = GridContext(height=8, width=8)
    base = WindowAttention(d_model=12, n_heads=3, window_size=4, shift=2)
    with torch.no_grad():
        base.relative_position_bias_table.normal_()
        unshifted = WindowAttention(d_model=12, n_heads=3, window_size=4, shift=0)
        unshifted.load_state_dict(base.state_dict())
        ref = base(x, ctx)[0]
        assert (unshifted(x, ctx)[0] - ref).abs().max() > 1e-3
        base.relative_position_bias_table.zero_()
        assert (base(x, ctx)[0] - ref).abs().max() > 1e-3


def test_a_grid_smaller_than_the_window_is_refused() -> None:
    attn = WindowAttention(d_model=8, n_heads=2, window_size=4)
    with pytest.raises(ValueError, match="smaller than the 4x4 window"):
        attn(torch.zeros(1, 9, 8), GridContext(height=3, width=3))


# --- parity with transformers --------------------------------------------------------------------


@pytest.mark.hf
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("side", [32, 28, 36])
def test_from_hf_equals_transformers(impl: str, side: int) -> None:
    """32: grids 16, 8, 4; 28: 14 (padded to 16 for the windows), 7, 4; 36: 18 (padded to 20),
    9 (odd: padded before merging), 5 (shifted, padded to 8)."""
    hf = hf_model(impl)
    ours = from_hf(hf).eval()
    d = diff(hf, ours, images(side))
    assert max(d.values()) <= TOL, d


@pytest.mark.hf
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_image_classification_equals_transformers(impl: str) -> None:
    hf = hf_model(impl, "SwinForImageClassification")
    ours = from_hf(hf).eval()
    assert ours.config.num_labels == 5
    d = diff(hf, ours, images(36))
    assert set(d) == {"hidden", "pooled", "logits"} and max(d.values()) <= TOL, d


@pytest.mark.hf
@pytest.mark.parametrize("cls", ["SwinModel", "SwinForImageClassification"])
def test_to_hf_round_trip_is_exact(cls: str) -> None:
    hf = hf_model(cls=cls)
    back = to_hf(from_hf(hf))
    assert type(back).__name__ == cls
    ref, got = hf.state_dict(), back.state_dict()
    assert sorted(got) == sorted(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert (back.config.depths, back.config.num_heads) == (hf.config.depths, hf.config.num_heads)
    assert max(diff(back, from_hf(hf).eval(), images(32)).values()) <= TOL


@pytest.mark.hf
def test_hub_checkpoint_names_are_read() -> None:
    """The Hub's swin checkpoints predate transformers 5's names (attention.self.query, ...,
    relative_position_index buffers): renamed back, they load to the same weights."""
    hf = hf_model()
    conv = SwinConverter()
    cfg = conv.config_from_hf({**hf.config.to_dict(), "architectures": ["SwinModel"]})
    new = conv.weights_from_hf(dict(hf.state_dict()), cfg)
    old_names: dict[str, torch.Tensor] = {}
    for name, t in hf.state_dict().items():
        for legacy, current in _LEGACY:  # current -> legacy, the inverse renaming
            current_re = re.escape(current.replace("\\", ""))
            name = re.sub(current_re, legacy.replace("\\", ""), name)
        old_names[name] = t
        if name.endswith("relative_position_bias_table"):
            old_names[name.replace("_bias_table", "_index")] = torch.zeros(16, 16)
    assert any(".attention.self.query." in k for k in old_names)
    old = conv.weights_from_hf(old_names, cfg)
    assert sorted(old) == sorted(new)
    assert all(torch.equal(old[k], new[k]) for k in new)


@pytest.mark.hf
def test_preset_parameter_count_equals_swin_model() -> None:
    transformers = _transformers()
    with torch.device("meta"):
        ref = transformers.SwinModel(transformers.SwinConfig())  # the swin-tiny card's sizes
    expected = sum(p.numel() for p in ref.parameters())
    assert al.count_parameters(al.presets.get("swin-tiny")) == expected == 27_519_354


@pytest.mark.hf
def test_a_tiny_preset_goes_to_transformers_and_agrees() -> None:
    cfg = al.presets.tiny(al.presets.get("swin-tiny"))
    torch.manual_seed(6)
    ours = al.build_model(cfg).eval()
    ours.hf_model_type = "swin"
    hf = to_hf(ours)
    assert hf.config.depths == [2, 2] and hf.config.window_size == 4
    assert max(diff(hf, ours, images(32)).values()) <= TOL


@pytest.mark.parametrize(
    ("key", "value", "hint"),
    [
        ("architectures", ["SwinForMaskedImageModeling"], "only SwinModel"),
        ("use_absolute_embeddings", True, "relative bias"),
        ("hidden_act", "gelu_10", "no exact attnlab activation"),
        ("mlp_ratio", 4.1, "must be whole"),
    ],
)
def test_unsupported_configs_are_refused_by_name(key: str, value, hint: str) -> None:
    with pytest.raises(ConversionError, match=hint):
        SwinConverter().config_from_hf({key: value})


# --- the stages as config ------------------------------------------------------------------------


def _swin(**changes) -> ModelConfig:
    return al.presets.tiny(al.presets.get("swin-tiny")).merged(**changes)


@pytest.mark.parametrize(
    ("changes", "hint"),
    [
        (dict(n_layers=3), "total depth (4)"),
        (dict(stages={"heads": [4, 6]}), "stages.heads.1 (6) must divide"),
        (dict(stages={"depths": [2]}), "one entry per stage"),
        (dict(attention={"sliding_window": 3}), "sliding_window (3) must be None"),
        (dict(norm={"kind": "rmsnorm"}), "norm ('rmsnorm') must be 'layernorm'"),
        (dict(ffn={"kind": "glu"}), "ffn ('glu') must be 'dense'"),
        (dict(classifier_pooler=True), "classifier_pooler (True) must be False"),
        (dict(attention={"k_bias": False}), "k_bias (False) must be True"),
        (dict(frontend={"kind": "patches", "image_size": 32, "patch_size": 8}), "patch-grid"),
    ],
)
def test_bad_stage_settings_fail_with_the_fix(changes: dict, hint: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(hint)):
        _swin(**changes)


def test_stages_round_trip_through_json() -> None:
    cfg = al.presets.get("swin-tiny")
    assert ModelConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.hf
def test_save_pretrained_is_read_by_transformers_and_back(tmp_path) -> None:
    """A classifier folder written by save_pretrained loads in transformers with the same logits,
    and load_pretrained (no transformers) reads the same model back."""
    transformers = _transformers()
    ours = from_hf(hf_model(cls="SwinForImageClassification")).eval()
    al.interop.save_pretrained(ours, tmp_path)
    loaded = transformers.SwinForImageClassification.from_pretrained(tmp_path).eval()
    assert max(diff(loaded, ours, images(32)).values()) <= TOL
    again = al.interop.load_pretrained(tmp_path).eval()
    assert again.config == ours.config
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in ours.state_dict().items())
