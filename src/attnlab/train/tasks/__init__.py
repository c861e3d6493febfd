"""The tasks of the recipes: data, model sizes from the data, evaluation. One file per task,
named after the recipe's `data.kind` it registers in `TASKS`:

    translation.py     joint-BPE encoder-decoder; validation loss during training, BLEU
                       (sacreBLEU, beam search) on the test split at the end
    lm.py              character LM; loss on random validation windows (nanoGPT's estimate_loss)
    classification.py  encoder-only classifier; accuracy on dev during training, on test at the
                       end (from scratch, or fine-tuning a pretrained encoder)

`prepare(recipe, ...)` (src/attnlab/train/tasks/base.py) gives a `Task`: the training batch
stream, the sizes the model takes from the data (vocab_size, pad_token_id, num_labels), the
tokenizer, and the evaluation functions. Adding a task: a file here whose `build` registers
itself with `@TASKS.register("KIND")`, its import line below, and its data section (a member of
`DataSpec`) in src/attnlab/train/specs.py.
"""

from . import classification, lm, translation  # each registers itself in TASKS
from .base import TASKS, IndexBatches, Task, TaskBuilder, fixed_batches, mean_loss, prepare
from .translation import bleu, translate

__all__ = [
    "TASKS",
    "IndexBatches",
    "Task",
    "TaskBuilder",
    "bleu",
    "classification",
    "fixed_batches",
    "lm",
    "mean_loss",
    "prepare",
    "translate",
    "translation",
]
