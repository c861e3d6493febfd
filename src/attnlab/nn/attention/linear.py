"""Linear attention (Katharopoulos et al. 2020, arXiv:2006.16236, "Transformers are RNNs").

Softmax attention weighs value j for query i by exp(q_i·k_j), normalised over j. With a kernel
φ(q_i)·φ(k_j) in its place (section 3.2) the sums regroup around the keys:

    out_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j) = φ(q_i) S / φ(q_i)·z
    S = Σ_j φ(k_j) v_jᵀ  (D, D)        z = Σ_j φ(k_j)  (D,)

so a layer costs O(n·D²) instead of O(n²·D), and a causal decoder carries S and z from token to
token (section 3.4, "transformers are RNNs"): each decoding step is O(D²) per head whatever the
length, with the recurrent cache (src/attnlab/cache/recurrent.py) instead of a KV cache.

    non-causal   out = φ(Q) (φ(K)ᵀ V) / (φ(Q) · Σ φ(K))
    causal       chunks of C tokens, a running (S, z) between them:
                   A     = tril(φ(Q_c) φ(K_c)ᵀ)                          (C, C) per head
                   out_c = (A V_c + φ(Q_c) S) / (A 1 + φ(Q_c) z + eps)
                   S += φ(K_c)ᵀ V_c ;  z += Σ φ(K_c)
                 nothing of n×n or n×D×D elements is formed: O(n·D + C² + D²) memory per head.

The paper computes the causal case with a CUDA kernel for the cumulative sums (section 3.3.1);
the chunked form above is the chunkwise-parallel one (Hua et al. 2022, arXiv:2202.10447, "mixed
chunk attention"; Yang et al. 2023, arXiv:2312.06635, section 2), plain matrix products.
Decoding is the same function with a state carried in (T = 1, one chunk).

Choices and divergences:
- φ comes from FEATURE_MAPS: "elu+1" is the paper's (section 3.2.1), strictly positive, so the
  normaliser never vanishes; "relu" can give a query zero similarity with every key, and eps
  keeps that row finite (its output is 0). eps = 1e-6 in the normaliser, as the authors' code.
- Numerics: φ, the products and the state are fp32 at least (sums of many positive bf16 terms
  lose the small ones); the output is cast back to the input dtype.
- Positions: the paper has none. RoPE rotates q and k *before* φ (the layer's hook order:
  projection, qk-norm, rotation, then φ), so the weights stay positive and normalised; φ is
  non-linear, so φ(R_m q)·φ(R_n k) is not a function of m - n alone, and RoPE's exact relative
  form is lost. RoFormer (Su et al. 2021, arXiv:2104.09864, section 3.3, eq. 19) instead rotates
  φ(q) and φ(k) in the numerator only, keeping the relative form but not positive, normalised
  weights. Sinusoidal and learned tables add to the embeddings as usual. Score biases (ALiBi, T5)
  need the (T, S) scores this layer never forms, so they are refused, as is a sliding window.
- Causality is sequence order (the order of the recurrence), not the position ids.
- No scale and no attention dropout: there are no scores or weights.
- A padded key gets φ(k) = 0, so it adds nothing to S or z.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ...cache.base import LayerKV
from ...cache.recurrent import LayerState
from ...registry import Registry
from .heads import HeadProjections
from .layer import ATTENTIONS, AttnContext

EPS = 1e-6  # in the normaliser (the authors' code, fast_transformers' LinearAttention)

FEATURE_MAPS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("feature map")


@FEATURE_MAPS.register("elu+1")
def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1 > 0 (Katharopoulos et al. 2020, section 3.2.1)."""
    return F.elu(x) + 1.0


@FEATURE_MAPS.register("relu")
def relu(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = max(x, 0) >= 0."""
    return F.relu(x)


def linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float = EPS
) -> torch.Tensor:
    """Non-causal: every query sees every key. q = φ(q) (B, H, T, D); k = φ(k), v (B, H_kv, S, D)
    with padded keys already zero. Returns (B, H, T, D)."""
    B, H, T, D = q.shape
    H_kv = k.shape[1]
    q = q.view(B, H_kv, H // H_kv, T, D)  # query heads grouped under the K/V head they share
    s = k.transpose(-1, -2) @ v  # (B, H_kv, D, S) @ (B, H_kv, S, D) -> (B, H_kv, D, D)
    z = k.sum(dim=2)  # (B, H_kv, D)
    num = q @ s[:, :, None]  # (B, H_kv, G, T, D) @ (B, H_kv, 1, D, D) -> (B, H_kv, G, T, D)
    den = q @ z[:, :, None, :, None]  # @ (B, H_kv, 1, D, 1) -> (B, H_kv, G, T, 1)
    return (num / (den + eps)).view(B, H, T, D)


def causal_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunk_size: int = 64,
    eps: float = EPS,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Causal, chunked: query i sees keys 0..i and everything `state` summarises. q = φ(q)
    (B, H, T, D); k = φ(k), v (B, H_kv, T, D) with padded keys already zero; state (S, z) =
    ((B, H_kv, D, D), (B, H_kv, D)) or None for an empty past. Returns the output (B, H, T, D)
    and the state after the last token."""
    B, H, T, D = q.shape
    H_kv = k.shape[1]
    q = q.view(B, H_kv, H // H_kv, T, D)  # (B, H_kv, G, T, D)
    if state is None:
        s, z = q.new_zeros(B, H_kv, D, v.shape[-1]), q.new_zeros(B, H_kv, D)
    else:
        s, z = state
    out = []
    # split, not slices: its backward writes each chunk's gradient once, where a slice's
    # backward would allocate a whole-sequence gradient per chunk (O(n²/C) memory traffic)
    qs, ks, vs = q.split(chunk_size, 3), k.split(chunk_size, 2), v.split(chunk_size, 2)
    chunks = zip(qs, ks, vs, strict=True)
    for qc, kc, vc in chunks:  # (B, H_kv, G, C, D), (B, H_kv, C, D), (B, H_kv, C, D)
        # within the chunk: the masked quadratic form, key j <= query i
        a = (qc @ kc[:, :, None].transpose(-1, -2)).tril()  # (B, H_kv, G, C, C)
        # before the chunk: the running state
        num = a @ vc[:, :, None] + qc @ s[:, :, None]  # (B, H_kv, G, C, D)
        den = a.sum(dim=-1, keepdim=True) + qc @ z[:, :, None, :, None]  # (B, H_kv, G, C, 1)
        out.append(num / (den + eps))
        s = s + kc.transpose(-1, -2) @ vc  # (B, H_kv, D, D)
        z = z + kc.sum(dim=2)  # (B, H_kv, D)
    return torch.cat(out, dim=3).view(B, H, T, D), (s, z)


@ATTENTIONS.register("linear")
class LinearAttention(HeadProjections):
    cache_kind = "recurrent"  # what model.new_cache hands out by default (running state, no K/V)

    def __init__(
        self,
        *,
        feature_map: str = "elu+1",
        chunk_size: int = 64,
        eps: float = EPS,
        **heads: Any,
    ) -> None:
        """Args: those of `HeadProjections` (heads.py: d_model, n_heads, n_kv_heads — each K/V
        head's state serves its group of query heads —, head_dim — φ keeps it, so the state is
        (D, D) —, qkv_bias, o_bias, q_norm, k_norm), and
        feature_map: a name in FEATURE_MAPS, the φ applied to q and k.
        chunk_size: tokens per chunk of the causal form, a runtime choice (it changes speed and
            memory, not the result); an attribute, like the softmax layer's kernel.
        eps: added to the normaliser.
        """
        if chunk_size < 1:
            raise ValueError(f"chunk_size ({chunk_size}) must be >= 1")
        phi = FEATURE_MAPS.get(feature_map)  # a typo fails here, with the known names
        super().__init__(**heads)
        self.phi, self.feature_map, self.chunk_size, self.eps = phi, feature_map, chunk_size, eps

    def _check(self, ctx: AttnContext, need_weights: bool) -> None:
        if need_weights:
            raise ValueError(
                "linear attention never forms the (T, S) attention weights: use softmax "
                "attention (attention kind 'softmax') to inspect them"
            )
        if ctx.bias is not None:
            raise ValueError(
                "linear attention cannot add a score bias (ALiBi, T5 relative): it never forms "
                "the scores; use positional 'rope', 'sinusoidal', 'learned' or 'none'"
            )
        if ctx.mask is not None and ctx.mask.window is not None:
            raise ValueError(
                f"linear attention has no sliding window (got window {ctx.mask.window}): its "
                f"state summarises the whole prefix; build the stack without a window"
            )

    def forward(
        self,
        x: torch.Tensor,
        ctx: AttnContext,
        memory: torch.Tensor | None = None,
        cache: LayerKV | LayerState | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """x (B, T, d_model); memory (B, S, d_model) for cross-attention; `cache` a recurrent
        cache's layer (self-attention) or the cross-attention K/V store. Returns (B, T, d_model)
        and None (no weights)."""
        self._check(ctx, need_weights)
        B, T, _ = x.shape
        # q (B, H, T, D), k, v (B, H_kv, S, D): projected, normed, rotated before φ (heads.py)
        q, k, v = self.project(x, ctx.rotation, memory, cache)
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32 at least (module docstring)
        fq, fk, v_acc = self.phi(q.to(acc)), self.phi(k.to(acc)), v.to(acc)
        padding = ctx.mask.key_padding if ctx.mask is not None else None  # (B, S), True = real
        if padding is not None:
            fk = fk * padding[:, None, :, None].to(acc)  # (B, S) -> (B, 1, S, 1): pads add 0
        if memory is None and cache is not None:  # decoding: continue the running state
            if not isinstance(cache, LayerState):
                raise ValueError(
                    f"linear attention decodes with a running state, not keys and values: use "
                    f"model.new_cache(..., kind='recurrent') (its default for this model), got "
                    f"{type(cache).__name__}"
                )
            out, state = causal_linear_attention(
                fq, fk, v_acc, cache.read_state(), self.chunk_size, self.eps
            )
            cache.write_state(*state)
        elif ctx.mask is not None and ctx.mask.causal:
            out, _ = causal_linear_attention(fq, fk, v_acc, None, self.chunk_size, self.eps)
        else:
            out = linear_attention(fq, fk, v_acc, self.eps)
        # (B, H, T, D) -> transpose (B, T, H, D) -> reshape (B, T, H·D)
        out = out.to(x.dtype).transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.o_proj(out), None  # (B, T, d_model)
