"""Drive a sweep: validate, key every cell, skip finished ones on --resume, run the rest, report."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from kvlab.errors import BadInputError
from kvlab.study.sweep.cells import is_done, load_spec
from kvlab.study.sweep.grid import Cell, cell_key, load_grid


def run_sweep(
    grid_path: str | Path,
    out: str | Path,
    *,
    ray: str | None = None,
    resume: bool = False,
    workers: int | None = None,
    log: Callable[[str], None] = lambda msg: None,
) -> dict:
    """Run every cell of the grid into ``out`` (``out/cells/<cell>/``, ``out/index.html``,
    ``out/result.json``) and return the sweep's result document."""
    grid = load_grid(grid_path)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise BadInputError(f"--out {out} is a file, not a folder")
    if (out / "cells").exists() and not resume:
        raise BadInputError(
            f"{out} already holds a sweep; pass --resume to finish it, or choose another --out"
        )
    if workers is not None and workers < 1:
        raise BadInputError(f"--workers must be >= 1, got {workers}")
    fingerprints = {}
    for spec in grid.models:  # loading validates every model before anything is written
        fingerprints[spec] = load_spec(spec).fingerprint
    cells = [
        Cell(c.model, c.experiment, c.options, c.seed, c.text, c.profile, cell_key(c, fingerprints[c.model]))
        for c in grid.cells
    ]
    (out / "cells").mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if not is_done(out / "cells" / c.folder_name, c.key)]
    log(f"{len(cells)} cells, {len(cells) - len(todo)} already done, {len(todo)} to run")
    started = time.perf_counter()

    def done(doc: dict) -> None:
        log(
            f"  {doc['status']:>8}  {doc['model']}  {doc['experiment']}  seed {doc['seed']}  {doc['seconds']} s"
        )

    if todo:
        if ray:
            from kvlab.study.sweep.ray_backend import run_ray

            run_ray(todo, str(out), ray, done)
        else:
            from kvlab.study.sweep.local import run_local

            n = workers or min(len(todo), os.cpu_count() or 1)
            run_local(todo, str(out), n, done)
    docs = []
    for c in cells:
        try:
            docs.append(json.loads((out / "cells" / c.folder_name / "cell.json").read_text()))
        except (OSError, ValueError):
            docs.append({**c.to_json(), "status": "missing", "summary": {}, "headline": [], "finding": ""})
    from kvlab.study.sweep.report import write_sweep_report

    result = {
        "grid": str(grid.source),
        "backend": f"ray:{ray}" if ray else "local",
        "cells": docs,
        "ran": len(todo),
        "skipped": len(cells) - len(todo),
        "seconds": round(time.perf_counter() - started, 2),
        "failed": [d["key"] for d in docs if d["status"] not in ("ok", "not_applicable")],
    }
    write_sweep_report(out, result)
    return result
