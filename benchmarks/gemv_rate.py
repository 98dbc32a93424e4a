"""How fast do the served step's GEMVs read the weights, against the fastest one thread reads them?

A decode step of one conversation is a GEMV per weight: each weight is read once and used for one row.
``serve_decode.py`` puts kvlab's and llama-server's steps beside a floor (the weights' bytes at the
fastest rate one thread read a 1 GiB tensor); both take well over it. This script asks where the rest
goes, on the bundled model's own weights (SmolLM2-135M-Instruct, float32, one thread), in decode order
(every layer's q, k, v, o, gate, up and down, then the tied lm_head):

* ``inductor``: every weight through ``F.linear`` on one row, compiled as the served step compiles
  (``torch.compile(fullgraph=True)``, max-autotune, ``kvlab.hf.graphs.FROZEN_INDUCTOR``: the weights
  frozen and packed for inductor's C++ GEMM templates, the kernels called from its C++ wrapper);
* ``aten``: ``torch.mv`` per weight (PyTorch's own kernel);
* ``kvlab_gemv``: ``kvlab::gemv`` (``kvlab/kernels/gemv.cpp``, the operator the served step's one-row
  linears are routed to), which reads each weight as 16 sequential streams, each prefetching ahead of
  itself (how ``read_streams.c`` reads fastest), called per weight from Python;
* ``sum``: the same bytes as one flat tensor, summed by torch (one stream, no arithmetic to speak of);
* ``read_streams``: ``read_streams.c`` over that flat tensor, 8 streams prefetching 1,024 bytes ahead;
* ``step``: one greedy decode step of the served step itself (``compile_ab.py``'s: ``kvlab serve --capture
  compile``'s one-row graph, window 1024 + 4 sinks, a 40-token prompt): its GEMVs, and all the rest;
* ``step_unguarded``: the same step with Dynamo's guards not evaluated
  (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``; one graph, so none runs): what they cost;
* ``step_unchecked``: that, and kvlab's check of the model (``_ModelParts.same``) skipped too: what the two
  checks a step makes before its graph cost together. Measured here only: a step is never served so;
* ``template_step``: the served step with its one-row linears left to inductor's GEMM templates (the pass
  that routes them to ``kvlab::gemv`` off): what the operator changes in the step.

``--rounds`` rounds, each running every arm once over all the weights, the order rotating; per arm the
median and the rate; every arm paired per round against ``inductor`` (geometric mean of the ratios, a
95% t interval). The three GEMVs' outputs are checked against a float64 product first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Refusal, c_compiler, run_main, write_results  # noqa: E402
from compile_ab import compile_one  # noqa: E402
from serve_decode import _stream_reader, fmt_interval, paired  # noqa: E402

HERE = Path(__file__).resolve().parent


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-write", action="store_true", help="print, do not write the results file")
    args = ap.parse_args(argv)
    if not 5 <= args.rounds <= 200:
        raise Refusal(
            f"--rounds must be 5 to 200 (an interval over fewer than 5 is not given), not {args.rounds}"
        )
    if c_compiler() is None:
        raise Refusal("needs a C compiler ($CC, cc, gcc or clang) for read_streams.c")
    return args


def arms(handle, weights: list, xs: dict) -> tuple[dict[str, Callable[[], object]], dict[str, list]]:
    """The ways to read the weights, each a callable over all of them; and the GEMVs' outputs."""
    import torch

    from kvlab import kernels
    from kvlab.hf import graphs
    from kvlab.hf.graphs import FROZEN_INDUCTOR
    from kvlab.kernels import gemv as kernel_gemv
    from kvlab.serve.engine import EngineSettings

    class Linears(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ws = torch.nn.ParameterList([torch.nn.Parameter(w, requires_grad=False) for w in weights])

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
            return [torch.nn.functional.linear(a if w.shape[1] == a.shape[1] else b, w) for w in self.ws]

    rows = {k: x[None] for k, x in xs.items()}
    a, b = rows[576], rows[1536]
    compiled = torch.compile(Linears().eval(), fullgraph=True, dynamic=False, options={"max_autotune": True})

    def inductor() -> list[torch.Tensor]:
        with torch.no_grad(), torch._inductor.config.patch(FROZEN_INDUCTOR):
            return [y[0] for y in compiled(a, b)]

    ys = [torch.empty(w.shape[0]) for w in weights]
    gemv = kernel_gemv.op()
    if gemv is None:
        raise SystemExit(f"kvlab::gemv did not build: {kernels.why_not(kernel_gemv.KERNEL)}")

    def aten() -> list[torch.Tensor]:
        return [torch.mv(w, xs[w.shape[1]], out=y) for w, y in zip(weights, ys, strict=True)]

    def kvlab_gemv() -> list[torch.Tensor]:
        return [gemv(xs[w.shape[1]], w) for w in weights]

    flat = torch.cat([w.reshape(-1) for w in weights])
    reader = _stream_reader()
    if reader is None:
        raise SystemExit("read_streams.c did not build")
    outs = {"inductor": inductor(), "aten": aten(), "kvlab_gemv": kvlab_gemv()}
    policy = EngineSettings(window=1024, sinks=4, evict_chunk=64, max_batch=1).policy
    step = compile_one(handle, policy, dict(FROZEN_INDUCTOR))[0]
    template = compile_one(handle, policy, {**FROZEN_INDUCTOR, "pre_grad_custom_pass": None})[0]

    def unguarded() -> float:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return step(1)

    def unchecked() -> float:
        with mock.patch.object(graphs._ModelParts, "same", lambda self, model: True):
            return unguarded()

    return {
        "inductor": inductor,
        "aten": aten,
        "kvlab_gemv": kvlab_gemv,
        "sum": flat.sum,
        "read_streams": lambda: reader(flat.data_ptr(), flat.numel(), 8, 1024),
        "step": lambda: step(1),
        "step_unguarded": unguarded,
        "step_unchecked": unchecked,
        "template_step": lambda: template(1),
    }, outs


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import torch

    from kvlab import load_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    handle = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    model = handle.model
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if any(w.shape[1] % 16 for w in weights):
        raise SystemExit("a weight's row is not a multiple of 16 floats")
    nbytes = sum(w.numel() * 4 for w in weights)
    xs = {k: torch.randn(k) for k in sorted({w.shape[1] for w in weights})}
    t0 = time.perf_counter()
    fns, outs = arms(handle, weights, xs)
    compile_s = time.perf_counter() - t0
    errs = {}
    for name, ys in outs.items():
        errs[name] = max(
            (y.double() - w.double() @ xs[w.shape[1]].double()).abs().max().item()
            for y, w in zip(ys, weights, strict=True)
        )
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(args.rounds + 1):  # round 0 warms up, discarded
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t = time.perf_counter()
            fns[name]()
            if r:
                times[name].append(time.perf_counter() - t)
        if r:
            print(
                f"round {r}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in times.items()), flush=True
            )
    body = report(times, errs, nbytes, len(weights), compile_s)
    if args.no_write:
        print(body)
    else:
        write_results(
            "gemv_rate", "One thread's GEMVs over the bundled model's weights, against its fastest read", body
        )


def report(
    times: dict[str, list[float]], errs: dict[str, float], nbytes: int, n: int, compile_s: float
) -> str:
    import torch

    fastest = max(nbytes / statistics.median(v) for v in times.values())
    lines = [
        f"{n} weights, {nbytes / 1e6:.1f} MB of float32, one thread (PyTorch {torch.__version__}, "
        f"BLAS {torch.backends.mkl.is_available() and 'mkl' or 'other'}); {len(times['inductor'])} rounds, "
        f"the order rotating; inductor and the step compiled in {compile_s:.0f} s. Max |difference| from a float64 "
        "product: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()) + ".",
        "",
        "| arm | median ms | GB/s | share of the fastest read | / inductor (time) | 95% interval | per round |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, v in times.items():
        p = paired(v, times["inductor"])
        rate = nbytes / statistics.median(v)
        lines.append(
            f"| {name} | {statistics.median(v) * 1e3:.1f} | {rate / 1e9:.2f} | {rate / fastest:.0%} | "
            f"{p['geo']:.3f}x | {fmt_interval(p)} | {', '.join(f'{x * 1e3:.1f}' for x in v)} |"
        )
    checks = [name for name in times if name.startswith("step_") or name == "template_step"]
    if "step" in times and checks:
        lines += [
            "",
            "The step without its checks, and with inductor's templates for its linears (`template_step`), "
            "paired round by round against the step:",
            "",
        ]
        lines += [
            "| arm | / step (time) | 95% interval | ms saved (median of the rounds) |",
            "|---|---|---|---|",
        ]
        for name in checks:
            p = paired(times[name], times["step"])
            saved = statistics.median(a - b for a, b in zip(times["step"], times[name], strict=True))
            lines.append(f"| {name} | {p['geo']:.3f}x | {fmt_interval(p)} | {saved * 1e3:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    run_main(main)
