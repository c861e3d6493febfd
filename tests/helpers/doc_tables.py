"""The generated parts of docs/: each a block between `<!-- BEGIN GENERATED: NAME -->` and
`<!-- END GENERATED -->` in a page, rendered from the code. `make docs` rewrites them
(`python -m helpers.doc_tables` with tests/ on the path); tests/test_docs.py fails when one is
stale, naming the block.

- docs/components.md, `attnlab presets --markdown`: the preset x components table
  (`attnlab.presets.components_table`, what `attnlab presets --markdown` prints)
- docs/architecture.md, `registries`: every `Registry` in src/attnlab (found in the source, so a
  new one joins the table by itself), its entries grouped by the module that registers them, and
  the modules that look entries up
- docs/architecture.md, `layers`: LAYERS (tests/helpers/layers.py), each package with the
  packages it imports as the code has them

A new table is one more entry in BLOCKS: (page, name, function returning the block's text).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable
from pathlib import Path

import attnlab as al
from helpers import ROOT
from helpers.layers import LAYERS, PACKAGE, package_imports

END = "<!-- END GENERATED -->"


def begin(name: str) -> str:
    return f"<!-- BEGIN GENERATED: {name} -->"


# --- registries ----------------------------------------------------------------------------------


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def registries() -> list[tuple[str, str]]:
    """(module, name) of every module-level `NAME = Registry(...)` in src/attnlab, in path
    order."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            target = node.target if isinstance(node, ast.AnnAssign) else None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
            value = getattr(node, "value", None)
            if (
                isinstance(target, ast.Name)
                and isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and value.func.id == "Registry"
            ):
                found.append((_module(path), target.id))
    return found


def _lookups(name: str) -> list[str]:
    """The modules that look entries of registry `name` up: `NAME.get`, `.build`, `.names()`,
    `x in NAME` (registering is not looking up)."""
    where = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            named = []
            if isinstance(node, ast.Attribute) and node.attr in ("get", "build", "names"):
                named = [node.value]
            elif isinstance(node, ast.Compare):
                named = [c for c, op in zip(node.comparators, node.ops, strict=True)
                         if isinstance(op, (ast.In, ast.NotIn))]  # fmt: skip
            for n in named:
                if (isinstance(n, ast.Name) and n.id == name) or (
                    isinstance(n, ast.Attribute) and n.attr == name
                ):
                    where.add(str(path.relative_to(PACKAGE)))
    return sorted(where)


def _home(entry: object) -> str:
    """The module an entry was written in: the class or function itself, the function a record
    wraps (`fn`), or the class of an instance."""
    for candidate in (entry, getattr(entry, "fn", None), type(entry)):
        if inspect.isclass(candidate) or inspect.isroutine(candidate):
            return candidate.__module__
    raise TypeError(f"cannot tell where {entry!r} was written")


def _file(module: str, near: str) -> str:
    """`module` as a path: relative to the registry's folder where it lies inside it, else to
    src/attnlab/; a package outside attnlab by its name (torch)."""
    if not module.startswith("attnlab."):
        return module.split(".")[0]
    folder = near.rsplit(".", 1)[0] + "."
    rel = module[len(folder) :] if module.startswith(folder) else module.split(".", 1)[1]
    return rel.replace(".", "/") + ".py"


def _entries(module: str, name: str) -> str:
    """Every entry by name, sorted, grouped by the file it is written in when there are several."""
    registry = getattr(importlib.import_module(module), name)
    by_file: dict[str, list[str]] = {}
    for entry in sorted(registry.names()):
        by_file.setdefault(_file(_home(registry.get(entry)), module), []).append(entry)
    if len(by_file) == 1:
        return ", ".join(next(iter(by_file.values())))
    return "; ".join(f"`{f}`: {', '.join(names)}" for f, names in sorted(by_file.items()))


def _load_every_entry() -> None:
    """Entries register by explicit import: import what registers them all (the optional
    dependencies of serve/ are not needed)."""
    for module in ("attnlab.nn", "attnlab.cache", "attnlab.presets", "attnlab.interop",
                   "attnlab.train.tasks", "attnlab.train.schedules", "attnlab.lab.evals"):  # fmt: skip
        importlib.import_module(module)


def registry_table() -> str:
    _load_every_entry()
    rows = [
        "| registry | defined in | entries (`file`: those it registers) | looked up in |",
        "|---|---|---|---|",
    ]
    for module, name in registries():
        defined = str(Path(*module.split(".")[1:])) + ".py"
        if (PACKAGE / Path(*module.split(".")[1:]) / "__init__.py").exists():
            defined = str(Path(*module.split(".")[1:], "__init__.py"))
        used = ", ".join(f"`{u}`" for u in _lookups(name))
        rows.append(f"| `{name}` | `{defined}` | {_entries(module, name)} | {used} |")
    return "\n".join(rows)


# --- layers --------------------------------------------------------------------------------------

# what the import list cannot say (kept here, beside the table it annotates)
NOTES = {
    "errors": "no torch, no pydantic",
    "atomic": "files renamed into place when whole",
    "registry": "no torch",
    "config": "no torch",
    "cache": "the decoding state: no model code",
    "graphs": "compiled graphs held per key",
    "nn": "models hand caches out (new_cache); attention fills them",
    "build": "the only reader of a config",
    "decode": "the strategies and the engine drive the models' public inference API",
    "serve": "the `serve` extra: fastapi, jinja2",
    "__init__": "the public API",
    "__main__": "`python -m attnlab`",
}


def layer_table() -> str:
    imports = package_imports()
    rows = ["| layer | package | imports (from the code) | note |", "|---|---|---|---|"]
    for rank, layer in enumerate(LAYERS):
        for package in sorted(layer, key=lambda p: (p.startswith("_"), p)):
            targets = ", ".join(sorted(imports.get(package, set()))) or "nothing from attnlab"
            rows.append(f"| {rank} | `{package}` | {targets} | {NOTES.get(package, '')} |")
    return "\n".join(rows)


# --- the blocks ----------------------------------------------------------------------------------

BLOCKS: list[tuple[str, str, Callable[[], str]]] = [
    ("docs/components.md", "attnlab presets --markdown", al.presets.components_table),
    ("docs/architecture.md", "registries", registry_table),
    ("docs/architecture.md", "layers", layer_table),
]


def current(page: str, name: str) -> str:
    """The text of block `name` in `page` as it stands."""
    text = (ROOT / page).read_text()
    start = text.index(begin(name)) + len(begin(name))
    return text[start : text.index(END, start)].strip()


def write() -> list[str]:
    """Rewrite every block from the code; the ones that changed."""
    changed = []
    for page, name, render in BLOCKS:
        path = ROOT / page
        text = path.read_text()
        start = text.index(begin(name)) + len(begin(name))
        new = "\n" + render() + "\n"
        end = text.index(END, start)
        if text[start:end] != new:
            path.write_text(text[:start] + new + text[end:])
            changed.append(f"{page}: {name}")
    return changed


if __name__ == "__main__":
    print("\n".join(write()) or "every generated block is current")
