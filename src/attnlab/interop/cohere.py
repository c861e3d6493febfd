"""Cohere (Command R): parallel block with one shared bias-free LayerNorm, logit scale.

Being written (issue 19); registers no converter yet.
"""
