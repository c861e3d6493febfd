"""The masks and bias descriptions every kernel is held to the naive one over
(tests/nn/attention/kernels/test_kernels.py, tests/nn/attention/test_softcap_sinks.py): causal,
padding, windows, the query offsets of a cache, a decode step; no bias, a dense tensor, ALiBi and
T5 buckets, causal and bidirectional."""

from __future__ import annotations

import torch

from attnlab.nn.attention import LinearBias, MaskSpec
from attnlab.nn.positional.alibi import alibi_slopes
from attnlab.nn.positional.relative import T5RelativeBias as T5Scheme


def arange(B: int, n: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n).expand(B, n).clone()


def padding(B: int, S: int) -> torch.Tensor:
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, :5] = False  # row 1 left-padded by five tokens
    return pad


# (T, S, mask maker): long enough for several blocks of 8 rows
MASKS = {
    "causal": (37, 37, lambda B: MaskSpec(arange(B, 37), arange(B, 37), True, aligned=True)),
    "causal-padding": (
        37,
        37,
        lambda B: MaskSpec(arange(B, 37), arange(B, 37), True, key_padding=padding(B, 37)),
    ),
    "bidir-padding": (
        30,
        33,
        lambda B: MaskSpec(arange(B, 30), arange(B, 33), False, key_padding=padding(B, 33)),
    ),
    "bidir-none": (29, 29, lambda B: MaskSpec(arange(B, 29), arange(B, 29))),
    "window-causal": (40, 40, lambda B: MaskSpec(arange(B, 40), arange(B, 40), True, window=6)),
    "window-bidir": (35, 35, lambda B: MaskSpec(arange(B, 35), arange(B, 35), False, window=5)),
    "cache-chunk": (19, 44, lambda B: MaskSpec(arange(B, 19, 25), arange(B, 44), True)),
    "decode-step": (1, 44, lambda B: MaskSpec(arange(B, 1, 43), arange(B, 44), True)),
}


def make_bias(kind: str, spec: MaskSpec, H: int, T: int, S: int, g: torch.Generator):
    """(bias argument, learnable parameters) for a bias kind."""
    if kind == "none":
        return None, []
    if kind == "dense":
        return torch.randn(spec.q_positions.shape[0], H, T, S, generator=g), []
    if kind.startswith("alibi"):
        slopes = torch.tensor(alibi_slopes(H))
        return LinearBias(slopes, spec.q_positions, spec.k_positions, kind == "alibi-causal"), []
    scheme = T5Scheme(n_heads=H, causal=kind == "t5-causal", num_buckets=8, max_distance=20)
    with torch.no_grad():
        scheme.relative_attention_bias.weight.normal_(generator=g)
    return scheme.score_bias(spec.q_positions, spec.k_positions), list(scheme.parameters())


BIASES = ["none", "dense", "alibi-causal", "alibi-bidir", "t5-causal", "t5-bidir"]
