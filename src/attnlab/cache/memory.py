"""The segment memory: Transformer-XL's recurrence as a cache kind (Dai et al. 2019,
arXiv:1901.02860, section 3.2).

Per layer the slots of two runs of positions, in order:

    [ memory: the last mem_len positions of earlier segments | the current segment ]
      detached (SG: no gradient reaches them)                    this call's tokens carry grad

Every forward call appends its tokens to the current segment and attends over memory + segment
(the causal mask, on explicit positions that keep counting across segments, does the rest).
A segment ends once it holds `segment_len` tokens (None: after every call); the next call
first folds it into the memory, which keeps the last `mem_len` positions of [memory; segment]
(the original code's `_update_mems`). So

    training / evaluation (one call per segment)     each segment sees the last mem_len
                                                     positions before it, no gradient through
    decoding token by token with segment_len T       token t of a segment sees the memory and
                                                     tokens 1..t: the same as the whole segment
                                                     run at once with that memory

What is stored per slot: its keys and values (`update`, any softmax layer), and the layer's
input hidden state where the layer keeps it (`remember`: the XL layer,
src/attnlab/nn/attention/xl.py). The paper recomputes K and V of the memory from SG(h_mem) in every segment,
K = W_k·[SG(h_mem); h], so in training W_k and W_v get gradient from the memory's positions too,
and use the weights of after the last update; an XL layer in training does exactly that from
the stored hidden states. Without gradients (evaluation, decoding) the weights do not change,
and with relative positions (src/attnlab/nn/positional/xl_relative.py) a key does not depend on
the position of the query reading it, so the stored K/V are those values already: nothing is
recomputed. (Any softmax model can use this cache: rotated keys keep their own positions, as in
every cache.) Memory is O(mem_len + segment) per row; the buffers are concatenated per call, a
copy of at most that size.
"""

from __future__ import annotations

import torch

from .base import (
    CACHE_KINDS,
    CacheBase,
    CacheShape,
    LayerView,
    advance,
    check_batch,
    kv_bytes,
    stats_dict,
)


class _MemoryLayer(LayerView):
    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new K/V (B, H_kv, T, D) detached; return [memory; segment; new] (B, H_kv,
        S, D), gradient only through the new part."""
        c, i = self.cache, self.layer
        keys = torch.cat((c.k[i].to(k.dtype), k), dim=2)
        values = torch.cat((c.v[i].to(v.dtype), v), dim=2)
        c.k[i], c.v[i] = keys.detach(), values.detach()  # SG: the next calls read no graph
        return keys, values

    def remember(self, x: torch.Tensor) -> torch.Tensor:
        """Store the layer's input for the new tokens (B, T, d_model) detached; return what was
        stored before them, SG(h_mem) (B, S − T, d_model), from which a layer in training
        recomputes the stored keys and values with its current weights (xl.py)."""
        c, i = self.cache, self.layer
        old = c.hidden[i] if c.hidden[i] is not None else x.detach()[:, :0]
        c.hidden[i] = torch.cat((old.to(x.dtype), x.detach()), dim=1)  # SG
        return old


class MemoryKVCache(CacheBase):
    def __init__(
        self, shape: CacheShape, mem_len: int | None = None, segment_len: int | None = None
    ) -> None:
        """mem_len: positions of earlier segments kept (0: none, each segment alone; an XL
        model's new_cache passes its attention.mem_len); segment_len: tokens after which a
        segment ends (None: every call is a segment)."""
        if mem_len is None:
            raise ValueError(
                "kind 'memory' needs mem_len, the positions of earlier segments to keep: "
                "model.new_cache(..., kind='memory', mem_len=N)"
            )
        if not isinstance(mem_len, int) or mem_len < 0:
            raise ValueError(
                f"mem_len ({mem_len!r}) must be an integer >= 0: the positions of earlier "
                f"segments each one attends to (0: none)"
            )
        if segment_len is not None and (not isinstance(segment_len, int) or segment_len < 1):
            raise ValueError(
                f"segment_len ({segment_len!r}) must be an integer >= 1, or None to end a "
                f"segment after every forward call"
            )
        super().__init__(shape, _MemoryLayer)  # max_len is informational: memory is bounded
        self.mem_len, self.segment_len = mem_len, segment_len
        B, H, D = shape.batch_size, shape.n_kv_heads, shape.head_dim
        empty = dict(dtype=shape.dtype, device=shape.device)
        self.k = [torch.zeros(B, H, 0, D, **empty) for _ in range(shape.n_layers)]
        self.v = [torch.zeros(B, H, 0, D, **empty) for _ in range(shape.n_layers)]
        # each layer's input per slot, kept by layers that call `remember` (Transformer-XL's)
        self.hidden: list[torch.Tensor | None] = [None] * shape.n_layers
        self.positions = torch.zeros(B, 0, dtype=torch.long, device=shape.device)
        self.valid = torch.zeros(B, 0, dtype=torch.bool, device=shape.device)
        self.n_memory = 0  # slots of earlier segments; the rest of the slots are the segment's

    @property
    def n_segment(self) -> int:
        """Tokens of the current segment stored so far."""
        return self.positions.shape[1] - self.n_memory

    def fold(self) -> None:
        """End the current segment: the memory becomes the last mem_len slots of
        [memory; segment]. Called by `append` when a segment is complete."""
        keep = min(self.mem_len, self.positions.shape[1])
        cut = self.positions.shape[1] - keep
        self.k = [t[:, :, cut:] for t in self.k]
        self.v = [t[:, :, cut:] for t in self.v]
        self.hidden = [None if h is None else h[:, cut:] for h in self.hidden]
        self.positions, self.valid = self.positions[:, cut:], self.valid[:, cut:]
        self.n_memory = keep

    def append(
        self, positions: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add T tokens to the segment (folding a complete one first); returns the (B, S)
        position and validity of memory + segment, the keys the step attends to."""
        check_batch(self.batch_size, positions)
        full = self.segment_len is None or self.n_segment >= self.segment_len
        if self.n_segment and full:
            self.fold()
        self.positions = torch.cat((self.positions, positions), dim=1)
        self.valid = torch.cat((self.valid, valid), dim=1)
        self.next_position = advance(self.next_position, positions, valid)
        self.length += positions.shape[1]
        self.begin_forward()
        return self.positions, self.valid

    def bytes_per_token(self) -> int:
        """K and V of one token of one sequence, all layers, plus the layer inputs where the
        layers keep them (Transformer-XL: d_model values per layer)."""
        s = self.shape
        hidden = sum(h.shape[-1] * h.element_size() for h in self.hidden if h is not None)
        return kv_bytes(s.n_layers, s.n_kv_heads, s.head_dim, s.dtype.itemsize) + hidden

    def stats(self) -> dict:
        """Bytes held: memory + segment slots, nothing reserved ahead."""
        n = self.batch_size * self.positions.shape[1]
        return stats_dict(n, n, self.bytes_per_token(), mem_len=self.mem_len)

    def reorder(self, index: torch.Tensor, cross: bool = True) -> None:
        """Keep batch rows `index` (beam search): row i becomes old row index[i]."""
        self.k = [t.index_select(0, index) for t in self.k]
        self.v = [t.index_select(0, index) for t in self.v]
        self.hidden = [None if h is None else h.index_select(0, index) for h in self.hidden]
        self.reorder_rows(index, ("positions", "valid"), cross)


CACHE_KINDS.register("memory")(MemoryKVCache)
