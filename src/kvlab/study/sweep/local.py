"""The local backend: a process pool, one torch thread per worker, each model loaded once per worker."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

from kvlab.study.sweep.cells import run_cell
from kvlab.study.sweep.grid import Cell


def _init() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_local(cells: Sequence[Cell], out_root: str, workers: int, done: Callable[[dict], None]) -> None:
    """Run ``cells`` here one after another, or in ``workers`` spawned processes; ``done`` gets each
    cell's document as it finishes."""
    if workers <= 1:
        for c in cells:
            done(run_cell(c.to_json(), out_root))
        return
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=mp.get_context("spawn"), initializer=_init
    ) as pool:
        for f in as_completed([pool.submit(run_cell, c.to_json(), out_root) for c in cells]):
            done(f.result())
