"""SmolLM3 (Hugging Face 2025, the SmolLM3 blog post and model card, huggingface.co/HuggingFaceTB/
SmolLM3-3B) <-> attnlab: transformers' model_type smollm3.

Llama's layout (src/attnlab/interop/llama.py) with NoPE layers (Kazemnejad et al. 2023,
arXiv:2305.19466): `no_rope_layers[i]` is 1 where layer i rotates q and k and 0 where it does not
(by default every `no_rope_layer_interval`-th layer, 4: layers 3, 7, 11, ... take no positions).
attnlab's form is a `layer_pattern` (src/attnlab/config/layer_pattern.py), the shortest that
repeats the layers: LayerSpec() keeps the model's RoPE, LayerSpec(positional=NoPositions())
drops it; each entry also carries the layer's window, where `use_sliding_window` slides the
"sliding_attention" entries of `layer_types` (transformers derives them from the NoPE layers).
"""

from __future__ import annotations

from typing import ClassVar

from ..config import LayerSpec, NoPositions
from .converter import CONVERTERS
from .hf_config import Fit, HFConfig
from .llama import _COMMON, LlamaConverter


def _shortest_period(specs: list[LayerSpec]) -> tuple[LayerSpec, ...]:
    """The shortest pattern p with specs[i] == p[i % len(p)] for every layer."""
    for n in range(1, len(specs) + 1):
        if all(s == specs[i % n] for i, s in enumerate(specs)):
            return tuple(specs[:n])
    return tuple(specs)


class SmolLM3Converter(LlamaConverter):
    model_type, hf_class = "smollm3", "SmolLM3ForCausalLM"
    defaults: ClassVar[dict] = dict(
        _COMMON, vocab_size=128256, hidden_size=2048, intermediate_size=11008,
        num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
        max_position_embeddings=32768, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=True, use_sliding_window=False, sliding_window=None,
        no_rope_layers=None, no_rope_layer_interval=4, layer_types=None,
        pad_token_id=128004, bos_token_id=128000, eos_token_id=128001,
    )  # fmt: skip
    default_theta = 2000000.0

    def _extra(self, hf: HFConfig) -> dict:
        n = hf["num_hidden_layers"]
        rope = hf["no_rope_layers"]
        if rope is None:
            interval = hf["no_rope_layer_interval"]
            rope = [int((i + 1) % interval != 0) for i in range(n)]
        window = hf["sliding_window"] if hf["use_sliding_window"] else None
        kinds = hf["layer_types"] or [
            "sliding_attention" if window is not None and not r else "full_attention" for r in rope
        ]
        if len(rope) != n or len(kinds) != n:
            hf.reject(
                "no_rope_layers" if len(rope) != n else "layer_types",
                rope if len(rope) != n else kinds,
                f"needs one entry per layer ({n})",
            )
            return {}
        if window is None and "sliding_attention" in kinds:
            hf.reject(
                "layer_types",
                kinds,
                "names sliding layers, but use_sliding_window / sliding_window give no window",
            )
        specs = [
            LayerSpec(
                sliding_window=window if k == "sliding_attention" else None,
                positional=None if r else NoPositions(),
            )
            for r, k in zip(rope, kinds, strict=True)
        ]
        plain = all(s == LayerSpec() for s in specs)
        return {} if plain else dict(layer_pattern=_shortest_period(specs))

    def _extra_to_hf(self, fit: Fit) -> dict:
        cfg = fit.cfg
        pattern = cfg.layer_pattern or (LayerSpec(),)
        specs = [pattern[i % len(pattern)] for i in range(cfg.n_layers)]
        windows = {s.sliding_window for s in specs} - {None}
        for j, s in enumerate(pattern):
            if s.positional is not None and s.positional.kind != "none":
                fit.fail(
                    f"layer_pattern.{j}.positional.kind",
                    s.positional.kind,
                    "transformers' smollm3 layers take the model's RoPE or none",
                )
        if len(windows) > 1:
            fit.fail("layer_pattern", sorted(windows), "smollm3 has one sliding_window")
        window = min(windows) if windows else None
        return dict(
            no_rope_layers=[int(s.positional is None) for s in specs],
            use_sliding_window=window is not None,
            sliding_window=window,
            layer_types=[
                "sliding_attention" if s.sliding_window else "full_attention" for s in specs
            ],
        )


CONVERTERS.register(SmolLM3Converter.model_type)(SmolLM3Converter())
