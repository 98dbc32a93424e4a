"""The Ray backend: one actor per model keeps it loaded; cells are actor calls, retried on failure.

Actors restart up to ``MAX_RESTARTS`` times when their process dies (a node lost, a kill -9) and a
call interrupted that way is retried up to ``MAX_TASK_RETRIES`` times; a cell that raises inside the
experiment is not retried (it is recorded as failed). Each actor asks for one CPU and, when the grid
runs on CUDA (or sets ``gpus_per_actor``), for that many GPUs (:func:`actor_options`), so Ray places as
many as the cluster has room for, across nodes, and gives each its own GPU (it sets the actor's
``CUDA_VISIBLE_DEVICES``, so the actor's ``cuda`` is the GPU it was given).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from collections.abc import Callable, Sequence
from typing import Any

from kvlab.errors import BadInputError
from kvlab.study.sweep.grid import Cell

MAX_RESTARTS = 3
MAX_TASK_RETRIES = 3
#: Seconds the driver waits for a Ray address to answer before giving up (Ray's own connect retries
#: for minutes on an address where nothing listens).
CONNECT_TIMEOUT_S = 5.0

_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$"
)


def parse_ray_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a Ray address (``host:port``, ``ray://host:port``, ``[ipv6]:port``), or None for
    ``auto`` and ``local`` (Ray finds or starts the cluster itself); a BadInputError for anything else:
    no port, a port outside 1-65535, or a host that is no IP address or hostname (``256.0.0.1``)."""
    text = address.strip()
    if text in ("auto", "local"):
        return None
    form = "a Ray address is host:port, ray://host:port, auto or local"
    rest = text.removeprefix("ray://")
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([^:\[\]/\s]+):(\d{1,5})", rest)
    if not match:
        raise BadInputError(f"--ray {address!r}: {form}")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if not 1 <= port <= 65535:
        raise BadInputError(f"--ray {address!r}: port {port} is not in 1-65535")
    if match.group(1) is not None or re.fullmatch(r"[\d.]+", host):
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise BadInputError(f"--ray {address!r}: {host} is not an IP address") from None
    elif not _HOSTNAME.match(host):
        raise BadInputError(f"--ray {address!r}: {host!r} is not a host name")
    return host, port


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse, within ``timeout`` seconds, a Ray address where nothing accepts a connection (Ray itself
    would retry for minutes). ``auto`` and ``local`` are left to Ray."""
    where = parse_ray_address(address)
    if where is None:
        return
    host, port = where
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except TimeoutError:
        raise BadInputError(
            f"cannot connect to the Ray cluster at {address!r}: no answer within {timeout:g} s"
        ) from None
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise BadInputError(f"cannot connect to the Ray cluster at {address!r}: {reason}") from None


def actor_options(gpus_per_actor: float) -> dict[str, Any]:
    """What each cell actor asks Ray for: one CPU, and ``gpus_per_actor`` GPUs (a fraction shares one)."""
    options: dict[str, Any] = {"num_cpus": 1}
    if gpus_per_actor > 0:
        options["num_gpus"] = gpus_per_actor
    return options


def check_ray_device(device: str) -> None:
    """On Ray a device is ``auto``, ``cpu`` or ``cuda``: Ray picks each actor's GPU, so an index is refused."""
    if device.startswith("cuda:"):
        raise BadInputError(
            f'device {device!r}: on Ray write device = "cuda" (Ray gives each actor its own GPU)'
        )


def gpus_per_actor_for(device: str, asked: float | None) -> float:
    """The GPUs each actor asks for: the grid's ``gpus_per_actor``, else 1 for a CUDA device, else 0.
    A CUDA device with no GPU per actor is refused (the actor would find no GPU it may use)."""
    check_ray_device(device)
    gpus = (1.0 if device == "cuda" else 0.0) if asked is None else asked
    if device == "cuda" and gpus <= 0:
        raise BadInputError('device = "cuda" on Ray needs gpus_per_actor > 0 (each actor its GPU)')
    return gpus


class RayCluster:
    """A connection to a Ray cluster (``address``, ``auto`` or ``local``), closed by :meth:`close`."""

    def __init__(self, address: str) -> None:
        check_reachable(address)  # a malformed or silent address is one line within seconds
        try:
            import ray
        except ImportError:
            raise BadInputError("--ray needs Ray: pip install 'kvlab[ray]'") from None
        self.ray, self.address = ray, address
        try:
            ray.init(
                address=None if address == "local" else address,
                ignore_reinit_error=True,
                log_to_driver=False,
                logging_level=logging.WARNING,  # not "connecting to ..." on stderr: errors stay one line
            )
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise BadInputError(f"cannot connect to the Ray cluster at {address!r}: {exc}") from None
        resources = ray.cluster_resources()
        self.cpus = max(1, int(resources.get("CPU", 1)))
        self.gpus = float(resources.get("GPU", 0))

    def device_for(self, device: str) -> str:
        """``auto`` on the cluster: ``cuda`` when it has GPUs, else ``cpu`` (resolved here, on the
        driver, so every cell's key names the device it runs on)."""
        if device == "auto":
            return "cuda" if self.gpus > 0 else "cpu"
        return device

    def check_gpus(self, gpus_per_actor: float) -> None:
        if gpus_per_actor > self.gpus:
            raise BadInputError(
                f"the grid asks for {gpus_per_actor:g} GPU(s) per actor and the Ray cluster at "
                f"{self.address!r} has {self.gpus:g}"
            )

    def close(self) -> None:
        self.ray.shutdown()


def run_ray(
    cells: Sequence[Cell],
    out_root: str,
    cluster: RayCluster,
    done: Callable[[dict], None],
    gpus_per_actor: float = 0.0,
) -> None:
    """Run ``cells`` on ``cluster``: per model, actors that keep it loaded on the cells' device, each
    asking Ray for :func:`actor_options`; ``done`` gets each cell's document as it finishes."""
    ray = cluster.ray
    cluster.check_gpus(gpus_per_actor)

    @ray.remote(max_restarts=MAX_RESTARTS, max_task_retries=MAX_TASK_RETRIES)
    class CellWorker:
        def __init__(self, spec: str, device: str, dtype: str):
            import os

            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from kvlab.study.sweep.cells import load_spec

            load_spec(spec, device, dtype)

        def run(self, cell_json: dict, out_root: str) -> dict:
            import ray

            from kvlab.study.sweep.cells import run_cell

            context = ray.get_runtime_context()
            given = {"node": context.get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}
            return run_cell(cell_json, out_root, extra={"ray": given})

    slots = cluster.cpus
    if gpus_per_actor > 0:
        slots = min(slots, max(1, int(cluster.gpus // gpus_per_actor)))
    by_model: dict[tuple[str, str, str], list[Cell]] = {}
    for c in cells:
        by_model.setdefault((c.model, c.device, c.dtype), []).append(c)
    per = max(1, slots // max(1, len(by_model)))
    options = actor_options(gpus_per_actor)
    refs = []
    for (spec, device, dtype), group in by_model.items():
        actors = [
            # Ray's stub types a @ray.remote class as the class itself, without .options
            CellWorker.options(**options).remote(spec, device, dtype)  # type: ignore[attr-defined]
            for _ in range(min(per, len(group)))
        ]
        refs += [actors[i % len(actors)].run.remote(c.to_json(), out_root) for i, c in enumerate(group)]
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        done(ray.get(ready[0]))
