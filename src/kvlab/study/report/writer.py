"""Writing results: ``result.json`` (summary, tables, figures, manifest), ``arrays.npz`` (raw arrays)."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from kvlab.study.experiments.base import ExperimentResult


def run_dir(base: str | Path, name: str) -> Path:
    """``<base>/<name>-<YYYYmmdd-HHMMSS>`` (a numeric suffix if that exists), created."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(base)
    path = base / f"{name}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = base / f"{name}-{stamp}-{n}"
    path.mkdir(parents=True)
    return path


def manifest(
    *,
    model: Any = None,
    model_spec: str = "",
    profile: str = "",
    seed: int = 0,
    started: float | None = None,
    extra: dict | None = None,
) -> dict:
    """Who, what, where: enough to re-run the result (command, versions, model fingerprint, seed)."""
    import torch
    import transformers

    import kvlab

    out: dict[str, Any] = {
        "command": " ".join(["kvlab", *sys.argv[1:]])
        if Path(sys.argv[0]).name == "kvlab"
        else " ".join(sys.argv),
        "model_spec": model_spec,
        "profile": profile,
        "seed": seed,
        "versions": {
            "kvlab": kvlab.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "written": datetime.now().isoformat(timespec="seconds"),
    }
    if started is not None:
        out["duration_s"] = round(time.perf_counter() - started, 2)
    if model is not None:
        out["model"] = {
            "name": model.name,
            "fingerprint": model.fingerprint,
            "dtype": str(model.dtype).replace("torch.", ""),
            "rope": model.rope.summary() if model.rope else None,
        }
    if extra:
        out.update(extra)
    return out


def to_jsonable(value: Any) -> Any:
    """Numbers, lists and dicts only; NaN/inf become None (strict JSON)."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, (np.floating, float)):
        f = float(value)
        return f if math.isfinite(f) else None
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.bool_,)):
        return bool(value)
    if hasattr(value, "tolist"):  # torch tensors
        return to_jsonable(value.tolist())
    if isinstance(value, Path):
        return str(value)
    return value


def write_result(result: ExperimentResult, out_dir: Path, manifest_data: dict) -> Path:
    """Write ``result.json`` (+ ``arrays.npz`` when there are arrays) into ``out_dir``; returns the JSON path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arrays_file = None
    if result.arrays:
        arrays_file = "arrays.npz"
        arrays = {k: np.asarray(v) for k, v in result.arrays.items()}
        # numpy's stub types **kwds against its allow_pickle flag too
        np.savez_compressed(out_dir / arrays_file, **arrays)  # type: ignore[arg-type]
    # A quick-profile result is a smoke run: its sentence is kept as ``smoke_result``, never as a finding.
    smoke = manifest_data.get("profile") == "quick"
    doc = {
        "name": result.name,
        "title": result.title,
        "status": result.status,
        "description": result.description,
        "evidence": "smoke run (quick profile): not a finding" if smoke else "finding",
        "finding": "" if smoke else result.finding,
        "smoke_result": result.finding if smoke else "",
        "headline": [list(row) for row in result.headline],
        "summary": result.summary,
        "tables": [t.to_json() for t in result.tables],
        "figures": [{"file": f.filename, "caption": f.caption} for f in result.figures],
        "notes": result.notes,
        "data_sources": result.data_sources,
        "arrays": {"file": arrays_file, "shapes": {k: list(np.shape(v)) for k, v in result.arrays.items()}},
        "manifest": manifest_data,
    }
    path = out_dir / "result.json"
    tmp = path.with_name(".result.json.tmp")
    tmp.write_text(json.dumps(to_jsonable(doc), indent=2, allow_nan=False))
    tmp.replace(path)
    return path
