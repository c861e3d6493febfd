"""DeepSeek-V3: MLA with q LoRA, sigmoid routing with a bias correction, grouped top-k.

Being written (issue 19); registers no converter yet.
"""
