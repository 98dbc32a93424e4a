"""The Ray backend: one actor per model keeps it loaded; cells are actor calls, retried on failure.

Actors restart up to ``MAX_RESTARTS`` times when their process dies (a node lost, a kill -9) and a
call interrupted that way is retried up to ``MAX_TASK_RETRIES`` times; a cell that raises inside the
experiment is not retried (it is recorded as failed). Each actor asks for one CPU, so Ray places as
many as the cluster has room for, across nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvlab.errors import BadInputError
from kvlab.study.sweep.grid import Cell

MAX_RESTARTS = 3
MAX_TASK_RETRIES = 3


def run_ray(
    cells: Sequence[Cell],
    out_root: str,
    address: str,
    done: Callable[[dict], None],
    actors_per_model: int = 0,
) -> list[dict]:
    try:
        import ray
    except ImportError:
        raise BadInputError("--ray needs Ray: pip install 'kvlab[ray]'") from None

    @ray.remote(num_cpus=1, max_restarts=MAX_RESTARTS, max_task_retries=MAX_TASK_RETRIES)
    class CellWorker:
        def __init__(self, spec: str):
            import os

            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from kvlab.study.sweep.cells import load_spec

            self.spec = spec
            load_spec(spec)

        def run(self, cell_json: dict, out_root: str) -> dict:
            from kvlab.study.sweep.cells import run_cell

            return run_cell(cell_json, out_root)

    try:
        ray.init(
            address=None if address == "local" else address, ignore_reinit_error=True, log_to_driver=False
        )
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise BadInputError(f"cannot connect to the Ray cluster at {address!r}: {exc}") from None
    try:
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        by_model: dict[str, list[Cell]] = {}
        for c in cells:
            by_model.setdefault(c.model, []).append(c)
        per = actors_per_model or max(1, cpus // max(1, len(by_model)))
        refs = []
        for spec, group in by_model.items():
            actors = [CellWorker.remote(spec) for _ in range(min(per, len(group)))]
            refs += [actors[i % len(actors)].run.remote(c.to_json(), out_root) for i, c in enumerate(group)]
        results = []
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            results.append(ray.get(ready[0]))
            done(results[-1])
        return results
    finally:
        ray.shutdown()
