"""What the adapter layer reads from a :class:`~kvlab.model.ModelHandle`, as a ``typing.Protocol``.

``kvlab.hf`` sits below ``kvlab.model`` (``tests/test_layering.py``), so it cannot import
``ModelHandle``; every function here that gets one takes a :class:`Runner` instead (``Runner |
PreTrainedModel`` where a plain Hugging Face model is taken too, e.g.
:func:`~kvlab.hf.rolling_cache.rolling_cache_for`), so the type checker sees every member read and a
rename on ``ModelHandle`` cannot silently send a handle down a plain-model path. ``ModelHandle``
satisfies it structurally (``tests/test_runner_protocol.py``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from kvlab.rope.spec import Rope


@runtime_checkable
class Runner(Protocol):
    """A model runner as ``kvlab.hf`` uses it: exactly the members read from a handle there.

    * ``model``, ``device``, ``dtype``, ``run``: :func:`kvlab.hf.batch.step_rolling_rows`,
      :class:`kvlab.hf.graphs.RollingDecoder` (``run``'s ``attention_kwargs``);
    * ``config``, ``fingerprint``, ``run`` (with ``stop_after_layer``): :mod:`kvlab.hf.masked`;
    * ``model``, ``config``, ``rope``, ``max_positions``, ``rope_problem``:
      :func:`kvlab.hf.rolling_cache.rolling_cache_for` (and through it
      :func:`kvlab.policy.cache_for`, which reads ``model`` and ``config``).
    """

    @property
    def model(self) -> Any:
        """The Hugging Face model."""
        ...

    @property
    def config(self) -> Any:
        """The model's config."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def rope(self) -> Rope | None:
        """The model's RoPE (None without RoPE, or with one kvlab cannot read: see ``rope_problem``)."""
        ...

    @property
    def rope_problem(self) -> str | None: ...

    @property
    def max_positions(self) -> int: ...

    @property
    def fingerprint(self) -> str:
        """The model's identity (architecture, config, weights): a snapshot from another is refused."""
        ...

    def run(
        self,
        input_ids: torch.Tensor,
        cache: Any = None,
        *,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
        logits_to_keep: int = 0,
        stop_after_layer: int | None = None,
        attention_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """One forward of ``input_ids`` on a live ``cache`` (:meth:`kvlab.model.ModelHandle.run`)."""
        ...
