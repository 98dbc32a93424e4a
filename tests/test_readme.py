"""README.md's Python snippets run as written, and print what the README says they print.

Every ```python block of the README runs in a fresh interpreter (in a temporary folder, so files it
writes land there). When a ```text block follows it (after a sentence of prose, at most), that block is the expected output: words must
match exactly and every number must match to the precision the README writes it with (``0.92``
checks two decimals; ``800`` checks the integer).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
# A ```text block after a snippet (prose without backticks may sit between them) is its expected output.
_BLOCK = re.compile(r"```python\n(.*?)```(?:[^`]*?```text\n(.*?)```)?", re.S)
_NUMBER = re.compile(r"^-?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?$")


def snippets() -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(README.read_text())]


def _same(expected: str, actual: str) -> bool:
    """Token-wise comparison; numbers compared at the precision the expected text shows."""
    exp, act = expected.split(), actual.split()
    if len(exp) != len(act):
        return False
    for e, a in zip(exp, act, strict=True):
        if _NUMBER.match(e) and _NUMBER.match(a):
            decimals = len(e.split(".")[1]) if "." in e and "e" not in e else None
            ev, av = float(e.replace(",", "")), float(a.replace(",", ""))
            if decimals is None:
                if "e" in e:  # scientific: same order of magnitude and leading digit
                    if f"{ev:.0e}" != f"{av:.0e}":
                        return False
                elif ev != av:
                    return False
            elif round(av, decimals) != round(ev, decimals):
                return False
        elif e != a:
            return False
    return True


def test_readme_has_snippets_with_outputs():
    found = snippets()
    assert len(found) >= 2, "README.md should show at least two Python snippets"
    assert any(out for _, out in found), "at least one snippet should show its output"


@pytest.mark.process
@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(snippets())))
def test_readme_snippet_runs_as_written(index, tmp_path, smollm):
    code, expected = snippets()[index]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"README snippet {index} failed:\n{done.stderr[-3000:]}"
    if expected is not None:
        assert _same(expected, done.stdout), (
            f"README snippet {index} printed:\n{done.stdout}\nbut the README says:\n{expected}"
        )


def test_number_comparison_uses_the_written_precision():
    assert _same("0.92 vs 0.998", "0.9213 vs 0.99849")
    assert not _same("0.92 vs 0.999", "0.9213 vs 0.99849")
    assert _same("800 tokens", "800 tokens") and not _same("800 tokens", "801 tokens")
    assert not _same("a b", "a b c")
