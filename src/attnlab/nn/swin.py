"""Swin Transformer: hierarchical vision encoder with shifted windows (Liu et al. 2021,
arXiv:2103.14030, sections 3.1-3.2).

An image becomes a grid of patch tokens (src/attnlab/nn/frontends/patch_grid.py). Stage s runs
`depth` pre-norm blocks of width d·2^s; attention is local: the grid is cut into w x w windows
and each token attends only within its window, with a learned bias per relative offset
B[(dy, dx)] from a (2w - 1)² x H table (section 3.2, eq. 4). Every second block shifts the grid
by (w/2, w/2) before cutting it (cyclic shift, figure 4), so windows straddle the previous
block's borders; tokens that the roll brought together from opposite edges are kept apart by a
mask of -100 added to their scores (the reference code's value, not -inf). Between stages,
patch merging concatenates each 2x2 neighbourhood (4d channels), normalises and maps it to 2d:
half the resolution, twice the width.

    pixels ─ patches + norm ─┬─ stage 0: blocks (W-MSA, SW-MSA, ...) ─ merge ─ stage 1 ─ ... ─ norm
                             └─ (B, H·W, d)                          (B, H/2·W/2, 2d)

The block is src/attnlab/nn/block.py's own (pre-norm, sequential); only the attention layer
differs: `WindowAttention` is `Attention` (same projections, same kernels) applied to windows,
and reads the grid size from its `GridContext`. Names follow transformers' Swin where they can
(relative_position_bias_table, reduction, norm). Details as transformers 5: a grid not divisible
by w is zero-padded at the bottom and right after the block's norm (the padding takes part in
attention, unmasked); a stage whose grid side is at most w runs unshifted; an odd grid is
zero-padded before merging; the stem's and the merges' LayerNorms use eps 1e-5 whatever the
blocks' eps. One difference: transformers' SwinLayer keeps the shift it turned off for a small
grid (`set_shift_and_window_size` writes it on the layer), so a larger image after a small one
runs unshifted there; here each call decides from its own grid, as a fresh transformers model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention.kernels import AttnCall, choose
from .attention.layer import Attention, AttnContext
from .attention.masks import MaskSpec
from .model import ModelOutput


@dataclass(frozen=True)
class GridContext(AttnContext):
    """An attention context for tokens laid out on a height x width grid (row-major)."""

    height: int = 0
    width: int = 0


def relative_position_index(w: int) -> torch.Tensor:
    """(w², w²) index into the (2w - 1)² bias table of the offset (dy, dx) between two tokens of
    a window: (dy + w - 1)·(2w - 1) + (dx + w - 1)."""
    ys, xs = torch.meshgrid(torch.arange(w), torch.arange(w), indexing="ij")
    coords = torch.stack([ys.flatten(), xs.flatten()])  # (2, w²)
    rel = coords[:, :, None] - coords[:, None, :] + (w - 1)  # (2, w², w²), each in [0, 2w - 2]
    return rel[0] * (2 * w - 1) + rel[1]


def partition(x: torch.Tensor, w: int) -> torch.Tensor:
    """(B, H, W, C) -> (B·nW, w·w, C): non-overlapping w x w windows, row-major over the grid."""
    B, H, W, C = x.shape
    x = x.view(B, H // w, w, W // w, w, C).transpose(2, 3)  # (B, H/w, W/w, w, w, C)
    return x.reshape(-1, w * w, C)


def merge_windows(windows: torch.Tensor, w: int, H: int, W: int) -> torch.Tensor:
    """The inverse of `partition`: (B·nW, w·w, C) -> (B, H, W, C)."""
    C = windows.shape[-1]
    x = windows.view(-1, H // w, W // w, w, w, C).transpose(2, 3)  # (B, H/w, w, W/w, w, C)
    return x.reshape(-1, H, W, C)


def shift_mask(H: int, W: int, w: int, s: int, device=None) -> torch.Tensor:
    """(nW, w², w²) additive mask of the shifted windows: -100 between tokens that the cyclic
    shift brought from different regions of the grid (3 regions per axis: the body, the last
    w - s rows that stay, the s rows rolled in from the other edge), else 0."""

    def regions(n: int) -> torch.Tensor:
        i = torch.arange(n, device=device)
        return (i >= n - w).long() + (i >= n - s).long()  # 0, 1 or 2

    ids = (regions(H)[:, None] * 3 + regions(W)[None, :]).float()  # (H, W)
    win = partition(ids[None, :, :, None], w)[..., 0]  # (nW, w²)
    differ = win[:, None, :] != win[:, :, None]  # (nW, w², w²)
    return torch.zeros(differ.shape, device=device).masked_fill(differ, -100.0)


class WindowAttention(Attention):
    """Multi-head attention inside w x w windows of a grid, with Swin's relative position bias;
    `shift` > 0 rolls the grid by (-shift, -shift) first and back after (SW-MSA)."""

    fusable = False  # its own forward over windows reads q_proj, k_proj, v_proj

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        window_size: int,
        shift: int = 0,
        qkv_bias: bool = True,
        o_bias: bool = True,
        dropout: float = 0.0,
        kernel: str = "auto",
    ) -> None:
        """window_size: the side w of each window; shift: the cyclic shift (0, or w // 2 in
        every second block). The other arguments are `Attention`'s (MHA, 1/sqrt(D) scale)."""
        super().__init__(
            d_model=d_model,
            n_heads=n_heads,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            dropout=dropout,
            kernel=kernel,
        )
        if not 0 <= shift < window_size:
            raise ValueError(f"shift ({shift}) must be in [0, window_size ({window_size}))")
        self.window_size, self.shift = window_size, shift
        w = window_size
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * w - 1) ** 2, n_heads))
        index = relative_position_index(w).flatten()
        self.register_buffer("relative_position_index", index, persistent=False)

    def _bias(self) -> torch.Tensor:
        w2 = self.window_size**2
        table = self.relative_position_bias_table[self.relative_position_index]  # (w⁴, H)
        return table.view(w2, w2, -1).permute(2, 0, 1)[None]  # (1, H, w², w²)

    def forward(
        self,
        x: torch.Tensor,
        ctx: GridContext,
        memory: torch.Tensor | None = None,
        cache=None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, H·W, C) on ctx's grid -> (B, H·W, C); weights (B·nW, heads, w², w²)."""
        if memory is not None or cache is not None:
            raise ValueError("window attention is self-attention over a whole grid: no cache")
        B, T, C = x.shape
        H, W, w = ctx.height, ctx.width, self.window_size
        if H * W != T:
            raise ValueError(f"the grid {H}x{W} does not hold the {T} tokens given")
        if min(H, W) < w:
            raise ValueError(
                f"a {H}x{W} grid is smaller than the {w}x{w} window, which the bias table is for: "
                f"use larger images or a smaller window_size"
            )
        s = self.shift if min(H, W) > w else 0  # one window per side: nothing to shift
        grid = x.view(B, H, W, C)
        grid = F.pad(grid, (0, 0, 0, -W % w, 0, -H % w))  # (B, Hp, Wp, C), zeros bottom/right
        Hp, Wp = grid.shape[1:3]
        if s:
            grid = torch.roll(grid, shifts=(-s, -s), dims=(1, 2))
        windows = partition(grid, w)  # (B·nW, w², C)
        q = self._heads(windows, self.q_proj, self.n_heads)  # (B·nW, heads, w², D)
        k = self._heads(windows, self.k_proj, self.n_heads)
        v = self._heads(windows, self.v_proj, self.n_heads)
        bias = self._bias()  # (1, heads, w², w²)
        if s:
            mask = shift_mask(Hp, Wp, w, s, x.device).to(bias.dtype)  # (nW, w², w²)
            bias = (bias[:, None] + mask[None, :, None]).flatten(0, 1)  # (nW, heads, w², w²)
            bias = bias.repeat(B, 1, 1, 1)  # (B·nW, ...): windows are batch-major
        bias = bias.expand(q.shape[0], -1, -1, -1).to(q.dtype)
        pos = torch.arange(w * w, device=x.device).expand(q.shape[0], -1)
        call = AttnCall(
            scale=self.scale,
            mask=MaskSpec(pos, pos),
            bias=bias,
            dropout_p=self.dropout_p(ctx),
            need_weights=need_weights,
        )
        # the kernel over (B·nW, heads, w², D), heads merged and projected: (B·nW, w², C)
        out, weights = self.finish(q, choose(self.kernel, q, k, v, call), k, v, call)
        grid = merge_windows(out, w, Hp, Wp)
        if s:
            grid = torch.roll(grid, shifts=(s, s), dims=(1, 2))
        return grid[:, :H, :W].reshape(B, T, C), weights


class PatchMerging(nn.Module):
    """2x2 neighbourhoods -> one token: (B, H·W, C) -> (B, ⌈H/2⌉·⌈W/2⌉, 2C) (section 3.1)."""

    def __init__(self, *, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * d_model, eps=eps)
        self.reduction = nn.Linear(4 * d_model, 2 * d_model, bias=False)

    def forward(self, x: torch.Tensor, H: int, W: int) -> torch.Tensor:
        B, _, C = x.shape
        grid = F.pad(x.view(B, H, W, C), (0, 0, 0, W % 2, 0, H % 2))  # even sides
        # channel order of the reference: (0, 0), (1, 0), (0, 1), (1, 1) as (row, col) offsets
        parts = [grid[:, r::2, c::2] for c in range(2) for r in range(2)]
        merged = torch.cat(parts, dim=-1).view(B, -1, 4 * C)  # (B, H/2·W/2, 4C)
        return self.reduction(self.norm(merged))


class Stage(nn.Module):
    """`blocks` (src/attnlab/nn/block.py, each with a WindowAttention) at one resolution, then
    patch merging (or None in the last stage)."""

    def __init__(self, *, blocks: list[nn.Module], merge: PatchMerging | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.merge = merge

    def forward(self, x: torch.Tensor, H: int, W: int) -> tuple[torch.Tensor, int, int]:
        ctx = GridContext(height=H, width=W)
        for block in self.blocks:
            x, _ = block(x, ctx)
        if self.merge is None:
            return x, H, W
        return self.merge(x, H, W), (H + 1) // 2, (W + 1) // 2


class HierarchicalEncoderModel(nn.Module):
    """An image encoder in stages: frontend (patch grid) -> stages -> final norm -> (classifier).
    `hidden` is the last stage's tokens after the final norm (transformers' SwinModel
    `last_hidden_state`; its pooler_output is their mean over tokens, `hidden.mean(1)`); the
    classifier, if any, maps that mean to the labels (SwinForImageClassification)."""

    def __init__(
        self,
        *,
        frontend: nn.Module,
        stages: list[Stage],
        final_norm: nn.Module,
        classifier: nn.Linear | None = None,
    ) -> None:
        """frontend: src/attnlab/nn/frontends/patch_grid.py's PatchGrid (it names the grid);
        stages: applied in order, each halving the grid but the last; final_norm: after them;
        classifier: a linear map of the mean final token to the labels, or None."""
        super().__init__()
        self.frontend = frontend
        self.stages = nn.ModuleList(stages)
        self.final_norm = final_norm
        self.classifier = classifier

    def forward(self, pixel_values: torch.Tensor | None = None, **options) -> ModelOutput:
        """pixel_values (B, C, H, W) -> ModelOutput(logits (B, num_labels) or None, hidden
        (B, T_last, d_last))."""
        if pixel_values is None or options.get("input_ids") is not None:
            raise ValueError("this model reads images: call model(pixel_values=...)")
        x = self.frontend(pixel_values)  # (B, H·W, d)
        H, W = self.frontend.grid_of(pixel_values)
        for stage in self.stages:
            x, H, W = stage(x, H, W)
        hidden = self.final_norm(x)
        logits = None if self.classifier is None else self.classifier(hidden.mean(1))
        return ModelOutput(logits, hidden)
