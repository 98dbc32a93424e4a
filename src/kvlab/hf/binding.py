"""Binding a live cache to its model: the one place a kvlab cache reaches into a model's forward.

Invariant: a bound cache is a :class:`~kvlab.hf.live_cache.LiveCache` that remembers its model (weakly);
the model carries one forward pre-hook and one post-hook (:func:`bind_to_model`, once per model, shared
by every cache bound to it), and a forward that carries no cache bound to *that* model passes untouched.
For a forward on a bound cache the hook does one of three things, and undoes it when the forward ends
(the post-hook always runs):

* a left-padded batch runs row by row, each row on its own cache of the same settings, as alone
  (:func:`begin_padded_rows`, :func:`end_padded_rows`);
* a cache that re-positions tokens (``rule.chooses_positions``: a rolling window) drops positions that
  just continue its token count (what ``model.generate`` passes), so that it chooses them and may re-base;
* the cache's own attention step, if its storage needs one (packed codes, ragged heads:
  :func:`kvlab.hf.cache_steps.open_cache_step`).

Data: the cache's ``_bound_to``; the model's two hooks; one entry per hooked call on
:data:`kvlab.hf.step.THREAD` ``.calls`` (what closes it, or None).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.batch import RowsCache, rows_step
from kvlab.hf.cache_steps import Finish, open_cache_step
from kvlab.hf.live_cache import LiveCache
from kvlab.hf.step import THREAD

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def bind_to_model(cache: LiveCache, model: PreTrainedModel) -> None:
    """Bind a kvlab cache to ``model`` (in place): one forward pre-hook per model (shared by every cache
    bound to it) lets a left-padded batch run row by row on the cache (``cache.rows``, see
    :func:`begin_padded_rows`) and the cache choose its positions and open its own attention step
    (module docstring). Calls that carry no cache bound to this model pass untouched."""
    cache._bound_to = weakref.ref(model)
    if not getattr(model, "_kvlab_rolling_hooks", False):
        model.register_forward_pre_hook(_open_bound_forward, with_kwargs=True)
        model.register_forward_hook(_close_bound_forward, with_kwargs=True, always_call=True)
        # nn.Module types its attributes as tensors or modules; a plain flag is stored all the same
        model._kvlab_rolling_hooks = True  # type: ignore[assignment]


def _open_bound_forward(model: PreTrainedModel, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of :func:`bind_to_model`."""
    stack = THREAD.calls
    stack.append(None)  # one entry per call, pushed first: the post-hook (always called) pops it
    key = "cache" if "cache" in kwargs else "past_key_values"
    cache = kwargs.get(key)
    bound = getattr(cache, "_bound_to", None)
    if not isinstance(cache, LiveCache) or bound is None or bound() is not model:
        return None
    padded = begin_padded_rows(model, cache, key, kwargs)
    if padded is not None:
        new_kwargs, state = padded
        stack[-1] = lambda out: end_padded_rows(state, out, failed=out is None)
        return args, new_kwargs
    opened = _open_forward(cache, model, kwargs)
    if opened is None:
        return None
    new_kwargs, finish = opened
    stack[-1] = finish
    return None if new_kwargs is kwargs else (args, new_kwargs)


def _close_bound_forward(_model: PreTrainedModel, _args: tuple, _kwargs: dict, out: Any) -> None:
    stack = THREAD.calls
    finish = stack.pop() if stack else None
    if finish is not None:
        finish(out)


def _open_forward(
    cache: LiveCache, model: PreTrainedModel, kwargs: dict
) -> tuple[dict, Finish | None] | None:
    """A forward on a bound cache (not a padded batch): its keyword arguments (changed or not) and what
    closes it, or None to leave it alone.

    A cache that re-positions tokens (``rule.chooses_positions``) drops the positions a forward brings
    when they just continue its token count (what ``generate`` passes), so that it chooses them (it may
    re-base: :meth:`~kvlab.hf.live_cache.LiveCache.choosing_positions`, for that forward only); positions
    the caller chose otherwise are left alone. Then the cache's own step, if its storage needs one."""
    if not cache.rule.chooses_positions:
        own_step = open_cache_step(cache, model, kwargs)
        return None if own_step is None else (kwargs, own_step)
    pos = kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor):
        rows = pos.reshape(-1, pos.shape[-1])
        start = cache.tokens_seen
        if not bool((rows == torch.arange(start, start + rows.shape[-1], device=rows.device)).all()):
            return None  # positions the caller chose: not ours to replace
    ctx = cache.choosing_positions()
    ctx.__enter__()
    try:
        finish_step = open_cache_step(cache, model, kwargs)
    except BaseException:
        ctx.__exit__(None, None, None)
        raise

    def finish(out: Any) -> None:
        try:
            if finish_step is not None:
                finish_step(out)
        finally:
            ctx.__exit__(None, None, None)

    return {**kwargs, "position_ids": None}, finish


# -- padded batches under model.generate (a bound cache runs each row on its own cache) ----------------


def begin_padded_rows(
    model: PreTrainedModel, cache: LiveCache, key: str, kwargs: dict
) -> tuple[dict, tuple[Any, RowsCache, LiveCache]] | None:
    """Set up a forward of a left-padded batch on ``cache`` (bound to ``model``; a
    :class:`~kvlab.hf.RollingCache` or :class:`~kvlab.hf.CompressedCache`): each row runs on its own
    cache of the same settings (``cache.rows``) with its pads stripped and its own positions, so
    every row computes what it would alone (its own sinks, rolls and re-bases; its own eviction, scored
    by its own queries, at its own budget). Returns the call's new kwargs and a context
    to close after the forward, or None when the call is not a padded batch (and the cache holds no
    rows). Refuses right padding and rows of padding only.
    """
    ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    rows_caches = cache.rows
    if rows_caches is None:
        if (
            not isinstance(mask, torch.Tensor)
            or mask.dim() != 2
            or bool(mask.all())
            or cache.get_seq_length()
        ):
            return None  # not padded, or padding on a cache the rows already share: the cache refuses it
        if not isinstance(ids, torch.Tensor) or ids.shape != mask.shape:
            raise BadInputError(
                "a padded batch on a kvlab cache needs input_ids with one mask column per token"
            )
        pads = []
        for row in mask.to(torch.long):
            p = int((row == 0).sum())
            if p == row.numel() or not (bool((row[:p] == 0).all()) and bool((row[p:] == 1).all())):
                raise BadInputError(
                    "kvlab's caches run left-padded batches only (pads first, then the row's tokens; "
                    "tokenizer.padding_side = 'left'), and every row needs at least one token"
                )
            pads.append(p)
        rows_caches = cache.start_rows(len(pads))
    else:
        if not isinstance(ids, torch.Tensor) or ids.shape[0] != len(rows_caches):
            raise BadInputError(
                f"this cache runs {len(rows_caches)} padded rows; the call brings another batch"
            )
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask[:, -ids.shape[-1] :].all()):
            raise BadInputError("new padding after the prompt: kvlab caches pad only the start of each row")
        pads = [0] * len(rows_caches)
    rows = RowsCache(rows_caches, pads, outer=cache)
    n = int(ids.shape[-1])
    positions = torch.zeros((len(pads), n), dtype=torch.long, device=ids.device)
    for r, (c, p) in enumerate(zip(rows_caches, pads, strict=True)):
        start = c.get_seq_length()
        positions[r, p:] = torch.arange(start, start + n - p, device=ids.device)
    new = {
        **kwargs,
        key: rows,
        "position_ids": positions,
        # a prepared 4-D mask keeps transformers from building one (attention is per row and needs none)
        "attention_mask": torch.zeros((len(pads), 1, 1, 1), dtype=model.dtype, device=ids.device),
    }
    ctx = rows_step(model, rows)
    ctx.__enter__()
    return new, (ctx, rows, cache)


def end_padded_rows(state: tuple[Any, RowsCache, LiveCache], out: Any, failed: bool) -> None:
    """Close what :func:`begin_padded_rows` opened; check every layer attended per row; hand the caller
    back its own cache in the output (generate carries ``outputs["cache"]`` to the next step)."""
    ctx, rows, cache = state
    ctx.__exit__(None, None, None)
    close = getattr(cache, "close", None)  # the caller's query hooks: the rows evicted with their queries
    if close is not None:
        close()
    if failed:
        return
    if rows.consumed != len(rows.row_layers[0]) or rows.views:
        raise UnsupportedModelError(
            "the model did not attend through transformers' attention interface in every layer, so a padded "
            "batch cannot run row by row with it (the cache is now inconsistent: discard it)"
        )
    for name in ("cache", "past_key_values"):
        if isinstance(out, dict) and out.get(name) is rows:
            out[name] = cache
