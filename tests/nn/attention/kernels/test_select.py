"""The one selector (src/attnlab/nn/attention/kernels/select.py): for each kind of call, the
kernel "auto" picks on the CPU and on CUDA (decided on the CPU for CUDA: the device is an
argument), every kernel passed over with its reason, a named kernel refused with its reason,
and the layer's choices as `attnlab inspect --kernels` prints them."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import attnlab as al
from attnlab.nn.attention import LinearBias, MaskSpec, record_choices
from attnlab.nn.attention.bigbird_plan import random_blocks
from attnlab.nn.attention.block_sparse import BlockSparseMask
from attnlab.nn.attention.kernels import KERNELS, AttnCall, NoKernelError, PagedKV, choose
from attnlab.nn.positional.alibi import alibi_slopes
from attnlab.nn.positional.relative import T5RelativeBias

B, H, H_KV, T, D = 2, 4, 2, 24, 8


def pos(n: int = T) -> torch.Tensor:
    return torch.arange(n).expand(B, n)


def pad() -> torch.Tensor:
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, :3] = False
    return real


def bigbird() -> BlockSparseMask:
    rand = random_blocks(T // 2, 2, 1, H, 0, False, 64)
    return BlockSparseMask.bigbird(T, 2, torch.from_numpy(np.asarray(rand)))


CAUSAL = MaskSpec(pos(), pos(), True, aligned=True)
ALIBI = LinearBias(torch.tensor(alibi_slopes(H)), pos(), pos(), True)
ALIBI_BIDIR = LinearBias(torch.tensor(alibi_slopes(H)), pos(), pos(), False)
T5 = T5RelativeBias(n_heads=H, causal=True).score_bias(pos(), pos())
GLOBAL = torch.zeros(B, T, dtype=torch.bool)
GLOBAL[:, 0] = True
BIGBIRD = bigbird()

# case -> (call, training, CPU's pick, CUDA's pick)
CASES = {
    "none": (AttnCall(scale=0.3), False, "sdpa", "sdpa"),
    "causal": (AttnCall(scale=0.3, mask=CAUSAL), True, "sdpa", "sdpa"),
    "causal-sinks": (
        AttnCall(scale=0.3, mask=CAUSAL, sinks=torch.zeros(H)),
        True,
        "sdpa",
        "sdpa",
    ),
    "padding": (
        AttnCall(scale=0.3, mask=MaskSpec(pos(), pos(), True, key_padding=pad())),
        True,
        "chunked",
        "flex",
    ),
    "window": (
        AttnCall(scale=0.3, mask=MaskSpec(pos(), pos(), True, window=8, aligned=True)),
        True,
        "chunked",
        "flex",
    ),
    "alibi": (AttnCall(scale=0.3, mask=CAUSAL, bias=ALIBI), True, "alibi-sdpa", "flex"),
    "alibi-bidir": (AttnCall(scale=0.3, bias=ALIBI_BIDIR), True, "chunked", "flex"),
    "alibi-dropout": (
        AttnCall(scale=0.3, mask=CAUSAL, bias=ALIBI, dropout_p=0.1),
        True,
        "alibi-sdpa",
        "alibi-sdpa",
    ),
    "t5": (AttnCall(scale=0.3, mask=CAUSAL, bias=T5), True, "chunked", "flex"),
    "t5-dropout": (
        AttnCall(scale=0.3, mask=CAUSAL, bias=T5, dropout_p=0.1),
        True,
        "chunked",
        "chunked",
    ),
    "softcap": (AttnCall(scale=0.3, mask=CAUSAL, softcap=50.0), True, "chunked", "flex"),
    "softcap-inference": (AttnCall(scale=0.3, mask=CAUSAL, softcap=50.0), False, "chunked", "flex"),
    "longformer": (
        AttnCall(
            scale=0.3,
            mask=MaskSpec(pos(), pos(), False, window=4, q_global=GLOBAL, k_global=GLOBAL),
        ),
        True,
        "chunked",
        "flex",
    ),
    "bigbird": (
        AttnCall(scale=0.3, mask=BIGBIRD, bias=BIGBIRD.bias()),
        True,
        "block-gather",
        "flex",
    ),
    "weights": (AttnCall(scale=0.3, mask=CAUSAL, need_weights=True), False, "naive", "naive"),
}


def qkv(training: bool):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g, requires_grad=training)
    k, v = (torch.randn(B, H_KV, T, D, generator=g) for _ in "kv")
    return q, k, v


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("case", list(CASES))
def test_auto_picks_the_listed_kernel_and_says_why_not_the_others(case, device):
    call, training, cpu, cuda = CASES[case]
    q, k, v = qkv(training)
    choice = choose("auto", q, k, v, call, device=device)
    assert choice.name == (cpu if device == "cpu" else cuda), choice.explain()
    for name, reason in choice.passed:  # every kernel before it in the list, with a sentence
        assert reason.startswith(("it ", "its ", "the ")) and len(reason) > 20, (name, reason)
        assert KERNELS.get(name).why_not(q, k, v, call, device) == reason
    listed = [n for n, _ in choice.passed] + [choice.name]
    from attnlab.nn.attention.kernels.select import preference

    assert listed == list(preference(device))[: len(listed)]


def test_flex_trains_on_cuda_only_and_sdpa_refuses_structure():
    q, k, v = qkv(True)
    t5 = CASES["t5"][0]
    assert KERNELS.get("flex").why_not(q, k, v, t5, "cuda") is None
    assert "not differentiable on cpu" in KERNELS.get("flex").why_not(q, k, v, t5, "cpu")
    with pytest.raises(
        NoKernelError,
        match="'sdpa' cannot serve this call: its score bias spans more than 16 query rows",
    ):
        choose("sdpa", q, k, v, t5)
    padded = CASES["padding"][0]
    with pytest.raises(NoKernelError, match="beyond the plain causal square"):
        choose("sdpa", q, k, v, padded)


def test_the_paged_layout_goes_to_the_native_kernel_on_the_cpu_and_to_flex_on_cuda():
    q, k, v = (t[:, :, :1] for t in qkv(False))
    pool = torch.zeros(H_KV, 16, D)
    slots, lengths = torch.zeros(B, 4, dtype=torch.long), torch.ones(B, dtype=torch.long)
    mask = MaskSpec(pos(1), pos(4), True)
    call = AttnCall(
        scale=0.3, mask=mask, layout="paged", pages=PagedKV(pool, pool, slots, lengths, 4)
    )
    from attnlab.nn import matvec

    if matvec.extension() is not None:
        assert choose("auto", q, k, v, call).name == "paged"
    assert choose("auto", q, k, v, call, device="cuda").name == "paged-flex"
    unsized = AttnCall(
        scale=0.3, mask=mask, layout="paged", pages=PagedKV(pool, pool, slots, lengths)
    )
    with pytest.raises(
        NoKernelError,
        match="no attention kernel serves this call: paged-flex: its pool does not say its "
        "block size; sdpa: it does not read the paged",
    ):
        choose("auto", q, k, v, unsized, device="cuda")  # the layer then takes the dense layout
    with pytest.raises(ValueError, match="layout 'paged' comes with `pages`"):
        AttnCall(scale=0.3, layout="paged")


def test_record_choices_reports_each_layers_kernel():
    cfg = al.presets.tiny(al.presets.get("gemma2-2b"))
    model = al.build_model(cfg).eval()
    layers = record_choices(model)
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (1, 24)))
    assert layers and all(choices for _, choices in layers)
    assert {c.name for _, cs in layers for c in cs} == {"chunked"}  # soft-capped on the CPU
    assert "sdpa: it cannot soft-cap" in layers[0][1][0].explain()
    for _, cs in layers:
        cs.clear()
    with torch.no_grad():  # at most 16 query rows (a decode step): the whole scores are one block
        model(torch.randint(0, cfg.vocab_size, (1, 9)))
    assert {c.name for _, cs in layers for c in cs} == {"naive"}
    assert "sdpa: it cannot soft-cap" in layers[0][1][0].explain()
    assert "chunked" not in layers[0][1][0].explain()  # naive came first, not after a refusal
    record_choices(model, on=False)
    assert all(m.choices is None for m in model.modules() if hasattr(m, "choices"))


def test_inspect_kernels_through_the_command_line():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "attnlab",
            "inspect",
            "bloom-560m",
            "--kernels",
            "--train",
            "--padded",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "kernels on cpu (float32, training, padded batch of 2 x 64 tokens" in out
    assert (
        "alibi-sdpa (passed over paged: it does not read the dense K/V layout; sdpa: its score bias spans more than 16 query rows"
        in out
    )
