"""Suite-wide settings. Tiny models are dominated by thread start-up: with pytest-xdist running
one worker per core, one torch thread per worker is fastest (10-70x under load)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

torch.set_num_threads(1)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) any op creates while active: the memory guards
    of tests/test_kernels.py and tests/test_linear_attention.py (`from conftest import ...`)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out
