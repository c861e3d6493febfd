"""Training: recipes, the loop, schedules, losses, checkpoints (DESIGN.md, issue 5).

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
