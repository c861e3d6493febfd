"""Granite: Llama's layout with embedding, residual, attention and logits multipliers.

Being written (issue 19); registers no converter yet.
"""
