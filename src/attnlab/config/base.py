"""The plumbing under every config node: `Frozen` (immutable, no unknown keys, pydantic's errors
turned into one `ConfigError` that lists every problem), `Kind` (a member of a tagged union, which
carries its own rules and test size), `TinySize`, and the helpers the kinds share.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import did_you_mean, excerpt, problem_list

if TYPE_CHECKING:
    from typing_extensions import Self

    from .model import ModelConfig


class ConfigError(ValueError):
    """An invalid config; `problems` lists each one (field, value, rule, fix)."""

    def __init__(self, title: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(problem_list(title, problems))


def _fields_at(model: Any, loc: tuple) -> list[str]:
    """The field names of the node at `loc` below pydantic model `model` (union members are
    picked by the tag pydantic puts in the path); [] when the path cannot be followed."""
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
        if part in model.model_fields:
            model = model.model_fields[part].annotation
            continue
        members = [m for m in get_args(model) if isinstance(m, type)]  # Optional / Union
        for arg in get_args(model):
            members += [m for m in get_args(arg) if isinstance(m, type)]  # Annotated[Union]
        match = [m for m in members if issubclass(m, BaseModel) and m.model_fields.get("kind")]
        match = [m for m in match if m.model_fields["kind"].default == part]
        if not match:
            return []
        model = match[0]
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def validation_problems(
    err: ValidationError,
    what: str = "field",
    sep: str = ".",
    root: str = "config",
    model: Any = None,
) -> list[str]:
    """pydantic's errors as problem lines (field, value, rule, fix); a closed set of values gets a
    did-you-mean. Used for configs and, with what="key" and sep=": ", for recipes."""
    out = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        ctx = e.get("ctx", {})
        inner = ctx.get("error")
        if isinstance(inner, ConfigError):  # a nested node's own report: keep its lines, add path
            out += [f"{where}{sep}{line}" if where else line for line in inner.problems]
        elif e["type"] == "value_error":  # our rule messages already name field, value and fix
            msg = str(inner) if inner is not None else e["msg"]
            out += [f"{where}{sep}{m}" if where and sep != "." else m for m in msg.splitlines()]
        elif e["type"] == "missing":
            out.append(f"{where}: required {what} is missing (set it)")
        elif e["type"] == "extra_forbidden":
            known = _fields_at(model, e["loc"][:-1]) if model is not None else []
            hint = did_you_mean(e["loc"][-1], known)
            out.append(f"{where}: unknown {what} (remove it or check its spelling).{hint}")
        else:
            allowed = re.findall(r"'([^']*)'", ctx.get("expected", ctx.get("expected_tags", "")))
            value = ctx.get("tag", e.get("input"))
            hint = did_you_mean(value, allowed) if allowed else ""
            shown = excerpt(repr(e.get("input")), 120)  # an error quotes input, never all of it
            out.append(f"{where or root} = {shown}: {e['msg']}.{hint}".rstrip("."))
    return out


class Frozen(BaseModel):
    """Base of every config node: immutable, no unknown keys, errors raised as ConfigError."""

    # inf / nan are never a size, rate or scale: refused (a learning rate of inf trained to NaN)
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            problems = validation_problems(err, model=type(self))
            raise ConfigError(type(self).__name__, problems) from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(cls.__name__, validation_problems(err, model=cls)) from None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def replace(self, **changes: Any):
        """A validated copy with some top-level fields changed (sub-configs as objects or dicts)."""
        data = self.model_dump(mode="json")
        for key, value in changes.items():
            data[key] = value.to_dict() if isinstance(value, Frozen) else value
        return type(self).from_dict(data)

    def merged(self, **changes: Any):
        """A validated copy with `changes` deep-merged: `attention={"dropout": 0.0}` changes that
        field only (replace() would swap in a whole new sub-config with defaults elsewhere)."""
        over = {k: v.to_dict() if isinstance(v, Frozen) else v for k, v in changes.items()}
        return type(self).from_dict(merge_dicts(self.to_dict(), over))


def merge_dicts(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep merge of config data; a sub-config whose `kind` changes is replaced, not merged."""
    out = dict(base)
    for k, v in over.items():
        b = out.get(k)
        if (
            isinstance(b, dict)
            and isinstance(v, dict)
            and v.get("kind", b.get("kind")) == b.get("kind")
        ):
            out[k] = merge_dicts(b, v)
        else:
            out[k] = v
    return out


@dataclass(frozen=True)
class TinySize:
    """The test size `presets.tiny` shrinks a model to, handed to every kind's `tiny`."""

    d_model: int  # the test model's width
    head_dim: int  # the test model's head width
    full_d_model: int  # the width of the model being shrunk

    def width(self, n: int) -> int:
        """A hidden width `n` of the full model at test size: its ratio to d_model kept, rounded
        to a multiple of 8 (at least 8)."""
        return 8 * max(1, round(n / self.full_d_model * self.d_model / 8))


class Kind(Frozen):
    """A member of a tagged union (a positional scheme, an attention, an FFN, ...). It holds what
    is particular to it: the cross-field rules it sets on the model it sits in and its test size.
    `ModelConfig` and `presets.tiny` only ask each kind, so adding one edits neither; a rule that
    concerns two kinds sits with one of them and asks the other a declared property (a class
    variable of its union's base), never its class."""

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        """This kind's rules on `model` (its own fields' rules are validators), each message
        opening with `where`, the node's place in the config ("positional", "layer_pattern.0.
        positional", ...). A kind without such rules has none ([])."""
        return []

    def tiny(self, size: TinySize) -> Self:
        """This node at test size (`presets.tiny`); unchanged unless the kind has sizes of its own."""
        return self


def _union_kinds(union: Any) -> list[Any]:
    """The member classes of an Annotated[Union[...], discriminator] config union."""
    return list(get_args(get_args(union)[0]))


def _divisors(n: int) -> str:
    return "{" + ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) + "}"


MAX_YAML_NODES = 100_000  # a recipe or config has a few hundred; an alias bomb has billions


def load_yaml(text: str, where: str = "YAML") -> Any:
    """yaml.safe_load, refusing documents whose aliases expand to more than MAX_YAML_NODES
    values ("billion laughs": a 1 KB file of nested anchors that names 10^9 values; PyYAML
    shares the aliased objects, but validating or printing them walks every one)."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(where, [f"not valid YAML: {excerpt(err, 300)}"]) from None
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(x: Any) -> int:  # values reachable, counting each alias again (memoised)
        if not isinstance(x, (dict, list)):
            return 1
        if id(x) in open_:
            raise ConfigError(where, ["an alias refers to itself (a recursive structure)"])
        if id(x) not in sizes:
            open_.add(id(x))
            items = [*x.keys(), *x.values()] if isinstance(x, dict) else x
            sizes[id(x)] = min(1 + sum(size(i) for i in items), MAX_YAML_NODES + 1)
            open_.discard(id(x))
        return sizes[id(x)]

    n = size(data)
    if n > MAX_YAML_NODES:
        raise ConfigError(
            where,
            [
                f"its aliases (&anchor / *alias) expand to more than {MAX_YAML_NODES:,} "
                f"values: write the values out, or use fewer nested aliases"
            ],
        )
    return data
