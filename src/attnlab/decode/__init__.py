"""Decoding, as free functions over an explicit cache (the caches: src/attnlab/cache/):

    steps.py          prefill and decode_step, which every strategy shares; plan (one per call)
    picker.py         which step decodes a model on a cache (cuda-graphs, native, compiled,
                      eager), for the loops and the engine alike
    native_step.py    the whole batch-1 step in one native call (and the engine's small batches)
    compiled_step.py  the step as one compiled graph over a fixed cache (CUDA's default)
    batch_step.py     the engine's decode batches as compiled graphs per size bucket (CUDA)
    settings.py       a model's generation settings (GenerationSettings) and how keywords resolve
    processors.py     the logits rules the settings switch on
    sampler.py        sampling without host reads (one setting, or each row its own)
    generate.py       greedy and sampling (stream, generate), sliding_stream
    beam.py           beam search with a length penalty
    requests.py       what a client asks the engine for, the rules a request must meet, Seq
    engine.py         continuous batching over one paged pool (src/attnlab/cache/ragged.py):
                      schedule -> run -> update, each step
    scheduler.py      the step's plan (StepPlan) and the one writer of request state (update)
    runner.py         a plan's inputs as tensors, run through the model on the pool
    output.py         logits -> tokens, finish reasons, log-probabilities
    step_time.py      fits of the engine's call times, for a step bounded in time
    cache.py          the old path of src/attnlab/cache/ (deprecated)

Everything here drives a model through its public inference API (src/attnlab/nn/model.py:
forward, encode/decode, or embed -> run -> logits, cache_geometry, new_cache). This package
imports nothing itself, so importing one strategy (or the engine) does not load the others.
The public entry point is the function `attnlab.generate` (generate.py, re-exported by
src/attnlab/__init__.py).
"""
