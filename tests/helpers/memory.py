"""The largest tensor a computation creates: the memory guards of the kernel tests (no kernel but
the naive one builds a T·S·H tensor; tests/nn/attention/kernels/test_kernels.py and the attention
kinds' tests in tests/nn/attention/)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) any op creates while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out
