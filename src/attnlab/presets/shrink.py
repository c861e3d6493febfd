"""The same architecture at test size: `tiny(cfg)` keeps every kind and shrinks the shared sizes
(each kind shrinks itself: `tiny(size)` of its config class)."""

from __future__ import annotations

from ..config import ModelConfig, StagesConfig, TinySize


def tiny(
    cfg: ModelConfig, d_model: int = 64, n_layers: int = 2, vocab_size: int = 256
) -> ModelConfig:
    """The same architecture at test size: d_model 64, 2 layers, head_dim d_model/4, vocab 256.

    Keeps MHA / MQA / GQA and the GQA group size, the positional scheme (learned tables hold 128
    positions, YaRN/dynamic-NTK original lengths shrink to 32), the FFN kind and its d_ff/d_model
    ratio, MoE top-k with max(4, 2·top_k) experts at most, the sliding window (at most 8, so tests
    see it, in each layer_pattern entry too; Longformer's width at most 12, window 7), norm,
    placement, residual topology, heads and tying; Transformer-XL's memory and segment at most 16
    positions. A layer pattern keeps as many layers as its first layer of each kind needs (a
    NoPE layer 4th in the pattern: 4 layers), and a MoE one sparse layer after its dense ones
    (DeepSeek-V3: 4 layers). A frontend keeps its kind and channels at its own
    test size (`frontend.tiny(size)`: 8x8 patches of 32x32 images, no vocabulary; 32 frames of
    audio for the encoder).
    Staged encoders (Swin) keep two stages of two blocks (n_layers 4), windows of at most 4.
    Each kind shrinks itself (`tiny(size)` of its config class): this function sets the shared
    sizes only.
    """
    head_dim = d_model // 4
    kv = cfg.kv_heads
    if kv == cfg.n_heads:
        heads, kv_heads = 4, 4
    elif kv == 1:
        heads, kv_heads = 4, 1
    else:  # GQA: keep the group size
        heads, kv_heads = 2 * (cfg.n_heads // kv), 2
    ch: dict = dict(
        vocab_size=vocab_size if cfg.vocab_size else 0,  # an image encoder has no token table
        d_model=d_model,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=None if kv_heads == heads else kv_heads,
        head_dim=None if heads * head_dim == d_model else head_dim,
    )
    if cfg.n_decoder_layers is not None:
        ch["n_decoder_layers"] = n_layers
    size = TinySize(d_model=d_model, head_dim=head_dim, full_d_model=cfg.d_model)
    if cfg.d_ff is not None:
        ch["d_ff"] = size.width(cfg.d_ff)
    # each kind knows its test size (Kind.tiny in config/base.py)
    for name in ("positional", "attention", "ffn", "norm"):
        ch[name] = getattr(cfg, name).tiny(size)
    # as many blocks as every kind of FFN block needs (a MoE: a sparse block after its dense
    # ones, DeepSeek-V3: 4)
    ch["n_layers"] = max(ch["n_layers"], cfg.ffn.tiny_layers())
    if cfg.layer_pattern is not None:  # each layer's window at most 8, as the model's
        ch["layer_pattern"] = pattern = [
            s.merged(sliding_window=min(s.sliding_window, 8)) if s.sliding_window else s
            for s in cfg.layer_pattern
        ]
        # enough layers that each kind of layer occurs: SmolLM3's NoPE layer is the 4th,
        # Gemma 3's global layer the 6th
        ch["n_layers"] = max(ch["n_layers"], 1 + max(pattern.index(s) for s in pattern))
    if cfg.n_decoder_layers is not None:  # as deep as the encoder
        ch["n_decoder_layers"] = ch["n_layers"]
    if cfg.pad_token_id is not None and cfg.pad_token_id >= vocab_size:
        ch["pad_token_id"] = 0
    if cfg.frontend is not None:
        ch["frontend"] = cfg.frontend.tiny(size)
    if cfg.stages is not None:  # two stages of two blocks: windows, shifted windows, one merge
        w = min(cfg.stages.window_size, 4)
        ch["stages"] = StagesConfig(depths=(2, 2), heads=(heads, 2 * heads), window_size=w)
        ch["n_layers"] = 4
    return cfg.replace(**ch)
