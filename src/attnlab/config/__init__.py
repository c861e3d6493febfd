"""The config tree: every architectural choice as data.

A `ModelConfig` is a tree of small frozen pydantic models, one sub-config per component kind.
Kinds that grow (positional schemes, attention, FFNs, norms, RoPE scaling, frontends) are tagged
unions keyed by `kind`, so a RoPE-only field can never sit on an ALiBi model. Every difference in
behaviour is a named field; nothing is inferred from a model's name. Derived sizes (`head_dim`,
`kv_heads`, `ffn_dim`, ...) are read in one place: the properties at the bottom of `ModelConfig`
(model.py).

Each member of a union is a `Kind` (under its union's base: `PositionalBase`, `AttentionBase`,
`FFNBase`, `NormBase`, `ScalingBase`, `FrontendBase`) and carries what is particular to it: its
cross-field rules (`problems(model, where)`), its test size (`tiny(size)`, for presets.tiny), the
sizes it derives (`rotary_dim`, `rope_head_dim`, `hidden_dim`) and its words for the preset
tables. What other kinds' rules need to know about it is a declared class variable
(`biases_scores`, `per_layer`, ...), never a test of its class; so `ModelConfig` only collects,
and adding a kind is its class and its name in the union.

One module per component kind, each holding its union: positional.py (with scaling.py for RoPE's
scalings), attention.py, norms.py, ffn.py, frontends.py (and Swin's stages); layer_pattern.py
(`LayerSpec`); model.py (`ModelConfig`); base.py the plumbing under them all (`Frozen`, `Kind`,
`ConfigError`). This file re-exports every name, so `attnlab.config.X` is the one import.

Invalid configs fail at construction with *every* problem at once, each naming the field, the
value, the rule and the fix; the exception is `ConfigError` (a `ValueError`). This package does
not import torch.
"""

from __future__ import annotations

from .attention import (
    AttentionBase,
    AttentionConfig,
    BlockSparseAttentionConfig,
    LinearAttentionConfig,
    LongformerAttentionConfig,
    MLAConfig,
    XLAttentionConfig,
)
from .attention import AttentionKind as AttentionKind
from .attention import FeatureMap as FeatureMap
from .base import ConfigError, Kind, TinySize
from .base import Frozen as Frozen
from .base import load_yaml as load_yaml
from .base import merge_dicts as merge_dicts
from .base import validation_problems as validation_problems
from .ffn import FFN as FFN
from .ffn import GLUFFN, DenseFFN, FFNBase, MoEFFN
from .ffn import Activation as Activation
from .frontends import AudioFrontend, FrontendBase, PatchFrontend
from .frontends import Frontend as Frontend
from .frontends import PatchGridFrontend as PatchGridFrontend
from .frontends import StagesConfig as StagesConfig
from .layer_pattern import LayerSpec
from .model import ModelConfig
from .norms import LayerNormConfig, NormBase, RMSNormConfig, UnitOffsetRMSNormConfig
from .norms import NormConfig as NormConfig
from .positional import (
    ALiBi,
    LearnedPositions,
    NoPositions,
    PositionalBase,
    RoPE,
    Sinusoidal,
    T5RelativeBias,
    XLRelative,
)
from .positional import Positional as Positional
from .scaling import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    LongRoPEScaling,
    NTKScaling,
    ProportionalScaling,
    ScalingBase,
    YaRNScaling,
)
from .scaling import RopeScaling as RopeScaling

__all__ = [
    "GLUFFN",
    "ALiBi",
    "AttentionBase",
    "AttentionConfig",
    "AudioFrontend",
    "BlockSparseAttentionConfig",
    "ConfigError",
    "DenseFFN",
    "DynamicNTKScaling",
    "FFNBase",
    "FrontendBase",
    "Kind",
    "LayerNormConfig",
    "LayerSpec",
    "LearnedPositions",
    "LinearAttentionConfig",
    "LinearScaling",
    "Llama3Scaling",
    "LongRoPEScaling",
    "LongformerAttentionConfig",
    "MLAConfig",
    "MoEFFN",
    "ModelConfig",
    "NTKScaling",
    "NoPositions",
    "NormBase",
    "PatchFrontend",
    "PositionalBase",
    "ProportionalScaling",
    "RMSNormConfig",
    "RoPE",
    "ScalingBase",
    "Sinusoidal",
    "T5RelativeBias",
    "TinySize",
    "UnitOffsetRMSNormConfig",
    "XLAttentionConfig",
    "XLRelative",
    "YaRNScaling",
]
