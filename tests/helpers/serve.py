"""A tiny served model and a real server process: the folder `attnlab serve` reads (a random
Llama-2 with a byte-level BPE and a ChatML template) and `python -m attnlab serve` on a free port
(tests/serve/, tests/cli/test_serve_cli.py). Needs httpx, fastapi and uvicorn: a test module that
imports this is skipped without them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import attnlab as al  # noqa: E402

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = "the quick brown fox jumps over the lazy dog. " * 20 + "hello world, serving tokens. " * 20


def bpe_tokenizer():
    """A byte-level BPE (300 tokens, the ChatML specials) trained on TEXT."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    return tok


def save_model(folder: Path, template: str | None) -> None:
    """A tiny random Llama-2 (xavier init) with bpe_tokenizer, `template` as its chat template
    (None: none) and <|im_end|> as EOS, saved as an HF-format folder."""
    tok = bpe_tokenizer()
    torch.manual_seed(0)
    cfg = al.presets.tiny(al.presets.get("llama2-7b"), vocab_size=320).replace(
        init="xavier", tie_embeddings=False
    )
    model = al.build_model(cfg)
    al.interop.save_pretrained(model, folder, "llama")
    tok.save(str(folder / "tokenizer.json"))
    tcfg = {"eos_token": "<|im_end|>", "bos_token": None}
    if template is not None:
        tcfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg))
    eos = tok.token_to_id("<|im_end|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m attnlab serve FOLDER` on a free port, healthy when made; `close()` ends it."""

    def __init__(self, folder: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "attnlab", "serve", str(folder), "--port", str(self.port)]
        # its output goes to a file: a pipe nobody reads would stop the server once the access
        # log (a line per request) had filled it
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed with the server)
        self.proc = subprocess.Popen(
            [*cmd, "--threads", "1", "--name", "tiny", *extra],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.close()
        raise RuntimeError("server did not become healthy in 120 s")

    def output(self) -> str:
        """What the server has written to stdout and stderr so far."""
        self.log.seek(0)
        return self.log.read().decode()

    def post(self, path: str, body, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60, **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def serve_tiny(tmp_path_factory, name: str, template: str) -> tuple[Server, Path]:
    """A tiny model with `template`, saved in a new folder and served (a module fixture's)."""
    f = tmp_path_factory.mktemp(name)
    save_model(f, template)
    return Server(f, "--num-blocks", "128", "--block-size", "8"), f
