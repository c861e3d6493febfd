"""How many intra-op threads a training run uses, and what it says about them.

The order of a parallel reduction, and so the last bits of every update, depend on the thread
count: every checkpoint records it (state.pt `threads`), and a resume takes the run's own count
again unless one was asked for, so that by default a resume is bit-exact. A count asked for
(`--threads N`, or OMP_NUM_THREADS in the environment) wins: the resume is then equal to the
uninterrupted run only to rounding.

Training threads that share their cores with other busy processes slow down badly (each update
waits for its slowest thread): a load average that already fills the cores is pointed out once,
at start, with the fix.
"""

from __future__ import annotations

import os

import torch


def choose(threads: int | None) -> str | None:
    """Apply `threads` (--threads) when given; returns what chose the thread count explicitly
    (--threads, else OMP_NUM_THREADS) in the words a message quotes, None when nothing did."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads {threads}: give a thread count of 1 or more")
        torch.set_num_threads(threads)
        return f"--threads {threads}"
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    return f"OMP_NUM_THREADS={omp}" if omp else None


def resume_threads(saved: int | None, asked_by: str | None, speak: bool) -> None:
    """Resume with the run's own thread count `saved` (bit-exact) unless `asked_by` names an
    explicit choice, which wins (exact only to rounding). More threads than this machine has
    cores would only be slow: then the resume keeps the current count, with a warning."""
    now = torch.get_num_threads()
    if saved is None or saved == now:
        return
    if asked_by is not None:
        if speak:
            print(
                f"using {now} thread{'s' * (now != 1)} as {asked_by} asks (the run used {saved}): "
                f"the resume equals the uninterrupted run only to rounding (the order of sums "
                f"differs); leave the thread count unset to resume bit-exactly"
            )
    elif saved <= (os.cpu_count() or saved):
        torch.set_num_threads(saved)
        if speak:
            print(f"using {saved} threads as the run did (was {now}): the resume is bit-exact")
    elif speak:
        print(
            f"warning: the run used {saved} threads and this machine has {os.cpu_count()} cores: "
            f"it continues with {now}, which is exact only to rounding (the order of sums differs)"
        )


def busy_cores_warning() -> str | None:
    """A warning when the 1-minute load average says the cores are already taken and training
    would add several threads that spin while they wait; None otherwise (or where there is no
    load average). Threads that wait passively (OMP_WAIT_POLICY=PASSIVE, the CLI's default:
    src/attnlab/cli/__init__.py) are not warned about: with both cores busy they trained 1.47x
    one thread (benchmarks/results/threads_under_load.json), spinning ones 0.04x."""
    if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        return None
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # no load average on this platform
        return None
    if threads <= 1 or load < cores:
        return None
    return (
        f"warning: the 1-minute load average is {load:.1f} on {cores} core(s): other processes "
        f"already keep them busy, and this run's {threads} threads would compete with them "
        f"(spinning OpenMP threads wait for their slowest one); train with --threads 1 (or "
        f"OMP_NUM_THREADS=1), or let them sleep while they wait: OMP_WAIT_POLICY=PASSIVE"
    )


def cpu_name() -> str:
    """The processor's model name (Linux /proc/cpuinfo, else platform.processor()), for the
    records of timed runs: timings from two machines are not comparable."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
