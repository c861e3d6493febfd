"""Training and decoding throughput under each OpenMP thread setting, on an idle machine and with
the cores kept busy by other processes: what `attnlab`'s default wait policy is chosen from
(src/attnlab/cli/__init__.py sets OMP_WAIT_POLICY=PASSIVE unless the environment says otherwise).

    python benchmarks/threads_under_load.py --out benchmarks/results/threads_under_load.json

Each setting runs in a fresh process (OpenMP reads its environment once, when torch loads):
    default   2 torch threads, OpenMP's own wait policy (GNU OpenMP spins before it sleeps)
    passive   2 torch threads, OMP_WAIT_POLICY=PASSIVE (a waiting thread sleeps at once)
    one       1 torch thread
and measures (a) training tokens/s of the shakespeare-char model (nanoGPT's CPU config: 4 layers,
d 128, context 64, batch 12; AdamW, fp32), the median of 5 timed windows of 10 steps after 5 warm-up
steps, and (b) greedy decoding tokens/s of a GPT-2-style model (6 layers, d 384, 256 new tokens
after 32, KV cache, batch 1). Load: 0 (idle), or N busy-looping Python processes (N = the cores).
Settings are interleaved within each round, rounds repeat, the JSON keeps every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "default": {"OMP_NUM_THREADS": "2"},
    "passive": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
    "one": {"OMP_NUM_THREADS": "1"},
    # GNU OpenMP's spin before sleeping, shortened (its default: 300,000 iterations)
    "spin10k": {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "10000"},
    "spin50k": {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "50000"},
}
WORK = r"""
import json, statistics, sys, time, torch
import attnlab as al
kind = sys.argv[1]
torch.manual_seed(0)
if kind == "train":
    cfg = al.presets.tiny(al.presets.get("gpt2-small")).model_copy(update=dict(
        vocab_size=65, d_model=128, n_layers=4, n_heads=4))
    model = al.build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 65, (12, 64))
    def step():
        loss = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), x.flatten())
        opt.zero_grad(); loss.backward(); opt.step()
    for _ in range(5): step()
    rates = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10): step()
        rates.append(10 * x.numel() / (time.perf_counter() - t))
else:
    cfg = al.presets.tiny(al.presets.get("gpt2-small")).model_copy(update=dict(
        vocab_size=8192, d_model=384, n_layers=6, n_heads=6,
        positional=al.config.LearnedPositions(max_len=512)))
    model = al.build_model(cfg).eval()
    ids = torch.randint(0, 8192, (1, 32))
    al.generate(model, ids, max_new_tokens=8)
    rates = []
    for _ in range(3):
        t = time.perf_counter()
        al.generate(model, ids, max_new_tokens=256)
        rates.append(256 / (time.perf_counter() - t))
print(json.dumps({"threads": torch.get_num_threads(), "rate": statistics.median(rates)}))
"""


def measure(kind: str, setting: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env.update(SETTINGS[setting], PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run(
        [sys.executable, "-c", WORK, kind], env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"{kind} / {setting} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kinds", default="train,decode")
    p.add_argument("--settings", default="default,passive,one", help=", ".join(SETTINGS))
    args = p.parse_args()
    cores = os.cpu_count() or 2
    result: dict = {"cpu": platform.processor(), "cores": cores, "samples": []}
    with open("/proc/cpuinfo") as f:
        result["cpu"] = next(
            (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?"
        )
    for load in (0, cores):
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
        try:
            time.sleep(1 if load else 0)
            for r in range(args.rounds):
                names = args.settings.split(",")
                order = names[r % len(names) :] + names[: r % len(names)]
                for kind in args.kinds.split(","):
                    for setting in order:
                        row = dict(
                            measure(kind, setting), kind=kind, setting=setting, load=load,
                            round=r, loadavg=os.getloadavg()[0],
                        )  # fmt: skip
                        print(json.dumps(row), flush=True)
                        result["samples"].append(row)
        finally:
            for h in hogs:
                h.kill()
    summary = {}
    for s in result["samples"]:
        key = f"{s['kind']}, load {s['load']}, {s['setting']}"
        summary.setdefault(key, []).append(s["rate"])
    result["median"] = {k: statistics.median(v) for k, v in summary.items()}
    for k, v in result["median"].items():
        print(f"{k}: {v:,.0f} tokens/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
