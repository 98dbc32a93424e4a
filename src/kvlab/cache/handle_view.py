"""What the packages below :mod:`kvlab.model` read from a :class:`~kvlab.model.ModelHandle`, as a ``Protocol``.

``kvlab.cache`` and ``kvlab.policy`` sit below ``kvlab.model`` (``tests/test_layering.py``), so they
cannot import ``ModelHandle``; :func:`kvlab.cache.io.load_snapshot`, :func:`kvlab.policy.observe`,
:func:`~kvlab.policy.evict.learned.train_evictor` and :func:`kvlab.policy.measure.time_decode_ms`
take a :class:`HandleView` instead, so the type checker sees every member they read. ``ModelHandle``
satisfies it (checked by mypy in ``kvlab.model.handle`` and by ``tests/test_handle_view.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from kvlab.cache.snapshot import KVSnapshot
    from kvlab.rope.spec import Rope


class CacheFacts(Protocol):
    """The model facts that fix a cache's geometry and its token ids' range (``ModelFacts``)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...


class Prefilled(Protocol):
    """A prefill's result (``kvlab.model.Forward``): the cache it made and its logits."""

    @property
    def snapshot(self) -> KVSnapshot: ...

    @property
    def logits(self) -> torch.Tensor: ...


@runtime_checkable
class HandleView(Protocol):
    """A model handle as ``kvlab.cache`` and ``kvlab.policy`` use it: exactly the members read there.

    * ``name``, ``fingerprint``, ``facts``, ``dtype``, ``device``, ``rope``: :func:`load_snapshot`'s model check;
    * ``model``, ``rope``, ``prefill``: :func:`kvlab.policy.observe` (and the evictor training over it);
      ``forward``: a score's extra pass after an observed context (:meth:`~kvlab.policy.Observation.probe`);
    * ``run``, ``device``, ``config``: :func:`kvlab.policy.measure.time_decode_ms`.
    """

    @property
    def name(self) -> str: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def facts(self) -> CacheFacts: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def rope(self) -> Rope | None: ...

    @property
    def config(self) -> Any: ...  # the Hugging Face model's config

    @property
    def model(self) -> torch.nn.Module: ...  # the Hugging Face model

    def prefill(self, tokens: list[int] | torch.Tensor, *, all_logits: bool = ...) -> Prefilled: ...

    def forward(
        self, tokens: list[int] | torch.Tensor, past: KVSnapshot | None = ..., *, all_logits: bool = ...
    ) -> Prefilled:
        """``tokens`` fed after ``past`` (:meth:`kvlab.model.ModelHandle.forward`): its snapshot holds both."""
        ...

    def run(
        self, input_ids: torch.Tensor, cache: Any = None, *, positions: torch.Tensor | None = None
    ) -> Any:
        """One forward of ``input_ids`` on a live ``cache`` (:meth:`kvlab.model.ModelHandle.run`)."""
        ...
