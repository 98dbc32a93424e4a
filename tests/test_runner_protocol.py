"""``kvlab.hf.runner.Runner`` names what the adapter layer reads from a ``ModelHandle`` (``kvlab.hf`` sits
below ``kvlab.model``, so it cannot import the class): ``ModelHandle`` must keep satisfying it."""

from __future__ import annotations

import inspect

from kvlab.hf.runner import Runner
from kvlab.model.handle import ModelHandle

MEMBERS = {
    "model",
    "config",
    "device",
    "dtype",
    "rope",
    "rope_problem",
    "max_positions",
    "fingerprint",
    "run",
}


def _members() -> set[str]:
    return {name for name in vars(Runner) if not name.startswith("_")}


def test_the_protocol_names_what_hf_reads():
    assert _members() == MEMBERS


def test_a_model_handle_is_a_runner(tiny_model):
    h = tiny_model("llama")
    assert isinstance(h, ModelHandle)
    assert isinstance(h, Runner)
    assert not isinstance(h.model, Runner)  # a plain Hugging Face model is not (no run, rope, ...)


def test_every_member_exists_on_model_handle_as_declared(tiny_model):
    h = tiny_model("llama")
    for name in sorted(_members() - {"run"}):  # data members: attributes or properties, not methods
        assert hasattr(h, name), name
        assert not inspect.ismethod(getattr(h, name)), name
    assert callable(h.run)
    theirs = inspect.signature(ModelHandle.run).parameters
    for name, p in inspect.signature(Runner.run).parameters.items():
        assert name in theirs, name
        assert (theirs[name].kind, theirs[name].default) == (p.kind, p.default), name
    extra = [p for n, p in theirs.items() if n not in inspect.signature(Runner.run).parameters]
    assert all(p.default is not inspect.Parameter.empty for p in extra), extra  # callable as Runner.run
