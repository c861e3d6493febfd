"""`attnlab serve` (src/attnlab/serve/) as a real server process, through a real HTTP client.

A tiny random-weight Llama-style model with a byte-level BPE tokenizer and a ChatML template is
saved as an HF-format folder; `python -m attnlab serve FOLDER` runs on a free port. Checked:

- greedy completions (plain and streamed, many at once) are the tokens `attnlab.generate` gives
  the same prompt alone; usage counts and finish_reason ("length", "stop" for a stop string);
- chat completions render the model's template (the prompt the server tokenized equals the
  template rendered by jinja2 here) — through the `openai` client, streamed and not;
- bad requests (unknown fields, negative max_tokens, bad temperature, unknown model, prompt longer
  than the context, not JSON, n > 1) get a 4xx JSON error in OpenAI's shape naming the problem,
  and the server keeps serving;
- a client that disconnects mid-stream frees its KV blocks (the engine's free block count,
  read from /health, returns to the total);
- a model without a chat template answers chat requests with a clear 400;
- logprobs (float64 references), echo, n, penalties, stop_token_ids, json_schema output, and
  the same streamed (the chunks put together equal the whole answer);
- tools: forced calls (named, required) parse and validate, auto calls are read from the text,
  the template sees the tools and earlier calls; bad tool requests are 400s.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import attnlab as al  # noqa: E402
from helpers.serve import CHATML, Server, free_port, save_model, serve_tiny  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("tiny-llama")
    save_model(f, CHATML)
    return f


@pytest.fixture(scope="module")
def server(folder):
    s = Server(folder, "--num-blocks", "128", "--block-size", "8")
    yield s
    s.close()


@pytest.fixture(scope="module")
def ref(folder):
    """(model, tokenizer) loaded in this process, for the references."""
    from tokenizers import Tokenizer

    model = al.interop.load_pretrained(folder).eval()
    return model, Tokenizer.from_file(str(folder / "tokenizer.json"))


def _greedy(ref, ids: list[int], n: int) -> list[int]:
    model, tok = ref
    eos = tok.token_to_id("<|im_end|>")
    out = al.generate(model, torch.tensor([ids]), n, eos_token_id=eos)[0, len(ids) :].tolist()
    return out


def _text(ref, ids: list[int]) -> str:
    return ref[1].decode(ids, skip_special_tokens=True)


PROMPTS = ["the quick brown", "hello world", "lazy dog. the", "serving", "fox jumps over t"]


def _all_free(server, seconds: float = 20) -> dict:
    """/health once every block is back (cancellation lands at the engine's next step)."""
    deadline = time.time() + seconds
    while True:
        h = server.health()
        if (h["blocks_free"] == h["blocks_total"] and not h["running"]) or time.time() > deadline:
            return h
        time.sleep(0.05)


def test_health_and_models(server):
    h = server.health()
    assert h["status"] == "ok" and h["blocks_free"] == h["blocks_total"] == 128
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_greedy_completions_equal_generate_alone(server, ref):
    def one(prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
        return server.post("/v1/completions", body).json()

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: they share the running batch
        answers = list(pool.map(one, PROMPTS))
    for prompt, a in zip(PROMPTS, answers, strict=True):
        ids = ref[1].encode(prompt).ids
        want = _greedy(ref, ids, 12)
        choice = a["choices"][0]
        assert choice["text"] == _text(ref, want)
        assert a["usage"] == {
            "prompt_tokens": len(ids),
            "completion_tokens": len(want),
            "total_tokens": len(ids) + len(want),
        }
        assert choice["finish_reason"] == ("stop" if len(want) < 12 else "length")


def _sse(response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return events


def test_streamed_completion_equals_the_whole(server, ref):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 15, "temperature": 0}
    whole = server.post("/v1/completions", body).json()["choices"][0]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    assert events[-2]["usage"]["completion_tokens"] == 15 or whole["finish_reason"] == "stop"


def test_stop_string_ends_the_text_before_it(server, ref):
    ids = ref[1].encode(PROMPTS[1]).ids
    full = _text(ref, _greedy(ref, ids, 20))
    stop = full.strip()[3:6]  # a piece of what the model will write
    assert stop and stop in full
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0}
    a = server.post("/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]
    assert a["finish_reason"] == "stop" and a["text"] == full[: full.index(stop)]
    assert _all_free(server)["blocks_free"] == 128  # the cancelled request's blocks are back


def test_chat_through_the_openai_client(server, ref):
    openai = pytest.importorskip("openai")
    from jinja2 import Environment

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    messages = [
        {"role": "system", "content": "you are a fox"},
        {"role": "user", "content": "hello world"},
    ]
    rendered = Environment(trim_blocks=True, lstrip_blocks=True).from_string(CHATML)
    text = rendered.render(messages=messages, add_generation_prompt=True)
    ids = ref[1].encode(text, add_special_tokens=False).ids
    want = _text(ref, _greedy(ref, ids, 10))
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0
    )
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want
    seeded = [
        client.completions.create(model="tiny", prompt="fox", max_tokens=8, seed=7).choices[0]
        for _ in range(2)
    ]
    assert seeded[0].text == seeded[1].text  # seeded sampling repeats


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"prompt": "hi", "max_tokens": 3, "bogus": 1}, 400, ["bogus"]),
        ({"prompt": "hi", "temprature": 0.5}, 400, ["temprature", "Did you mean 'temperature'"]),
        ({"prompt": "hi", "max_tokens": -1}, 400, ["max_tokens"]),
        ({"prompt": "hi", "temperature": -0.5}, 400, ["temperature"]),
        ({"prompt": "hi", "temperature": 7}, 400, ["temperature"]),
        ({"prompt": "hi", "model": "gpt-9"}, 404, ["gpt-9", "tiny"]),
        ({"prompt": "the " * 1200, "max_tokens": 2}, 400, ["context"]),
        ({"prompt": "hi", "max_tokens": 5000}, 400, ["max_tokens", "context"]),
        ({"prompt": [1, 2, 99999]}, 400, ["token ids"]),
        ({"prompt": "hi", "n": 17}, 400, ["n"]),
        ({"max_tokens": 3}, 400, ["prompt"]),
    ],
)
def test_bad_requests_get_a_4xx_naming_the_problem(server, body, status, words):
    r = server.post("/v1/completions", {"model": "tiny", **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"]
    assert server.health()["status"] == "ok"


def test_malformed_bodies_and_chat_fields(server):
    r = httpx.post(
        server.url + "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] is None  # no field is at fault (not a character offset)
    r = server.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = server.post("/v1/chat/completions", {"model": "tiny", "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert _all_free(server)["blocks_free"] == 128


@pytest.mark.parametrize("n", [1, 2])
def test_disconnect_mid_stream_frees_the_blocks(server, n):
    cancelled = _all_free(server)["cancelled"]
    # greedy: the same tokens every run, and this model's greedy continuation of the prompt
    # holds no EOS in 900 tokens (sampled, a 320-token vocabulary meets EOS early: the request
    # could end by itself before the client leaves); n = 2: both choices' requests cancelled
    body = {"model": "tiny", "prompt": "the quick", "max_tokens": 900, "stream": True,
            "temperature": 0, "n": n}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            assert '"finish_reason":null' in line.replace(" ", "") or not line, line
            if got == 5:
                break
        h = server.health()
        assert h["running"] == n and h["blocks_free"] < h["blocks_total"]  # it holds blocks
    # the connection is closed here, long before 900 tokens: the request is cancelled (not run
    # to its end) and its blocks are back
    h = _all_free(server)
    assert h["blocks_free"] == h["blocks_total"] and h["running"] == 0 and h["waiting"] == 0
    assert h["cancelled"] == cancelled + n


def _generated(server) -> float:
    """/metrics' attnlab_generation_tokens_total: tokens the server has read from the engine."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "attnlab_generation_tokens_total":
                return sample.value
    raise AssertionError("no attnlab_generation_tokens_total in /metrics")


def test_a_dropped_client_cancels_a_whole_answer(server):
    """Not streamed: the handler waits for the whole answer, and watches the connection while it
    does. A client that goes away cancels the request (it decoded to max_tokens, holding its
    blocks, before): counted in `cancelled`, its blocks back, far fewer tokens than asked for."""
    before, cancelled = _generated(server), _all_free(server)["cancelled"]
    max_tokens = 1000  # greedy "the quick": no EOS in 900 tokens (the stream test above)
    body = json.dumps({"model": "tiny", "prompt": "the quick", "max_tokens": max_tokens,
                       "temperature": 0}).encode()  # fmt: skip
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + body)
        deadline = time.time() + 10
        while not server.health()["running"] and time.time() < deadline:
            time.sleep(0.005)
    # closed: the server reads the disconnect and cancels at the engine's next step
    h = _all_free(server)
    assert h["cancelled"] == cancelled + 1  # a request that ran to max_tokens is not counted
    assert h["blocks_free"] == h["blocks_total"] and h["running"] == 0 and h["waiting"] == 0
    assert _generated(server) - before < max_tokens / 2


def test_a_model_without_a_chat_template_refuses_chat(tmp_path):
    save_model(tmp_path, None)
    s = Server(tmp_path, "--num-blocks", "32")
    try:
        r = s.post("/v1/chat/completions", {"model": "tiny", "messages": [
            {"role": "user", "content": "hi"}]})  # fmt: skip
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        r = s.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        s.close()


def test_the_three_sources_load_into_one_record(folder, ref, tmp_path):
    """An HF folder and a run directory (a checkpoint + the run's tokenizer.json) give the same
    model and tokenizer; the HF folder's template and EOS come from its json files."""
    from attnlab.loading import load_model as load_served
    from attnlab.train import checkpoint

    hf = load_served(folder)
    assert hf.chat_template == CHATML and hf.name == folder.name
    config = json.loads((folder / "config.json").read_text())
    assert hf.context_length == config["max_position_embeddings"]
    assert hf.eos_token_ids == [ref[1].token_to_id("<|im_end|>")]
    model = ref[0]
    run = tmp_path / "run"
    checkpoint.save(run, "last", model, model.config, {}, {"step": 1})
    (run / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    got = load_served(run, name="mine")
    assert got.name == "mine" and got.chat_template is None
    assert got.eos_token_ids == [ref[1].token_to_id("<|endoftext|>")]  # a known EOS spelling
    ids = torch.tensor([ref[1].encode("the quick brown fox").ids])
    with torch.no_grad():
        for m in (hf.model, got.model):
            torch.testing.assert_close(m(ids).logits, model(ids).logits, rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="gguf"):
        load_served(tmp_path / "nothing-here")


def test_a_quantized_server_answers_as_the_quantized_model_alone(folder, ref):
    """`serve --quantize int8`: the tokens of al.quantize(al.fuse(model), "int8", head=True)
    decoding the prompt by itself."""
    import copy

    model, tok = ref
    q = al.quantize(al.fuse(copy.deepcopy(model)), "int8", head=True)
    s = Server(folder, "--num-blocks", "32", "--quantize", "int8")
    try:
        for prompt in PROMPTS[:2]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0}
            got = s.post("/v1/completions", body).json()["choices"][0]["text"]
            assert got == _text(ref, _greedy((q, tok), tok.encode(prompt).ids, 10))
    finally:
        s.close()


def test_a_step_time_bound_serves_the_same_tokens(folder, ref):
    """`serve --max-step-ms 2` (a bound below this model's steps, so prompts mostly wait for
    steps without decodes): concurrent greedy completions still equal each prompt decoded
    alone; without chunked prefill the option is refused in one line naming the fix."""
    from concurrent.futures import ThreadPoolExecutor

    s = Server(folder, "--num-blocks", "64", "--block-size", "8", "--max-step-ms", "2")
    try:
        prompts = [p * 4 for p in PROMPTS]  # long enough to need several chunks each
        body = lambda p: {"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0}  # noqa: E731
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: s.post("/v1/completions", body(p)).json(), prompts))
        _, tok = ref
        for prompt, answer in zip(prompts, got, strict=True):
            want = _text(ref, _greedy(ref, tok.encode(prompt).ids, 12))
            assert answer["choices"][0]["text"] == want
    finally:
        s.close()
    out = subprocess.run(
        [sys.executable, "-m", "attnlab", "serve", str(folder), "--port", str(free_port()),
         "--step-tokens", "0", "--max-step-ms", "100"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "max_step_ms (100.0)" in out.stderr and "step_tokens" in out.stderr


def test_a_taken_port_fails_before_the_model_loads(folder, tmp_path):
    """The port is bound before the model is loaded: with it taken, serve ends in one error line
    naming the port and the fix (the model never loads: a missing one is not even reported), and
    never claims to be serving."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        for model in (folder, tmp_path / "not-there"):
            out = subprocess.run(
                [sys.executable, "-m", "attnlab", "serve", str(model), "--port", port],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert out.returncode == 2, out.stderr
            assert f"error: cannot listen on 127.0.0.1:{port}" in out.stderr
            assert "choose another --port" in out.stderr
            assert "Traceback" not in out.stderr and "serving" not in out.stdout


def test_accepted_connections_turn_nagle_off():
    """`attnlab serve`'s listening socket says TCP (cli/serve.py `_bind`), so asyncio sets
    TCP_NODELAY on every connection it accepts (uvicorn serves through loop.create_server): with
    proto 0 it did not, and a response written in two parts waited ~40 ms for the client's
    delayed ACK, on every /health and every non-streamed answer."""
    import asyncio

    from attnlab.cli.serve import _bind

    async def main() -> int:
        sock = _bind("127.0.0.1", 0)
        seen = asyncio.get_running_loop().create_future()

        class Record(asyncio.Protocol):
            def connection_made(self, transport):
                conn = transport.get_extra_info("socket")
                seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Record, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(main()) != 0


def test_keep_alive_answers_take_milliseconds(server):
    """The same, end to end: 20 /health requests on one connection, none near the 40 ms delayed
    ACK (the median was 44 ms before the fix, 1.5 ms after, on an idle server)."""
    times = []
    with httpx.Client() as client:
        for _ in range(20):
            t = time.perf_counter()
            assert client.get(server.url + "/health").status_code == 200
            times.append(time.perf_counter() - t)
    assert sorted(times)[10] < 0.02, [round(1000 * t, 1) for t in times]


# --- hardening: Host, API key, body size, surrogates, /docs --------------------------------------


def test_a_foreign_host_header_is_refused(server):
    """DNS rebinding: a page's own domain name in Host reaches 127.0.0.1 but gets a 403."""
    body = {"model": "tiny", "prompt": "the", "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Host": "attacker.example"})
    assert r.status_code == 403 and "attacker.example" in r.json()["error"]["message"]
    for host in ("localhost", f"127.0.0.1:{server.port}", f"localhost:{server.port}"):
        r = httpx.post(
            server.url + "/v1/completions", json=body, headers={"Host": host}, timeout=60
        )
        assert r.status_code == 200, (host, r.text)


def test_docs_are_off_and_bodies_are_bounded(server):
    assert httpx.get(server.url + "/docs").status_code == 404
    assert httpx.get(server.url + "/openapi.json").status_code == 404
    big = json.dumps({"model": "tiny", "prompt": "x" * 5_000_000, "max_tokens": 1})
    t0 = time.time()
    r = httpx.post(server.url + "/v1/completions", content=big,
                   headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
    assert time.time() - t0 < 10
    assert server.health()["status"] == "ok"


def test_a_lone_surrogate_is_a_400_and_the_connection_stays_usable(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:  # one keep-alive connection
        for _ in range(3):
            raw = b'{"model": "tiny", "prompt": "\\ud800x", "max_tokens": 2}'
            r = client.post("/v1/completions", content=raw,
                            headers={"content-type": "application/json"})  # fmt: skip
            assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
            chat = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\udc00"}]}'
            r = client.post("/v1/chat/completions", content=chat,
                            headers={"content-type": "application/json"})  # fmt: skip
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0"
            ok = client.post(
                "/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": 2}
            )
            assert ok.status_code == 200


def test_an_api_key_guards_every_endpoint_but_health(folder):
    s = Server(folder, "--api-key", "s3cret")
    try:
        assert httpx.get(s.url + "/health").status_code == 200
        body = {"model": "tiny", "prompt": "the", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"},
                        {"Authorization": "s3cret"}, {"Authorization": "Bearer"}):  # fmt: skip
            r = httpx.post(s.url + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/v1/models").status_code == 401
        # RFC 7235 section 2.1: the scheme is case-insensitive
        for scheme in ("Bearer", "bearer", "BEARER"):
            ok = {"Authorization": f"{scheme} s3cret"}
            r = httpx.post(s.url + "/v1/completions", json=body, headers=ok, timeout=60)
            assert r.status_code == 200, (scheme, r.text)
        from openai import AuthenticationError, OpenAI

        with pytest.raises(AuthenticationError):
            OpenAI(base_url=s.url + "/v1", api_key="nope").models.list()
        assert [m.id for m in OpenAI(base_url=s.url + "/v1", api_key="s3cret").models.list()] == [
            "tiny"
        ]
    finally:
        s.close()


def test_metrics_in_prometheus_format(folder):
    """/metrics counts what was served: requests per endpoint, prompt and generated tokens, a
    time-to-first-token sample per request and an inter-token one per later token, and the
    engine's steps by kind (one after the other, each request is a prefill step, then a decode
    step per later token)."""
    from prometheus_client.parser import text_string_to_metric_families

    s = Server(folder, "--num-blocks", "64", "--block-size", "8")
    try:
        n_tokens = 0
        for max_tokens in (3, 5):
            r = s.post("/v1/completions", {"model": "tiny", "prompt": "the quick", "max_tokens": max_tokens,
                                           "temperature": 0})  # fmt: skip
            n_tokens += r.json()["usage"]["completion_tokens"]
        steps = lambda kind: got.get(("attnlab_engine_step_seconds_count", (("kind", kind),)), 0)  # noqa: E731
        deadline = time.time() + 10
        while True:  # the last step is timed in the engine's thread as its answer goes out
            r = httpx.get(s.url + "/metrics", timeout=10)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            got = {
                (sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(r.text)
                for sample in family.samples
            }
            if steps("decode") >= n_tokens - 2 or time.time() > deadline:
                break
            time.sleep(0.05)
        assert got[("attnlab_requests_total", (("endpoint", "completions"),))] == 2
        assert got[("attnlab_generation_tokens_total", ())] == n_tokens
        assert got[("attnlab_time_to_first_token_seconds_count", ())] == 2
        assert got[("attnlab_inter_token_latency_seconds_count", ())] == n_tokens - 2
        assert got[("attnlab_kv_blocks_total", ())] == 64
        assert got[("attnlab_requests_running", ())] == 0
        assert (steps("prefill"), steps("decode"), steps("decode+prefill")) == (2, n_tokens - 2, 0)
    finally:
        s.close()


def test_logprobs_in_openais_shapes_equal_the_models(server, ref):
    """Completions' logprobs=k and chat's logprobs / top_logprobs: every generated token with
    its log-probability (the model's own, float64 reference over the whole sequence) and its k
    best alternatives, in OpenAI's shapes (streamed: tests below)."""
    model, tok = ref
    body = {"model": "tiny", "prompt": "the quick brown", "max_tokens": 5, "temperature": 0,
            "logprobs": 2}  # fmt: skip
    r = server.post("/v1/completions", body).json()
    lp = r["choices"][0]["logprobs"]
    ids = tok.encode("the quick brown").ids
    new = _greedy(ref, ids, 5)
    with torch.no_grad():
        want = model(torch.tensor([ids + new])).logits[0].double().log_softmax(-1)
    assert len(lp["tokens"]) == len(new) == r["usage"]["completion_tokens"]
    for i, t in enumerate(new):
        assert abs(lp["token_logprobs"][i] - want[len(ids) - 1 + i, t].item()) < 1e-4
        assert len(lp["top_logprobs"][i]) == 2 and max(
            lp["top_logprobs"][i].values()
        ) == pytest.approx(lp["token_logprobs"][i])  # greedy: the token is the best
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    assert lp["text_offset"][0] == 0
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="x")
    c = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(x.top_logprobs) == 3 and x.top_logprobs[0].token == x.token for x in content)
    assert all(x.logprob <= 0 and bytes(x.bytes).decode() == x.token for x in content)
    with pytest.raises(BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       top_logprobs=2)  # fmt: skip


def test_n_choices_are_seeded_requests(server, ref):
    """n = 3 sampled choices: choice i is the request decoded alone with seed + i; usage counts
    the prompt once and every choice's tokens."""
    model, tok = ref
    eos = tok.token_to_id("<|im_end|>")
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 8, "temperature": 0.9,
            "seed": 5, "n": 3}  # fmt: skip
    r = server.post("/v1/completions", body).json()
    ids = tok.encode("hello world").ids
    want = []
    for i in range(3):
        out = al.generate(model, torch.tensor([ids]), 8, "sample", temperature=0.9, seed=5 + i,
                          eos_token_id=eos)  # fmt: skip
        want.append(out[0, len(ids) :].tolist())
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["text"] for c in r["choices"]] == [_text(ref, w) for w in want]
    assert len({c["text"] for c in r["choices"]}) > 1
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert r["usage"]["completion_tokens"] == sum(
        len([t for t in w if t != eos]) + (eos in w) for w in want
    )
    assert _all_free(server)["blocks_free"] == 128


def test_penalties_reach_the_engine(server, ref):
    """A strong presence penalty changes a greedy completion (the engine's formula is checked in
    tests/decode/test_engine.py); out of range it is a 400 naming the field."""
    body = {"model": "tiny", "prompt": "the quick brown", "max_tokens": 12, "temperature": 0}
    plain = server.post("/v1/completions", body).json()["choices"][0]["text"]
    pen = server.post("/v1/completions", {**body, "presence_penalty": 2}).json()["choices"][0][
        "text"
    ]
    assert pen != plain
    r = server.post("/v1/completions", {**body, "frequency_penalty": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frequency_penalty"


def test_stop_token_ids_end_the_completion(server, ref):
    """vLLM's stop_token_ids: the completion ends at the first of them (included in the tokens,
    as an EOS is), finish_reason stop."""
    _, tok = ref
    ids = tok.encode("the quick brown").ids
    free = _greedy(ref, ids, 10)
    body = {"model": "tiny", "prompt": "the quick brown", "max_tokens": 10, "temperature": 0,
            "stop_token_ids": [free[3]], "logprobs": 0}  # fmt: skip
    r = server.post("/v1/completions", body).json()
    cut = free.index(free[3]) + 1
    assert len(r["choices"][0]["logprobs"]["tokens"]) == cut
    assert r["choices"][0]["finish_reason"] == "stop"


def test_echo_returns_the_prompt_and_its_logprobs(server, ref):
    """echo with logprobs (what evaluation harnesses send to score a continuation): the text is
    the prompt and the completion, and every prompt token after the first has the model's
    log-probability given the tokens before it (float64 reference)."""
    model, tok = ref
    prompt = "the quick brown fox jumps"
    ids = tok.encode(prompt).ids
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True,
            "logprobs": 1}  # fmt: skip
    r = server.post("/v1/completions", body).json()
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt)
    assert len(lp["tokens"]) == len(ids) + 1 and "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    new = _greedy(ref, ids, 1)
    with torch.no_grad():
        want = model(torch.tensor([ids + new])).logits[0].double().log_softmax(-1)
    for j in range(1, len(ids) + 1):
        token = (ids + new)[j]
        assert abs(lp["token_logprobs"][j] - want[j - 1, token].item()) < 1e-4
    plain = server.post("/v1/completions", {**body, "logprobs": None}).json()["choices"][0]
    assert plain["text"] == choice["text"] and plain["logprobs"] is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_parses_and_validates(server, temperature):
    """response_format json_schema (llguidance's token masks): a tiny random model's output,
    greedy or sampled, is JSON that follows the schema; a schema that cannot compile is a 400."""
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
              "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}}}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    for seed in range(3):
        body = {"model": "tiny", "prompt": "the", "max_tokens": 60, "temperature": temperature,
                "seed": seed, "response_format": fmt}  # fmt: skip
        r = server.post("/v1/completions", body).json()
        out = json.loads(r["choices"][0]["text"])
        assert set(out) == {"ok", "n"} and isinstance(out["ok"], bool) and out["n"] in (1, 2, 3)
        assert r["choices"][0]["finish_reason"] == "stop"
    any_object = {**body, "response_format": {"type": "json_object"}, "max_tokens": 200}
    r = server.post("/v1/completions", any_object).json()["choices"][0]
    if r["finish_reason"] == "stop":  # a random model may write an object longer than 200 tokens
        assert isinstance(json.loads(r["text"]), dict)
    bad = {
        **body,
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
    }
    r = server.post("/v1/completions", bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_json_schema_output_streams_too(server):
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}  # fmt: skip
    body = {"model": "tiny", "prompt": "the", "max_tokens": 30, "temperature": 1.0, "seed": 2,
            "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        events = _sse(r)
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert isinstance(json.loads(text)["ok"], bool)


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
         "loops over more than"),
        ("{{ 'a' * 10**9 }}", "builds a value"),
        ("{{ 10 ** 100000 }}", "too large"),
        ("{% for i in range(999999) %}{{ 'x' * 100 }}{% endfor %}", "output passes"),
    ],
)  # fmt: skip
def test_hostile_chat_templates_end_at_once(template, says):
    """A template is code from the model's author: loops, big values and endless output are
    bounded (a TemplateError, the server's 400) instead of holding a worker for minutes."""
    from attnlab.serve.chat import TemplateError, render_chat

    t0 = time.time()
    with pytest.raises(TemplateError, match=says):
        render_chat(template, [{"role": "user", "content": "hi"}])
    assert time.time() - t0 < 5


def _streamed(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return _sse(r)


def _joined(chunks: list[dict], index: int) -> dict:
    """A completion choice's streamed chunks put back together: text and logprobs lists."""
    out = {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for ch in c.get("choices", ()):
            if ch["index"] != index:
                continue
            out["text"] += ch["text"]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                out[key] += (ch["logprobs"] or {}).get(key) or []
            out["finish_reason"] = ch["finish_reason"] or out.get("finish_reason")
    return out


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_logprobs_and_echo_equal_the_whole_answer(server, echo):
    """stream with logprobs (and echo): the chunks' texts and logprobs, put together, are the
    unstreamed answer's — tokens, log-probabilities, alternatives and character offsets."""
    body = {"model": "tiny", "prompt": "lazy dog. the", "max_tokens": 9, "temperature": 0,
            "logprobs": 2, "echo": echo}  # fmt: skip
    whole = server.post("/v1/completions", body).json()["choices"][0]
    events = _streamed(server, "/v1/completions", body)
    got = _joined(events[:-1], 0)
    assert got["text"] == whole["text"] and got["finish_reason"] == whole["finish_reason"]
    lp = whole["logprobs"]
    assert got["tokens"] == lp["tokens"] and got["text_offset"] == lp["text_offset"]
    for g, w in zip(got["top_logprobs"], lp["top_logprobs"], strict=True):
        assert (g is None and w is None) or g == pytest.approx(w, abs=1e-5)
    assert got["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-5)
    if echo:
        assert got["token_logprobs"][0] is None and events[0]["choices"][0]["text"].startswith(
            "lazy dog"
        )


def test_streamed_chat_logprobs_through_the_openai_client(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="x")
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6,
              temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    parts = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    content = [x for p in parts if p.logprobs for x in p.logprobs.content]
    assert "".join(p.delta.content or "" for p in parts) == whole.message.content
    assert [x.token for x in content] == [x.token for x in whole.logprobs.content]
    assert [x.logprob for x in content] == pytest.approx(
        [x.logprob for x in whole.logprobs.content]
    )
    assert all(len(x.top_logprobs) == 2 for x in content)


def test_streamed_n_choices_equal_the_whole_answer(server):
    """stream with n = 3: every choice's chunks carry its index, and put together each is the
    unstreamed choice (the same seeded requests); usage counts every choice's tokens."""
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 7, "temperature": 0.9,
            "seed": 11, "n": 3}  # fmt: skip
    whole = server.post("/v1/completions", body).json()
    events = _streamed(
        server, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert events[-1] == "[DONE]" and events[-2]["usage"] == whole["usage"]
    assert {ch["index"] for e in events[:-2] for ch in e["choices"]} == {0, 1, 2}
    for c in whole["choices"]:
        got = _joined(events[:-1], c["index"])
        assert (got["text"], got["finish_reason"]) == (c["text"], c["finish_reason"])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "temperature": 0.9, "seed": 3, "n": 2}  # fmt: skip
    whole = server.post("/v1/chat/completions", chat).json()
    events = _streamed(server, "/v1/chat/completions", chat)
    for c in whole["choices"]:
        text = "".join(
            ch["delta"].get("content") or ""
            for e in events[:-1]
            for ch in e["choices"]
            if ch["index"] == c["index"]
        )
        assert text == c["message"]["content"]
    assert _all_free(server)["blocks_free"] == 128


# a Hermes-style template (the shape of Qwen 2.5's): tools in the system turn, calls in
# <tool_call> tags, tool answers in <tool_response> tags
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% elif m['tool_calls'] %}<|im_start|>assistant\n{% for c in m['tool_calls'] %}"
    "<tool_call>\n{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']}"
    " | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    s, f = serve_tiny(tmp_path_factory, "tiny-tools", TOOLS_TEMPLATE)
    yield s, f
    s.close()


def _valid_call(call, tools) -> dict:
    """The call's arguments, checked against its tool's schema (enums, required, no others)."""
    schema = next(t for t in tools if t["function"]["name"] == call.function.name)
    params = schema["function"]["parameters"]
    args = json.loads(call.function.arguments)
    assert set(args) == set(params["required"]) and call.id.startswith("call_")
    assert all(args[k] in params["properties"][k]["enum"] for k in args)
    return args


def test_forced_tool_calls_parse_and_validate(tool_server):
    """tool_choice naming a function, and "required": the answer is tool_calls in OpenAI's
    shape (through the openai client) whose arguments follow the tool's schema — a tiny random
    model's output, constrained; streamed, each call's name comes first and its arguments in
    pieces as they are written, and the client rebuilds the same calls."""
    from openai import OpenAI

    s, _ = tool_server
    client = OpenAI(base_url=s.url + "/v1", api_key="x")
    tools = [WEATHER, TIME]
    ask = [{"role": "user", "content": "weather in oslo?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        c = client.chat.completions.create(model="tiny", messages=ask, tools=tools,
                                           tool_choice=named, temperature=1.0, seed=seed,
                                           max_tokens=60).choices[0]  # fmt: skip
        assert c.finish_reason == "stop" and c.message.content is None
        assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
        _valid_call(c.message.tool_calls[0], tools)
        c = client.chat.completions.create(model="tiny", messages=ask, tools=tools,
                                           tool_choice="required", temperature=1.0, seed=seed,
                                           max_tokens=120, parallel_tool_calls=False).choices[0]  # fmt: skip
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        _valid_call(c.message.tool_calls[0], tools)
    for choice, finish in (("required", "tool_calls"), (named, "stop")):
        stream = client.chat.completions.create(model="tiny", messages=ask, tools=tools,
                                                tool_choice=choice, temperature=1.0, seed=1,
                                                max_tokens=120, stream=True)  # fmt: skip
        deltas = [c.choices[0] for c in stream if c.choices]
        pieces = [t for d in deltas for t in d.delta.tool_calls or ()]
        assert deltas[-1].finish_reason == finish and pieces
        calls = {}  # as a client rebuilds them: the first delta names the call, the rest add
        for t in pieces:
            if t.function.name:
                assert t.index not in calls and t.id.startswith("call_")
                calls[t.index] = [t.function.name, ""]
            calls[t.index][1] += t.function.arguments or ""
        assert len(pieces) > len(calls) + 1  # the arguments came in pieces, not at the end
        whole = client.chat.completions.create(model="tiny", messages=ask, tools=tools,
                                               tool_choice=choice, temperature=1.0, seed=1,
                                               max_tokens=120).choices[0]  # fmt: skip
        assert [(n, json.loads(a)) for n, a in calls.values()] == [
            (t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls
        ]


def test_tools_reach_the_template_with_earlier_calls(tool_server):
    """The prompt the server tokenizes is the template rendered here with the tools and a
    conversation holding an earlier call (its arguments as an object) and the tool's answer."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from tokenizers import Tokenizer

    s, f = tool_server
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    body = {"model": "tiny", "messages": messages, "tools": [TIME], "max_tokens": 1}
    r = s.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **_: json.dumps(x, ensure_ascii=False)
    plain = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {**call, "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1"},
    ]  # fmt: skip
    text = env.from_string(TOOLS_TEMPLATE).render(
        messages=plain, tools=[TIME], add_generation_prompt=True
    )
    assert '{"zone": "UTC"}' in text and '"name": "get_time"' in text and "<tools>" in text
    tok = Tokenizer.from_file(str(f / "tokenizer.json"))
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "body", "not among the tools"),
        ({"tool_choice": "required"}, "body", "no tools are given"),
        ({"tools": [WEATHER, WEATHER]}, "body", "same name"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "body", "give one of them"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
          "function": {"name": "f", "arguments": "[1]"}}]}]}, "messages", "not a JSON object"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s(tool_server, body, param, words):
    s, _ = tool_server
    full = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}
    r = s.post("/v1/chat/completions", full)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert (r.json()["error"]["param"] or "").startswith(param)


def test_tools_for_a_template_without_them_are_a_400(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "does not show tools" in r.json()["error"]["message"]
    r = server.post("/v1/chat/completions", {**body, "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200  # "none": the tools are not rendered, nothing to refuse


def test_auto_tool_calls_are_read_from_the_text(tool_server):
    """tool_choice auto: the model's own text is read for calls. A random model writes none by
    itself, so its output is held to a bare JSON call by response_format (the Llama 3 JSON
    format): the answer is that call, finish_reason tool_calls; without the schema, text."""
    s, _ = tool_server
    call = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": "get_time"},
                           "arguments": TIME["function"]["parameters"]}}  # fmt: skip
    body = {"model": "tiny", "messages": [{"role": "user", "content": "time?"}],
            "tools": [TIME, WEATHER], "max_tokens": 60, "temperature": 1.0, "seed": 4,
            "response_format": {"type": "json_schema", "json_schema": {"schema": call}}}  # fmt: skip
    c = s.post("/v1/chat/completions", body).json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    (got,) = c["message"]["tool_calls"]
    assert got["function"]["name"] == "get_time"
    assert json.loads(got["function"]["arguments"])["zone"] in ("UTC", "CET")
    with httpx.stream("POST", s.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as r:  # fmt: skip
        events = [e for e in _sse(r) if e != "[DONE]"]
    deltas = [e["choices"][0] for e in events if e.get("choices")]
    got = [t for d in deltas for t in d["delta"].get("tool_calls", ())]
    assert deltas[-1]["finish_reason"] == "tool_calls" and got[0]["function"]["name"] == "get_time"
    assert json.loads("".join(t["function"]["arguments"] for t in got))["zone"] in ("UTC", "CET")
    assert not any(d["delta"].get("content") for d in deltas)  # a bare JSON call: no content
    body.pop("response_format")
    c = s.post("/v1/chat/completions", {**body, "max_tokens": 5}).json()["choices"][0]
    assert "tool_calls" not in c["message"] and isinstance(c["message"]["content"], str)


def test_a_hub_id_and_a_device_torch_lacks_are_refused_before_loading(tmp_path):
    """A name shaped like OWNER/NAME that is not on disk: attnlab reads local files only, and
    says how to download it; --device cuda on a torch without CUDA names the fix."""
    cmd = [sys.executable, "-m", "attnlab", "serve", "--port", str(free_port())]
    out = subprocess.run([*cmd, "SomeOrg/Some-Model"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 2 and "reads local folders and files only" in out.stderr
    assert "hf download SomeOrg/Some-Model --local-dir DIR" in out.stderr
    if not torch.cuda.is_available():
        (tmp_path / "m.gguf").write_bytes(b"")
        out = subprocess.run([*cmd, str(tmp_path / "m.gguf"), "--device", "cuda"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == 2 and "sees no CUDA device" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_an_hf_folder_without_weights_is_named_as_such(tmp_path):
    """What an interrupted export or download leaves: config.json, no safetensors."""
    from attnlab.loading import load_model as load_served

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 9}))
    with pytest.raises(
        FileNotFoundError, match=r"HF config.json but no weights \(\*.safetensors\)"
    ):
        load_served(tmp_path)
