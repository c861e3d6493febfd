"""Serving: an OpenAI-compatible HTTP server over the continuous-batching engine.

    loading.py   a run directory, HF folder or .gguf file -> ServedModel (model, tokenizer,
                 chat template, special tokens)
    chat.py      chat messages -> prompt text with the model's Jinja template (sandboxed)
    protocol.py  the request bodies (strict) and OpenAI's error shape
    worker.py    the engine's background thread; per-request asyncio queues
    app.py       the FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health

Start it with `attnlab serve MODEL` (src/attnlab/cli/serve.py). Needs the `serve` extra
(fastapi, uvicorn, jinja2); nothing here is imported by `import attnlab`.
"""
