"""The documentation tells the truth about the code it describes."""

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
