"""The latent cache: multi-head latent attention's compressed entries, one tensor per token.

MLA (DeepSeek-V2, arXiv:2405.04434, section 2.1.2-2.1.3; src/attnlab/nn/attention/mla.py)
rebuilds every head's key and value from two things per token, and that is all it caches:

    c_kv  (kv_lora_rank)        the normalised KV latent, shared by all heads
    k_pe  (qk_rope_head_dim)    the decoupled key that carries RoPE, shared by all heads

The layer hands them over as one (B, 1, T, W) entry, W = kv_lora_rank + qk_rope_head_dim: a
single "head" (the cache's n_kv_heads is 1, head_dim W). Per token and layer that is W values
instead of MHA's 2·H·D (DeepSeek-V2: 576 against 2·128·192 for its 128 heads; V2-Lite: 576
against 2·16·192), the saving the paper reports in its Table 1.

The layer calls `update(entry, entry)`: the same tensor as key and value, because in the
absorbed form (mla.py) the latent is both, MQA over one head whose value is the first
kv_lora_rank channels of its key. The static, sliding and paged caches therefore also work with
MLA, storing the entry twice (as K and as V); this cache stores it once, so its bytes per token
are half of `kv_bytes` for the same shape. It is a static cache otherwise: preallocated
(L, B, 1, max_len, W) buffers filled in order, reordered for beam search like the others.

A layer with separate keys and values (softmax attention) passes two tensors and is refused.
"""

from __future__ import annotations

import torch

from .base import CACHE_KINDS, CacheBase, CacheShape, LayerView, kv_bytes
from .static import StaticKVCache


class _LatentLayer(LayerView):
    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k is v: the (B, 1, T, W) entries; returns every stored one (B, 1, S, W) as both."""
        if v is not k:
            raise ValueError(
                "the latent cache stores one tensor per token (multi-head latent attention's "
                "latent and RoPE key), but this layer passed separate keys and values: decode "
                "it with kind 'static', 'sliding' or 'paged'"
            )
        c, T = self.cache, k.shape[2]
        buf = c.k.select(0, self.layer)  # (B, 1, max_len, W)
        buf.narrow(2, c.length - T, T).copy_(k)
        stored = buf.narrow(2, 0, c.length)  # (B, 1, S, W)
        return stored, stored


class LatentKVCache(StaticKVCache):
    def __init__(self, shape: CacheShape) -> None:
        # StaticKVCache's bookkeeping (positions, validity, append) with one buffer, not two
        CacheBase.__init__(self, shape, _LatentLayer)
        B, S = shape.batch_size, shape.max_len
        buf = (shape.n_layers, B, shape.n_kv_heads, S, shape.head_dim)  # (L, B, 1, max_len, W)
        self.k = torch.zeros(buf, dtype=shape.dtype, device=shape.device)
        self.v = None  # the entry is its own value
        self.positions = torch.zeros(B, S, dtype=torch.long, device=shape.device)
        self.valid = torch.zeros(B, S, dtype=torch.bool, device=shape.device)

    def bytes_per_token(self) -> int:
        """Bytes of one token of one sequence, all layers: L · W · bytes (half of kv_bytes)."""
        s = self.shape
        return kv_bytes(s.n_layers, s.n_kv_heads, s.head_dim, s.dtype.itemsize) // 2

    def reorder(self, index: torch.Tensor, cross: bool = True) -> None:
        """Keep batch rows `index` (beam search): row i becomes old row index[i]."""
        self.k = self.k.index_select(1, index)
        self.reorder_rows(index, ("positions", "valid"), cross)


CACHE_KINDS.register("latent")(LatentKVCache)
