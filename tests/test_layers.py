"""The packages form layers: each imports only from layers below it (LAYERS in
tests/helpers/layers.py; docs/architecture.md, "Import direction", is generated from them).
tests/test_architecture.py rules out circles between modules; this rules out the upward imports
that a circle-free graph still allows (nn/ importing the decoding strategies, lab/ importing the
command line), function-level imports included.
"""

from __future__ import annotations

from helpers.layers import NN_BELOW, PACKAGE, RANK, imports, top


def test_every_package_is_in_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()}
    tops = {t for t in tops if not t.startswith(("_", ".")) or t in ("__init__", "__main__")}
    tops.discard("py.typed")
    assert tops <= set(RANK), f"give these a layer in LAYERS: {sorted(tops - set(RANK))}"


def test_no_package_imports_from_a_layer_above_or_beside_it():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = top(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        for target, line in imports(path):
            other = top(target)
            if other != me and RANK[other] >= RANK[me]:
                where = path.relative_to(PACKAGE.parent.parent)
                upward.append(f"{where}:{line}: {me} (layer {RANK[me]}) imports {target}")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_attention_layer_imports_no_positional_scheme_or_block():
    upward = []
    nn = PACKAGE / "nn"
    for sub, above in NN_BELOW.items():
        for path in sorted((nn / sub).rglob("*.py")):
            for target, line in imports(path):
                parts = target.split(".")
                if parts[:2] == ["attnlab", "nn"] and len(parts) > 2 and parts[2] in above:
                    upward.append(f"{path.relative_to(nn)}:{line}: imports {target}")
    assert not upward, "nn/attention/ reaching above itself:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """The walker resolves relative imports: a cache module importing the decoding strategies
    (two dots up, then decode) is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\n\nfrom ..decode import generate\n")
    found = imports(probe, ("attnlab", "cache", "probe"))
    assert found == [("attnlab.decode", 3)]
    assert RANK[top("attnlab.decode")] > RANK["cache"]


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
