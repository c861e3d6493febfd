"""Gemma 2 and Gemma 3 (text): sandwich norms, logit soft-capping, sliding / global layers, qk-norm.

Being written (issue 19); registers no converter yet.
"""
