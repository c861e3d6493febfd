"""Qwen3-MoE: Qwen3's attention (qk-norm) with fine-grained experts and normalised top-k.

Being written (issue 19); registers no converter yet.
"""
