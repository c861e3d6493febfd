"""Every claim of every experiment in one table, one column per corpus: what docs/lab.md shows.

    attnlab lab summary docs/lab                  # print the table (markdown)
    attnlab lab summary docs/lab --write docs/lab.md

ROOT holds one run folder per experiment and corpus (src/attnlab/lab/runner.py): NAME for the
recipe's own data, NAME-CORPUS for a replication (`lab run NAME --corpus CORPUS`). The claims
are judged with the experiment's current file (configs/labs/NAME.yaml: its gates, margins and
stated effects) on the folder's results.jsonl, as `attnlab lab report` does. `--write FILE`
replaces what lies between the markers BEGIN and END in FILE, so the page cannot drift from the
results it quotes (tests/lab/test_lab_summary.py checks docs/lab.md).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from . import spec as S
from .report import ClaimResult, judge, power_note, read_results

BEGIN = "<!-- lab summary: attnlab lab summary docs/lab --write docs/lab.md -->"
END = "<!-- end of lab summary -->"
HOME = "tinyshakespeare"  # how the table names the recipe's own data (the labs' recipes' data)


@dataclass(frozen=True)
class Column:
    corpus: str | None  # None: the recipe's own data
    seeds: int
    results: dict[str, ClaimResult]  # claim id -> result


def columns(root: Path, lab: S.Lab) -> list[Column]:
    """The experiment's run folders under root that have results: its own, then its corpora."""
    out = []
    for corpus in [None, *lab.corpora]:
        folder = root / (lab.name + (f"-{corpus}" if corpus else ""))
        if not (folder / "results.jsonl").exists():
            continue
        records = read_results(folder)
        seeds = len({r["seed"] for r in records})
        out.append(Column(corpus, seeds, {r.claim.id: r for r in judge(lab, records, False, corpus)}))  # fmt: skip
    return out


def _cell(r: ClaimResult | None) -> str:
    if r is None:
        return "not run"
    m = r.measurement
    shown = "—" if m is None else m.describe().split(" (")[0]
    extra = f"; {power_note(r)}" if r.verdict.status == "inconclusive" else ""
    if r.verdict.status == "no verdict":
        extra = f" ({r.verdict.reason})"
    return f"{shown} **{r.verdict.status}**{extra}"


def _agreement(results: list[ClaimResult | None]) -> str:
    decided = [r.verdict.status for r in results if r is not None and r.verdict.status in ("pass", "fail")]  # fmt: skip
    if len(results) < 2 or any(r is None for r in results):
        return ""
    if len(decided) == len(results):
        return "same on both" if len(set(decided)) == 1 else "**differs**"
    return "decided on one only" if decided else "undecided on both"


def table(root: str | Path, names: list[str] | None = None) -> str:
    """The markdown summary of every experiment under root (default: every experiment)."""
    root = Path(root)
    corpora: list[str] = []
    rows, totals = [], {}
    for name in names or S.names():
        lab = S.load(name)
        cols = columns(root, lab)
        if not cols:
            continue
        for c in cols:
            key = c.corpus or HOME
            if c.corpus and c.corpus not in corpora:
                corpora.append(c.corpus)
            totals.setdefault(key, Counter()).update(r.verdict.status for r in c.results.values())
        rows.append((lab, {c.corpus: c for c in cols}))
    head = ["experiment (seeds)", "claim", HOME, *corpora, *(["on both corpora"] if corpora else [])]  # fmt: skip
    L = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lab, cols in rows:
        for i, claim in enumerate(lab.claims):
            seeds = ", ".join(f"{(c or HOME)} {cols[c].seeds}" for c in cols)
            first = f"`{lab.name}` ({seeds})" if i == 0 else ""
            tag = " (control)" if claim.control else ""
            cells = [cols[c].results.get(claim.id) if c in cols else None for c in [None, *corpora]]  # fmt: skip
            agree = [_agreement(cells)] if corpora else []
            L.append("| " + " | ".join([first, f"**{claim.id}**{tag}", *map(_cell, cells), *agree]) + " |")  # fmt: skip
    L += [""]
    for key, n in totals.items():
        parts = ", ".join(f"{n[s]} {s}" for s in ("pass", "fail", "inconclusive", "no verdict"))
        L.append(f"- {key}: {sum(n.values())} claims: {parts}.")
    return "\n".join(L) + "\n"


def write_into(path: str | Path, text: str) -> None:
    """Replace the block between BEGIN and END in the file at path with text."""
    path = Path(path)
    page = path.read_text()
    if BEGIN not in page or END not in page:
        raise ValueError(f"{path} has no summary block: add the lines {BEGIN!r} and {END!r} where it goes")  # fmt: skip
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n\n{text}\n{END}{tail}")
