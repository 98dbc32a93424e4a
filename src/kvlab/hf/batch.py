"""One decode step for several rolling caches at once: one batched forward, each cache updated in place.

Continuous batching (the server, :mod:`kvlab.serve`) decodes every live conversation together. Each
conversation owns a :class:`~kvlab.hf.RollingCache` holding a different number of tokens at
different positions. The step batches what batching makes cheaper and nothing else:

* **Linear layers run on all rows at once** (the weights are read once per step, not once per row).
  Each row's query sits at its own cache's ``next_position`` (per-row ``position_ids``).
* **Attention runs per row, on the row's own cache, in place.** A small transformers ``Cache``
  (:class:`RowsCache`) hands each row's new K/V to that row's :class:`~kvlab.hf.RollingLayer`
  (which applies its pending roll and writes the token into its buffer), and the step's attention
  (a :class:`~kvlab.hf.step.Step` answering kvlab's one registered attention function; no model code
  is patched) attends each row's single query to that row's visible keys. No row is padded and no cache is copied: a padded
  stack of four 1,000-token caches cost more than the forward itself (measured in
  ``benchmarks/serve.py``'s notes).

What each row computes equals that row's step alone up to the summation order of a batched matmul
(tested); a model whose attention this step cannot reproduce (logit soft-capping, learned attention
sinks, a forward that never calls transformers' attention interface) is refused, never guessed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.live_cache import LiveCache
from kvlab.hf.runner import Runner
from kvlab.hf.step import Step, causal_after, open_step

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


class RowsCache(Cache, Step):
    """The cache a batched step gives the model: ``update`` feeds each row's K/V to its own rolling layer.

    Row ``r``'s first ``pads[r]`` tokens are padding (a left-padded prompt): they never reach its cache.
    It returns the new K/V unchanged (nothing reads them: :meth:`attend` reads ``views``),
    and counts the layers whose views attention consumed, so a forward that bypassed the attention
    function is caught instead of returning logits computed from the new tokens alone.
    """

    def __init__(
        self, caches: Sequence[LiveCache], pads: Sequence[int] | None = None, outer: LiveCache | None = None
    ) -> None:
        super().__init__(layers=list(caches[0].layers))
        self.caches = list(caches)
        self.pads = list(pads) if pads is not None else [0] * len(self.caches)
        self.row_layers: list[list[Any]] = [list(c.layers) for c in caches]
        self.outer = outer  # the caller's cache when its rows run here (a padded batch): the query source
        self.views: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.consumed = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if key_states.shape[0] != len(self.caches):
            raise UnsupportedModelError("a batched rolling step needs one row per cache")
        # an evicting cache scores with the prompt's queries, captured on the caller's cache: each row
        # gets its own, pads stripped
        queries = getattr(self.outer.layers[layer_idx], "pending_queries", None) if self.outer else None
        views = []
        for r, (layers, p) in enumerate(zip(self.row_layers, self.pads, strict=True)):
            layer = layers[layer_idx]
            if queries is not None and not getattr(layer, "evicted", True):
                layer.pending_queries = queries[r : r + 1, p:]
            elif queries is None and getattr(layer, "pending_queries", None) is not None:
                # a decode step over separate caches that keep evicting by attention (every=): each cache's
                # query hook saw this forward's queries of every row; this row's are its own
                if layer.pending_queries.shape[0] != len(self.caches):
                    raise UnsupportedModelError(
                        "a batched step's queries did not reach every cache's query hook (one row each): "
                        "its attention-scored caches would score other rows' queries (discard them)"
                    )
                layer.pending_queries = layer.pending_queries[r : r + 1]
            views.append(
                layers[layer_idx].update(key_states[r : r + 1, :, p:], value_states[r : r + 1, :, p:])
            )
        self.views[layer_idx] = views
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(c.get_seq_length() for c in self.caches)

    def attend(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kw
    ) -> tuple[torch.Tensor, None]:
        """Attention of each row's one query over that row's own cached keys (grouped-query, no copy of K/V)."""
        if (
            getattr(module.config, "attn_logit_softcapping", None)
            or getattr(module, "sinks", None) is not None
        ):
            raise UnsupportedModelError(
                "batched rolling steps do not support attention soft-capping or learned sinks"
            )
        views = self.views.pop(module.layer_idx)
        n, heads, q_len, d = query.shape
        scale = kw.get("scaling") or d**-0.5
        window = kw.get("sliding_window") or getattr(module, "sliding_window", None)
        out = query.new_zeros((n, q_len, heads, d))  # padding queries attend to nothing: zeros
        for r, (k, v) in enumerate(views):
            kv_heads, p = k.shape[1], self.pads[r]
            if q_len - p == 1:  # one query (a decode step): no mask, no copy
                if (
                    window and k.shape[-2] > window
                ):  # a sliding layer: its last `window` slots, itself included
                    k, v = k[:, :, -int(window) :], v[:, :, -int(window) :]
                # query head h reads kv head h // groups
                q = query[r, :, -1].reshape(kv_heads, heads // kv_heads, d)
                w = torch.softmax((q @ k[0].transpose(-1, -2)) * scale, dim=-1, dtype=torch.float32)
                out[r, -1] = (w.to(v.dtype) @ v[0]).reshape(heads, d)
            else:
                out[r, p:] = _causal_rows_attention(query[r, :, p:], k[0], v[0], scale, window)
        self.consumed += 1
        return out, None


def _causal_rows_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    """``m`` new queries ``[heads, m, d]`` over one row's keys ``[kv_heads, K, d]`` whose last ``m`` are
    the queries' own tokens; slots are contiguous positions, so causality and a sliding window are
    slot distances. Returns ``[m, heads, d]``."""
    heads, m, d = q.shape
    kv_heads, K = k.shape[0], k.shape[1]
    qg = q.reshape(kv_heads, heads // kv_heads, m, d)
    scores = (qg @ k.transpose(-1, -2).unsqueeze(1)) * scale  # [kv_heads, groups, m, K]
    allowed = causal_after(m, K, q.device)
    if window:  # and at most `window` slots back: itself and the window - 1 before it
        at = torch.arange(m, device=q.device)[:, None] + (K - m)  # each query's own slot
        allowed &= torch.arange(K, device=q.device)[None, :] > at - int(window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return (w.to(v.dtype) @ v.unsqueeze(1)).reshape(heads, m, d).transpose(0, 1)


@contextlib.contextmanager
def rows_step(model: PreTrainedModel, rows: RowsCache) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for cache in rows.caches:  # each row's query sits at next_position: a re-base may follow
            choosing = getattr(cache, "choosing_positions", None)
            if choosing is not None:
                stack.enter_context(choosing())
        stack.callback(open_step(model, rows))
        yield


@torch.no_grad()
def step_rolling_rows(handle: Runner, caches: Sequence[LiveCache], tokens: Sequence[int]) -> torch.Tensor:
    """Feed ``tokens[r]`` to ``caches[r]`` for every row in one forward; returns ``[rows, vocab]`` logits.

    Writes into every cache (one token each; in place, like any decode step). If the forward fails
    part-way, some layers of the caches hold the token and others do not: discard them. A single row
    takes the plain path (:meth:`ModelHandle.run` on its own cache).
    """
    if len(caches) != len(tokens) or not caches:
        raise BadInputError(f"need one token per cache, got {len(tokens)} tokens for {len(caches)} caches")
    if len({id(c) for c in caches}) != len(caches):
        raise BadInputError("a cache appears twice in one batched step")
    layers = [list(c.layers) for c in caches]
    if any(not per_layer[0].is_initialized for per_layer in layers):
        raise BadInputError("every cache must hold a prompt before a batched decode step")
    if len(caches) == 1:
        out = handle.run(torch.tensor([[int(tokens[0])]], device=handle.device), caches[0], logits_to_keep=1)
        return out.logits[:, -1].float()
    rows = RowsCache(caches)
    # each row's next position: a rolling cache's (which may re-base), an evicting one's token count
    positions = torch.tensor([[c.get_seq_length()] for c in caches], dtype=torch.long, device=handle.device)
    ids = torch.tensor([[int(t)] for t in tokens], dtype=torch.long, device=handle.device)
    # a prepared 4-D mask keeps transformers from building one (attention is per row and needs none)
    mask = torch.zeros((len(caches), 1, 1, 1), dtype=handle.dtype, device=handle.device)
    with rows_step(handle.model, rows):
        out = handle.run(ids, rows, positions=positions, attention_mask=mask, logits_to_keep=1)
    if rows.consumed != len(layers[0]) or rows.views:
        raise UnsupportedModelError(
            f"{type(handle.model).__name__} did not attend through transformers' attention interface in every "
            "layer, so a batched rolling step cannot run on it (its caches are now inconsistent: discard them)"
        )
    return out.logits[:, -1].float()


# -- the server's safety nets: a prompt fed in pieces, a failed step undone ------------------------------


@torch.no_grad()
def step_rolling_rows_isolated(
    handle: Runner, caches: Sequence[LiveCache], tokens: Sequence[int]
) -> list[torch.Tensor | Exception]:
    """:func:`step_rolling_rows`, where a row that fails fails alone: per row, its ``[vocab]`` logits or the
    exception it raised (its cache may then hold part of the step: discard it).

    The rows run in one batched forward; if that raises, every cache is put back as it was before the
    step (:meth:`~kvlab.hf.live_cache.LiveCache.checkpoint`) and each row runs on its own, so only the rows that fail alone fail. A model
    the batched step cannot run (:class:`~kvlab.errors.UnsupportedModelError`) fails every row, as it would
    at every step. While steps succeed this costs a copy of the layers' attributes per row.
    """
    if len(caches) > 1:  # one row runs alone (below) at once
        undo = [c.checkpoint() for c in caches]
        try:
            logits = step_rolling_rows(handle, caches, tokens)
            return [logits[i] for i in range(len(caches))]
        except UnsupportedModelError as exc:
            return [exc] * len(caches)
        except Exception:
            log.warning(
                "a batched decode step failed; running its %d rows one by one", len(caches), exc_info=True
            )
        for restore in undo:
            restore()
    out: list[torch.Tensor | Exception] = []
    for cache, token in zip(caches, tokens, strict=True):
        try:
            out.append(step_rolling_rows(handle, [cache], [token])[0])
        except Exception as exc:
            out.append(exc)
    return out
