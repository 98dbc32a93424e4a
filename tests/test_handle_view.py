"""``kvlab.cache.handle_view.HandleView`` names what ``kvlab.cache`` and ``kvlab.policy`` read from a
``ModelHandle`` (they sit below ``kvlab.model``, so they cannot import the class): a handle must keep
satisfying it (mypy checks the types in ``kvlab.model.handle``; this checks the members at run time)."""

from __future__ import annotations

import inspect

from kvlab.cache.handle_view import HandleView
from kvlab.model.handle import ModelHandle

METHODS = ("prefill", "run", "forward")  # forward: a score's extra pass over a snapshot (kvzip)
MEMBERS = {"name", "fingerprint", "facts", "dtype", "device", "rope", "config", "model", *METHODS}


def test_the_protocol_names_what_the_lower_layers_read():
    assert {name for name in vars(HandleView) if not name.startswith("_")} == MEMBERS


def test_a_model_handle_is_a_view(tiny_model):
    h = tiny_model("llama")
    assert isinstance(h, ModelHandle) and isinstance(h, HandleView)
    assert not isinstance(h.model, HandleView)  # a plain Hugging Face model is not (no prefill, facts, ...)
    for name in sorted(MEMBERS - set(METHODS)):
        assert not inspect.ismethod(getattr(h, name)), name
    for method in METHODS:
        theirs = inspect.signature(getattr(ModelHandle, method)).parameters
        ours = inspect.signature(getattr(HandleView, method)).parameters
        assert all(n in theirs or "kw" in theirs for n in ours), method
