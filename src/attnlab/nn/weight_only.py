"""The base of the weight-only quantized Linear maps (src/attnlab/nn/quantize.py,
src/attnlab/nn/quant_blocks.py): a Linear whose weight is stored in another form, exported by
`state_dict()` as the dequantized float weight under the Linear's own name, and the fallback every
kind shares where no kernel runs (a dequantized copy multiplied by torch's matmul)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from . import matvec
from .fused_linear import FusedLinear


def _warn_once(module: nn.Module, message: str) -> None:
    if not getattr(module, "_warned", False):
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        module._warned = True


class _WeightOnly(nn.Module):
    """A Linear map whose weight is stored in another form; the subclass says which. tied: a
    quantized copy of a weight that lives elsewhere under its own name (a tied head, the module
    docstring), so it neither writes nor expects state dict entries."""

    def __init__(self, lin: nn.Linear, tied: bool = False) -> None:
        self.take_shape(lin, tied)
        self.store(lin.weight.detach())

    def take_shape(self, lin: nn.Linear, tied: bool) -> None:
        """Everything but the weight: sizes, dtype, bias, a fused map's layout."""
        nn.Module.__init__(self)
        self.tied = tied
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.float_dtype = lin.weight.dtype  # what state_dict() exports
        bias = None if lin.bias is None else nn.Parameter(lin.bias.detach().clone(), False)
        self.bias = bias
        if isinstance(lin, FusedLinear):  # a fused q/k/v or gate/up map (fused_linear.py): its
            self.layout = lin.layout  # parent exports the unfused names from it

    def store(self, w: torch.Tensor) -> None:
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        if self.tied:
            return
        destination[prefix + "weight"] = self.dequantized().to(self.float_dtype)
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        key = prefix + "weight"
        if self.tied:
            return  # re-made from the loaded table by _retie
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
            self.__dict__.pop("_dense", None)  # a fallback copy of the old weights
        if self.bias is not None:
            if prefix + "bias" in state_dict:
                with torch.no_grad():
                    self.bias.copy_(state_dict[prefix + "bias"])
            else:
                missing_keys.append(prefix + "bias")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def _dense_fallback(self, x: torch.Tensor) -> torch.Tensor:
        """No kernel for this CPU: a dequantized copy in x's dtype, made once and multiplied by
        torch's matmul (the float model's speed and memory, never slower than it)."""
        dense = getattr(self, "_dense", None)
        if dense is None or dense.dtype != x.dtype or dense.device != x.device:
            _warn_once(
                self,
                f"{type(self).__name__}: no usable quantized CPU kernel here "
                f"({_why_no_kernel(self, x)}); multiplying a dequantized copy instead: the "
                "dequantized model's values at the float model's speed",
            )
            dense = self._dense = self.dequantized().to(device=x.device, dtype=x.dtype)
        return F.linear(x, dense, self.bias)


def _why_no_kernel(module: nn.Module, x: torch.Tensor) -> str:
    if x.device.type != "cpu":
        return f"x is on {x.device}"
    why = [getattr(module, "no_kernel_because", "")]
    if not matvec.available():
        why.append("the matvec kernels are off (src/attnlab/nn/matvec.py)")
    return "; ".join(w for w in why if w)
