"""The lab: experiments that check the field's published claims on real data, with plots and an
honest verdict. An experiment is a YAML file in configs/labs/ (src/attnlab/lab/spec.py);

    attnlab lab list
    attnlab lab run positions [--quick] [--jobs 2] [--seeds 1 2 3] [--out DIR]
    attnlab lab report runs/labs/positions
    attnlab lab summary docs/lab [--write docs/lab.md]
    attnlab lab attention RUN_DIR "a sentence"

spec.py      the experiment file, validated
runner.py    one training run per (variant, seed), resumable; results.jsonl
evals.py     the evaluations (length extrapolation, RoPE scaling, timings, ...)
verdict.py   measurement -> pass / fail / inconclusive / no verdict (a pure function)
report.py    report.md; plots.py its figures; attention.py attention heatmaps
summary.py   every claim of every experiment, one column per corpus (docs/lab.md)
power.py     the power of a verdict and the seeds a claim needs (--plan)
"""

from .report import judge, write_report
from .runner import run_lab
from .spec import Lab, load, names
from .verdict import Measurement, Verdict, decide, measure

__all__ = [
    "Lab",
    "Measurement",
    "Verdict",
    "decide",
    "judge",
    "load",
    "measure",
    "names",
    "run_lab",
    "write_report",
]
