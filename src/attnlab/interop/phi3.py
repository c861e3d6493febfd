"""Phi-3 / Phi-4-mini: Llama's body with fused qkv_proj and gate_up_proj, longrope scaling, partial rotary.

Being written (issue 19); registers no converter yet.
"""
