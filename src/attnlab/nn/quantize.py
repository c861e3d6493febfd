"""Weight-only quantization for CPU inference: `quantize(model, "int8")` or `"bf16"`.

Decoding one token at a time reads every weight once per token and does little arithmetic with
it, so it is bound by memory bandwidth: storing weights in fewer bytes is the speed-up (gpt-fast
`quantize.py`, `WeightOnlyInt8QuantHandler`; LLM.int8() without the outliers, Dettmers et al.
2022, arXiv:2208.07339, section 3).

- "int8": each output channel (row) of a Linear weight W (N, K) gets its own symmetric scale
  s_n = max_k |W_nk| / 127 and W_nk ≈ s_n · q_nk with q_nk = round(W_nk / s_n) in [-127, 127].
  The matmul is torch's CPU kernel `aten._weight_int8pack_mm(x, q, s)`, which computes x · (s·q)ᵀ
  in one pass over the int8 bytes. It is fast only for bf16 activations (fp32 ones take a
  reference path ~20× slower than an fp32 matmul, measured with torch 2.13 on AVX-512), and it
  returns wrong values or crashes for K not a multiple of 32, so `Int8Linear` rounds x to bf16
  for the call and returns the result in x's dtype, where the CPU has native bf16; elsewhere (or
  without the kernel) it dequantizes and multiplies in x's dtype, with a warning: same values,
  no speed-up.
- "bf16": weights stored in bfloat16 and multiplied by oneDNN's bf16 kernels (x rounded to bf16,
  the result back in x's dtype); only where the CPU does bf16 natively (AVX512-BF16 or AMX),
  else it warns that bf16 matmuls will be emulated and slow.

Only Linear maps inside the stack are replaced: embeddings, norms and MoE routers stay in their
dtype (a router's small error would flip discrete choices), and so does the output head unless
`head=True` (it is an untied `lm_head`; a tied head is the embedding table and stays float).
Norms, softmax, the residual stream and the KV cache keep their dtype. A quantized model's
`state_dict()` gives the dequantized weights in the original dtype under the original names (so
`interop.to_hf` and `save_pretrained` export what the model computes with), and `load_state_dict`
of float weights quantizes them. Quantize after `fuse` (src/attnlab/nn/fuse.py), not before.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import check_choice

MODES = ("int8", "bf16")
_INT8_MM = getattr(torch.ops.aten, "_weight_int8pack_mm", None)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if probe is not None:
        try:
            if not probe():
                return False
        except RuntimeError:
            pass
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _warn_once(module: nn.Module, message: str) -> None:
    if not getattr(module, "_warned", False):
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        module._warned = True


class _WeightOnly(nn.Module):
    """A Linear map whose weight is stored in another form; the subclass says which."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.float_dtype = lin.weight.dtype  # what state_dict() exports
        bias = None if lin.bias is None else nn.Parameter(lin.bias.detach().clone(), False)
        self.bias = bias
        if hasattr(lin, "layout"):  # a fused q/k/v or gate/up map keeps its unfused names
            self.layout = lin.layout
        self.store(lin.weight.detach())

    def store(self, w: torch.Tensor) -> None:
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "weight"] = self.dequantized().to(self.float_dtype)
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
        elif tuple(state_dict[key].shape) != (self.out_features, self.in_features):
            errors.append(
                f"size mismatch for {key}: {tuple(state_dict[key].shape)} in the state dict, "
                f"{(self.out_features, self.in_features)} in the model"
            )
        else:
            with torch.no_grad():
                self.store(state_dict[key].to(self.float_dtype))
        if self.bias is not None:
            if prefix + "bias" in state_dict:
                with torch.no_grad():
                    self.bias.copy_(state_dict[prefix + "bias"])
            else:
                missing_keys.append(prefix + "bias")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int8Linear(_WeightOnly):
    """y = x · (s ⊙ q)ᵀ + b with q (N, K) int8 and s (N,) per-output-channel scales."""

    def store(self, w: torch.Tensor) -> None:
        scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / 127  # (N,)
        q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scale)
        self.register_buffer("scales_bf16", scale.to(torch.bfloat16))
        self.use_kernel = (
            _INT8_MM is not None and self.in_features % 32 == 0 and cpu_has_native_bf16()
        )

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]  # (N, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel and x.device.type == "cpu":
            # (..., K) -> (M, K) bf16 -> kernel -> (M, N) -> x's dtype, (..., N)
            y = _INT8_MM(
                x.reshape(-1, self.in_features).to(torch.bfloat16), self.qweight, self.scales_bf16
            )
            y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        _warn_once(
            self,
            "Int8Linear: no usable int8 CPU kernel here (torch.ops.aten._weight_int8pack_mm "
            "missing, no native bf16, K not a multiple of 32, or not on CPU); dequantizing per "
            "call instead: same values, no speed-up",
        )
        w = self.qweight.to(x.dtype) * self.scales.to(x.dtype)[:, None]
        return F.linear(x, w, self.bias)


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


def quantize(model: nn.Module, mode: str = "int8", *, head: bool = False) -> nn.Module:
    """Replace `model`'s Linear maps by weight-only `mode` ("int8" or "bf16") ones, in place;
    returns it. head: also the untied output head `lm_head`. See the module docstring."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize expects a torch.nn.Module, got {type(model).__name__}")
    check_choice("mode", mode, MODES)
    if any(isinstance(m, _WeightOnly) for m in model.modules()):
        raise ValueError("this model is already quantized; quantize a float model once")
    if mode == "bf16" and not cpu_has_native_bf16():
        warnings.warn(
            "quantize(model, 'bf16'): this CPU has no native bf16 (AVX512-BF16 or AMX) and torch "
            "will emulate bf16 matmuls, which is slower than fp32; use 'int8' or keep fp32",
            RuntimeWarning,
            stacklevel=2,
        )
    lm_head = getattr(model, "lm_head", None)
    if head and lm_head is None:
        warnings.warn(
            "quantize(head=True): the output head is tied to the token embedding, which stays "
            "float; only an untied lm_head is quantized",
            RuntimeWarning,
            stacklevel=2,
        )
    kind = _KINDS[mode]
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
            setattr(parent, name, kind(child))
    return model.eval()
