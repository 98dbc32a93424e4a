"""Build BENCHMARKS.md, one page, from the summary block at the head of each result file.

Invariant: every figure on the page is a row of a summary block, and every row's numbers appear in the body of
its result file, which names the command that measured them. A result file is refused (and nothing is written)
when it has no summary block, a malformed row, a figure its body does not contain, an absolute machine path, or
a script that is not in the repository. Superseded files live in ``benchmarks/results/archive/`` and are listed,
not summarised.

A block (its rules are the checks below)::

    <!-- summary -->
    | theme | claim | figure | versus | machine | date | commit | status |
    |---|---|---|---|---|---|---|---|
    | speed | ... | **1.39x** (median of 7) | a plain read | CPU 2 cores | 2026-11-29 | 78a62c9 | current |
    <!-- /summary -->

Usage: ``python benchmarks/assemble.py`` writes BENCHMARKS.md; ``--check FILE...`` only reports on those files.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
COLUMNS = ("theme", "claim", "figure", "versus", "machine", "date", "commit", "status")
THEMES = {
    "speed": "Speed: what is fastest",
    "memory": "Memory: what holds least",
    "quality": "Quality: what is best",
    "reliability": "Reliability: what holds up",
}
REGRESSION = "regression"
STATUSES = ("current", "not reproduced", "bar not met", "code changed since")
MAX_BYTES = 15 * 1024
CPU = "CPU 2 cores"  # this project's machine: the page names any other in the row
#: one figure inline per theme: (a picture in benchmarks/results/, what it shows)
FIGURES = {
    "quality": (
        "eval_calibrated_4k.png",
        "RULER-style accuracy (4k) vs the share of context removed, kvlab, kvpress, same ids",
    ),
}

BLOCK = re.compile(r"<!-- summary -->\n(.*?)\n<!-- /summary -->", re.S)
NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|home|root|Users|mnt|private)/")
SCRIPT = re.compile(r"(?<![\w/.-])((?:benchmarks|scripts|tests)/[\w./-]+\.(?:py|sh))")
NOT_KEPT = re.compile(r"\bnot kept\b")


class Refused(Exception):
    """A result file the page cannot be built from; the message names the file and the reason."""


@dataclass(frozen=True)
class Row:
    theme: str
    claim: str
    figure: str
    versus: str
    machine: str
    date: str
    commit: str
    status: str
    source: str  # the result file's name


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _row(cells: list[str], name: str, body: str) -> Row:
    if len(cells) != len(COLUMNS):
        raise Refused(
            f"{name}: a summary row has {len(cells)} cells, not {len(COLUMNS)}: {' | '.join(cells)}"
        )
    row = Row(*cells, source=name)
    if row.theme not in (*THEMES, REGRESSION):
        raise Refused(f"{name}: theme {row.theme!r} is not one of {', '.join((*THEMES, REGRESSION))}")
    if row.status not in STATUSES:
        hint = (
            " (a superseded file moves to benchmarks/results/archive/)" if row.status == "superseded" else ""
        )
        raise Refused(f"{name}: status {row.status!r} is not one of {', '.join(STATUSES)}{hint}")
    if not re.fullmatch(r"\d{4}-\d\d-\d\d", row.date):
        raise Refused(f"{name}: date {row.date!r} is not YYYY-MM-DD")
    if not re.fullmatch(r"[0-9a-f]{7,40}", row.commit):
        raise Refused(f"{name}: commit {row.commit!r} is not a short hash")
    missing = [n for n in NUMBER.findall(row.figure) if n not in body]
    if missing:
        raise Refused(f"{name}: the figure {row.figure!r} has {', '.join(missing)}, which its body does not")
    return row


def summary(text: str, name: str) -> list[Row]:
    """The rows of a result file's summary block, each checked against the file's body."""
    found = BLOCK.search(text)
    if found is None:
        raise Refused(f"{name}: no summary block (<!-- summary --> ... <!-- /summary -->)")
    lines = [ln for ln in found.group(1).splitlines() if ln.strip()]
    if len(lines) < 3 or tuple(_cells(lines[0])) != COLUMNS:
        raise Refused(
            f"{name}: the summary block must be a table with columns {' | '.join(COLUMNS)} and a row"
        )
    body = text[: found.start()] + text[found.end() :]
    return [_row(_cells(ln), name, body) for ln in lines[2:]]


def check_text(text: str, name: str, root: Path = ROOT) -> list[Row]:
    """:func:`summary` plus the file-wide rules: no machine path, no script missing from the repository."""
    if (m := MACHINE_PATH.search(text)) is not None:
        line = text[: m.start()].count("\n") + 1
        raise Refused(f"{name}: an absolute machine path on line {line} (make it relative to the repository)")
    for script in SCRIPT.findall(text):
        if not (root / script).exists():
            raise Refused(f"{name}: cites {script}, which is not in the repository")
    if (m := NOT_KEPT.search(text)) is not None:
        line = text[: m.start()].count("\n") + 1
        raise Refused(
            f"{name}: line {line} rests on something 'not kept'; keep it in the repository or drop it"
        )
    return summary(text, name)


def _known_commit(commit: str) -> bool:
    probe = ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def read_results(folder: Path = RESULTS) -> tuple[list[Row], dict[str, str]]:
    """Every current file's rows (commits checked against this repository) and each file's first script."""
    rows: list[Row] = []
    scripts: dict[str, str] = {}
    for path in sorted(folder.glob("*.md")):
        text = path.read_text()
        got = check_text(text, path.name)
        unknown = sorted({r.commit for r in got if not _known_commit(r.commit)})
        if unknown:
            raise Refused(f"{path.name}: commit {', '.join(unknown)} is not in this repository")
        rows += got
        if (s := SCRIPT.search(text)) is not None:
            scripts[path.name] = s.group(1)
    return rows, scripts


def _table(rows: list[Row], scripts: dict[str, str]) -> str:
    head = "| claim | figure | versus | date | commit | command | status |\n|---|---|---|---|---|---|---|"
    out = [head]
    for r in rows:
        claim = f"[{r.claim}](benchmarks/results/{r.source})"  # the file: command, raw rows, reading
        script = scripts.get(r.source)
        # the script's name only (the page has a size cap): the claim's file gives its path and command line
        command = f"`{Path(script).name}`" if script else "(in the file)"
        versus = r.versus if r.machine == CPU else f"{r.versus} ({r.machine})"
        out.append(f"| {claim} | {r.figure} | {versus} | {r.date} | {r.commit} | {command} | {r.status} |")
    return "\n".join(out)


HEADER = """# Benchmarks

One row per headline, from the summary block of each file in [benchmarks/results/](benchmarks/results/)
(`benchmarks/assemble.py`). Rows: 2 CPU cores, float32, unless they say otherwise; speed ratios
are measured side by side in one run. *code changed since*: the code it measured changed.
"""


def _grouped(stems: list[str]) -> list[str]:
    """The files' stems for the page, those that share a stem before their last ``_`` as one
    (``serve_decode_{2b59823,51fd8d0}``), in order."""
    by: dict[str, list[str]] = {}
    for stem in stems:
        by.setdefault(stem.rpartition("_")[0] or stem, []).append(stem)
    out = []
    for head, group in by.items():
        if len(group) == 1:
            out.append(f"`{group[0]}`")
        else:
            out.append(f"`{head}_{{{','.join(g[len(head) + 1 :] for g in group)}}}`")
    return out


def page(rows: list[Row], scripts: dict[str, str], archived: list[str]) -> str:
    """BENCHMARKS.md's text: comparisons by theme, the rows that are not current, then regressions."""
    current = [r for r in rows if r.status == "current"]
    parts = [HEADER]
    for theme, title in THEMES.items():
        picked = [r for r in current if r.theme == theme]
        if picked:
            parts.append(f"## {title}\n\n{_table(picked, scripts)}\n")
            if theme in FIGURES and (RESULTS / FIGURES[theme][0]).exists():
                picture, caption = FIGURES[theme]
                parts.append(f"![{caption}](benchmarks/results/{picture})\n")
    other = [r for r in rows if r.status != "current" and r.theme != REGRESSION]
    if other:
        parts.append(f"## Not met, not reproduced, or code changed since\n\n{_table(other, scripts)}\n")
    regressions = [r for r in rows if r.theme == REGRESSION]
    if regressions:
        parts.append(
            "## Regression checks (kvlab vs its own earlier commits)\n\n"
            + _table(regressions, scripts)
            + "\n"
        )
    if archived:
        names = ", ".join(_grouped(archived))  # one link: the page has a size cap
        parts.append(
            "## Archive\n\nSuperseded runs (`.md`), kept for the record in "
            f"[benchmarks/results/archive/](benchmarks/results/archive/): {names}.\n"
        )
    return "\n".join(parts)


def assembled() -> str:
    """BENCHMARKS.md's text; :class:`Refused` if a result file breaks a rule or the page is over 15 KB."""
    rows, scripts = read_results()
    archived = sorted(p.stem for p in (RESULTS / "archive").glob("*.md"))
    text = page(rows, scripts, archived)
    if len(text.encode()) > MAX_BYTES:
        raise Refused(
            f"BENCHMARKS.md would be {len(text.encode()):,} bytes, over {MAX_BYTES:,}: fewer or shorter rows"
        )
    return text


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["--check"]:
            for name in argv[1:]:
                path = Path(name)
                rows = check_text(path.read_text(), path.name)
                print(f"{path.name}: {len(rows)} summary rows, ok")
            return 0
        text = assembled()
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    (ROOT / "BENCHMARKS.md").write_text(text)
    print(f"BENCHMARKS.md: {len(text.encode()):,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
