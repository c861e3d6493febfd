"""Multi-head latent attention, MLA (DeepSeek-V2, arXiv:2405.04434, section 2.1).

Keys and values are not projected per head from x but decompressed from one low-rank latent per
token, shared by every head, and position enters through a separate small key that RoPE rotates
("decoupled RoPE", section 2.1.3), also shared by every head:

    x ─ kv_a_proj ─┬─ c_kv (r) ─ kv_a_norm ─┬──────── cached ─ kv_b_proj ─┬─ k_nope (H, dn)
                   └─ k_pe (dr) ─ rotation ─┘    (latent.py)              └─ v      (H, dv)
    x ─ q_proj (or q_a_proj ─ q_a_norm ─ q_b_proj) ─┬─ q_nope (H, dn)
                                                    └─ q_pe (H, dr) ─ rotation
    head h:  q = [q_nope; q_pe]   k = [k_nope; k_pe]   softmax(q·k · scale) v ─ o_proj

r = kv_lora_rank, dr = qk_rope_head_dim, dn = qk_nope_head_dim, dv = v_head_dim. A decoder
caches only [c_kv; k_pe], r + dr values per token and layer (src/attnlab/cache/latent.py),
instead of 2·H·D. RoPE cannot live in the latent: a rotation between q and kv_b_proj's key
half would depend on the position and could not be folded into the weights (section 2.1.3).

Two ways to compute the same function, a runtime choice (`absorb`):

    expanded   decompress k_nope and v for every key, then per-head attention (as transformers)
    absorbed   fold kv_b_proj's key half into the query and its value half after the output
               (section 2.1.2, "absorb W^UK into W^UQ, W^UV into W^O"):
                 q_lat = q_nope W_uk (H, r);  scores = q_lat·c_kv + q_pe·k_pe
                 out   = (softmax · c_kv) W_uvᵀ
               which is multi-query attention over one head [c_kv; k_pe] whose value is c_kv
               (the kernel is given the whole entry as value; the rope channels of its output
               are dropped): it attends over the cache as stored, nothing is decompressed.

`absorb` None (the default) absorbs in decoding steps (one new token per row, with a cache) and
expands otherwise, as vLLM splits decode and prefill: with T queries the expanded form pays the
decompression of S keys once (S·H·r·(dn + dv)) and per-head products dn + dr wide, the absorbed
one products r + dr wide per (query, key) pair (V2-Lite: 576 against 192), so it wins only for
few queries per step.

As transformers' DeepseekV2Attention: the latents' RMSNorms have their own eps (1e-6),
attention_bias puts biases on the down projections and o_proj only, and YaRN's mscale reaches
the softmax scale through `scale` (src/attnlab/interop/deepseek_v2.py computes it). The layer is
an `Attention` (layer.py) for `set_kernel` and dropout only; its projections are its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...cache.base import LayerKV
from ..norms import RMSNorm
from .heads import HeadGeometry
from .kernels.call import AttnCall
from .kernels.select import AUTO, check_name, choose
from .layer import ATTENTIONS, Attention, AttnContext


@ATTENTIONS.register("mla")
class MultiHeadLatentAttention(Attention):
    cache_kind = "latent"  # what model.new_cache hands out by default
    fusable = False  # its own projections: latents, not q/k/v

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        bias: bool = False,
        scale: float | None = None,
        dropout: float = 0.0,
        latent_norm_eps: float = 1e-6,
        kernel: str = AUTO,
        absorb: bool | None = None,
    ) -> None:
        """Args:
        d_model: input and output width.
        n_heads: H, query heads; each decompresses its own key and value.
        kv_lora_rank: r, the KV latent's width.
        qk_nope_head_dim, qk_rope_head_dim: dn and dr, the two parts of each query/key head.
        v_head_dim: dv, each value head's width.
        q_lora_rank: the query latent's width (DeepSeek-V2), or None for one q_proj (V2-Lite).
        bias: biases on q_a_proj, kv_a_proj and o_proj (transformers' attention_bias).
        scale: multiplies q·k (None: 1/sqrt(dn + dr)).
        dropout: on the attention weights (training only).
        latent_norm_eps: eps of the RMSNorms on the latents.
        kernel: a name in KERNELS; a runtime choice, see `set_kernel`.
        absorb: True / False compute the absorbed / expanded form; None decides per call
            (module docstring). A runtime choice: the function is the same.
        """
        nn.Module.__init__(self)  # not Attention's projections: MLA has its own
        sizes = dict(
            n_heads=n_heads,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
        )
        bad = [f"{k} ({v})" for k, v in sizes.items() if v < 1]
        if q_lora_rank is not None and q_lora_rank < 1:
            bad.append(f"q_lora_rank ({q_lora_rank})")
        if bad:
            raise ValueError(f"{', '.join(bad)} must be >= 1")
        check_name(kernel)  # a typo fails here, with the known names
        H, r, dn, dr, dv = n_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_lora_rank, self.v_head_dim = r, dv
        self.qk_nope_head_dim, self.qk_rope_head_dim = dn, dr
        # the sizes every attention kind states (heads.py), here what a cache is sized by
        # (model.new_cache): H query heads over one shared "head" of r + dr channels
        g = HeadGeometry.of(d_model, H, n_kv_heads=1, head_dim=r + dr)
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = g.sizes
        self.scale = scale if scale is not None else (dn + dr) ** -0.5
        self.dropout, self.kernel, self.absorb = dropout, kernel, absorb
        self.choices = None  # what each call got, when recorded (layer.py, record_choices)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, H * (dn + dr), bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(dim=q_lora_rank, eps=latent_norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, H * (dn + dr), bias=False)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj = nn.Linear(d_model, r + dr, bias=bias)
        self.kv_a_norm = RMSNorm(dim=r, eps=latent_norm_eps)
        self.kv_b_proj = nn.Linear(r, H * (dn + dv), bias=False)  # no bias: absorbable
        self.o_proj = nn.Linear(H * dv, d_model, bias=bias)

    def _query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, d_model) -> q_nope (B, H, T, dn), q_pe (B, H, T, dr), not yet rotated."""
        B, T, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        # (B, T, H·(dn + dr)) -> view (B, T, H, dn + dr) -> transpose (B, H, T, dn + dr)
        q = q.view(B, T, self.n_heads, -1).transpose(1, 2)
        return q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

    def latent(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """x (B, T, d_model) -> the cache entries [c_kv; rotated k_pe], (B, 1, T, r + dr)."""
        c, k_pe = self.kv_a_proj(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = k_pe[:, None]  # (B, 1, T, dr): one key head shared by all query heads
        if ctx.rotation is not None:
            k_pe = ctx.rotation(k_pe)
        return torch.cat((self.kv_a_norm(c)[:, None], k_pe), dim=-1)  # (B, 1, T, r + dr)

    def forward(
        self,
        x: torch.Tensor,
        ctx: AttnContext,
        memory: torch.Tensor | None = None,
        cache: LayerKV | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, d_model); `cache` any cache kind's layer (the latent cache stores the entry
        once, the others as K and as V). Returns (B, T, d_model) and, with need_weights, the
        (B, H, T, S) attention weights."""
        if memory is not None:
            raise ValueError(
                "multi-head latent attention has no cross-attention form: use attention kind "
                "'softmax' in an encoder-decoder model"
            )
        B, T, _ = x.shape
        q_nope, q_pe = self._query(x)  # (B, H, T, dn), (B, H, T, dr)
        if ctx.rotation is not None:
            q_pe = ctx.rotation(q_pe)
        entry = self.latent(x, ctx)  # (B, 1, T, r + dr)
        if cache is not None:
            entry, _ = cache.update(entry, entry)  # every stored entry, (B, 1, S, r + dr)
        absorb = cache is not None and T == 1 if self.absorb is None else self.absorb
        attend = self._absorbed if absorb else self._expanded
        out, weights = attend(q_nope, q_pe, entry, ctx, need_weights)  # (B, H, T, dv)
        # (B, H, T, dv) -> transpose (B, T, H, dv) -> reshape (B, T, H·dv)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.v_head_dim)
        return self.o_proj(out), weights  # (B, T, d_model)

    def _kernel(self, q, k, v, ctx: AttnContext, need_weights: bool):
        call = AttnCall(
            scale=self.scale,
            mask=ctx.mask,
            bias=ctx.bias,
            dropout_p=self.dropout_p(ctx),
            need_weights=need_weights,
        )
        choice = choose(self.kernel, q, k, v, call)
        if self.choices is not None:
            self.choices.append(choice)
        return choice.kernel.fn(q, k, v, call)

    def _expanded(self, q_nope, q_pe, entry, ctx, need_weights):
        """Decompress every key and value, then H-head attention (transformers' order)."""
        B, _, S, _ = entry.shape
        H, r, dn, dv = self.n_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim
        c, k_pe = entry[:, 0, :, :r], entry[:, :, :, r:]  # (B, S, r), (B, 1, S, dr)
        # (B, S, H·(dn + dv)) -> view (B, S, H, dn + dv) -> transpose (B, H, S, dn + dv)
        kv = self.kv_b_proj(c).view(B, S, H, dn + dv).transpose(1, 2)
        k_nope, v = kv.split([dn, dv], dim=-1)  # (B, H, S, dn), (B, H, S, dv)
        k = torch.cat((k_nope, k_pe.expand(B, H, S, -1)), dim=-1)  # (B, H, S, dn + dr)
        q = torch.cat((q_nope, q_pe), dim=-1)  # (B, H, T, dn + dr)
        # one head width for every kernel (tiled.py, and CUDA's flash path, need it): zero
        # channels pad v, or q and k, which leaves the scores and the first dv outputs alike
        width = max(dn + self.qk_rope_head_dim, dv)
        q, k, v = (
            t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v)
        )
        out, weights = self._kernel(q, k, v, ctx, need_weights)  # (B, H, T, width)
        return out[..., :dv], weights

    def _absorbed(self, q_nope, q_pe, entry, ctx, need_weights):
        """Attend over the latents as stored: MQA with key [c_kv; k_pe] and value c_kv."""
        H, r, dn = self.n_heads, self.kv_lora_rank, self.qk_nope_head_dim
        w = self.kv_b_proj.weight.view(H, -1, r)  # (H, dn + dv, r)
        w_uk, w_uv = w[:, :dn], w[:, dn:]  # (H, dn, r), (H, dv, r)
        q_lat = torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk)  # q_nope·k_nope = q_lat·c_kv
        q = torch.cat((q_lat, q_pe), dim=-1)  # (B, H, T, r + dr)
        # the entry is key and value (its first r channels are the value): the kernel sees one
        # width and no copy is made; the rope channels of the output are dropped
        out, weights = self._kernel(q, entry, entry, ctx, need_weights)  # (B, H, T, r + dr)
        return torch.einsum("bhtr,hvr->bhtv", out[..., :r], w_uv), weights  # (B, H, T, dv)
