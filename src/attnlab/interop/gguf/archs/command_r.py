"""command-r: Cohere's Command R (CommandR2Model, conversion/command_r.py): LayerNorm, a logit
scale, qk-norm when its tensors are there, the head tied to the embedding; interleaved RoPE in
transformers too, so nothing is permuted."""

from __future__ import annotations

from .base import Arch, Keys, text_parameters


def _cohere(k: Keys, meta, hf, tensors) -> dict:
    return dict(
        layer_norm_eps=k("attention.layer_norm_epsilon"),
        logit_scale=k("logit_scale"),
        use_qk_norm="blk.0.attn_q_norm.weight" in tensors,
        tie_word_embeddings=True,
    )


def _parameters(w, hp: dict) -> None:
    """CommandR2Model.set_gguf_parameters: the context of its __init__, the logit scale, no
    scaling."""
    import gguf

    context = hp.get("model_max_length") or hp["max_position_embeddings"]
    text_parameters(w, dict(hp, max_position_embeddings=context))
    w.add_logit_scale(hp["logit_scale"])
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)


COMMAND_R = Arch("command-r", "cohere", "COMMAND_R", _parameters, config=_cohere,
                 rms_norm_eps=1e-6)  # fmt: skip
