"""The recurrent cache: linear attention's running state instead of keys and values.

Linear attention (src/attnlab/nn/attention/linear.py; Katharopoulos et al. 2020,
arXiv:2006.16236, section 3.4) sees its past only through two sums per K/V head,

    s  (B, H_kv, D, D)   Σ φ(k) vᵀ        z  (B, H_kv, D)   Σ φ(k)

so that is all decoding keeps, one pair per layer: memory L·B·H_kv·(D² + D) values, fixed when
the cache is made, whatever the length; a step costs O(D²) per head instead of O(length); the
cache never fills (max_len is informational). The states are fp32 at least, like the layer's
sums. `append` returns the new tokens' positions and validity only (S = T): the state stands
for every earlier key, so the mask describes just the new ones; a padded token adds nothing
(the layer zeroes its φ(k)), so a left-padded row decodes exactly as if alone. Beam search
reorders rows like any cache (`reorder`); `finish` has nothing to give back.

Only linear attention can use it: softmax attention needs every key, and asking this cache for
keys (`update`) says so.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .base import CACHE_KINDS, CacheBase, CacheShape, LayerView, advance, check_batch


@runtime_checkable
class LayerState(Protocol):
    """One linear-attention layer's running state (`cache.layers[i]` of a recurrent cache)."""

    def read_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(s (B, H_kv, D, D), z (B, H_kv, D)): the sums over every token so far."""
        ...

    def write_state(self, s: torch.Tensor, z: torch.Tensor) -> None:
        """Replace the state by the sums including this step's tokens: once per forward pass,
        after the cache's `append` (as KV caches' `update`; RuntimeError otherwise)."""
        ...


class _StateLayer(LayerView):
    def read_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.s[self.layer], self.cache.z[self.layer]

    def write_state(self, s: torch.Tensor, z: torch.Tensor) -> None:
        self.check_order()  # the state stands for the tokens `append` recorded
        self.cache.s[self.layer], self.cache.z[self.layer] = s, z

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError(
            "the recurrent cache holds linear attention's running state, not keys and values: "
            "a softmax-attention model decodes with kind 'static', 'sliding' or 'paged'"
        )


class RecurrentCache(CacheBase):
    def __init__(self, shape: CacheShape) -> None:
        super().__init__(shape, _StateLayer)
        B, H, D = shape.batch_size, shape.n_kv_heads, shape.head_dim
        dtype = torch.promote_types(shape.dtype, torch.float32)
        zeros = lambda *size: torch.zeros(size, dtype=dtype, device=shape.device)  # noqa: E731
        self.s = [zeros(B, H, D, D) for _ in range(shape.n_layers)]  # (B, H_kv, D, D) per layer
        self.z = [zeros(B, H, D) for _ in range(shape.n_layers)]  # (B, H_kv, D) per layer

    def bytes_per_token(self) -> int:
        """0: the state does not grow with the sequence (`state_bytes` is what it holds)."""
        return 0

    def state_bytes(self) -> int:
        """Bytes of every layer's state, all rows: constant from creation on."""
        return sum(t.numel() * t.element_size() for t in (*self.s, *self.z))

    def stats(self) -> dict:
        n = self.state_bytes()
        return {
            "allocated_bytes": n,
            "used_bytes": n,
            "waste_bytes": 0,
            "waste_fraction": 0.0,
            "state_bytes_per_row": n // self.batch_size if self.batch_size else 0,
        }

    def append(
        self, positions: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record T new tokens (positions, valid: (B, T)); returns them: the keys this step
        attends to besides the state."""
        check_batch(self.batch_size, positions)
        self.next_position = advance(self.next_position, positions, valid)
        self.length += positions.shape[1]
        self.begin_forward()
        return positions, valid

    def reorder(self, index: torch.Tensor, cross: bool = True) -> None:
        """Keep batch rows `index` (beam search): row i becomes old row index[i]."""
        self.s = [s.index_select(0, index) for s in self.s]
        self.z = [z.index_select(0, index) for z in self.z]
        self.reorder_rows(index, (), cross)


CACHE_KINDS.register("recurrent")(RecurrentCache)
