"""One live cache: a transformers ``Cache`` whose layers own their state and follow one rule.

Invariant: every layer of a :class:`LiveCache` follows the same rule object (``rule``: a
:class:`~kvlab.hf.rolling_cache.RollRule` for sinks + window, with or without a codec; a
:class:`~kvlab.hf.compressed_cache.CompressionRule` for scored layouts, codecs and shared budgets),
holds only what that rule keeps, and answers transformers' per-layer questions itself (length, query
offset, mask sizes). What the cache adds is the plumbing every kind shares, once:

* :meth:`bind`: the model's forward pre-hook (one per model) lets a left-padded batch run row by row
  (:meth:`start_rows`) and lets the cache open its own forward (:meth:`open_forward`: choose its
  positions, attend over packed codes or ragged heads for that forward only);
* :meth:`start_rows`: ``n`` caches of the same preset, one per row of a padded batch;
* ``packed_steps`` / ``packed_steps_by_path``: one-token steps whose attention read packed codes.

:class:`~kvlab.hf.rolling_cache.RollingCache` and :class:`~kvlab.hf.compressed_cache.CompressedCache`
are its presets: each builds its rule and layers (the in-place rolling buffers, the packed-code layers,
the ragged per-head layers) and adds what only its kind can do (``seed``/``hold_roll``/``checkpoint``
for a rolling window; ``close``/``held`` for an evicting cache). :func:`kvlab.hf.policy_cache.cache_for`
picks the preset a policy spec names.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from transformers.cache_utils import Cache

from kvlab.errors import BadInputError
from kvlab.hf.step import THREAD

Finish = Callable[[Any], None]


class LiveCache(Cache):
    """Layers that own their state, one ``rule`` they follow, and the shared plumbing (module docstring).

    A preset passes its layers, its rule, the config rows are built from, and ``preset``: its own
    keyword arguments, from which :meth:`start_rows` builds each row (``type(self)(config, **preset)``)."""

    rule: Any
    # kvlab's layer kinds (each preset narrows it): transformers types the list as its own kinds
    layers: list[Any]  # type: ignore[assignment]

    def __init__(self, layers: list[Any], rule: Any, config: Any, preset: dict[str, Any]) -> None:
        self.rule = rule
        self._config = config
        self._preset = preset
        self.rows: list[Any] | None = None  # per-row caches once a padded batch arrived (bind)
        self.packed_steps = 0  # one-token steps whose attention read the packed codes (bound, coded caches)
        self.packed_steps_by_path = {"kernel": 0, "torch": 0}
        super().__init__(layers=layers)

    @property
    def empty(self) -> bool:
        """Whether no token has been fed yet (rows can only start on an empty cache)."""
        return self.get_seq_length() == 0

    def bind(self, model: Any) -> None:
        """Bind this cache to ``model`` (in place): see :func:`bind_to_model`."""
        bind_to_model(self, model)

    def start_rows(self, n: int) -> list[Any]:
        """Switch this empty cache to ``n`` per-row caches of the same preset (a left-padded batch under
        ``model.generate``): each row keeps, evicts or quantizes its own tokens exactly as it would alone.
        In place; the rows are in :attr:`rows`."""
        if self.rows is not None or not self.empty:
            raise BadInputError(f"start_rows() needs an empty {type(self).__name__}")
        self._check_rows()
        self.rows = [self._new_row() for _ in range(n)]
        return self.rows

    def _check_rows(self) -> None:
        """Refuse a padded batch this preset cannot run row by row (nothing to refuse by default)."""

    def _new_row(self) -> LiveCache:
        return type(self)(self._config, **self._preset)

    def open_forward(self, model: Any, kwargs: dict) -> tuple[dict, Finish | None] | None:
        """Called by the bound model's pre-hook for a forward on this cache (not a padded batch): the
        forward's keyword arguments (changed or not) and what closes it, or None to leave it alone. By
        default the cache's own step (:meth:`begin_step`), if it opens one."""
        finish = self.begin_step(model, kwargs)
        return None if finish is None else (kwargs, finish)

    def begin_step(self, model: Any, kwargs: dict) -> Finish | None:
        """The cache's own attention for this forward (packed codes, ragged heads), or None (SDPA)."""
        return None

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].query_offset() if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx >= len(self.layers):  # transformers' convention for a layer the cache has not got
            return query_length, 0
        return self.layers[layer_idx].get_mask_sizes(query_length)


def bind_to_model(cache: Any, model: Any) -> None:
    """Bind a kvlab cache to ``model``: one forward pre-hook per model (shared by every cache bound to
    it) lets a left-padded batch run row by row on the cache (``cache.rows``, see
    :func:`kvlab.hf.batch.begin_padded_rows`) and the cache open its own forward
    (:meth:`LiveCache.open_forward`). Calls that carry no cache bound to this model pass untouched."""
    cache._bound_to = weakref.ref(model)
    if not getattr(model, "_kvlab_rolling_hooks", False):
        model.register_forward_pre_hook(_open_bound_forward, with_kwargs=True)
        model.register_forward_hook(_close_bound_forward, with_kwargs=True, always_call=True)
        model._kvlab_rolling_hooks = True


def _open_bound_forward(model: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of :func:`bind_to_model`."""
    stack = THREAD.calls
    stack.append(None)  # one entry per call, pushed first: the post-hook (always called) pops it
    key = "cache" if "cache" in kwargs else "past_key_values"
    cache: Any = kwargs.get(key)
    bound = getattr(cache, "_bound_to", None)
    if bound is None or bound() is not model:
        return None
    from kvlab.hf.batch import begin_padded_rows, end_padded_rows  # batch builds on this module

    padded = begin_padded_rows(model, cache, key, kwargs)
    if padded is not None:
        new_kwargs, state = padded
        stack[-1] = lambda out: end_padded_rows(state, out, failed=out is None)
        return args, new_kwargs
    opened = cache.open_forward(model, kwargs)
    if opened is None:
        return None
    new_kwargs, finish = opened
    stack[-1] = finish
    return None if new_kwargs is kwargs else (args, new_kwargs)


def _close_bound_forward(_model: Any, _args: tuple, _kwargs: dict, out: Any) -> None:
    stack = THREAD.calls
    finish = stack.pop() if stack else None
    if finish is not None:
        finish(out)
