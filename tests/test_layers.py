"""The packages form layers: each imports only from layers below it (docs/architecture.md,
"Import direction"). tests/test_architecture.py rules out circles between modules; this rules out
the upward imports that a circle-free graph still allows (nn/ importing the decoding strategies,
lab/ importing the command line), function-level imports included.
"""

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
    {"lab", "serve"},
    {"cli"},
    {"__init__", "__main__"},  # the public API and `python -m attnlab`
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
# inside nn/: the attention layer takes its inputs (bias, mask, rotation descriptions) from
# nn/attention/ itself; positional schemes make them, so they sit above it
NN_BELOW = {"attention": {"positional", "ffn", "block", "stack", "model", "init", "fuse"}}


def _imports(path: Path, module: tuple[str, ...] | None = None) -> list[tuple[str, int]]:
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


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_is_in_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()}
    tops = {t for t in tops if not t.startswith(("_", ".")) or t in ("__init__", "__main__")}
    tops.discard("py.typed")
    assert tops <= set(RANK), f"give these a layer in LAYERS: {sorted(tops - set(RANK))}"


def test_no_package_imports_from_a_layer_above_or_beside_it():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _top(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        for target, line in _imports(path):
            other = _top(target)
            if other != me and RANK[other] >= RANK[me]:
                where = path.relative_to(PACKAGE.parent.parent)
                upward.append(f"{where}:{line}: {me} (layer {RANK[me]}) imports {target}")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_attention_layer_imports_no_positional_scheme_or_block():
    upward = []
    nn = PACKAGE / "nn"
    for sub, above in NN_BELOW.items():
        for path in sorted((nn / sub).rglob("*.py")):
            for target, line in _imports(path):
                parts = target.split(".")
                if parts[:2] == ["attnlab", "nn"] and len(parts) > 2 and parts[2] in above:
                    upward.append(f"{path.relative_to(nn)}:{line}: imports {target}")
    assert not upward, "nn/attention/ reaching above itself:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """The walker resolves relative imports: a cache module importing the decoding strategies
    (two dots up, then decode) is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\n\nfrom ..decode import generate\n")
    found = _imports(probe, ("attnlab", "cache", "probe"))
    assert found == [("attnlab.decode", 3)]
    assert RANK[_top("attnlab.decode")] > RANK["cache"]


def test_the_old_cache_path_warns_and_gives_the_same_objects():
    import importlib
    import sys

    import pytest

    import attnlab.cache as cache

    sys.modules.pop("attnlab.decode.cache", None)
    with pytest.warns(DeprecationWarning, match="moved to attnlab.cache"):
        old = importlib.import_module("attnlab.decode.cache")
    assert old.PagedKVCache is cache.PagedKVCache and old.new_cache is cache.new_cache
    assert set(old.__all__) == set(cache.__all__)
