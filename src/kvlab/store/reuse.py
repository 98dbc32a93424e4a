"""Reusing stored caches in generation, and forking one shared context into many continuations.

:func:`prefill_with_store` is the memoised prefill: look up the longest stored prefix, run the model
on the remaining tokens only (``handle.extend``), optionally store the new blocks. Because K/V of a
token depend only on the tokens before it, the result equals a full prefill up to floating-point
summation order (tested against one). When the whole prompt is stored, the last token is
recomputed anyway: its logits are needed and are not stored.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import BadInputError
from kvlab.model.handle import as_handle
from kvlab.store.store import KVStore, Match, PutReport

if TYPE_CHECKING:
    from kvlab.model.handle import ModelHandle


@dataclass(frozen=True)
class StoredPrefill:
    """A prefill that used the store.

    Attributes:
        snapshot: the cache of the whole prompt.
        last_logits: ``[vocab]`` next-token logits after the prompt.
        match: what the store supplied (``match.cached_tokens`` slots were loaded, not computed).
        lookup_ms / compute_ms / ttft_ms: store lookup, forward pass on the rest, and their sum.
        stored: what putting the prompt's cache wrote (None when not stored).
    """

    snapshot: KVSnapshot
    last_logits: torch.Tensor
    match: Match
    lookup_ms: float
    compute_ms: float
    stored: PutReport | None = None

    @property
    def ttft_ms(self) -> float:
        return self.lookup_ms + self.compute_ms

    @property
    def cached_tokens(self) -> int:
        return self.match.cached_tokens


@dataclass(frozen=True)
class ReuseResult:
    prefill: StoredPrefill
    token_ids: list[int]
    text: str


def _ids(handle: ModelHandle, prompt: str | Sequence[int], chat: bool) -> list[int]:
    ids = handle.encode(prompt, chat=chat) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise BadInputError("empty prompt: give text or at least one token id")
    return ids


def prefill_with_store(
    handle: ModelHandle,
    store: KVStore,
    prompt: str | Sequence[int],
    *,
    chat: bool = False,
    salt: str | None = None,
    store_prompt: bool = True,
) -> StoredPrefill:
    """Prefill ``prompt``, loading its longest stored prefix and computing only the rest.

    ``handle``: a :class:`~kvlab.model.ModelHandle` or a plain Hugging Face causal LM (then give token
    ids, or wrap it with its tokenizer: ``kvlab.model.as_handle(model, tokenizer)``)."""
    handle = as_handle(handle)
    ids = _ids(handle, prompt, chat)
    ns = store.namespace(handle, salt=salt)
    t0 = time.perf_counter()
    match = store.lookup(ids, ns, max_tokens=len(ids) - 1, device=handle.device)
    t1 = time.perf_counter()
    rest = ids[match.cached_tokens :]
    fwd = (
        handle.extend(match.snapshot, rest, all_logits=False)
        if match.snapshot is not None
        else handle.prefill(ids, all_logits=False)
    )
    t2 = time.perf_counter()
    report = store.put(fwd.snapshot, salt=salt, model=handle) if store_prompt else None
    return StoredPrefill(fwd.snapshot, fwd.logits[-1], match, (t1 - t0) * 1000, (t2 - t1) * 1000, report)


def reuse_generate(
    handle: ModelHandle,
    store: KVStore,
    prompt: str | Sequence[int],
    max_new_tokens: int = 32,
    *,
    chat: bool = False,
    salt: str | None = None,
    store_prompt: bool = True,
    stop_at_eos: bool = True,
) -> ReuseResult:
    """Greedy generation whose prompt prefill reuses the store (and feeds it, unless ``store_prompt=False``)."""
    handle = as_handle(handle)
    pre = prefill_with_store(handle, store, prompt, chat=chat, salt=salt, store_prompt=store_prompt)
    gen = handle.generate(pre.snapshot, pre.last_logits, max_new_tokens, stop_at_eos=stop_at_eos)
    return ReuseResult(prefill=pre, token_ids=gen.token_ids, text=gen.text)


def fork(
    handle: ModelHandle,
    base: KVSnapshot,
    continuations: Sequence[str | Sequence[int]],
    max_new_tokens: int = 16,
    *,
    stop_at_eos: bool = True,
) -> list[Any]:
    """Many agents continue from one shared context; returns one ``Generation`` per continuation.

    ``base`` is shared read-only: it is never copied up front and never written (``handle.forward``
    does not modify its past), so each agent's result equals prefilling base + its own text. Each
    agent's own snapshot holds its own tensors once it has run (transformers concatenates the past
    with the new tokens), so the memory an agent adds is its own cache while it is alive.
    """
    handle = as_handle(handle)
    if not continuations:
        raise BadInputError("fork needs at least one continuation")
    out = []
    for c in continuations:
        ids = _ids(handle, c, False) if isinstance(c, str) else [int(t) for t in c]
        if not ids:
            raise BadInputError("each continuation needs at least one token")
        fwd = handle.extend(base, ids, all_logits=False)
        out.append(handle.generate(fwd.snapshot, fwd.logits[-1], max_new_tokens, stop_at_eos=stop_at_eos))
    return out
