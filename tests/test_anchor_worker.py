"""benchmarks/anchors/anchor_worker.py's dispatch: each job kind reaches its runner; an unknown kind is refused.

A job without a ``kind`` (benchmarks/compression.py's, before it named one) once reached ``job["kind"]``
and died with a KeyError in the worker's own venv, so the compression benchmark ran with no kvpress rows.
The runners are replaced here: no kvpress, no model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "anchors"))
import anchor_worker  # noqa: E402


@pytest.mark.parametrize(
    ("job", "runner"),
    [
        ({}, "compression_main"),  # no kind: the compression job
        ({"kind": "compression"}, "compression_main"),
        ({"kind": "ruler"}, "ruler_main"),
        ({"kind": "snapkv_slots"}, "snapkv_slots_main"),
    ],
)
def test_each_kind_reaches_its_runner(job, runner, tmp_path, monkeypatch):
    called = []
    for name in ("compression_main", "ruler_main", "snapkv_slots_main"):
        monkeypatch.setattr(anchor_worker, name, lambda j, out, name=name: called.append((name, j, out)))
    path = tmp_path / "job.json"
    path.write_text(json.dumps({**job, "model_dir": "x"}))
    anchor_worker.main(str(path), str(tmp_path / "out.json"))
    assert called == [(runner, {**job, "model_dir": "x"}, str(tmp_path / "out.json"))]


def test_an_unknown_kind_is_refused_in_one_line(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"kind": "perplexity"}))
    with pytest.raises(SystemExit, match="unknown job kind 'perplexity'"):
        anchor_worker.main(str(path), str(tmp_path / "out.json"))
