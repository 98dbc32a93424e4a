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


def run_local(cells: Sequence[Cell], out_root: str, workers: int, done: Callable[[dict], None]) -> list[dict]:
    if workers <= 1:
        out = []
        for c in cells:
            out.append(run_cell(c.to_json(), out_root))
            done(out[-1])
        return out
    results = []
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=mp.get_context("spawn"), initializer=_init
    ) as pool:
        futures = [pool.submit(run_cell, c.to_json(), out_root) for c in cells]
        for f in as_completed(futures):
            results.append(f.result())
            done(results[-1])
    return results
