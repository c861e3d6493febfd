"""`decode_step` in one native call, for the decoders people run at batch 1 on a CPU.

A decode step of a small model at batch 1 is ~120 matrix-vector products (the weights' bytes:
src/attnlab/nn/matvec.py makes them read at the memory's speed) and ~1,000 small torch ops around
them (norms, RoPE, the cache write, attention over a few hundred keys, the gated activation,
residual adds), each a few microseconds of dispatch. On SmolLM2-135M (4-bit, 2 threads) those ops
took 7.5 of a 14.1 ms step (benchmarks/cpu_decode.py's profile), more than the products.
`NativeStep` hands one call of src/attnlab/nn/csrc/step.cpp the whole step instead:

    x = embed(token)                          Python: the model's own embedding (packed or not)
    cos, sin = rotation(position)             Python: the model's RoPE, with any scaling
    for each layer:                           C++, fp32:
        h = RMSNorm(x); q, k, v = W_qkv h     the model's weights where they are (fp32, int8,
        rotate q, k; K/V -> cache slot        4-bit, Q8_0: rows.h), fused or separate maps
        a = softmax(q·Kᵀ · scale) V           every cached key of the KV head (GQA/MQA)
        x += m · W_o a
        x += m · W_down (act(W_gate h') ⊙ W_up h'),  h' = RMSNorm(x)
    logits = W_head RMSNorm(x) · multiplier

It serves exactly the models that are this function: decoder-only, pre-norm sequential blocks
with RMSNorm, softmax attention (qk-norm per head allowed) without soft-capping, sinks or a window, RoPE (any
scaling whose tables do not go stale, so not LongRoPE), a gated FFN (SwiGLU / GeGLU) without
GPT-OSS's clamp, fp32 activations and cache, one sequence, a static cache without padding. Any
other model, batch or cache runs the eager step (`why_not` and `why_not_on` say why; the
decode-step picker, decode/picker.py, asks them). The engine's decode batches of up to NATIVE_ROWS
rows take it row by row over the pool (`NativeRows`). The values are the eager
model's up to fp32 rounding and summation order (tests/decode/test_native_step.py compares logits
and greedy tokens with the eager step for every weight kind). `ATTNLAB_KERNELS=0` switches it off
with the matvec kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.ragged import RaggedPagedCache
from ..cache.static import StaticKVCache
from ..nn import matvec
from ..nn.activations import gelu_tanh
from ..nn.attention.layer import Attention
from ..nn.block import Block
from ..nn.ffn.glu import GLUFFN, FusedGLUFFN
from ..nn.fused_linear import FusedLinear
from ..nn.model import DecoderOnlyModel
from ..nn.norms import RMSNorm
from ..nn.positional.rope import RotaryEmbedding
from ..nn.quant_blocks import BlockInt8Linear, Int4Linear, PackedEmbedding
from ..nn.quantize import Int8Linear

F32, I8, Q4, Q8, Q4_X8, Q8_X8 = range(6)  # step.cpp's weight kinds
_ACTS = {F.silu: 0, F.gelu: 1, gelu_tanh: 2}  # step.cpp's activations
# the engine's decode steps of at most this many rows take the native step, one row at a time:
# each row reads every weight once, so past a few rows torch's batched matmuls win (SmolLM2-135M,
# 4-bit, 2 threads: ~8 ms a row native against 45 ms for a whole eager step of 1 row and 160 ms
# of 32)
NATIVE_ROWS = 8
_FLOAT_LINEARS = (nn.Linear, matvec.KernelLinear, FusedLinear)


def _fp32_cpu(*ts: torch.Tensor | None) -> bool:
    return all(
        t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())
        for t in ts
    )


def weight_spec(lin: nn.Module) -> tuple | None:
    """step.cpp's view of a Linear map: (kind, K, a, b, c, bias), or None for a kind it lacks."""
    bias = getattr(lin, "bias", None)
    if type(lin) in _FLOAT_LINEARS:
        w = lin.weight
        return (F32, lin.in_features, w.detach(), None, None, bias) if _fp32_cpu(w, bias) else None
    if isinstance(lin, Int8Linear) and _fp32_cpu(lin.scales, bias):
        return (I8, lin.in_features, lin.qweight, lin.scales, None, bias)
    x8 = getattr(lin, "activations", "fp32") == "int8"  # quant_blocks.int8_activations
    if isinstance(lin, Int4Linear) and _fp32_cpu(lin.d, lin.m, bias):
        return (Q4_X8 if x8 else Q4, lin.in_features, lin.packed, lin.d, lin.m, bias)
    if isinstance(lin, BlockInt8Linear) and _fp32_cpu(lin.d, bias):
        return (Q8_X8 if x8 else Q8, lin.in_features, lin.qweight, lin.d, None, bias)
    return None


def _norm(norm: nn.Module) -> tuple[torch.Tensor, float] | None:
    if type(norm) is not RMSNorm or not _fp32_cpu(norm.weight):
        return None
    return norm.weight.detach(), float(norm.eps)


def _qk_norm(norm: nn.Module | None) -> tuple[torch.Tensor | None, float]:
    return (None, 0.0) if norm is None else _norm(norm)


def _head(model: DecoderOnlyModel) -> tuple | None:
    if model.lm_head is not None:
        return weight_spec(model.lm_head)
    if model.logit_scale != 1.0:
        return None
    emb = model.embed_tokens
    if isinstance(emb, PackedEmbedding):
        return weight_spec(emb.table)
    if type(emb) is nn.Embedding and _fp32_cpu(emb.weight):
        return (F32, emb.embedding_dim, emb.weight.detach(), None, None, None)
    return None


def eval_decoder(model: nn.Module) -> str | None:
    """What the native and compiled steps both ask first: why `model` is not a decoder-only
    model in eval mode, or None."""
    if not isinstance(model, DecoderOnlyModel):
        return f"{type(model).__name__} is not a decoder-only model"
    if model.training:
        return "the model is in training mode (dropout)"
    return None


def why_not(model: nn.Module) -> str | None:
    """Why `model` cannot take the native step (the first reason found), or None if it can."""
    if (why := eval_decoder(model)) is not None:
        return why
    if model.final_logit_softcap is not None:
        return "final logit soft-capping"
    stack = model.decoder
    if stack.embedding_norm is not None or stack.variants is not None or stack.window is not None:
        return "an embedding norm, per-layer variants or a sliding window"
    pos = stack.positional
    if type(pos) is not RotaryEmbedding or pos.reprefill_after is not None:
        return f"positional scheme {type(pos).__name__} (RoPE without LongRoPE's switch only)"
    if _norm(stack.final_norm) is None:
        return "the final norm is not an fp32 RMSNorm"
    if _head(model) is None:
        return "the output head's weights are of a kind the step lacks"
    multipliers = set()
    for i, block in enumerate(stack.blocks):
        why = _why_not_block(block)
        if why:
            return f"block {i}: {why}"
        multipliers.add(block.residual_multiplier)
    if len(multipliers) > 1:
        return "blocks with different residual multipliers"
    return None


def _why_not_block(block: nn.Module) -> str | None:
    if type(block) is not Block or block.cross_attn is not None:
        return f"{type(block).__name__} with cross-attention, or not a Block"
    if (block.placement, block.residual) != ("pre", "sequential"):
        return f"placement {block.placement!r}, residual {block.residual!r} (pre, sequential only)"
    if _norm(block.attn_norm) is None or _norm(block.ffn_norm) is None:
        return "a norm that is not an fp32 RMSNorm"
    attn = block.self_attn
    if type(attn) is not Attention:
        return f"attention {type(attn).__name__}"
    if attn.softcap is not None or attn.sinks is not None:
        return "attention soft-capping or sinks"
    if attn.qk_norm_scope != "head" or any(
        n is not None and (_norm(n) is None or n.weight.numel() != attn.head_dim)
        for n in (attn.q_norm, attn.k_norm)
    ):
        return "qk-norm that is not an fp32 RMSNorm per head"
    maps = _qkv(attn)
    if any(weight_spec(m) is None for m in [*maps, attn.o_proj]):
        return "q/k/v/o weights of a kind the step lacks"
    ffn = block.ffn
    if type(ffn) not in (GLUFFN, FusedGLUFFN):
        return f"FFN {type(ffn).__name__} (a gated FFN only)"
    if ffn.limit is not None or ffn.up_shift or ffn.act not in _ACTS:
        return "a clamped gate or an activation the step lacks"
    if any(weight_spec(m) is None for m in [*_gate_up(ffn), ffn.down_proj]):
        return "FFN weights of a kind the step lacks"
    return None


def _qkv(attn: Attention) -> list[nn.Module]:
    if attn.projection_layout == "fused":
        return [attn.qkv_proj]
    return [attn.q_proj, attn.k_proj, attn.v_proj]


def _gate_up(ffn: nn.Module) -> list[nn.Module]:
    return [ffn.gate_up_proj] if isinstance(ffn, FusedGLUFFN) else [ffn.gate_proj, ffn.up_proj]


class NativeStep:
    """The native step of one model (built once per generation: it holds the weights' tensors as
    they are now). Call it with a token (1,) and the static cache the prefill filled."""

    def __init__(self, model: DecoderOnlyModel, ext) -> None:
        stack, blocks = model.decoder, model.decoder.blocks
        attn0, ffn0 = blocks[0].self_attn, blocks[0].ffn
        self.model, self.positional = model, stack.positional
        final_w, final_eps = _norm(stack.final_norm)
        self.step = ext.Step(
            model.embed_tokens.embedding_dim,
            attn0.n_heads,
            attn0.n_kv_heads,
            attn0.head_dim,
            stack.positional.rot_dim,
            stack.positional.layout == "interleaved",
            attn0.scale,
            ffn0.down_proj.in_features,  # d_ff
            _ACTS[ffn0.act],
            blocks[0].residual_multiplier,
            final_w,
            final_eps,
            _head(model),
            model.logit_multiplier,
        )
        for block in blocks:
            attn, ffn = block.self_attn, block.ffn
            self.step.add_layer(
                *_norm(block.attn_norm),
                [weight_spec(m) for m in _qkv(attn)],
                weight_spec(attn.o_proj),
                *_norm(block.ffn_norm),
                [weight_spec(m) for m in _gate_up(ffn)],
                weight_spec(ffn.down_proj),
                *_qk_norm(attn.q_norm),
                *_qk_norm(attn.k_norm),
            )
        self._valid = torch.ones(1, 1, dtype=torch.bool)

    def __call__(self, token: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """token (1,) -> logits (1, vocab), its K/V written to the cache as the eager step would."""
        positions = cache.next_position[:, None]  # (1, 1)
        cache.append(positions, self._valid)  # the slot, its position and validity, as eager
        rot = self.positional.rotation(positions)  # cos, sin (1, 1, R/2)
        x = self.model.embed(token[:, None]).reshape(-1)  # (1, 1, d_model) -> (d_model,)
        return self.step.forward(
            x.contiguous(),
            rot.cos.reshape(-1).contiguous(),
            rot.sin.reshape(-1).contiguous(),
            cache.k,
            cache.v,
            cache.length - 1,
        )

    def paged(self, token: torch.Tensor, cache) -> torch.Tensor:
        """token (1,) -> logits (1, vocab) for the one row `cache` (the engine's
        RaggedPagedCache) has selected: its K/V written to the row's next pool slot, attention
        over the row's slots in the pool (step.cpp's slot table)."""
        positions = cache.next_position[:, None]  # (1, 1)
        cache.append(positions, self._valid)  # the row's next slot, its position and validity
        rot = self.positional.rotation(positions)
        x = self.model.embed(token[:, None]).reshape(-1)
        return self.step.forward(
            x.contiguous(),
            rot.cos.reshape(-1).contiguous(),
            rot.sin.reshape(-1).contiguous(),
            cache.k.unsqueeze(1),  # (L, H_kv, P, D) -> (L, 1, H_kv, P, D): one "row" of P slots
            cache.v.unsqueeze(1),
            int(positions),  # the new token's logical slot: the row's keys are 0 .. it
            cache.read_slots[0],  # logical slot -> pool slot
        )


class NativeRows:
    """The engine's decode batch row by row through the native step (`NativeStep.paged`):
    `(seqs) -> logits (B, V)` as `attnlab.generate` computes each row alone, or None past
    NATIVE_ROWS rows (the runner's batched forward is faster there)."""

    def __init__(self, step: NativeStep, cache) -> None:
        self.step, self.cache = step, cache

    def __call__(self, seqs: list) -> torch.Tensor | None:
        if len(seqs) > NATIVE_ROWS:
            return None
        rows = []
        for s in seqs:
            self.cache.select([s.rid], [s.filled])
            token = torch.tensor([s.newest], device=self.cache.k.device)
            rows.append(self.step.paged(token, self.cache))
        return torch.cat(rows).float()


def why_not_on(model: nn.Module, cache) -> str | None:
    """Why the native step cannot decode `model` on `cache` (decode/picker.py asks), or None:
    the model's shape (`why_not`); a cache that is neither a static fp32 CPU one of one row
    without padding (a decoding loop's) nor the engine's fp32 CPU pool; no kernels here
    (switched off, or no compiler: src/attnlab/nn/matvec.py)."""
    if isinstance(cache, RaggedPagedCache):
        if not (cache.k.dtype == torch.float32 and cache.k.device.type == "cpu"):
            return "the engine's pool is not fp32 on the CPU"
    elif not (
        type(cache) is StaticKVCache
        and cache.batch_size == 1
        and cache.k.dtype == torch.float32
        and cache.k.device.type == "cpu"
        and cache.k.is_contiguous()
        and cache.v.is_contiguous()
    ):
        return "it decodes one row of a static fp32 CPU cache (or the engine's pool)"
    elif not bool(cache.valid[:, : cache.length].all()):
        return "the row is left-padded"
    if (why := why_not(model)) is not None:
        return why
    if matvec.extension() is None:
        return "the native kernels are not built here (src/attnlab/nn/matvec.py)"
    return None


def build(model: nn.Module, cache) -> NativeStep | NativeRows:
    """The native step for a loop's cache, or the engine's rows over its pool."""
    step = NativeStep(model, matvec.extension())
    return NativeRows(step, cache) if isinstance(cache, RaggedPagedCache) else step
