"""Drive a sweep: validate, key every cell, skip finished ones on --resume, run the rest, report."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.errors import BadInputError
from kvlab.progress import Counter, Estimate, Mode, counting
from kvlab.study.sweep.cells import is_done, load_spec
from kvlab.study.sweep.grid import Cell, Grid, cell_key, load_grid

if TYPE_CHECKING:
    from kvlab.study.sweep.ray_backend import RayCluster


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
    from kvlab.model.loading import check_device_name, parse_dtype

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
    cluster: RayCluster | None = None
    if ray:
        from kvlab.study.sweep.ray_backend import RayCluster, check_ray_device

        check_ray_device(device)
        cluster = RayCluster(ray)
    try:
        device, gpus, here = _devices(cluster, device, grid.gpus_per_actor)
        cells = _keyed_cells(grid, here, device, dtype)
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
        _run_cells(cells, todo, out, cluster, device, gpus, workers, progress)
    finally:
        if cluster is not None:
            cluster.close()
    from kvlab.study.sweep.report import write_sweep_report

    docs = [_cell_doc(out, c) for c in cells]
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


def _devices(cluster: RayCluster | None, device: str, asked_gpus: float | None) -> tuple[str, float, str]:
    """The cells' device, the GPUs each Ray actor asks for (0 locally), and the device this process
    loads the models on to read their fingerprints."""
    if cluster is None:
        from kvlab.model.loading import resolve_device

        device = resolve_device(device)
        return device, 0.0, device
    from kvlab.study.sweep.ray_backend import gpus_per_actor_for

    device = cluster.device_for(device)
    gpus = gpus_per_actor_for(device, asked_gpus)
    cluster.check_gpus(gpus)
    return device, gpus, "cpu"  # the driver only reads fingerprints; the actors load their own copies


def _keyed_cells(grid: Grid, here: str, device: str, dtype: str) -> list[Cell]:
    """The grid's cells, keyed and placed; loading each model (on ``here``) validates it before anything
    is written."""
    fingerprints = {spec: load_spec(spec, here, dtype).fingerprint for spec in grid.models}
    return [c.placed(cell_key(c, fingerprints[c.model], device, dtype), device, dtype) for c in grid.cells]


def _run_cells(
    cells: list[Cell],
    todo: list[Cell],
    out: Path,
    cluster: RayCluster | None,
    device: str,
    gpus: float,
    workers: int | None,
    progress: Mode,
) -> None:
    """Run ``todo`` on the Ray ``cluster`` or in local worker processes, counting cells done of all."""
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


def _cell_doc(out: Path, c: Cell) -> dict:
    """A cell's ``cell.json``, or a ``missing`` record where it wrote none."""
    try:
        return json.loads((out / "cells" / c.folder_name / "cell.json").read_text())
    except (OSError, ValueError):
        return {**c.to_json(), "status": "missing", "summary": {}, "headline": [], "finding": ""}


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
