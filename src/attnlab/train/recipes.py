"""Training recipes: everything a run needs besides the data files, as one validated tree.

A recipe is YAML (configs/NAME.yaml) checked by the pydantic models of its sections
(src/attnlab/train/specs.py) and `Recipe` below: frozen, no unknown keys (an unknown key is
rejected with the known ones and a did-you-mean), every problem reported at once.
`--set key.sub=value` overrides any leaf before validation; values are parsed as YAML
(`--set optimizer.betas=[0.9,0.98]`, `--set model.overrides.norm_placement=pre`).
`model_config` turns the model section and the sizes that come from the data into a ModelConfig.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import Field, ValidationError, model_validator

from ..config import ConfigError, ModelConfig, load_yaml, validation_problems
from ..config import merge_dicts as merge
from .specs import (
    BatchSpec,
    CheckpointSpec,
    ConstantSchedule,
    DataSpec,
    DecodingSpec,
    EvalSpec,
    ModelSpec,
    Node,
    OptimizerSpec,
    ScheduleSpec,
)

CONFIGS = Path(__file__).resolve().parents[3] / "configs"  # src/attnlab/train -> project root


class Recipe(Node):
    name: str = "run"
    description: str = ""
    seed: int = Field(1337, ge=0)  # torch, numpy and Python generators take non-negative seeds
    steps: int = Field(gt=0)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on a GPU, else fp32
    # torch.compile the training forward (opt-in: the first steps compile; evaluation and
    # decoding run the model as it is)
    compile: bool = False
    log_every: int = Field(10, gt=0)
    model: ModelSpec
    data: DataSpec
    batch: BatchSpec
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: ScheduleSpec = ConstantSchedule()
    eval: EvalSpec = EvalSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    decoding: DecodingSpec = DecodingSpec()

    @model_validator(mode="after")
    def _fits(self) -> Recipe:
        kind = self.data.kind
        if kind == "lm" and self.batch.size is None:
            raise ValueError(
                "batch.size (sequences of data.context tokens) is required for data.kind 'lm'"
            )
        if kind != "lm" and self.batch.max_tokens is None:
            raise ValueError(
                f"batch.max_tokens is required for data.kind {kind!r} (length-bucketed batches)"
            )
        pretrained_tok = getattr(self.data, "tokenizer", None) == "pretrained"
        if pretrained_tok and self.model.pretrained is None:
            raise ValueError(
                "data.tokenizer 'pretrained' reads model.pretrained's tokenizer.json: set "
                "model.pretrained, or choose a tokenizer trained on the data (bpe, wordpiece)"
            )
        if self.model.pretrained is not None and kind == "translation":
            raise ValueError(
                "model.pretrained: fine-tuning supports data.kind 'classification' (an encoder) "
                "and 'lm' (a decoder), not 'translation'; train this task from a preset"
            )
        if self.model.pretrained is not None and not pretrained_tok:
            raise ValueError(
                "model.pretrained needs its own vocabulary: set data.tokenizer to 'pretrained'"
            )
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recipe:
        """Validate a raw recipe; every problem at once, unknown keys with a did-you-mean."""
        problems: list[str] = []
        data = _drop_unknown(cls, data, "", problems)
        try:
            recipe = cls.model_validate(data)
        except ValidationError as err:
            problems += _problems(err)
        if problems:
            raise ConfigError("recipe", problems)
        return recipe


def _node_class(annotation: Any, value: Any) -> type[Node] | None:
    """The Node class a raw value will be validated as (tagged unions: by its `kind`)."""
    if isinstance(annotation, type) and issubclass(annotation, Node):
        return annotation
    members = get_args(annotation)  # Union[A, B, ...]: pydantic keeps Field(...) apart
    for m in (m for m in members if isinstance(m, type)):
        if issubclass(m, Node) and m.model_fields["kind"].default == value.get("kind"):
            return m
    return None


def _drop_unknown(cls: type[Node], data: Any, path: str, problems: list[str]) -> Any:
    """`data` without the keys `cls` does not know (recursively); each is a problem."""
    if not isinstance(data, dict):
        return data
    known = list(cls.model_fields)
    out = {}
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
            if cls is ModelSpec and key in ModelConfig.model_fields:
                hint = f"model fields go under model.overrides (model.overrides.{key})"
            problems.append(f"{path}{key}: unknown key: {hint}")
            continue
        sub = (
            _node_class(cls.model_fields[key].annotation, value)
            if isinstance(value, dict)
            else None
        )
        out[key] = _drop_unknown(sub, value, f"{path}{key}.", problems) if sub else value
    return out


def _problems(err: ValidationError) -> list[str]:
    return validation_problems(err, what="key", sep=": ", root="recipe")


# --- loading, overrides ---------------------------------------------------------------------


def find(name_or_path: str | Path) -> Path:
    """A recipe file: a path, a name in configs/ (`multi30k-de-en`), or a file name there
    (`multi30k-de-en.yaml`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    cand = CONFIGS / f"{name_or_path}.yaml"
    if cand.is_file():
        return cand
    if path.name == str(name_or_path) and (CONFIGS / path.name).is_file():  # a bare file name
        return CONFIGS / path.name
    known = names()
    close = difflib.get_close_matches(path.stem, known, n=3, cutoff=0.5)
    if (CONFIGS / path.name).is_file():  # the right file name in another folder
        close = [str(CONFIGS / path.name)]
    raise FileNotFoundError(
        f"no recipe {str(name_or_path)!r}: not a file, and not a name in {CONFIGS}"
        + (f"; did you mean {', '.join(map(repr, close))}?" if close else "")
        + f" (known: {', '.join(known)})"
    )


def names() -> list[str]:
    return sorted(p.stem for p in CONFIGS.glob("*.yaml"))


def parse_set(items: list[str]) -> list[tuple[list[str], Any]]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--set", [f"expected key.sub=value, got {item!r}"])
        out.append(
            (key.strip().split("."), load_yaml(value, f"--set {key}") if value != "" else "")
        )
    return out


def apply_set(data: dict[str, Any], items: list[str]) -> dict[str, Any]:
    """A copy of the raw recipe dict with `--set key.sub=value` overrides applied."""
    data = yaml.safe_load(yaml.safe_dump(data))  # deep copy of plain data
    for path, value in parse_set(items):
        node = data
        for k in path[:-1]:
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise ValueError(f"--set {'.'.join(path)}: {k!r} holds {nxt!r}, not a section")
            node = nxt
        node[path[-1]] = value
    return data


def load(name_or_path: str | Path, overrides: list[str] | None = None) -> Recipe:
    path = find(name_or_path)
    data = load_yaml(path.read_text(), f"recipe {path}") or {}
    if not isinstance(data, dict):
        raise ConfigError("recipe", [f"{path}: the top level must be a mapping of keys"])
    return Recipe.from_dict(apply_set(data, overrides or []))


def model_config(spec: ModelSpec, **from_data: Any) -> ModelConfig:
    """The ModelConfig of a recipe, with the sizes that come from the data (vocab_size, ...)."""
    from .. import presets

    if spec.config is not None:
        base = spec.config.to_dict()
    elif spec.pretrained is not None:
        from ..interop import pretrained_config

        ckpt = pretrained_config(spec.pretrained)
        base = merge(ckpt.to_dict(), spec.overrides)
        from_data = _checkpoint_sizes(spec.pretrained, ckpt, dict(from_data))
        if from_data.get("num_labels"):  # a classifier replaces a pretraining (MLM) head
            base["mlm_head"] = False
    else:
        base = merge(presets.get(spec.preset).to_dict(), spec.overrides)
    ignored = sorted(set(spec.overrides) & set(from_data))
    if ignored:  # the data decides these: an override would be silently replaced
        raise ConfigError(
            "recipe",
            [
                f"model.overrides.{k}: set by the data ({k} = {from_data[k]} from the tokenizer "
                f"or the labels), so an override does nothing: remove it (change the data "
                f"section instead, e.g. data.vocab_size for a trained BPE tokenizer)"
                for k in ignored
            ],
        )
    return ModelConfig.from_dict({**base, **from_data})


def _checkpoint_sizes(name: str, ckpt: ModelConfig, sizes: dict[str, Any]) -> dict[str, Any]:
    """A pretrained checkpoint keeps its own embedding size and padding id; the data's (from the
    checkpoint's tokenizer) must fit them. Returns the sizes still to apply (num_labels)."""
    vocab, pad = sizes.pop("vocab_size", None), sizes.pop("pad_token_id", None)
    if vocab is not None and vocab > ckpt.vocab_size:
        raise ValueError(
            f"model.pretrained {name}: its tokenizer has {vocab} tokens but the checkpoint embeds "
            f"{ckpt.vocab_size}: use the tokenizer saved with the checkpoint"
        )
    if pad is not None and ckpt.pad_token_id is not None and pad != ckpt.pad_token_id:
        raise ValueError(
            f"model.pretrained {name}: the tokenizer pads with id {pad}, the checkpoint with "
            f"{ckpt.pad_token_id}: use the tokenizer saved with the checkpoint"
        )
    if sizes.get("num_labels") and ckpt.arch != "encoder":
        raise ValueError(
            f"model.pretrained {name} is a {ckpt.arch!r} checkpoint: classification fine-tuning "
            f"needs an encoder (BERT, RoBERTa)"
        )
    return sizes
