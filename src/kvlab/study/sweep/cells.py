"""Running one cell: load (or reuse) its model, run the experiment into a temp folder, rename it."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.study.sweep.grid import Cell

if TYPE_CHECKING:
    from kvlab.model.handle import ModelHandle

_MODELS: dict[tuple[str, str, str], ModelHandle] = {}  # per worker process: each model is loaded once


def load_spec(spec: str, device: str = "cpu", dtype: str = "float32") -> ModelHandle:
    """A ModelHandle for ``spec`` on ``device`` in ``dtype``: ``tiny:<config.json>`` (random weights,
    seed 0, the bundled model's tokenizer so text experiments run) or anything ``load_model`` takes."""
    from kvlab.model.loading import parse_dtype, resolve_device

    device = resolve_device(device)
    key = (spec, device, dtype)
    if key in _MODELS:
        return _MODELS[key]
    if spec.startswith("tiny:"):
        from transformers import AutoTokenizer

        from kvlab.model.handle import ModelHandle
        from kvlab.model.loading import bundled_model_dir
        from kvlab.model.random import tiny_random_model

        tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir(), local_files_only=True)
        tiny = tiny_random_model(spec.removeprefix("tiny:"), seed=0, vocab=len(tokenizer))
        model = tiny.model.to(device=device, dtype=parse_dtype(dtype))
        handle = ModelHandle(model, tokenizer, name=f"tiny-{Path(spec.removeprefix('tiny:')).stem}")
    else:
        from kvlab.model import load_model

        handle = load_model(spec, device=device, dtype=dtype)
    _MODELS[key] = handle
    return handle


def is_done(folder: Path, key: str) -> bool:
    """A finished cell: its folder holds cell.json with the same key and status ok."""
    try:
        doc = json.loads((folder / "cell.json").read_text())
    except (OSError, ValueError):
        return False
    return doc.get("key") == key and doc.get("status") == "ok"


def run_cell(cell_json: dict, out_root: str, extra: dict | None = None) -> dict:
    """Run one cell into ``<out_root>/cells/<folder>`` atomically (temp folder + rename): a worker killed
    midway leaves only a hidden temp folder, never a cell that --resume would take as done. The model is
    loaded on the cell's device in its dtype; ``extra`` (what a Ray actor was given) goes into cell.json."""
    import torch

    from kvlab.study.experiments import ExperimentContext, get_experiment
    from kvlab.study.runner import run_experiment

    torch.set_num_threads(int(os.environ.get("KVLAB_SWEEP_THREADS", "1")))
    cell = Cell.from_json(cell_json)
    cells_dir = Path(out_root) / "cells"
    final = cells_dir / cell.folder_name
    if is_done(final, cell.key):
        return json.loads((final / "cell.json").read_text())
    tmp = cells_dir / f".{cell.folder_name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir(parents=True)
    started = time.perf_counter()
    handle = load_spec(cell.model, cell.device, cell.dtype)
    ctx = ExperimentContext(
        out_dir=tmp,
        profile=cell.profile,
        seed=cell.seed,
        model_spec=cell.model,
        dtype=cell.dtype,
        device=cell.device,
        options=dict(cell.options),
        model_handle=handle,
    )
    try:
        result = run_experiment(get_experiment(cell.experiment), ctx)
        status, error = result.status, None
        summary = json.loads((tmp / "result.json").read_text())
    except Exception as exc:  # a failed cell is recorded, and the sweep carries on
        status, error, summary = "failed", f"{type(exc).__name__}: {exc}", {}
    doc = {
        **cell.to_json(),
        "model_name": handle.name,
        "fingerprint": handle.fingerprint,
        "ran_on": ctx.device_info(),
        **(extra or {}),
        "status": status,
        "error": error,
        "seconds": round(time.perf_counter() - started, 2),
        "summary": summary.get("summary", {}),
        "finding": summary.get("finding", ""),
        "smoke_result": summary.get("smoke_result", ""),
        "headline": summary.get("headline", []),
        "folder": f"cells/{cell.folder_name}",
    }
    (tmp / "cell.json").write_text(json.dumps(doc, indent=1, default=str))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return doc
