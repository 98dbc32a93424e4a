"""Names never become paths outside kvlab's own folders (a derivative --name once rmtree'd any folder)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.errors import BadInputError
from kvlab.paths import contained, safe_name

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "name", ["/abs/path", "..", "../x", "a/b", "", ".", "a\\b", "x\x00y", ".hidden", "a..b"]
)
def test_unsafe_names_are_refused(name):
    with pytest.raises(BadInputError, match="plain name"):
        safe_name(name)


@pytest.mark.parametrize("name", ["smollm2-135m-derivative", "a", "run_1.v2"])
def test_plain_names_pass(name):
    assert safe_name(name) == name


def test_contained(tmp_path):
    assert contained(tmp_path, tmp_path / "a" / "b") == (tmp_path / "a" / "b").resolve()
    for bad in (tmp_path, tmp_path / ".." / "x", Path("/etc")):
        with pytest.raises(BadInputError, match="outside"):
            contained(tmp_path, bad)
    (tmp_path / "link").symlink_to("/tmp")
    with pytest.raises(BadInputError, match="outside"):
        contained(tmp_path, tmp_path / "link" / "x")


@pytest.mark.process
@pytest.mark.parametrize("name", ["SENTINEL", "../../victim"])
def test_derivative_name_outside_the_cache_dir_deletes_nothing(tmp_path, name):
    """The old bug: `finetune-derivative --name /abs/path` removed that folder. Now: exit 2, untouched."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    cache = tmp_path / "cache"
    arg = str(victim) if name == "SENTINEL" else name
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "KVLAB_CACHE_DIR": str(cache)}
    proc = subprocess.run(
        [sys.executable, "-m", "kvlab", "transfer", "finetune-derivative", "--name", arg, "--steps", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2 and "plain name" in proc.stderr and "Traceback" not in proc.stderr
    assert (victim / "precious.txt").read_text() == "keep me"
