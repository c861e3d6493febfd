"""Weight-only quantization for CPU inference: `quantize(model, "int8")` or `"bf16"`.

Decoding one token at a time reads every weight once per token and does little arithmetic with
it, so it is bound by memory bandwidth: storing weights in fewer bytes is the speed-up (gpt-fast
`quantize.py`, `WeightOnlyInt8QuantHandler`; LLM.int8() without the outliers, Dettmers et al.
2022, arXiv:2208.07339, section 3).

- "int8": each output channel (row) of a Linear weight W (N, K) gets its own symmetric scale
  s_n = bf16(max_k |W_nk| / 127) and W_nk ≈ s_n · q_nk with q_nk = round(W_nk / s_n) clamped to
  [-127, 127] (round half to even). The scale is rounded to bfloat16 because torch's kernel takes
  it so; every path multiplies by the same numbers s_n · q_nk. A decode step's rows (at most
  `matvec.MAX_ROWS`, fp32) go through attnlab's int8 matvec (src/attnlab/nn/matvec.py: fp32
  activations, any K, every x86 CPU; the dequantized weights' values up to summation order). More
  rows (a prefill) take torch's CPU kernel `aten._weight_int8pack_mm(x, q, s)` where the CPU has
  native bf16 (checked at run time: `cpu_has_native_bf16`; it is fast only for bf16 activations,
  so x is rounded to bf16 for the call, and it is wrong for K not a multiple of 32), else the
  dequantized matmul in x's dtype. Without the matvec kernels (no C++ compiler, or
  ATTNLAB_KERNELS=0) and without that kernel, the layer multiplies a dequantized copy, with a
  warning: the float model's speed and memory, never slower.
- "int4": blocks of 32 inputs with w = d·q + m, q in [0, 15] (src/attnlab/nn/quant_blocks.py:
  a GGUF file's Q4_0 / Q4_1 blocks where the weights are exactly those, else min/max blocks);
  the output head, when quantized (`head=True`), is int8: 4 bits there cost SmolLM2-135M 5.6 %
  of WikiText-2 perplexity (benchmarks/cpu_decode.py, run before this choice), and llama.cpp's 4-bit files keep their
  output table at 8 bits too.
- "bf16": weights stored in bfloat16 and multiplied by oneDNN's bf16 kernels (x rounded to bf16,
  the result back in x's dtype); only where the CPU does bf16 natively (AVX512-BF16 or AMX),
  else it warns that bf16 matmuls will be emulated and slow.

Only Linear maps inside the stack are replaced: embeddings, norms and MoE routers stay in their
dtype (a router's small error would flip discrete choices), and so does the output head unless
`head=True`. An untied `lm_head` is then quantized like the others; a decoder's tied head (the
token embedding, read whole at every step: a fifth of SmolLM2-135M's bytes) gets a quantized copy
as `lm_head` (made with tied=True), used only for the logits, while the embedding lookup keeps the
float table. Norms, softmax, the residual stream and the KV cache keep their dtype. A quantized
model's `state_dict()` gives the dequantized weights in the original dtype under the original
names (so `interop.to_hf` and `save_pretrained` export what the model computes with; a tied copy
adds no name), and `load_state_dict` of float weights quantizes them (a tied copy is re-made from
the loaded table). Quantize after `fuse` (src/attnlab/nn/fuse.py), not before.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import check_choice
from . import matvec
from .model import DecoderOnlyModel
from .quant_blocks import Int4Linear
from .weight_only import _WeightOnly, _why_no_kernel

MODES = ("int8", "int4", "bf16")
_INT8_MM = getattr(torch.ops.aten, "_weight_int8pack_mm", None)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16), asked at run time:
    oneDNN must support bf16 here (`_is_mkldnn_bf16_supported`, true on any AVX-512 core, where it
    may emulate) and the kernel's CPU flags must list avx512_bf16 or amx_bf16 (Linux's
    /proc/cpuinfo; elsewhere the answer is False, the safe side: fp32 paths, no speed-up)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if probe is not None:
        try:
            if not probe():
                return False
        except RuntimeError:
            pass
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class Int8Linear(_WeightOnly):
    """y = x · (s ⊙ q)ᵀ + b with q (N, K) int8 and s (N,) per-output-channel scales."""

    def store(self, w: torch.Tensor) -> None:
        self.__dict__.pop("_dense", None)  # a fallback copy of the old weights
        # (N,): the scale in bf16, the kernel's dtype (a relative change under 2^-9, far below
        # int8's step), kept as fp32 for the fallback path: both multiply by the same numbers
        scale = (w.float().abs().amax(dim=1).clamp(min=1e-30) / 127).to(torch.bfloat16)
        q = torch.round(w.float() / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("qweight", q)  # (N, K)
        self.register_buffer("scales", scale.float())
        self.register_buffer("scales_bf16", scale)
        reasons = [
            why
            for why, bad in (
                ("torch has no aten._weight_int8pack_mm", _INT8_MM is None),
                (f"K = {self.in_features} is not a multiple of 32", self.in_features % 32),
                ("this CPU has no native bf16", not cpu_has_native_bf16()),
            )
            if bad
        ]
        self.use_kernel, self.no_kernel_because = not reasons, "; ".join(reasons)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]  # (N, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            matvec.few_rows(x, self.in_features)
            and self.scales.dtype == torch.float32
            and self.qweight.device.type == "cpu"
        ):  # a decode step: the int8 matvec
            y = matvec.run("mv_int8", matvec.rows_of(x), self.qweight, self.scales)
            if y is not None:
                return self._finish(y.view(*x.shape[:-1], self.out_features))
        if self.use_kernel and x.device.type == "cpu":
            # (..., K) -> (M, K) bf16 -> kernel -> (M, N) -> x's dtype, (..., N)
            y = _INT8_MM(
                x.reshape(-1, self.in_features).to(torch.bfloat16), self.qweight, self.scales_bf16
            )
            return self._finish(y.to(x.dtype).view(*x.shape[:-1], self.out_features))
        if matvec.available():  # rows of a prefill: compute-bound, the dequantized matmul
            w = self.qweight.to(x.dtype) * self.scales.to(x.dtype)[:, None]
            return F.linear(x, w, self.bias)
        return self._dense_fallback(x)


class Bf16Linear(_WeightOnly):
    """y = x · Wᵀ + b with W stored in bfloat16, x rounded to bfloat16 for the matmul."""

    def store(self, w: torch.Tensor) -> None:
        self.register_buffer("weight_bf16", w.to(torch.bfloat16))

    def dequantized(self) -> torch.Tensor:
        return self.weight_bf16.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight_bf16).to(x.dtype)
        return y if self.bias is None else y + self.bias


_KINDS = {"int8": Int8Linear, "bf16": Bf16Linear}


def _kind(mode: str) -> type[_WeightOnly]:
    return Int4Linear if mode == "int4" else _KINDS[mode]


def quantize(model: nn.Module, mode: str = "int8", *, head: bool = False) -> nn.Module:
    """Replace `model`'s Linear maps by weight-only `mode` ("int8", "int4" or "bf16") ones, in
    place; returns it. head: also the output head (an untied lm_head, or a quantized copy of a
    decoder's tied embedding); with "int4" the head is int8, as llama.cpp's 4-bit files keep
    their output table at 8 bits (its error moves every logit). See the module docstring."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize expects a torch.nn.Module, got {type(model).__name__}")
    check_choice("mode", mode, MODES)
    if is_quantized(model):
        raise ValueError("this model is already quantized; quantize a float model once")
    if mode == "bf16" and not cpu_has_native_bf16():
        warnings.warn(
            "quantize(model, 'bf16'): this CPU has no native bf16 (AVX512-BF16 or AMX) and torch "
            "will emulate bf16 matmuls, which is slower than fp32; use 'int8' or keep fp32",
            RuntimeWarning,
            stacklevel=2,
        )
    kind = _kind(mode)
    head_kind = Int8Linear if mode == "int4" else kind
    lm_head = getattr(model, "lm_head", None)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or name == "router":
                continue
            if child is lm_head and not head:
                continue
            if child.weight.device.type != "cpu":
                raise ValueError(
                    f"quantize is for CPU inference; {name} is on {child.weight.device}: "
                    f"call model.cpu() first"
                )
            setattr(parent, name, (head_kind if child is lm_head else kind)(child))
    if head and lm_head is None:
        _tie_head(model, head_kind)
    slow = [m for m in model.modules() if _no_kernel(m)]
    if slow:  # said here, at the caller's line, rather than from inside a forward pass
        why = sorted({_why_no_kernel(m, torch.empty(0)) for m in slow})
        warnings.warn(
            f"quantize(model, {mode!r}): no usable quantized CPU kernel ({'; '.join(why)}); "
            "these layers multiply a dequantized copy instead: the dequantized model's values "
            "at the float model's speed and memory, no speed-up",
            RuntimeWarning,
            stacklevel=2,
        )
        for m in slow:
            m._warned = True
    return model.eval()


def _no_kernel(module: nn.Module) -> bool:
    """Whether a quantized layer has no kernel on this machine: neither the matvec kernels
    (src/attnlab/nn/matvec.py, built here on first use) nor, for int8, torch's bf16 one."""
    if not isinstance(module, _WeightOnly) or isinstance(module, Bf16Linear):
        return False
    if isinstance(module, Int8Linear) and module.use_kernel:
        return False
    return not matvec.ready()


def is_quantized(model: nn.Module) -> bool:
    """Whether any of `model`'s Linear maps is a weight-only quantized one."""
    return any(isinstance(m, _WeightOnly) for m in model.modules())


def _tied_weight(model: nn.Module) -> torch.Tensor:
    """What a tied head multiplies by: logit_scale · E (src/attnlab/nn/model.py, `logits`)."""
    table = model.embed_tokens.weight.detach()
    return table * model.logit_scale if model.logit_scale != 1.0 else table


def _tie_head(model: nn.Module, kind: type[_WeightOnly]) -> None:
    """A decoder's tied head as a quantized copy of its embedding (the module docstring)."""
    if not isinstance(model, DecoderOnlyModel) or model.embed_tokens is None:
        warnings.warn(
            f"quantize(head=True): {type(model).__name__}'s output head is tied to a token table "
            "and stays float (a quantized copy is made for decoder-only models only)",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    w = _tied_weight(model)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")  # a shell for kind()
    lin.weight = nn.Parameter(w, requires_grad=False)
    model.lm_head = kind(lin, tied=True)
    if not getattr(model, "_retie_hook", False):
        model.register_load_state_dict_post_hook(_retie)
        model._retie_hook = True


def _retie(model: nn.Module, incompatible) -> None:
    head = getattr(model, "lm_head", None)
    if isinstance(head, _WeightOnly) and head.tied:
        with torch.no_grad():
            head.store(_tied_weight(model))
