"""What the tests share, in one place: `from helpers.<module> import ...` (tests/ is on the path,
pyproject.toml's `pythonpath`). No test module imports another; fixtures live in the conftest.py
of the folder whose tests use them (tests/conftest.py for the whole suite).

- attention.py: the masks and bias descriptions the kernel tests run every kernel over
- doc_tables.py: the generated blocks of docs/ (`make docs` writes them, tests/test_docs.py checks)
- gguf_families.py: the test-size model of each GGUF family (random weights, tiny vocabularies)
- gguf_writing.py: GGUF files written as llama.cpp's converter writes them
- inputs.py: one forward pass's inputs for any config
- lab.py: the tiny lab experiments
- layers.py: the layers of the package and the import walker (tests/test_layers.py)
- memory.py: the largest tensor a computation creates
- parity.py: random weights far from their init, and the differences to transformers
- serve.py: a tiny served model and a real server process
- tolerance.py: tolerances derived from the arithmetic
- train.py: the tiny training recipes and their records
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
