"""``kvlab::gemv`` (kvlab/kernels/gemv.cpp) and the pass that routes the frozen CPU step's one-row linears
to it: the operator equals ``F.linear`` on every shape it takes, the pass touches only what it takes,
and without a C++ compiler nothing is routed."""

from __future__ import annotations

import pytest
import torch

from kvlab import kernels
from kvlab.hf.graphs import FROZEN_INDUCTOR
from kvlab.kernels import gemv

pytestmark = pytest.mark.process  # a C++ compiler runs (once per machine and torch)


@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [
        ((1,), 576, 576),
        ((1, 1), 49, 1536),
        ((3,), 7, 16),
        ((2, 2), 1, 32),
        ((1,), 4, 64),
        ((1, 1, 1), 1000, 48),
    ],
)
def test_gemv_equals_linear(rows, n, k):
    op = gemv.op()
    assert op is not None, kernels.why_not(gemv.KERNEL)
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(*rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    ref = (x.double() @ w.double().T).float()
    torch.testing.assert_close(op(x, w), ref, rtol=1e-5, atol=1e-5)


def test_gemv_takes_a_strided_row():
    op = gemv.op()
    assert op is not None
    x = torch.randn(48, 2)[:, 1]  # one row, every other float
    w = torch.randn(5, 48)
    assert not x.is_contiguous()
    torch.testing.assert_close(op(x, w), w @ x, rtol=1e-5, atol=1e-5)


def test_gemv_refuses_what_it_does_not_take():
    op = gemv.op()
    assert op is not None
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.randn(1, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op(torch.randn(1, 20), torch.randn(4, 20))
    with pytest.raises(RuntimeError, match="last size"):
        op(torch.randn(1, 32), torch.randn(4, 16))


class _Linears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.plain = torch.nn.Linear(64, 96, bias=False)
        self.biased = torch.nn.Linear(96, 64, bias=True)
        self.odd = torch.nn.Linear(20, 8, bias=False)  # rows of 20: not a multiple of 16

    def forward(self, x: torch.Tensor, many: torch.Tensor, small: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.biased(self.plain(x)), self.plain(many), self.odd(small), self.plain(x.double().float())


def _graph(m: torch.nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    """The graph Dynamo hands a backend (nodes carry their example values), before any inductor pass."""
    got: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, _inputs: list[torch.Tensor]):
        got.append(gm)
        return gm.forward

    torch.compile(m, backend=backend, fullgraph=True, dynamic=False)(*args)
    return got[0]


def test_the_pass_routes_one_row_linears_without_bias_only():
    m = _Linears().eval()
    args = (torch.randn(1, 1, 64), torch.randn(2, 64), torch.randn(1, 20))
    gm = _graph(m, *args)
    gemv.ROUTE(gm.graph)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(gemv.op()) == 2  # plain(x) and plain(x.double().float()): one row each
    assert sum(t in gemv.ROUTE.LINEARS for t in targets) == 3  # biased, two rows, rows of 20


def test_the_frozen_step_calls_gemv_and_equals_eager():
    m = _Linears().eval()
    args = (torch.randn(1, 1, 64), torch.randn(2, 64), torch.randn(1, 20))
    assert gemv.settings()
    with torch.no_grad(), torch._inductor.config.patch({**gemv.settings(), **FROZEN_INDUCTOR}):
        step = torch.compile(m, fullgraph=True, dynamic=False)
        step(*args)  # compiled here
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = step(*args)
    assert sum(e.count for e in prof.key_averages() if e.key == "kvlab::gemv") == 2
    for got, want in zip(out, m(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_a_cxx_compiler_nothing_is_routed(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(kernels, "_LOADED", {})
    monkeypatch.setattr(kernels, "_ERRORS", {})
    monkeypatch.setattr(gemv, "_OP", [])
    assert gemv.op() is None and gemv.settings() == {}
    assert "no-such-compiler" in (kernels.why_not(gemv.KERNEL) or "")
    assert not list(tmp_path.glob("kernels/*.so"))


def test_gemv_on_several_threads_equals_linear():
    """With several threads each takes a block of rows (at::parallel_for): the same products."""
    op = gemv.op()
    assert op is not None
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(7)
        x, w = torch.randn(1, 64, generator=g), torch.randn(5000, 64, generator=g)  # several blocks of rows
        ref = (x.double() @ w.double().T).float()
        torch.testing.assert_close(op(x, w), ref, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)
