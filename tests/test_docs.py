"""The documentation tells the truth about the code it describes."""

import re
from pathlib import Path

import attnlab as al

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- BEGIN GENERATED: attnlab presets --markdown -->"
END = "<!-- END GENERATED -->"


def test_components_table_is_generated_from_the_presets():
    text = (ROOT / "docs" / "components.md").read_text()
    table = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()
    assert table == al.presets.components_table(), "regenerate with `make docs`"


def test_every_preset_is_in_the_readme_with_its_exact_count():
    readme = (ROOT / "README.md").read_text()
    for name in al.presets.names():
        line = next((x for x in readme.splitlines() if x.startswith(name + " ")), None)
        assert line is not None, f"README lacks preset {name}"
        assert f"{al.count_parameters(al.presets.get(name)):,}" in line


PATH = re.compile(r"(?<![\w/.])((?:src/attnlab|docs|tests|benchmarks|configs)/[\w./-]*\w)")


def _mentions(text: str) -> set[str]:
    """Path mentions, without placeholders (configs/NAME.yaml) and prefixes (tests/test_interop_*)."""
    found = {m.rstrip(".") for m in PATH.findall(text)}
    return {p for p in found if not re.search(r"/[A-Z]+\b", p) and not p.endswith("_")}


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
