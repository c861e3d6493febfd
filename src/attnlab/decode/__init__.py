"""Decoding, as free functions over an explicit cache (the caches: src/attnlab/cache/):

    steps.py       prefill and decode_step, which every strategy shares; plan (one per call)
    settings.py    a model's generation settings (GenerationSettings) and how keywords resolve
    processors.py  the logits rules the settings switch on
    generate.py    greedy and sampling (stream, generate), sliding_stream
    beam.py        beam search with a length penalty
    requests.py    what a client asks the engine for, and the rules a request must meet
    engine.py      continuous batching over one paged pool (src/attnlab/cache/ragged.py)

Everything here drives a model through its public inference API (src/attnlab/nn/model.py:
forward, encode/decode, or embed -> run -> logits, cache_geometry, new_cache). This package
imports nothing itself, so importing one strategy (or the engine) does not load the others.
The public entry point is the function `attnlab.generate` (generate.py, re-exported by
src/attnlab/__init__.py).
"""
