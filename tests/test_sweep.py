"""Sweeps: every preset and every registry entry builds, runs forward and backward, and learns.

Three parametrised tests (docs/architecture.md, "Registries"):

- every preset at tiny size: a training step gives a finite loss, logits of the right shape and a
  finite gradient on every parameter (only unrouted MoE experts may get none);
- every registry entry (positional schemes, kernels, norms, FFNs, init schemes) inside a tiny
  decoder and encoder-decoder: it is really the module in use, and it runs forward and backward;
  a kernel also gives the naive kernel's outputs and gradients;
- every preset learns a copy task: the held-out loss falls below 0.7 x min(initial loss, ln V).
  ln V is the best loss a model that ignores its context can reach on uniform random tokens, so
  reaching 0.7 of it needs working attention, gradients and optimisation.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnlab as al
from attnlab.config import (
    GLUFFN,
    ALiBi,
    BlockSparseAttentionConfig,
    DenseFFN,
    LayerNormConfig,
    LearnedPositions,
    ModelConfig,
    MoEFFN,
    NoPositions,
    RMSNormConfig,
    RoPE,
    Sinusoidal,
    T5RelativeBias,
    UnitOffsetRMSNormConfig,
    XLAttentionConfig,
    XLRelative,
)
from attnlab.nn.attention import KERNELS
from attnlab.nn.attention.layer import Attention
from attnlab.nn.ffn import FFNS
from attnlab.nn.init import INITS
from attnlab.nn.norms import NORMS
from attnlab.nn.positional import POSITIONAL
from helpers.inputs import inputs_for

PRESETS = al.presets.names()


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread; two pytest-xdist workers then share 2 cores without
    oversubscription (and the learning runs stay bit-reproducible). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def first_stack(model: nn.Module) -> nn.Module:
    return model.decoder if hasattr(model, "decoder") else model.encoder


def expected_logits_shape(cfg: ModelConfig, labels: torch.Tensor) -> tuple[int, ...] | None:
    if cfg.arch == "encoder" and cfg.num_labels:
        return (labels.shape[0], cfg.num_labels)
    if cfg.arch == "encoder" and not cfg.mlm_head:
        return None
    return (*labels.shape, cfg.vocab_size)


def training_step(model: nn.Module, cfg: ModelConfig) -> tuple[torch.Tensor, al.ModelOutput]:
    args, kwargs, labels = inputs_for(cfg)
    out = model(*args, **kwargs)
    image = cfg.frontend is not None and cfg.arch == "encoder"
    tokens = (2, cfg.frontend.seq_len) if image else (args or (labels,))[-1].shape
    width = cfg.d_model
    if cfg.stages is not None:  # Swin: the last stage's grid (each merge halves a side) and width
        side = math.isqrt(cfg.frontend.seq_len)
        for _ in cfg.stages.depths[1:]:
            side = (side + 1) // 2
        tokens, width = (2, side * side), cfg.d_model << (len(cfg.stages.depths) - 1)
    assert out.hidden.shape == (*tokens, width)
    shape = expected_logits_shape(cfg, labels)
    assert (out.logits is None) if shape is None else (tuple(out.logits.shape) == shape)
    if out.logits is None:  # an encoder without a head: any scalar of the hidden states
        loss = out.hidden.square().mean()
    else:
        loss = F.cross_entropy(out.logits.flatten(0, -2), labels.flatten())
    if out.aux_loss is not None:
        loss = loss + out.aux_loss
    loss.backward()
    return loss, out


def assert_finite_grads(model: nn.Module) -> None:
    """Every parameter gets a finite gradient; a MoE expert no token was routed to may get none."""
    missing = []
    for name, p in model.named_parameters():
        if not p.requires_grad:  # a frozen table (Whisper's sinusoids) gets no gradient
            continue
        if p.grad is None:
            if ".experts." not in name:
                missing.append(name)
            continue
        assert torch.isfinite(p.grad).all(), f"non-finite gradient in {name}"
    assert not missing, f"parameters without a gradient (unused?): {missing}"
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("name", PRESETS)
def test_preset_forward_backward(name: str) -> None:
    cfg = al.presets.tiny(al.presets.get(name))
    torch.manual_seed(0)
    model = al.build_model(cfg).train()  # with the preset's own dropout
    loss, out = training_step(model, cfg)
    assert torch.isfinite(loss)
    assert (out.aux_loss is not None) == isinstance(cfg.ffn, MoEFFN)
    assert_finite_grads(model)


# --- every registry entry ------------------------------------------------------------------------

REGISTRIES = {
    "positional": POSITIONAL,
    "kernel": KERNELS,
    "norm": NORMS,
    "ffn": FFNS,
    "init": INITS,
}

# The config that puts each entry in a model. A new registry entry without a line here fails
# test_registry_entry, so the sweep cannot silently fall behind the registries.
ENTRY_CONFIGS: dict[tuple[str, str], dict] = {
    ("positional", "sinusoidal"): dict(positional=Sinusoidal()),
    ("positional", "learned"): dict(positional=LearnedPositions(max_len=32, offset=2)),
    ("positional", "rope"): dict(positional=RoPE(fraction=0.5)),
    ("positional", "alibi"): dict(positional=ALiBi()),
    ("positional", "t5-relative"): dict(positional=T5RelativeBias(num_buckets=8, max_distance=16)),
    ("positional", "none"): dict(positional=NoPositions()),
    # a decoder only (config/attention.py refuses encoders): the encoder-decoder row is skipped
    ("positional", "xl-relative"): dict(
        positional=XLRelative(), attention=XLAttentionConfig(mem_len=8)
    ),
    ("kernel", "naive"): {},
    # sdpa serves the plain causal square and unmasked calls: a decoder without padding
    ("kernel", "sdpa"): {},
    ("kernel", "chunked"): dict(positional=T5RelativeBias(num_buckets=8, max_distance=16)),
    ("kernel", "alibi-sdpa"): dict(positional=ALiBi()),
    # BigBird's key blocks: blocks of one token, so 12 tokens are past full attention's 7
    ("kernel", "block-gather"): dict(
        attention=BlockSparseAttentionConfig(block_size=1, num_random_blocks=1),
        positional=NoPositions(),
    ),
    ("kernel", "tiled"): dict(positional=T5RelativeBias(num_buckets=8, max_distance=16)),
    # forward-only on the CPU: compared with naive without gradients (its own sweep:
    # tests/nn/attention/kernels/test_flex.py)
    ("kernel", "flex"): dict(positional=T5RelativeBias(num_buckets=8, max_distance=16)),
    # the engine's pool layout only (tests/nn/attention/kernels/test_paged_decode.py): a dense call
    # is refused
    ("kernel", "paged"): {},
    ("kernel", "paged-flex"): {},
    ("norm", "layernorm"): dict(norm=LayerNormConfig()),
    ("norm", "rmsnorm"): dict(norm=RMSNormConfig()),
    ("norm", "rmsnorm-unit-offset"): dict(norm=UnitOffsetRMSNormConfig()),
    ("ffn", "dense"): dict(ffn=DenseFFN(activation="gelu")),
    ("ffn", "glu"): dict(ffn=GLUFFN(multiple_of=16)),
    ("ffn", "moe"): dict(ffn=MoEFFN(expert=GLUFFN(multiple_of=16), n_experts=4, top_k=2)),
    **{("init", name): dict(init=name) for name in ("xavier", "normal", "gpt2", "t5")},
}

ENTRIES = [(kind, name) for kind, reg in REGISTRIES.items() for name in reg.names()]


def entry_model(arch: str, changes: dict) -> tuple[nn.Module, ModelConfig]:
    base = dict(arch=arch, vocab_size=50, d_model=32, n_layers=2, n_heads=4, d_ff=64, init="xavier")
    if arch == "encoder":
        base["mlm_head"] = True
    cfg = ModelConfig(**{**base, **changes})
    torch.manual_seed(0)
    return al.build_model(cfg).eval(), cfg


# (kind, name) -> the architectures it cannot be: Transformer-XL is decoder-only (its memory is
# one causal stream; the config refuses it elsewhere, tests/nn/attention/test_transformer_xl.py)
# and the kernels that exploit one structure run where it is: causal ALiBi in a decoder,
# BigBird's blocks in an encoder (the config refuses block-sparse elsewhere)
ONLY = {
    ("positional", "xl-relative"): ("decoder",),
    ("kernel", "alibi-sdpa"): ("decoder",),
    ("kernel", "sdpa"): ("decoder",),  # the encoder-decoder's padded source is not plain
    ("kernel", "block-gather"): ("encoder",),
    ("kernel", "paged"): ("decoder",),
}
ENTRY_CASES = [
    (kind, name, arch)
    for arch in ("decoder", "encoder-decoder", "encoder")
    for kind, name in ENTRIES
    if arch in ONLY.get((kind, name), ("decoder", "encoder-decoder"))
]


@pytest.mark.parametrize(
    "kind,name,arch", ENTRY_CASES, ids=[f"{k}-{n}-{a}" for k, n, a in ENTRY_CASES]
)
def test_registry_entry(kind: str, name: str, arch: str) -> None:
    if (kind, name) not in ENTRY_CONFIGS:
        pytest.fail(f"{kind} {name!r} is registered but has no ENTRY_CONFIGS line: add one")
    model, cfg = entry_model(arch, ENTRY_CONFIGS[kind, name])
    block = first_stack(model).blocks[0]
    if kind == "positional":
        assert isinstance(first_stack(model).positional, POSITIONAL.get(name))
    elif kind == "norm":
        assert isinstance(block.attn_norm, NORMS.get(name))
    elif kind == "ffn":
        assert isinstance(block.ffn, FFNS.get(name))
    elif kind == "kernel":
        al.set_kernel(model, name)
        assert {m.kernel for m in model.modules() if isinstance(m, Attention)} == {name}
    caps = KERNELS.get(name).caps if kind == "kernel" else None
    if caps is not None and caps.layouts == frozenset({"paged"}):
        args, kwargs, _ = inputs_for(cfg)
        with pytest.raises(ValueError, match=f"'{name}' cannot serve this call: it does not read"):
            model(*args, **kwargs)
        return
    if caps is not None and (not caps.backward or "cpu" not in caps.backward_devices):
        reference = al.set_kernel(entry_model(arch, ENTRY_CONFIGS[kind, name])[0], "naive")
        args, kwargs, _ = inputs_for(cfg)
        with torch.no_grad():
            torch.testing.assert_close(
                model(*args, **kwargs).logits, reference(*args, **kwargs).logits
            )
        return
    loss, _ = training_step(model, cfg)
    assert torch.isfinite(loss)
    assert_finite_grads(model)
    if kind == "kernel":  # a kernel computes the naive kernel's function, gradients included
        reference = al.set_kernel(entry_model(arch, ENTRY_CONFIGS[kind, name])[0], "naive")
        ref_loss, _ = training_step(reference, cfg)
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
        for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=n)


# --- learning: every preset learns a copy task ---------------------------------------------------

V, N, BATCH = 16, 5, 32  # vocabulary, copied length, batch size
LR, WARMUP, MAX_STEPS, EVAL_EVERY, TARGET = 3e-3, 10, 600, 25, 0.7


def copy_task(cfg: ModelConfig, g: torch.Generator, b: int):
    """(args, kwargs, labels, pick): pick(ModelOutput) gives the logits scored against labels.

    decoder: x x (2N random tokens), predict the second copy from its second token on — the
        tokens x_1..x_{N-1}, each at distance N-1 from its first occurrence;
    encoder: x x with about half of the second copy replaced by a [MASK] id (V-1), predict it;
    encoder-decoder: source x, target x (teacher-forced after a start token);
    an image model (a frontend) copies no tokens: noise images with one patch brightened in one
    channel, the label is that channel (the class token must find the patch).
    """
    arch = cfg.arch
    if cfg.frontend is not None and cfg.frontend.kind == "audio":
        return audio_task(cfg, g, b)
    if cfg.frontend is not None:
        return image_task(cfg, g, b)
    if arch == "decoder":
        x = torch.randint(0, V, (b, N), generator=g)
        ids = torch.cat([x, x], dim=1)
        return (ids,), {}, ids[:, N + 1 :], lambda out: out.logits[:, N : 2 * N - 1]
    x = torch.randint(1, V, (b, N), generator=g)  # 0 is the mask / start id
    if arch == "encoder":
        hide = torch.rand(b, N, generator=g) < 0.5
        hide[:, 0] = True
        ids = torch.cat([x, x.masked_fill(hide, 0)], dim=1)
        return (ids,), {}, x[hide], lambda out: out.logits[:, N:][hide]
    return (x, al.shift_right(x, 0)), {}, x, lambda out: out.logits


def audio_task(cfg: ModelConfig, g: torch.Generator, b: int):
    """Speech as a copy task: the source x sounds as N stretches of frames, each lighting the
    mel channel of its token over noise; the decoder writes x (teacher-forced)."""
    f = cfg.frontend
    frames = 2 * f.max_source_positions
    x = torch.randint(1, V, (b, N), generator=g)
    feats = 0.5 * torch.randn(b, f.num_mel_bins, frames, generator=g)
    span = frames // N
    for j in range(N):
        feats[torch.arange(b), x[:, j], j * span : (j + 1) * span] += 2.0
    kwargs = {"input_features": feats, "decoder_input_ids": al.shift_right(x, 0)}
    return (), kwargs, x, lambda out: out.logits


def image_task(cfg: ModelConfig, g: torch.Generator, b: int):
    f = cfg.frontend
    s, p, c = f.image_size, f.patch_size, f.num_channels
    px = 0.5 * torch.randn(b, c, s, s, generator=g)
    label = torch.randint(0, c, (b,), generator=g)
    row, col = torch.randint(0, s // p, (2, b), generator=g) * p
    for i in range(b):
        px[i, label[i], row[i] : row[i] + p, col[i] : col[i] + p] += 2.0
    return (), {"pixel_values": px}, label, lambda out: out.logits


def copy_loss(model: nn.Module, batch) -> torch.Tensor:
    args, kwargs, labels, pick = batch
    logits = pick(model(*args, **kwargs))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def headless_backbone(name: str) -> bool:
    """A frontend encoder without a head (SwinModel) has no logits to learn a task with; its
    gradients: test_preset_forward_backward, its function: tests/interop/test_swin.py."""
    cfg = al.presets.tiny(al.presets.get(name), vocab_size=V)
    return cfg.frontend is not None and cfg.arch == "encoder" and not cfg.num_labels


LEARNERS = [name for name in PRESETS if not headless_backbone(name)]


def test_only_headless_backbones_sit_out_the_copy_task() -> None:
    assert sorted(set(PRESETS) - set(LEARNERS)) == ["swin-tiny"]


@pytest.mark.parametrize("name", LEARNERS)
def test_preset_learns_copy_task(name: str, record_property) -> None:
    cfg = al.presets.tiny(al.presets.get(name), vocab_size=V)
    torch.manual_seed(0)
    model = al.build_model(cfg)
    g = torch.Generator().manual_seed(1)
    held_out = copy_task(cfg, g, 64)
    labels = V if cfg.arch == "decoder" else V - 1
    if cfg.frontend is not None and cfg.arch == "encoder":  # images: one label per channel
        labels = cfg.frontend.num_channels
    chance = math.log(labels)  # labels are uniform over these
    model.eval()
    with torch.no_grad():
        initial = copy_loss(model, held_out).item()
    target = TARGET * min(initial, chance)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    # linear warm-up: the post-norm presets (2017, BERT, BART) diverge without it
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    start, final, step = time.process_time(), initial, 0
    while step < MAX_STEPS and final >= target:
        model.train()
        for _ in range(EVAL_EVERY):
            loss = copy_loss(model, copy_task(cfg, g, BATCH))
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
        step += EVAL_EVERY
        model.eval()
        with torch.no_grad():
            final = copy_loss(model, held_out).item()
    seconds = time.process_time() - start
    for key, value in dict(initial=initial, final=final, steps=step, cpu_s=seconds).items():
        record_property(key, value)
    print(f"{name}: loss {initial:.3f} -> {final:.3f} in {step} steps, {seconds:.1f} s CPU")
    assert final < target, (
        f"{name} did not learn the copy task: held-out loss {initial:.3f} -> {final:.3f} after "
        f"{step} steps, needed < {target:.3f} ({TARGET} x min(initial, ln {math.exp(chance):.0f}))"
    )


AUTOCAST = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", AUTOCAST, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", PRESETS)
def test_preset_trains_a_step_under_autocast(name: str, dtype: torch.dtype) -> None:
    """Every preset trains one step under CPU autocast in 16 bits (what CUDA training runs by
    default, src/attnlab/train/loop.py): a finite loss and finite gradients. Masked fills and other
    constants must be representable in the dtype actually computed (Gemma 2's capped blocks once
    filled a float32 minimum into a bf16 block and raised)."""
    cfg = al.presets.tiny(al.presets.get(name))
    torch.manual_seed(0)
    model = al.build_model(cfg).train()
    with torch.autocast("cpu", dtype=dtype):
        loss, _ = training_step(model, cfg)
    assert torch.isfinite(loss), f"{name}: loss {loss} under {dtype}"
    assert_finite_grads(model)
