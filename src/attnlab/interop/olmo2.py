"""OLMo 2: norms after the sublayers (post-sublayer placement), qk-norm over the whole projection.

Being written (issue 19); registers no converter yet.
"""
