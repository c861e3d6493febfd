"""Sections of a benchmark, each in a process of its own, within one time budget: a GPU lent for
eight minutes must come back with every number that finished, whatever else failed.

    parent   run_sections(...)   for each section: its share of the time left (`shares`), a
                                 process of its own (a new session), stopped with its whole
                                 group past that share plus GRACE_S; a section that crashes or
                                 is stopped loses only its own unfinished rows. After each
                                 section the result is rewritten whole (`write_atomic`)
    child    Rows(path, section) appends each row to a JSON-lines file the moment it is done
                                 (flushed and fsynced), so rows survive a kill; `summary()` is
                                 the section's last row: graphs compiled, unfused-flex warnings,
                                 CUDA-graph skips (torch's own counters) and attnlab's holders

benchmarks/gpu.py is the one user; tests/test_gpu_bench.py runs it on the CPU (--smoke) with a
section stopped mid-way.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

GRACE_S = 10.0  # past its share, a section gets this long to finish its row before it is killed
MIN_SECTION_S = 20.0  # a section given less than this is skipped (imports alone take ~10 s)


def write_atomic(path: Path, text: str) -> None:
    """`text` to `path` through a file beside it, renamed into place: never half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Rows:
    """One section's rows as a child writes them: appended to `path` as each finishes."""

    def __init__(self, path: Path, section: str) -> None:
        self.path, self.section, self.start = path, section, time.perf_counter()
        self.unfused_flex = _count_unfused_flex()
        self.emitted = 0
        # GPU_BENCH_STALL=SECTION:N makes SECTION hang after its N-th row: how the tests stop
        # a section mid-way, as a hung compile or a driver stall would
        name, _, n = os.environ.get("GPU_BENCH_STALL", "").partition(":")
        self.stall_after = int(n) if name == section and n else None

    def emit(self, row: dict) -> dict:
        row = {"section": self.section, **row}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(json.dumps(row), flush=True)
        self.emitted += 1
        if self.stall_after is not None and self.emitted >= self.stall_after:
            time.sleep(1e6)  # a hang, as a compile that never ends (tests/test_gpu_bench.py)
        return row

    def summary(self, device: str) -> dict:
        """The section's counters, as its last row."""
        from torch._dynamo.utils import counters

        from attnlab.decode import batch_step, compiled_step
        from attnlab.nn.attention.kernels import flex

        mode = "reduce-overhead" if device == "cuda" else "default"
        held = {
            "compiled_step": compiled_step.compiled(mode),
            "batch_step": batch_step.compiled(mode),
            "flex": flex.graphs("flex"),
            "paged_flex": flex.graphs("paged-flex"),
        }
        attnlab = {
            name: {"compiles": g.compiles, "renewed": g.renewed, "held": len(g)}
            for name, g in held.items()
        }
        return self.emit(
            {
                "summary": {
                    "wall_s": time.perf_counter() - self.start,
                    "graphs_compiled": counters["stats"]["unique_graphs"],
                    "unfused_flex_warnings": self.unfused_flex[0],
                    "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
                    # calls torch could not compile flex for (they ran on the chunked kernel)
                    "flex_fallback_calls": flex.FALLBACKS["calls"],
                    "attnlab_graphs": attnlab,
                }
            }
        )


def _count_unfused_flex() -> list[int]:
    """A one-item list that counts torch's "flex_attention called without torch.compile()"
    warnings from now on (torch says it once a process: each section is a process)."""
    from torch.nn.attention import flex_attention as torch_flex

    count, real = [0], torch_flex._warn_once

    def counting(warning_id: str, *args, **kwargs) -> None:
        if warning_id == "flex_attention_performance":
            count[0] += 1
        real(warning_id, *args, **kwargs)

    torch_flex._warn_once = counting
    return count


def read_rows(path: Path) -> list[dict]:
    """Every complete row in `path` (a line cut short by a kill is dropped)."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def run_sections(
    command: Callable[[str, float], list[str]],
    sections: Sequence[str],
    shares: dict[str, float],
    budget_s: float,
    rows_path: Path,
    after_each: Callable[[], None],
    budgets: dict[str, float] | None = None,
) -> None:
    """Run `command(section, seconds)` for each section in turn, each given its share of the
    time left (or `budgets[section]` seconds), stopped with its process group past it. A
    section that was skipped, crashed or stopped gets a row saying so; `after_each` runs after
    every section (the parent rewrites its result)."""
    deadline = time.perf_counter() + budget_s
    for i, name in enumerate(sections):
        left = deadline - time.perf_counter()
        weight = shares.get(name, 1.0) / sum(shares.get(s, 1.0) for s in sections[i:])
        budget = min(left, (budgets or {}).get(name, left * weight))
        if budget < MIN_SECTION_S and not (budgets and name in budgets):
            _append(rows_path, {"section": name, "skipped": f"{left:.0f} s left in the budget"})
            after_each()
            continue
        start = time.perf_counter()
        proc = subprocess.Popen(command(name, budget), start_new_session=True)
        code = None
        try:
            code = proc.wait(timeout=budget + GRACE_S)
        except subprocess.TimeoutExpired:
            _append(rows_path, {"section": name, "stopped": f"past its {budget:.0f} s"})
        finally:  # ended, stopped, or the parent interrupted: nothing of the section outlives it
            _kill_group(proc)
        if code not in (0, None):
            _append(rows_path, {"section": name, "crashed": f"exit status {code}"})
        _append(rows_path, {"section": name, "process_s": time.perf_counter() - start})
        after_each()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the section's process group (it and what it started), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _append(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
