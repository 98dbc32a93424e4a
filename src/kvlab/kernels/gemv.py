"""The compiled CPU step's one-row linears through ``kvlab::gemv`` (``gemv.cpp``).

A decode step of one conversation reads every weight once for one row: it is bound by how fast the
weights are read. One thread reads memory fastest as many sequential streams at once, each prefetching
ahead of itself; ``gemv.cpp`` reads each weight's rows as 16 such streams (a thread's block of rows, with
several threads). In the served step of the bundled model (one thread) that is faster than inductor's
frozen GEMM templates, paired against them in ``benchmarks/results/serve_decode.md`` (the commit before)
and ``gemv_rate.md``. :data:`ROUTE` is an inductor
graph pass the frozen CPU step runs before its graph is lowered (``kvlab.hf.graphs``): it sends each
``F.linear`` without bias whose input is one float32 row on the CPU, with rows of a multiple of 16, to
``kvlab::gemv``; everything else (several rows, a bias, another dtype or device) stays inductor's.

The operator is built on first use by :mod:`kvlab.kernels` (a C++ compiler and the running torch's
headers; about ten seconds on 2 cores, once per machine and torch); without one, :func:`settings` is
empty and the step keeps inductor's GEMVs: the same products, summed in another order.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from kvlab import kernels

log = logging.getLogger(__name__)
KERNEL = "gemv"
_LOCK = threading.Lock()
_OP: list[torch._ops.OpOverload | None] = []  # [] before the first try; [op] or [None] after


def op() -> torch._ops.OpOverload | None:
    """``torch.ops.kvlab.gemv.default``, built and registered on the first call; None where it cannot
    be built (:func:`kvlab.kernels.why_not` says why)."""
    with _LOCK:
        if not _OP:
            found = None
            if kernels.load(KERNEL) is not None:  # loading the library registers the operator
                found = torch.ops.kvlab.gemv.default
                torch.library.register_fake("kvlab::gemv")(_shape)
            else:
                log.info(
                    "kvlab::gemv unavailable (%s): the step keeps inductor's GEMVs", kernels.why_not(KERNEL)
                )
            _OP.append(found)
        return _OP[0]


def _shape(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _routed(x: object, w: object) -> bool:
    """Whether ``F.linear(x, w)`` (no bias) is one float32 row on the CPU that ``kvlab::gemv`` takes."""
    return (
        isinstance(x, torch.Tensor)
        and isinstance(w, torch.Tensor)
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and w.ndim == 2
        and x.ndim >= 1
        and x.shape[-1] == w.shape[1]
        and w.shape[1] % 16 == 0
        and x.numel() == w.shape[1]  # one row
    )


class _Route(CustomGraphPass):
    """The pre-grad pass: one-row ``F.linear`` nodes without bias become ``kvlab::gemv`` nodes."""

    LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)

    def __call__(self, graph: torch.fx.Graph) -> None:
        gemv = op()
        if gemv is None:
            return
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in self.LINEARS:
                continue
            args = list(node.args) + [node.kwargs.get("bias")] * (3 - len(node.args))
            x, w, bias = args[0], args[1], args[2]
            if bias is not None or set(node.kwargs) - {"bias"}:
                continue
            value = [getattr(a, "meta", {}).get("example_value") for a in (x, w)]
            if _routed(*value):
                node.target, node.args, node.kwargs = gemv, (x, w), {}

    def uuid(self) -> bytes:
        source = (Path(kernels.__file__).parent / f"{KERNEL}.cpp").read_bytes() + Path(__file__).read_bytes()
        return hashlib.sha256(source).digest()


ROUTE = _Route()


def settings() -> dict[str, object]:
    """Inductor settings that route the step's one-row linears to ``kvlab::gemv`` (empty without it)."""
    return {"pre_grad_custom_pass": ROUTE} if op() is not None else {}
