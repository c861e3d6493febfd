"""BigBird's block-sparse attention (src/attnlab/nn/attention/block_sparse.py) against
transformers' BigBirdModel: tiny random-weight models built from a config (no download), fp32, a
right-padded batch, outputs compared at real tokens. Block size 8 and 2 random blocks put
transformers' switch to full attention at T <= (5 + 2·2)·8 = 72 tokens, so T = 96 and 131 run its
block-sparse path (131 is not a multiple of 8: transformers pads it) and T = 40 its fallback."""

from __future__ import annotations

import pytest
import torch

import attnlab as al
from attnlab.config import BlockSparseAttentionConfig, ModelConfig
from attnlab.nn.attention import AttnContext, BlockSparseAttention, BlockSparseMask
from attnlab.nn.attention import kernels as K
from attnlab.nn.attention.block_sparse import random_blocks
from attnlab.nn.attention.kernels import AttnCall, attend
from attnlab.nn.attention.masks import MaskSpec
from helpers.memory import LargestTensor

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

TOL = 1e-4
VOCAB, BLOCK, RANDOM = 128, 8, 2
SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=128, max_position_embeddings=512, block_size=BLOCK,
    num_random_blocks=RANDOM, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip
LENGTHS = [40, 96, 131]  # full-attention fallback, block-sparse, block-sparse with padding


def hf_model(model_cls: str = "BigBirdModel", **changes) -> torch.nn.Module:
    """A fresh model each time: transformers switches a model to full attention for good the
    first time it sees a short input."""
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(transformers.BigBirdConfig(**{**SIZES, **changes}))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial norms and biases (they start at 1 and 0)
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def batch(T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, T) ids and mask: rows of T, T - 13 and T // 2 real tokens, right-padded with 0."""
    g = torch.Generator().manual_seed(2)
    mask = (torch.arange(T) < torch.tensor([T, T - 13, T // 2])[:, None]).long()
    ids = torch.randint(1, VOCAB, (3, T), generator=g)
    return ids.masked_fill(mask == 0, 0), mask


def max_diff(hf: torch.nn.Module, ours: torch.nn.Module, T: int) -> dict[str, float]:
    ids, mask = batch(T)
    real = mask.bool()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        out = ours(ids, mask)
    res = {"hidden": (ref.hidden_states[-1] - out.hidden)[real].abs().max().item()}
    if out.logits is not None:
        res["logits"] = (ref.logits - out.logits)[real].abs().max().item()
    return res


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("model_cls", ["BigBirdModel", "BigBirdForMaskedLM"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_from_hf_matches_transformers(T: int, model_cls: str, training: bool) -> None:
    """Eval mode: every random block is block 0 (counted 1 + r times). Training mode (dropout 0):
    transformers' numpy plan seeded with each layer's index."""
    hf = hf_model(model_cls).train(training)
    ours = al.interop.from_hf(hf).train(training)
    sparse = T > (5 + 2 * RANDOM) * BLOCK
    assert isinstance(ours.config.attention, BlockSparseAttentionConfig)
    res = max_diff(hf, ours, T)
    assert hf.base_model.attention_type == ("block_sparse" if sparse else "original_full")
    assert max(res.values()) < TOL, res


def test_legacy_plan_lengths_match_transformers() -> None:
    """T = 1024 takes transformers' "old plans used in paper" (`_bigbird_block_rand_mask`, drawn
    from a max_position_embeddings-long plan); here with 16-token blocks and 3 random blocks."""
    changes = dict(hidden_size=32, num_attention_heads=2, block_size=16, num_random_blocks=3)
    for training in (True, False):
        hf = hf_model(max_position_embeddings=2048, **changes).train(training)
        ours = al.interop.from_hf(hf).train(training)
        res = max_diff(hf, ours, 1024)
        assert max(res.values()) < TOL, (training, res)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_pattern_is_what_transformers_attends_to(training: bool) -> None:
    """The keys with non-zero weight in transformers' block-sparse attention probabilities, per
    head, at real queries, are exactly the mask description's (an oracle independent of the
    outputs: the pattern itself)."""
    T = 131
    hf = hf_model(num_hidden_layers=1).train(training)
    ids, mask = batch(T)
    with torch.no_grad():
        probs = hf(input_ids=ids, attention_mask=mask, output_attentions=True).attentions[0]
    layer = al.interop.from_hf(hf).train(training).encoder.blocks[0].self_attn
    pattern = layer.pattern(T, mask.bool(), ids.device)
    seen = probs[..., :T, :T] > 0  # (B, H, T, T); transformers padded to 136
    real = mask.bool()[:, None, :, None].expand_as(seen)
    assert torch.equal(seen[real], pattern.dense().expand_as(seen)[real])
    heads_differ = not torch.equal(pattern.counts[0], pattern.counts[1])
    assert heads_differ == training  # eval: block 0 for every head, no randomness
    assert bool((pattern.counts > 1).any()) == (not training)  # eval repeats block 0


def test_small_input_falls_back_to_full_attention() -> None:
    layer = BlockSparseAttention(d_model=32, n_heads=4, block_size=4, num_random_blocks=1)
    assert layer.min_sparse_len == (5 + 2) * 4 + 1
    x = torch.randn(2, 28, 32)
    pos = torch.arange(28).expand(2, 28)
    full = layer(x, AttnContext(MaskSpec(pos, pos, aligned=True)))[0]
    plain = super(BlockSparseAttention, layer).forward(x, AttnContext(MaskSpec(pos, pos)))[0]
    torch.testing.assert_close(full, plain)


def test_to_hf_of_from_hf_is_exact() -> None:
    for cls in ("BigBirdModel", "BigBirdForMaskedLM"):
        hf = hf_model(cls)
        back = dict(al.interop.to_hf(al.interop.from_hf(hf)).state_dict())
        state = dict(hf.state_dict())
        assert set(back) == set(state)
        pooler = [k for k in state if "pooler" in k]  # not modelled: written as zeros
        assert all(not back[k].any() for k in pooler)
        assert all(torch.equal(state[k], back[k]) for k in state if k not in pooler)


def test_original_full_and_unsupported_heads() -> None:
    hf = hf_model(attention_type="original_full")
    ours = al.interop.from_hf(hf)
    assert ours.config.attention.kind == "softmax"
    assert max(max_diff(hf, ours, 96).values()) < TOL
    with pytest.raises(ValueError, match="hidden_act, not tanh"):
        al.interop.from_hf(hf_model("BigBirdForSequenceClassification"))


def test_preset_block_settings_equal_the_model_card() -> None:
    a = al.presets.get("bigbird-roberta-base").attention
    card = transformers.BigBirdConfig()  # google/bigbird-roberta-base's values are the defaults
    assert (a.kind, a.block_size, a.num_random_blocks) == ("block-sparse", card.block_size, 3)
    assert card.attention_type == "block_sparse" and card.num_random_blocks == 3
    assert a.legacy_plan_len == card.max_position_embeddings


# --- kernels ------------------------------------------------------------------------------------


def sparse_inputs(T: int = 100, H: int = 4, training: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, H, T, 16, generator=g, requires_grad=True) for _ in range(3))
    padding = torch.arange(T) < torch.tensor([T, T - 21])[:, None]  # (2, T)
    rand = random_blocks(-(-T // BLOCK), BLOCK, RANDOM, H, 3, training, 512)
    mask = BlockSparseMask.bigbird(T, BLOCK, torch.from_numpy(rand), padding)
    return q, k, v, mask


def run_kernel(name: str, training: bool) -> tuple[torch.Tensor, tuple]:
    q, k, v, mask = sparse_inputs(training=training)
    out, _ = attend(q, k, v, AttnCall(scale=0.25, mask=mask, bias=mask.bias()), kernel=name)
    real = mask.key_padding[:, None, :, None]  # padding queries: any output, ignored
    (out * real).square().sum().backward()
    return out * real, (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize(
    "kernel",
    [
        "auto",
        "block-gather",
        "chunked",
        "tiled",
    ],
)
def test_kernels_equal_naive_on_the_pattern(kernel: str, training: bool, monkeypatch) -> None:
    """Blocks forced small (several row runs or chunks of query blocks, gathered keys,
    recomputation in backward); T = 100 leaves the last block short."""
    monkeypatch.setattr(K.chunked, "BLOCK_BYTES", 4 * 2 * 4 * 100 * 24)  # 24 rows per block
    monkeypatch.setattr(K.chunked, "SAVE_BYTES", 0)
    monkeypatch.setattr(K.block_gather, "BLOCK_BYTES", 4 * 2 * 4 * 8 * BLOCK * 16 * 3)  # 3 blocks
    monkeypatch.setattr(K.block_gather, "SAVE_BYTES", 0)
    out, grads = run_kernel(kernel, training)
    ref_out, ref_grads = run_kernel("naive", training)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=2e-5)
    for got, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=5e-5)


def test_visible_keys_skip_what_no_head_sees() -> None:
    """A run of middle rows sees its window, the global blocks and its random blocks — in
    training mode all drawn from the first 2r + 5 blocks — not the whole sequence."""
    _, _, _, mask = sparse_inputs(T=400)
    keys = mask.visible_keys(slice(200, 208))  # query block 25 of 50
    assert isinstance(keys, torch.Tensor)
    blocks = set((keys // BLOCK).tolist())
    assert {0, 24, 25, 26, 49} <= blocks <= {0, 24, 25, 26, 49} | set(range(2 * RANDOM + 5))
    runs = mask.row_runs(slice(0, 400))  # the global blocks apart, the rest in short runs
    assert [r.start for r in runs[1:]] == [r.stop for r in runs[:-1]]
    assert runs[0] == slice(0, 8) and runs[-1] == slice(392, 400)
    assert all(r.stop - r.start <= 8 * BLOCK for r in runs)


@pytest.mark.parametrize("kernel", ["auto", "block-gather", "chunked", "naive"])
def test_no_kernel_but_naive_builds_the_n_by_n_wall(kernel: str) -> None:
    """T = 2,048, 8 heads, blocks of 64: (1, 8, T, T) would hold 33.6M elements. Forward and
    backward through a real block-sparse encoder, training mode (its random plan)."""
    n = 2048
    cfg = ModelConfig(
        arch="encoder", vocab_size=64, d_model=64, n_layers=1, n_heads=8,
        attention=BlockSparseAttentionConfig(block_size=64, num_random_blocks=3),
    )  # fmt: skip
    torch.manual_seed(0)
    model = al.set_kernel(al.build_model(cfg).train(), kernel)
    ids = torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(0))
    with LargestTensor() as mode:
        model(ids).hidden.sum().backward()
    wall = 8 * n * n
    if kernel == "naive":
        assert mode.largest >= wall  # the oracle does build it: the test can see the wall
    else:
        assert mode.largest < wall // 4, f"{kernel} allocated {mode.largest:,} elements"
