"""The layers of the package: LAYERS, lowest first, and the walker that finds every attnlab
import of a file (function-level ones too). tests/test_layers.py holds the code to the layers;
tests/helpers/doc_tables.py renders them, with what each package imports, in
docs/architecture.md ("Import direction")."""

from __future__ import annotations

import ast
from pathlib import Path

import attnlab as al

PACKAGE = Path(al.__file__).parent

# lowest first; a package may import from its own layer's other packages only where listed below
LAYERS: list[set[str]] = [
    {"errors", "atomic"},
    {"registry", "config", "data"},  # no torch in the first two; data stands alone
    # cache: the decoding state, below the modules that fill it; graphs: compiled graphs held
    # per key, which nn's kernels and decode's steps both hold
    {"presets", "cache", "graphs"},
    {"nn"},
    {"build", "surgery"},
    {"decode"},
    {"interop"},
    {"train"},
    {"loading"},  # the one model loader (run, checkpoint, HF folder, .gguf) below cli and serve
    {"lab", "serve"},
    {"cli"},
    {"__init__", "__main__"},  # the public API and `python -m attnlab`
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
# inside nn/: the attention layer takes its inputs (bias, mask, rotation descriptions) from
# nn/attention/ itself; positional schemes make them, so they sit above it
NN_BELOW = {"attention": {"positional", "ffn", "block", "stack", "model", "init", "fuse"}}


def imports(path: Path, module: tuple[str, ...] | None = None) -> list[tuple[str, int]]:
    """(imported attnlab module, line) for every import in `path`, relative ones resolved against
    `module` (its dotted name as parts; by default where it lies under src/)."""
    module = module or path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = module[:-1]  # what one leading dot means, for a module and an __init__ alike
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None:  # from . import a, b: each name is a module
                found += [(f"{target}.{a.name}", node.lineno) for a in node.names]
            else:
                found.append((target, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
    return [(t, line) for t, line in found if t == "attnlab" or t.startswith("attnlab.")]


def top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def package_imports() -> dict[str, set[str]]:
    """Each top-level package or module (`top`) -> the other ones it imports."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        me = top(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        found.setdefault(me, set()).update(top(t) for t, _ in imports(path))
    return {me: targets - {me} for me, targets in found.items()}
