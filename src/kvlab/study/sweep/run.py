"""Drive a sweep: validate, key every cell, skip finished ones on --resume, run the rest, report."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlab.errors import BadInputError
from kvlab.study.sweep.cells import is_done, load_spec
from kvlab.study.sweep.grid import cell_key, load_grid


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
) -> dict:
    """Run every cell of the grid into ``out`` (``out/cells/<cell>/``, ``out/index.html``,
    ``out/result.json``) and return the sweep's result document.

    ``device`` and ``dtype`` (a command line's ``--device``/``--dtype``) override the grid's. Locally the
    device is resolved on this machine (``auto``: CUDA when there is one; one worker on CUDA unless
    ``workers`` says otherwise); on Ray, ``auto`` is ``cuda`` when the cluster has GPUs, and each actor
    asks Ray for ``gpus_per_actor`` GPUs (1 on CUDA unless the grid says otherwise)."""
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

        def done(doc: dict) -> None:
            log(
                f"  {doc['status']:>8}  {doc['model']}  {doc['experiment']}  seed {doc['seed']}  {doc['seconds']} s"
            )

        if todo and cluster is not None:
            from kvlab.study.sweep.ray_backend import run_ray

            run_ray(todo, str(out), cluster, done, gpus_per_actor=gpus)
        elif todo:
            from kvlab.study.sweep.local import run_local

            default = 1 if device.startswith("cuda") else min(len(todo), os.cpu_count() or 1)
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
