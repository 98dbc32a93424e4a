"""Drive a sweep: validate, key every cell, skip finished ones on --resume, run the rest, report."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from kvlab.errors import BadInputError
from kvlab.progress import Counter, Estimate, Mode, counting
from kvlab.study.sweep.cells import is_done, load_spec
from kvlab.study.sweep.grid import Cell, cell_key, load_grid


def run_sweep(
    grid_path: str | Path,
    out: str | Path,
    *,
    ray: str | None = None,
    resume: bool = False,
    workers: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
    log: Callable[[str], None] = lambda msg: None,
    progress: Mode = "off",
) -> dict:
    """Run every cell of the grid into ``out`` (``out/cells/<cell>/``, ``out/index.html``,
    ``out/result.json``) and return the sweep's result document.

    ``device`` and ``dtype`` (a command line's ``--device``/``--dtype``) override the grid's. Locally the
    device is resolved on this machine (``auto``: CUDA when there is one; one worker on CUDA unless
    ``workers`` says otherwise); on Ray, ``auto`` is ``cuda`` when the cluster has GPUs, and each actor
    asks Ray for ``gpus_per_actor`` GPUs (1 on CUDA unless the grid says otherwise). ``progress``
    (:func:`kvlab.progress.choose_mode`) shows the cells done of all on stderr, with an estimate of the
    time left (:func:`_cell_counter`)."""
    from kvlab.model.loading import check_device_name, parse_dtype, resolve_device

    grid = load_grid(grid_path)
    device = check_device_name(device) if device else grid.device
    dtype = str(parse_dtype(dtype)).removeprefix("torch.") if dtype else grid.dtype
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise BadInputError(f"--out {out} is a file, not a folder")
    if (out / "cells").exists() and not resume:
        raise BadInputError(
            f"{out} already holds a sweep; pass --resume to finish it, or choose another --out"
        )
    if workers is not None and workers < 1:
        raise BadInputError(f"--workers must be >= 1, got {workers}")
    cluster: Any = None
    gpus = 0.0
    if ray:
        from kvlab.study.sweep.ray_backend import RayCluster, check_ray_device, gpus_per_actor_for

        check_ray_device(device)
        cluster = RayCluster(ray)
    try:
        if cluster is not None:
            device = cluster.device_for(device)
            gpus = gpus_per_actor_for(device, grid.gpus_per_actor)
            cluster.check_gpus(gpus)
            here = "cpu"  # the driver only reads fingerprints; the actors load their own copies
        else:
            device = here = resolve_device(device)
        fingerprints = {}
        for spec in grid.models:  # loading validates every model before anything is written
            fingerprints[spec] = load_spec(spec, here, dtype).fingerprint
        cells = [
            c.placed(cell_key(c, fingerprints[c.model], device, dtype), device, dtype) for c in grid.cells
        ]
        try:
            (out / "cells").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BadInputError(
                f"--out {out}: cannot create the sweep folder ({exc.strerror or exc})"
            ) from None
        todo = [c for c in cells if not is_done(out / "cells" / c.folder_name, c.key)]
        log(
            f"{len(cells)} cells on {device} in {dtype}, {len(cells) - len(todo)} already done, {len(todo)} to run"
        )
        started = time.perf_counter()
        default = 1 if device.startswith("cuda") else min(len(todo), os.cpu_count() or 1)
        at_once = int(cluster.cpus) if cluster is not None else workers or default
        with _cell_counter(cells, todo, progress, at_once, out) as counter:

            def done(doc: dict) -> None:
                label = f"{doc['model']} {doc['experiment']} seed {doc['seed']}"
                counter.done(doc["key"], float(doc["seconds"]), doc["status"], label=label)

            if todo and cluster is not None:
                from kvlab.study.sweep.ray_backend import run_ray

                run_ray(todo, str(out), cluster, done, gpus_per_actor=gpus)
            elif todo:
                from kvlab.study.sweep.local import run_local

                run_local(todo, str(out), workers or default, done)
    finally:
        if cluster is not None:
            cluster.close()
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
        "device": device,
        "dtype": dtype,
        "gpus_per_actor": gpus,
        "cells": docs,
        "ran": len(todo),
        "skipped": len(cells) - len(todo),
        "seconds": round(time.perf_counter() - started, 2),
        "failed": [d["key"] for d in docs if d["status"] not in ("ok", "not_applicable")],
    }
    write_sweep_report(out, result)
    return result


def _cell_counter(
    cells: list[Cell], todo: list[Cell], mode: Mode, at_once: int, out: Path
) -> AbstractContextManager[Counter]:
    """Cells done of all (those a resumed sweep holds count as done), with an estimate of the time left:
    each cell weighs its experiment's typical seconds in its profile (``kvlab.study.runner.TYPICAL_SECONDS``),
    scaled by what the finished cells took (their ``cell.json`` seconds); ``at_once`` cells run together."""
    from kvlab.study.runner import TYPICAL_SECONDS

    weights = {}
    for c in cells:
        typical = TYPICAL_SECONDS.get(c.profile, {}).get(c.experiment)
        if typical is not None:
            weights[c.key] = float(typical)
    waiting, kept = {c.key for c in todo}, {}
    for c in cells:
        if c.key not in waiting:
            try:
                kept[c.key] = float(
                    json.loads((out / "cells" / c.folder_name / "cell.json").read_text())["seconds"]
                )
            except (OSError, ValueError, KeyError, TypeError):
                kept[c.key] = weights.get(c.key, 0.0)  # no bearing on the estimate's scale
    return counting(
        "sweep",
        [c.key for c in cells],
        mode=mode,
        estimate=Estimate(weights, seconds=True, parallel=max(1, at_once)),
        finished=kept,
        detail="cells",
    )
