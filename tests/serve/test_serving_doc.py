"""docs/serving.md's `/health` and streaming samples have the fields the server sends (issue 49,
item 11: the /health sample had lost six fields, every stream chunk its `"logprobs": null`).

The samples were pasted from a run on the real SmolLM2 file, so their values are that model's;
their shape is checked here against the app (src/attnlab/serve/app.py) serving the tiny model
in this process, through FastAPI's test client: the /health body's fields in the same order,
and each sample chunk's fields, nested, against a real chunk's.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from helpers import ROOT
from helpers.serve import CHATML, save_model

DOC = ROOT / "docs" / "serving.md"


def _shape(value):
    """The structure of a JSON value: dicts' keys in order (nested), lists' items' shapes."""
    if isinstance(value, dict):
        return [(k, _shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return None


def _samples() -> tuple[dict, list[dict]]:
    """(the /health sample, the streaming sample's chunks) of serving.md."""
    text = DOC.read_text()
    health = re.search(r"curl -s localhost:8765/health\n```\n```json\n(.*?)\n```", text, re.S)
    stream = re.search(r"\"stream\": true}'\n```\n```\n(.*?)```", text, re.S)
    assert health and stream, "serving.md's /health or streaming sample was not found"
    chunks = [json.loads(line[6:]) for line in stream.group(1).splitlines()
              if line.startswith("data: {")]  # fmt: skip
    return json.loads(health.group(1)), chunks


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from fastapi.testclient import TestClient

    from attnlab.decode.engine import Engine
    from attnlab.loading import load_model
    from attnlab.serve.app import create_app

    folder = tmp_path_factory.mktemp("tiny-llama")
    save_model(folder, CHATML)
    served = load_model(folder, "smollm2")
    engine = Engine(served.model.eval(), num_blocks=32, block_size=8, max_batch=4)
    with TestClient(create_app(served, engine)) as c:
        yield c


def test_the_health_sample_has_the_fields_the_server_sends(client):
    doc, _ = _samples()
    got = client.get("/health").json()
    assert list(doc) == list(got)


def test_the_stream_sample_has_the_chunks_the_server_sends(client):
    """The first chunk (the assistant's role), a content chunk and the last one (its finish
    reason) of the sample have the shapes of the server's own."""
    _, doc = _samples()
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 20, "temperature": 0, "stream": True}  # fmt: skip
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    got = [json.loads(x[6:]) for x in lines[:-1]]
    assert got[-1]["choices"][0]["finish_reason"] is not None
    for mine, theirs in ((doc[0], got[0]), (doc[1], got[1]), (doc[-1], got[-1])):
        assert _shape(mine) == _shape(theirs), (mine, theirs)
