"""What every attention kind shares, declared once (src/attnlab/nn/attention/heads.py, masks.py,
kernels/base.py):

- one head geometry: the same sizes fail the same way in softmax and linear attention, every
  problem at once, with the fix;
- constructor parameters written once: a kind that passes `**kwargs` on still names all of its
  parent's parameters in its signature, and `Registry.build` (by name) reaches them;
- kernels and masks declare what they support by name; a mask kind that declares nothing more
  than `block` runs through every kernel and equals the naive one;
- the fused q/k/v layout is the layer's own: switched by its methods, refused where it cannot
  serve (a memory, a kind with its own projections), state dicts unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from attnlab.nn.attention import (
    ATTENTIONS,
    KERNELS,
    Attention,
    AttnContext,
    BlockSparseAttention,
    HeadGeometry,
    Kernel,
    KernelCaps,
    LinearAttention,
    LongformerAttention,
    MaskCaps,
    MaskDescription,
    MaskSpec,
)
from attnlab.nn.attention.block_sparse import BlockSparseMask
from attnlab.nn.attention.kernels import AttnCall, NoKernelError, attend


def test_geometry_defaults_and_widths():
    g = HeadGeometry.of(64, 8, 2)
    assert (g.n_kv_heads, g.head_dim, g.q_width, g.kv_width) == (2, 8, 64, 16)
    assert HeadGeometry.of(64, 8).n_kv_heads == 8  # MHA
    assert HeadGeometry.of(10, 4, head_dim=3).head_dim == 3  # no divisibility needed then


@pytest.mark.parametrize("kind", [Attention, LinearAttention])
def test_every_kind_checks_heads_alike_and_reports_every_problem(kind):
    with pytest.raises(ValueError) as info:
        kind(d_model=10, n_heads=12, n_kv_heads=5)
    message = str(info.value)
    assert "n_kv_heads in {1, 2, 3, 4, 6, 12}" in message  # the fix, with the values
    assert "d_model (10) must be divisible by n_heads (12)" in message  # and the other problem
    with pytest.raises(ValueError, match=r"must be >= 1"):
        kind(d_model=8, n_heads=2, n_kv_heads=0)


def test_every_attention_kind_has_a_keyword_only_signature_naming_its_parents_parameters():
    shared = set(inspect.signature(Attention).parameters)
    assert {"d_model", "n_heads", "qkv_bias", "q_norm", "scale", "kernel"} <= shared
    for name in ATTENTIONS:
        params = inspect.signature(ATTENTIONS.get(name)).parameters.values()
        assert params and all(p.kind is p.KEYWORD_ONLY for p in params), name
    for kind in (BlockSparseAttention, LongformerAttention):  # they pass **attention on
        assert shared <= set(inspect.signature(kind).parameters), kind.__name__
    assert inspect.signature(LongformerAttention).parameters["qkv_bias"].default is True


def test_the_builder_reaches_a_parameter_passed_on_by_kwargs():
    dims = {"d_model": 16, "n_heads": 4, "n_kv_heads": 2, "head_dim": 4}
    layer = ATTENTIONS.build(
        "block-sparse", {"kind": "block-sparse", "qkv_bias": True, "block_size": 4}, dims
    )
    assert layer.q_proj.bias is not None and layer.block_size == 4 and layer.n_kv_heads == 2
    assert layer.k_proj.out_features == 2 * 4


def test_kernels_declare_their_capabilities_by_name():
    for name in KERNELS:
        caps = KERNELS.get(name).caps
        assert isinstance(caps, KernelCaps) and dataclasses.is_dataclass(caps), name
    assert KERNELS.get("naive").caps.weights and not KERNELS.get("tiled").caps.dropout
    with pytest.raises(TypeError):
        Kernel(KERNELS.get("naive").fn, KernelCaps(bias=1, weights=1, dropout=1, backward=1))
    with pytest.raises(TypeError):
        KernelCaps(True, True, True, True)  # keyword-only: no positional booleans


def test_mask_kinds_declare_their_structure():
    assert MaskSpec.caps == MaskCaps(offsets=True, key_blocks=False, pointwise=True)
    assert BlockSparseMask.caps == MaskCaps(offsets=False, key_blocks=True, pointwise=True)
    assert MaskDescription.caps == MaskCaps(offsets=False, key_blocks=False)


@dataclasses.dataclass(frozen=True)
class OnlyBlocks(MaskDescription):
    """A mask kind that declares nothing beyond `block`: kernels must take the safe paths."""

    spec: MaskSpec

    def block(self, q, k, padding=True):
        return self.spec.block(q, k, padding)


@pytest.mark.parametrize("kernel", ["auto", *(k for k in KERNELS if k != "naive")])
def test_a_mask_kind_with_only_block_runs_in_every_kernel_that_serves_it(kernel):
    """A kernel that exploits more structure than `block` refuses with its reason; the others,
    and the selector, compute naive's function (sdpa too: 11 query rows, at most DENSE_ROWS, take
    the mask as the dense tensor `block` gives)."""
    torch.manual_seed(0)
    B, H, T, D = 2, 2, 11, 8
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    pos = torch.arange(T).expand(B, T)
    padding = torch.ones(B, T, dtype=torch.bool)
    padding[1, :4] = False  # a left-padded row: its first queries see no key
    mask = OnlyBlocks(MaskSpec(pos, pos, causal=True, window=4, key_padding=padding))
    call = AttnCall(scale=D**-0.5, mask=mask)
    want, _ = attend(q, k, v, call, kernel="naive")
    if kernel in ("alibi-sdpa", "block-gather", "flex", "paged", "paged-flex"):
        with pytest.raises(NoKernelError, match=f"'{kernel}' cannot serve this call: it"):
            attend(q, k, v, call, kernel=kernel)
        return
    got, _ = attend(q, k, v, call, kernel=kernel)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _layer() -> Attention:
    torch.manual_seed(0)
    return Attention(d_model=16, n_heads=4, n_kv_heads=2, qkv_bias=True, k_bias=False).eval()


def test_the_fused_layout_is_switched_by_the_layer_and_computes_the_same():
    layer, x = _layer(), torch.randn(2, 5, 16)
    ctx = AttnContext(MaskSpec(torch.arange(5).expand(2, 5), torch.arange(5).expand(2, 5), True))
    names = list(layer.state_dict())
    want, _ = layer(x, ctx)
    layer.fuse_projections()
    layer.fuse_projections()  # a second call changes nothing
    assert layer.projection_layout == "fused" and next(iter(layer._modules)) == "qkv_proj"
    assert list(layer.state_dict()) == names
    torch.testing.assert_close(layer(x, ctx)[0], want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="unfuse"):
        layer(x, AttnContext(), memory=x)  # cross-attention reads keys from another input
    layer.unfuse_projections()
    assert layer.projection_layout == "separate" and list(layer._modules)[:3] == [
        "q_proj",
        "k_proj",
        "v_proj",
    ]
    assert layer.k_proj.bias is None  # the zero slice of the fused bias is not kept
    torch.testing.assert_close(layer(x, ctx)[0], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", [LongformerAttention, BlockSparseAttention, LinearAttention])
def test_kinds_with_their_own_projections_have_no_fused_layout(kind):
    layer = kind(d_model=16, n_heads=4)
    with pytest.raises(ValueError, match="no fused layout"):
        layer.fuse_projections()
    assert layer.projection_layout == "separate"


def test_mla_has_the_separate_layout_and_no_fused_one():
    from attnlab.nn.attention.mla import MultiHeadLatentAttention

    layer = MultiHeadLatentAttention(
        d_model=16, n_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4
    )
    assert layer.projection_layout == "separate" and layer.fused_layouts() == {}
    with pytest.raises(ValueError, match="no fused layout"):
        layer.fuse_projections()


def test_a_subclass_with_its_own_forward_is_left_unfused():
    """A forward of its own may read q_proj, k_proj, v_proj, which fusing would remove: such a
    subclass is not fusable unless it says so, and al.fuse leaves it as it is."""

    class OwnForward(Attention):
        def forward(self, x, ctx, memory=None, cache=None, need_weights=False):
            q = self.q_proj(x)  # reads the separate maps
            return super().forward(x, ctx, memory, cache, need_weights)[0] + 0 * q.sum(), None

    class SaysFusable(OwnForward):
        fusable = True

    assert Attention.fusable and not OwnForward.fusable and SaysFusable.fusable
    layer = OwnForward(d_model=16, n_heads=4)
    with pytest.raises(ValueError, match="no fused layout"):
        layer.fuse_projections()
