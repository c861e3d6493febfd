"""Sliding-window KV cache: a ring buffer of the last `window` slots per row.

With sliding-window attention (Beltagy et al. 2020, arXiv:2004.05150; Mistral 7B, Jiang et al.
2023, arXiv:2310.06825, section 2, "rolling buffer cache") a query at position q sees keys at
q - window < k <= q. Decoding one token therefore never needs more than the last `window` keys,
and the cache holds exactly those: memory O(window), not O(max_len); it never runs out.

    one token (decode step)   write it into slot length % window, attend over the ring
    a chunk of T > 1 tokens   attend over [old ring ; the chunk], then keep the chunk's last
                              min(T, window) tokens in the ring

A chunk longer than the window (a long prompt) needs keys that its own later tokens evict, so
the chunk is attended to whole — transient memory O(window + T), the size of the prompt's own
K/V — and only then folded into the ring. On the very first chunk the ring is empty and the
chunk alone is returned, without a copy. Slots hold keys in ring order, not position order; the
mask reads each slot's recorded position, so order does not matter.

Exactness needs each row's real tokens to sit in consecutive slots once the row has started
(then slot age and position distance agree): left padding is fine, padding after a real token
is refused with a clear error.
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
    stats_dict,
)


class _RingLayer(LayerView):
    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, i = self.cache, self.layer
        k, v = k.to(c.k.dtype), v.to(c.v.dtype)
        if c._slot is not None:  # one token: into its slot, then attend over the ring
            c.k[i, :, :, c._slot] = k[:, :, 0]
            c.v[i, :, :, c._slot] = v[:, :, 0]
            return c.k[i], c.v[i]  # (B, H_kv, window, D)
        keys = (k, v) if c._first else (torch.cat((c.k[i], k), 2), torch.cat((c.v[i], v), 2))
        n = c._keep.numel()  # a chunk: attend to [ring ; chunk] first, then fold its tail in
        c.k[i].index_copy_(2, c._keep, k[:, :, -n:])
        c.v[i].index_copy_(2, c._keep, v[:, :, -n:])
        return keys  # (B, H_kv, S, D), S = T on the first chunk, window + T after


class SlidingKVCache(CacheBase):
    def __init__(self, shape: CacheShape, window: int) -> None:
        super().__init__(shape, _RingLayer)  # max_len is informational: a ring never runs out
        B, W = shape.batch_size, window
        buf = (shape.n_layers, B, shape.n_kv_heads, W, shape.head_dim)
        self.k = torch.zeros(buf, dtype=shape.dtype, device=shape.device)
        self.v = torch.zeros(buf, dtype=shape.dtype, device=shape.device)
        self.positions = torch.zeros(B, W, dtype=torch.long, device=shape.device)
        self.valid = torch.zeros(B, W, dtype=torch.bool, device=shape.device)
        self.started = torch.zeros(B, dtype=torch.bool, device=shape.device)  # a real token seen
        self.window = W
        self._slot: int | None = None
        self._first = True
        self._keep = torch.empty(0, dtype=torch.long)

    def stats(self) -> dict:
        B = self.batch_size
        used = B * min(self.length, self.window)
        return stats_dict(B * self.window, used, self.bytes_per_token(), window=self.window)

    def _check_padding(self, valid: torch.Tensor) -> None:
        seen = valid.long().cummax(dim=1).values.bool() | self.started[:, None]
        if bool((seen & ~valid).any()):
            raise ValueError(
                "sliding-window cache: padding after a row's first real token would age real "
                "keys out of the ring too early; left-pad prompts (attention_mask 0 only at the "
                "start of a row), or use kind='static'"
            )
        self.started |= valid.any(dim=1)

    def append(
        self, positions: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve slots for T new tokens; returns the (B, S) position and validity of every key
        the step attends to, in the order `layers[i].update` returns them."""
        check_batch(self.batch_size, positions)
        self._check_padding(valid)
        self.next_position = advance(self.next_position, positions, valid)
        T, W, start = positions.shape[1], self.window, self.length
        self.length += T
        self.begin_forward()
        if T == 1:
            self._slot = start % W
            self.positions[:, self._slot] = positions[:, 0]
            self.valid[:, self._slot] = valid[:, 0]
            return self.positions, self.valid
        self._slot, self._first = None, start == 0
        n = min(T, W)
        keep = torch.arange(start + T - n, start + T, device=positions.device) % W
        out = (positions, valid)
        if not self._first:
            out = (torch.cat((self.positions, positions), 1), torch.cat((self.valid, valid), 1))
        self.positions.index_copy_(1, keep, positions[:, -n:])
        self.valid.index_copy_(1, keep, valid[:, -n:])
        self._keep = keep
        return out

    def reorder(self, index: torch.Tensor, cross: bool = True) -> None:
        self.k, self.v = self.k.index_select(1, index), self.v.index_select(1, index)
        self.reorder_rows(index, ("positions", "valid", "started"), cross)


@CACHE_KINDS.register("sliding")
def _sliding(shape: CacheShape, window: int | None = None) -> SlidingKVCache:
    """The model's window; a wider `window` is allowed (it stays exact), a narrower one is not."""
    if shape.window is None:
        raise ValueError(
            "kind='sliding' needs a model with sliding-window attention "
            "(attention.sliding_window), and this model attends to the whole prefix: "
            "use kind='static' or kind='paged'"
        )
    window = shape.window if window is None else window
    if window < shape.window:
        raise ValueError(
            f"sliding cache window ({window}) is smaller than the model's sliding_window "
            f"({shape.window}): keys the model attends to would be dropped; omit window="
        )
    return SlidingKVCache(shape, window)
