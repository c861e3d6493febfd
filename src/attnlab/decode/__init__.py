"""Decoding, as free functions over an explicit cache:

    cache/       the KV-cache kinds (static, sliding, paged) and their protocol
    steps.py     prefill and decode_step, which every strategy shares
    generate.py  greedy and sampling (stream, generate), sliding_stream
    beam.py      beam search with a length penalty

This package imports nothing itself: the models (src/attnlab/nn/model.py) import `cache` to hand
caches out, and the strategies import the models, so an eager import here would be a circle.
The public entry point is the function `attnlab.generate` (generate.py, re-exported by
src/attnlab/__init__.py).
"""
