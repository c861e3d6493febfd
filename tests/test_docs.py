"""The documentation tells the truth about the code it describes."""

import re

import pytest

import attnlab as al
from helpers import ROOT
from helpers.doc_tables import BLOCKS, current, registries, registry_table

BEGIN = "<!-- BEGIN GENERATED: attnlab presets --markdown -->"
END = "<!-- END GENERATED -->"


def test_components_table_is_generated_from_the_presets():
    text = (ROOT / "docs" / "components.md").read_text()
    table = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()
    assert table == al.presets.components_table(), "regenerate with `make docs`"


def test_every_preset_is_in_the_docs_with_its_exact_count():
    text = (ROOT / "docs" / "components.md").read_text()
    for name in al.presets.names():
        line = next((x for x in text.splitlines() if x.startswith(name + " ")), None)
        assert line is not None, f"docs/components.md lacks preset {name}"
        assert f"{al.count_parameters(al.presets.get(name)):,}" in line


@pytest.mark.parametrize(("page", "name", "render"), BLOCKS, ids=[n for _, n, _ in BLOCKS])
def test_every_generated_block_is_the_code_rendered_now(page, name, render):
    """docs/architecture.md's registry and layer tables (and components.md's preset table) are
    what tests/helpers/doc_tables.py renders from the code."""
    assert current(page, name) == render(), f"{page}: {name} is stale: regenerate with `make docs`"


def test_the_registry_table_finds_every_registry_the_package_holds():
    """Oracle: the Registry objects at module level of every module that imports (the table finds
    them in the source). Each is listed once, under the module that creates it."""
    import importlib
    import pkgutil

    from attnlab.registry import Registry

    held: dict[int, set[tuple[str, str]]] = {}
    for info in pkgutil.walk_packages(al.__path__, "attnlab."):
        if info.name in ("attnlab.__main__", "attnlab.decode.cache"):  # runs the CLI; a shim
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra (serve's fastapi) that is not installed
            continue
        for attr, value in vars(module).items():
            if isinstance(value, Registry):
                held.setdefault(id(value), set()).add((info.name, attr))
    listed = set(registries())
    assert len(listed) == len(held) >= 16
    assert all(places & listed for places in held.values())
    table = registry_table()
    assert "paged-flex" in table and "`fixed.py`: fixed" in table


PATH = re.compile(r"(?<![\w/.])((?:src/attnlab|docs|tests|benchmarks|configs)/[\w./-]*\w)")


def _mentions(text: str) -> set[str]:
    """Path mentions, without placeholders (configs/NAME.yaml) and prefixes
    (tests/interop/test_interop_*)."""
    found = {m.rstrip(".") for m in PATH.findall(text)}
    return {p for p in found if not re.search(r"/[A-Z]+\b", p) and not p.endswith("_")}


def test_readme_is_a_users_page():
    """Under 15 KB, with the task table and a GPU section (the long tables live in docs/)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 15_000, len(readme.encode())
    assert "## What to run for what" in readme and "## On a GPU" in readme
    for command in ("train", "eval", "translate", "generate", "chat", "serve", "convert", "plot",
                    "inspect", "lab run"):  # fmt: skip
        assert f"`attnlab {command} " in readme, command


def test_every_repository_path_the_docs_and_docstrings_mention_exists():
    """README, docs/*.md and every docstring or comment in src/: a `src/attnlab/...`, `docs/...`,
    `tests/...` path they name is a file or folder (a `::test_name` suffix is allowed)."""
    sources = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "src").rglob("*.py")]
    missing = []
    for f in sources:
        for path in _mentions(f.read_text()):
            if not (ROOT / path.split("::")[0]).exists():
                missing.append(f"{f.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(missing)


def _map_entries() -> set[str]:
    """The modules docs/architecture.md's map names: its first code block after "## Map" is a
    tree, two spaces a level, folders ending in "/" (description lines are indented further and
    name no module)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text[text.index("## Map") :].split("```")[1]
    entries, folders = set(), []
    for line in block.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not re.fullmatch(r"[\w.]+(/|\.py)", name):
            continue
        level = (len(line) - len(line.lstrip())) // 2
        folders = folders[:level]
        if name.endswith("/"):
            folders.append(name)
        else:
            entries.add("".join(folders) + name)
    return entries


def test_every_module_is_on_the_map_and_the_map_names_only_modules():
    package = ROOT / "src" / "attnlab"
    modules = {str(p.relative_to(package)) for p in package.rglob("*.py")}
    on_map = _map_entries()
    assert not modules - on_map, f"modules missing from docs/architecture.md: {modules - on_map}"
    assert not on_map - modules, f"the map names modules that do not exist: {on_map - modules}"


EXCERPT = re.compile(r"<!-- excerpt: (src/attnlab/[\w/.]+\.py) -->\n```python\n(.*?)```", re.S)


def _code(line: str) -> str:
    """A line without its comment and surrounding space (excerpts may annotate shapes)."""
    code = line.strip()
    return "" if code.startswith("#") else code.split("  #")[0].split(" # ")[0].strip()


def test_every_walkthrough_excerpt_matches_the_source_it_names():
    """Each excerpt marked `<!-- excerpt: PATH -->` in docs/walkthrough.md is code of PATH: its
    lines, less comments and `...` elisions, occur in the file in the same order."""
    text = (ROOT / "docs" / "walkthrough.md").read_text()
    excerpts = EXCERPT.findall(text)
    assert len(excerpts) >= 8, "the walkthrough's excerpts lost their <!-- excerpt: --> marks"
    stale = []
    for path, body in excerpts:
        source = [_code(x) for x in (ROOT / path).read_text().splitlines()]
        at = 0
        for line in body.splitlines():
            want = _code(line)
            if not want or want == "...":
                continue
            try:
                at = source.index(want, at) + 1
            except ValueError:
                stale.append(f"{path}: {want!r}")
                break
    assert not stale, "walkthrough excerpts out of date:\n" + "\n".join(stale)
