"""Training: a recipe in, a run directory out (src/attnlab/train/run.py). The files of
src/attnlab/train/:

    recipes.py, specs.py   the validated recipe (YAML in configs/) and its sections
    tasks/                 translation, lm, classification: data, model sizes, evaluation
    loop.py                the Trainer: accumulation, clipping, exact resume, NaN stop, DDP
    precision.py           autocast, fp16 loss scaling
    schedules.py           noam, cosine, constant learning-rate schedules
    losses.py              label-smoothed cross-entropy summed per token, MoE auxiliary loss
    checkpoint.py          atomic, SHA-256-verified checkpoints; a failed write said plainly
    lock.py                one trainer per run directory (flock, the owner's PID)
    threads.py             the thread count on resume (run's own, or the one asked), busy cores
    metrics.py, plot.py    metrics.jsonl and its curves

attnlab train multi30k-de-en-quick          # or: python -m attnlab train configs/X.yaml
"""

from .checkpoint import CheckpointError
from .loop import Checkpointing, Trainer, TrainingDiverged
from .losses import smoothed_cross_entropy_sum
from .recipes import Recipe
from .recipes import load as load_recipe
from .run import train
from .schedules import constant, cosine, noam

__all__ = [
    "CheckpointError",
    "Checkpointing",
    "Recipe",
    "Trainer",
    "TrainingDiverged",
    "constant",
    "cosine",
    "load_recipe",
    "noam",
    "smoothed_cross_entropy_sum",
    "train",
]
