"""Serving: an OpenAI-compatible HTTP server over the continuous-batching engine.

    chat.py      chat messages -> prompt text with the model's Jinja template (sandboxed)
    protocol.py  the request bodies (strict) and OpenAI's error shape
    worker.py    the engine's background thread; per-request asyncio queues
    app.py       the FastAPI app: builds the app's record and wires the parts below
    state.py     AppState: what every handler reads (model, worker, metrics, limits, grammar)
    handlers.py  the endpoints over AppState: /v1/completions, /v1/chat/completions,
                 /v1/models, /health, /metrics
    submit.py    a body -> one engine Request per choice
    answer.py    a choice's events; the whole answer (stream.py: the streamed one)
    replies.py   incremental text with stop strings, logprobs and usage in OpenAI's shapes
    errors.py    APIError and the error handlers
    guard.py     Host header, API key and body size, checked before a request is read
    connections.py  request-head and idle timeouts, --max-connections, accept() failures logged once
    metrics.py   /metrics in Prometheus' text format
    grammar.py   response_format: a JSON schema as a token mask at every step (llguidance)
    tools.py     tools / tool_choice: calls read from the model's text, or forced by a schema

Start it with `attnlab serve MODEL` (src/attnlab/cli/serve.py, which loads the model with
src/attnlab/loading.py, as `attnlab generate` does). Needs the `serve` extra
(fastapi, uvicorn, jinja2, prometheus-client, llguidance); nothing here is imported by `import attnlab`.
"""
