"""Activation functions, by the names configs use (a registry: the field keeps adding them).

    relu       max(0, x)                                    2017 Transformer, T5 v1.0
    gelu       x·Φ(x), exact erf form                       BERT (Hendrycks & Gimpel 2016,
                                                            arXiv:1606.08415)
    gelu-tanh  GELU's tanh approximation                    GPT-2's `gelu_new`, Gemma
    gelu-sigmoid  x·σ(1.702·x), GELU's sigmoid              GPT-OSS's clamped SwiGLU (ibid.,
               approximation                                section 2; transformers' quick_gelu)
    silu       x·σ(x) (swish)                               SwiGLU in Llama, Mistral, Qwen

Each entry is a plain function on tensors; an FFN looks its activation up here, so a typo fails
with the known names and a did-you-mean. Adding one: register it here and add its name to
`Activation` in src/attnlab/config/ffn.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..registry import Registry

ActivationFn = Callable[[torch.Tensor], torch.Tensor]
ACTIVATIONS: Registry[ActivationFn] = Registry("activation")

ACTIVATIONS.register("relu")(F.relu)
ACTIVATIONS.register("gelu")(F.gelu)


@ACTIVATIONS.register("gelu-tanh")
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


@ACTIVATIONS.register("gelu-sigmoid")
def gelu_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)  # transformers' quick_gelu and GPT-OSS's, op for op


ACTIVATIONS.register("silu")(F.silu)
