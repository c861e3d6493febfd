"""`attnlab inspect MODEL --kernels` names the decode step each caller gets (src/attnlab/cli/
inspect_kernels.py, from src/attnlab/decode/picker.py) with the reasons the others did not serve."""

from __future__ import annotations

import attnlab as al
from attnlab.cli.inspect_kernels import kernel_report
from attnlab.nn import matvec


def _steps(name: str) -> list[str]:
    lines = kernel_report(al.presets.get(name), 16, "cpu", False, False, "float32")
    return lines[lines.index("decode steps (decode/picker.py)") + 1 :]


def test_the_report_names_the_decode_step_of_generate_and_of_the_engine():
    loop, engine = _steps("llama3.2-1b")
    native = "native" if matvec.extension() is not None else "eager"
    assert loop.startswith(f"  generate, one row: {native} (cuda-graphs: it decodes the engine's")
    assert engine.startswith(f"  engine decode batches: {native} (cuda-graphs: on the CPU")
    loop, engine = _steps("gemma2-2b")  # soft-capped logits: not the native step's function
    assert loop.startswith("  generate, one row: eager (") and "native: final logit soft" in loop
    assert "compiled: the cache is StaticKVCache" in loop
    assert engine.startswith("  engine decode batches: eager (")


def test_training_and_encoders_report_no_decode_step():
    lines = kernel_report(al.presets.get("llama3.2-1b"), 16, "cpu", True, False, "float32")
    assert "decode steps (decode/picker.py)" not in lines
    lines = kernel_report(al.presets.get("bert-base"), 16, "cpu", False, False, "float32")
    assert "decode steps (decode/picker.py)" not in lines
