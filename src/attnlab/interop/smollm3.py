"""SmolLM3: Llama's layout with NoPE layers (no RoPE on every 4th layer) as a layer_pattern.

Being written (issue 19); registers no converter yet.
"""
