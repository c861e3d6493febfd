"""An experiment: a YAML file in configs/labs/, validated here (frozen, no unknown keys, every
problem at once).

    name, description
    recipe        a base training recipe (configs/NAME.yaml, src/attnlab/train/recipes.py)
    overrides     recipe keys every run shares (nested, merged: {model: {overrides: {...}}})
    variants      name -> recipe overrides; one variant is one coupled setting (post-norm with
                  no final norm, a GLU with its own d_ff), plus the lab keys `seeds` (its own),
                  `init_from` (another variant: start from that run's weights, same seed) and
                  `train` (false: evaluate the freshly initialised model) and `quick` (its
                  own overrides under --quick, applied after the variant's)
    seeds         each variant is run once per seed; a seed fixes the initial draw and the data
                  order, so variants are paired by seed
    train         false: no training at all (measurements of the architecture)
    evaluate      evaluations run on each trained model (src/attnlab/lab/evals.py)
    gate          the quality gate: metric <= max, else the run gives no verdict (a run
                  that misses it by less than its variant's seed-to-seed spread passes)
    corpora       other data to replicate the experiment on (`lab run NAME --corpus C`):
                  name -> recipe overrides (e.g. the data set and its tokenizer) and that
                  corpus's own gate (its losses are in other units)
    plots         figures of report.md (src/attnlab/lab/plots.py)
    claims        what the literature says and how we check it (src/attnlab/lab/verdict.py)
    quick         `--quick`: recipe overrides, seeds and evaluation arguments for a
                  seconds-long run of the whole pipeline (its verdicts mean nothing)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..config import ConfigError, load_yaml, validation_problems
from ..errors import did_you_mean

LABS = Path(__file__).resolve().parents[3] / "configs" / "labs"  # src/attnlab/lab -> root
RESERVED = (
    "seeds",
    "init_from",
    "train",
    "quick",
)  # variant keys that are the lab's, not the recipe's


class Node(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Evaluation(BaseModel):
    """One evaluation: `kind` (a name in EVALS) and its arguments (checked by its own model)."""

    model_config = ConfigDict(frozen=True, extra="allow")
    kind: str
    variants: list[str] | None = None  # run on these variants only (None: all)


class Gate(Node):
    metric: str = "val_loss"
    max: float


class Plot(Node):
    kind: Literal["lines", "bars", "scatter", "curves", "training"]
    title: str
    metric: str = "val_loss"  # y; for lines a template with {x}, e.g. len_loss_x{x}
    x: list[Any] = Field(default_factory=list)  # lines: the values put into {x}
    x_metric: str | None = None  # scatter: the x axis metric
    xlabel: str = ""
    ylabel: str = ""
    variants: list[str] | None = None  # None: all
    logx: bool = False
    logy: bool = False
    file: str | None = None  # PNG name (default: from the title)


class Claim(Node):
    id: str
    text: str  # the claim, in words
    literature: str  # the published number(s)
    citation: str
    a: str  # "variant.metric"
    b: str | float  # "variant.metric", or a constant
    expect: Literal["lower", "higher", "equal"]
    margin: float = Field(0.0, ge=0)  # lower/higher: the effect must exceed it; equal: tolerance
    # the effect (in a − b's units, log units for `log`) the experiment is meant to detect: what
    # `lab run --plan` plans its seeds for and the report's power is computed at
    effect: float | None = Field(None, gt=0)
    log: bool = False  # compare log values (the effect is a ratio)
    control: bool = False  # the experiment's positive control
    gated: bool = True  # False: the quality gate does not apply (e.g. trainability claims)


class Corpus(Node):
    """A second corpus the experiment replicates on: recipe overrides applied after the lab's
    own (`data: {dataset: wikitext-2, tokenizer: bpe}`), and the quality gate's maximum in that
    corpus's units (None: the lab's)."""

    description: str = ""
    overrides: dict[str, Any] = Field(default_factory=dict)
    gate: float | None = None
    # this corpus's loss units per the recipe's (nats per BPE token / nats per character: its
    # characters per token): the margins and stated effects of claims that are not ratios are
    # multiplied by it, so that a replication asks for the same effect per character
    scale: float = Field(1.0, gt=0)


class Quick(Node):
    overrides: dict[str, Any] = Field(default_factory=dict)
    seeds: list[int] | None = None
    evaluate: dict[str, dict[str, Any]] = Field(default_factory=dict)  # kind -> argument changes
    gate: float | None = None  # a looser gate for --quick (still no verdict at a few steps)


class Lab(Node):
    name: str
    description: str = ""
    recipe: str
    overrides: dict[str, Any] = Field(default_factory=dict)
    variants: dict[str, dict[str, Any]]
    seeds: list[int] = Field(default_factory=lambda: [1], min_length=1)
    train: bool = True
    evaluate: list[Evaluation] = Field(default_factory=list)
    gate: Gate | None = None
    plots: list[Plot] = Field(default_factory=list)
    claims: list[Claim] = Field(default_factory=list)
    quick: Quick = Quick()
    corpora: dict[str, Corpus] = Field(default_factory=dict)

    def gate_max(self, quick: bool = False, corpus: str | None = None) -> float | None:
        """The quality gate's maximum for a run mode and corpus (None: no gate)."""
        if self.gate is None:
            return None
        if quick and self.quick.gate is not None:
            return self.quick.gate
        if corpus is not None and self.corpora[corpus].gate is not None:
            return self.corpora[corpus].gate
        return self.gate.max

    def loss_scale(self, corpus: str | None = None) -> float:
        """The corpus's loss units per the recipe's (1 for the recipe's own data)."""
        return self.corpora[corpus].scale if corpus is not None else 1.0

    def corpus(self, name: str | None) -> Corpus | None:
        """The named corpus (None for the recipe's own); a clear error for an unknown one."""
        if name is None:
            return None
        if name not in self.corpora:
            known = ", ".join(self.corpora) or "none: the experiment runs on its recipe's data only"  # fmt: skip
            raise ValueError(f"experiment {self.name} has no corpus {name!r}.{did_you_mean(name, list(self.corpora))} Corpora: {known}")  # fmt: skip
        return self.corpora[name]

    @field_validator("variants")
    @classmethod
    def _some(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        if not v:
            raise ValueError("variants: give at least one named variant")
        return v


def _problems(lab: Lab) -> list[str]:
    """What pydantic cannot see: unknown evaluation kinds and arguments, claims and plots that
    name missing variants, init_from chains."""
    from .evals import EVALS

    p: list[str] = []
    names = list(lab.variants)
    for i, ev in enumerate(lab.evaluate):
        if ev.kind not in EVALS.names():
            p.append(f"evaluate.{i}.kind: unknown evaluation {ev.kind!r}.{did_you_mean(ev.kind, EVALS.names())} Known: {', '.join(EVALS.names())}")  # fmt: skip
            continue
        p += [f"evaluate.{i}.{line}" for line in args_problems(ev.kind, ev.model_extra or {})]
        for var in ev.variants or []:
            if var not in names:
                p.append(f"evaluate.{i}.variants: unknown variant {var!r}.{did_you_mean(var, names)}")  # fmt: skip
    for name, v in lab.variants.items():
        src = v.get("init_from")
        if src is not None and src not in names:
            p.append(f"variants.{name}.init_from: {src!r} is not a variant.{did_you_mean(src, names)}")  # fmt: skip
        if src is not None and lab.variants[src].get("init_from") is not None:
            p.append(f"variants.{name}.init_from: {src!r} itself starts from another variant: chains are not supported")  # fmt: skip
        seeds = v.get("seeds")
        if seeds is not None and not (
            isinstance(seeds, list) and all(isinstance(s, int) for s in seeds)
        ):
            p.append(f"variants.{name}.seeds: a list of integers, got {seeds!r}")  # fmt: skip
    for i, c in enumerate(lab.claims):
        for side in ("a", "b"):
            ref = getattr(c, side)
            if isinstance(ref, str):
                var, dot, metric = ref.partition(".")
                if not dot or not metric:
                    p.append(f"claims.{i}.{side}: {ref!r} must be 'variant.metric' or a number")
                elif var not in names:
                    p.append(f"claims.{i}.{side}: unknown variant {var!r}.{did_you_mean(var, names)} Variants: {', '.join(names)}")  # fmt: skip
    for i, pl in enumerate(lab.plots):
        for var in pl.variants or []:
            if var not in names:
                p.append(f"plots.{i}.variants: unknown variant {var!r}.{did_you_mean(var, names)}")  # fmt: skip
        if pl.kind == "lines" and (not pl.x or "{x}" not in pl.metric):
            p.append(f"plots.{i}: a 'lines' plot needs x values and a metric template with {{x}}")
        if pl.kind == "scatter" and pl.x_metric is None:
            p.append(f"plots.{i}: a 'scatter' plot needs x_metric")
    for kind in lab.quick.evaluate:
        if kind not in [e.kind for e in lab.evaluate]:
            p.append(f"quick.evaluate.{kind}: not an evaluation of this lab")
    if lab.claims and not any(c.control for c in lab.claims):
        p.append("claims: mark one claim `control: true` (the positive control: an effect known to be large)")  # fmt: skip
    return p


def args_problems(kind: str, args: dict[str, Any]) -> list[str]:
    from .evals import EVALS

    model = EVALS.get(kind).args
    try:
        model.model_validate(args)
    except ValidationError as err:
        return validation_problems(err, what="argument", sep=": ", root=kind, model=model)
    return []


def from_dict(data: Any, where: str = "lab") -> Lab:
    if not isinstance(data, dict):
        raise ConfigError(where, ["the top level must be a mapping of keys"])
    try:
        lab = Lab.model_validate(data)
    except ValidationError as err:
        raise ConfigError(where, validation_problems(err, what="key", sep=": ", root="lab", model=Lab)) from None  # fmt: skip
    problems = _problems(lab)
    if problems:
        raise ConfigError(where, problems)
    return lab


def names() -> list[str]:
    return sorted(p.stem for p in LABS.glob("*.yaml"))


def find(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    cand = LABS / f"{name_or_path}.yaml"
    if cand.is_file():
        return cand
    raise FileNotFoundError(
        f"no experiment {str(name_or_path)!r} in {LABS}.{did_you_mean(str(name_or_path), names())}"
        f" Known: {', '.join(names())} (`attnlab lab list`)"
    )


def load(name_or_path: str | Path) -> Lab:
    path = find(name_or_path)
    return from_dict(load_yaml(path.read_text(), f"experiment {path}"), f"experiment {path.name}")
