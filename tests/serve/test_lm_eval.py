"""lm-evaluation-harness scores a multiple-choice task through `attnlab serve` with its
`local-completions` model (OpenAI's completions API: echo + logprobs over token-id prompts,
several per request), and every loglikelihood it reports equals the one attnlab computes in
this process for the same tokens (float64 log-softmax of the model's logits).

The task is a small local file (tests/serve/lm_eval_tiny/tiny_choice.jsonl) loaded through the
`datasets` json builder: nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")

import attnlab as al
from helpers.serve import CHATML, serve_tiny

DATA = Path(__file__).parent / "lm_eval_tiny" / "tiny_choice.jsonl"

TASK = """task: attnlab_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
doc_to_choice: "{{{{choices}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s, folder = serve_tiny(tmp_path_factory, "tiny-eval", CHATML)
    yield s, folder
    s.close()


def _loglikelihood(model, tok, context: str, continuation: str) -> float:
    """What a causal LM harness scores: encode context + continuation whole, split at the
    context's length, sum the continuation tokens' log-probabilities (float64)."""
    ids = tok.encode(context + continuation).ids
    n = len(tok.encode(context).ids)
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return sum(lp[t - 1, ids[t]].item() for t in range(n, len(ids)))


def test_lm_eval_loglikelihoods_equal_attnlabs(served, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from tokenizers import Tokenizer

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny.yaml").write_text(TASK.format(data=DATA))
    s, folder = served
    results = simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": s.url + "/v1/completions",
            "model": "tiny",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(folder),
            "tokenized_requests": True,
            "max_retries": 1,
            "max_length": 256,
        },
        tasks=["attnlab_tiny_choice"],
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=4,  # several prompts per request: OpenAI's batched prompt shape
        log_samples=True,
    )
    model = al.interop.load_pretrained(folder).eval()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    samples = results["samples"]["attnlab_tiny_choice"]
    rows = [json.loads(x) for x in DATA.read_text().splitlines()]
    assert len(samples) == len(rows)
    checked = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            got = resp[0][0]
            assert got == pytest.approx(_loglikelihood(model, tok, context, continuation), abs=1e-4)
            checked += 1
    assert checked == sum(len(r["choices"]) for r in rows)
    acc = results["results"]["attnlab_tiny_choice"]["acc,none"]
    assert 0 <= acc <= 1
