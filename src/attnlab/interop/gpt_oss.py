"""GPT-OSS: attention sinks, alternating sliding window, clamped-SwiGLU experts, YaRN.

Being written (issue 19); registers no converter yet.
"""
