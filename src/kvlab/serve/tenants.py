"""Fair shares between the tenants of ``kvlab serve``: one queue per tenant, admitted by deficit round-robin.

A tenant is an API key (without keys, every client is one tenant, as for the caches). The engine's waiting
requests are a :class:`FairQueue`: one FIFO per tenant, and when a decode slot frees, the next request is
picked by deficit round-robin over the tenants, weighed in tokens of work (prompt tokens plus
``max_new_tokens``, as the virtual token counter of Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024, counts them), so a tenant with a thousand requests waiting is served in turn with one
that has one.
Each tenant is also held to :class:`KeyLimits`: requests open (queued + running), requests running at once
(its share of the batch) and tokens of work in flight. A request over its tenant's caps is refused at once
(:class:`KeyLimitError`, a 429 with ``Retry-After``); one that could never fit them
(:class:`WorkTooLargeError`, a 400) is refused as such. A flood from one key thus raises that key's 429s, not
the others'. See docs/serving.md ("Fair shares").
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvlab.errors import KvlabError


class QueueFullError(KvlabError):
    """More requests are waiting than the server accepts (HTTP 429)."""


class KeyLimitError(QueueFullError):
    """The tenant (API key) already has its share open: requests or tokens of work (HTTP 429)."""


class WorkTooLargeError(KvlabError):
    """A request asks for more work than one tenant may ever have in flight (HTTP 400)."""


class Work(Protocol):
    """What the queue needs of a request: its tenant, its cost in tokens, whether it was cancelled."""

    @property
    def tenant(self) -> str: ...

    @property
    def cost(self) -> int: ...

    def is_cancelled(self) -> bool: ...


W = TypeVar("W", bound=Work)


@dataclass(frozen=True)
class KeyLimits:
    """Per-tenant caps (None: only the server's own limits apply)."""

    max_open: int | None = None  # requests queued + running
    max_batch: int | None = None  # requests running (prefilling or decoding) at once
    max_work: int | None = None  # tokens (prompt + max_new_tokens) of the requests queued + running


def default_key_limits(
    *,
    keys: int,
    max_queue: int,
    max_batch: int,
    max_prompt_tokens: int,
    max_tokens: int,
    max_open: int | None = None,
    max_batch_per_key: int | None = None,
    max_work: int | None = None,
) -> KeyLimits:
    """The caps ``kvlab serve`` runs with: those given, else the defaults.

    With two keys or more, a key may hold half the places (``(max_queue + max_batch) // 2`` open requests,
    so it never fills the queue while other keys exist) and all decode slots but one (so another key's
    request finds a free slot at the next iteration). With one key or none there is one tenant: only the
    server's own limits apply. Work in flight: twice the largest request of one prompt
    (``2 * (max_prompt_tokens + max_tokens)``), with or without keys."""
    shared = keys >= 2
    if max_open is None and shared:
        max_open = max(1, (max_queue + max_batch) // 2)
    if max_batch_per_key is None and shared:
        max_batch_per_key = max(1, max_batch - 1)
    if max_work is None:
        max_work = 2 * (max_prompt_tokens + max_tokens)
    return KeyLimits(max_open, max_batch_per_key, max_work)


def tenant_label(key: str) -> str:
    """The tenant's name in metrics and scheduling: 12 hex digits of a hash of its key (never the key)."""
    return hashlib.sha256(b"kvlab-tenant-label|" + key.encode()).hexdigest()[:12]


class FairQueue(Generic[W]):
    """The requests waiting for the engine, one FIFO per tenant, admitted by deficit round-robin.

    Not thread-safe: the engine calls it under its own lock. ``max_queue`` bounds the requests waiting in
    all; ``limits`` bound each tenant's (see :class:`KeyLimits`).
    """

    def __init__(self, *, max_queue: int, limits: KeyLimits) -> None:
        self.max_queue, self.limits = max_queue, limits
        # tenants with requests waiting, in round-robin order (the next to be served first)
        self._queues: collections.OrderedDict[str, collections.deque[W]] = collections.OrderedDict()
        self._deficit: dict[str, int] = {}
        # id -> request the engine serves (``running``, ``take``, ``release``)
        self._running: dict[int, W] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[W]:
        return (item for q in self._queues.values() for item in q)

    # -- offering -------------------------------------------------------------------------------------
    def check(self, tenant: str, requests: int, work: int) -> None:
        """Raise unless ``requests`` more requests of ``tenant`` holding ``work`` tokens fit now: the queue
        (:class:`QueueFullError`), the tenant's caps (:class:`KeyLimitError`), or ever
        (:class:`WorkTooLargeError`)."""
        lim = self.limits
        if lim.max_work is not None and work > lim.max_work:
            raise WorkTooLargeError(
                f"this request needs {work} tokens of work (prompt tokens + max_tokens, summed over its "
                f"prompts); a key may have at most {lim.max_work} in flight (--max-work-per-key)"
            )
        self._drop_cancelled()
        if self._size + requests > self.max_queue:
            raise QueueFullError(f"{self._size} requests are already waiting; retry shortly")
        open_requests, open_work = self.usage(tenant)
        if lim.max_open is not None and open_requests + requests > lim.max_open:
            raise KeyLimitError(
                f"this API key has {open_requests} requests open (queued or running); each key may have at "
                f"most {lim.max_open} (--max-open-per-key); retry shortly"
            )
        if lim.max_work is not None and open_work + work > lim.max_work:
            raise KeyLimitError(
                f"this API key has {open_work} tokens of work in flight and this request needs {work}; each "
                f"key may have at most {lim.max_work} (--max-work-per-key); retry shortly"
            )

    def offer(self, items: list[W]) -> None:
        """Queue every one of ``items`` (all of one tenant) or none (raises as :meth:`check`)."""
        if not items:
            return
        tenant = items[0].tenant
        self.check(tenant, len(items), sum(i.cost for i in items))
        if tenant not in self._queues:
            self._queues[tenant] = collections.deque()
            self._deficit[tenant] = 0
        self._queues[tenant].extend(items)
        self._size += len(items)

    def usage(self, tenant: str) -> tuple[int, int]:
        """``tenant``'s requests and tokens of work open: waiting here, plus running (the last snapshot)."""
        mine = [i for i in [*self._queues.get(tenant, ()), *self._running.values()] if i.tenant == tenant]
        return len(mine), sum(i.cost for i in mine)

    def _drop_cancelled(self) -> None:
        """Forget the waiting requests whose clients left (nobody reads them; they would hold places)."""
        for tenant, q in list(self._queues.items()):
            kept = [i for i in q if not i.is_cancelled()]
            if len(kept) < len(q):
                self._size -= len(q) - len(kept)
                q.clear()
                q.extend(kept)
                if not q:
                    self._forget(tenant)

    # -- admitting ------------------------------------------------------------------------------------
    def running(self, items: Iterable[W]) -> None:
        """The requests the engine serves now (prefilling or decoding): counted in their tenants' caps."""
        self._running = {id(item): item for item in items}

    def release(self, item: W) -> None:
        """``item``, running, has ended: it leaves its tenant's share now, not at the next snapshot (a
        no-op for one already released)."""
        self._running.pop(id(item), None)

    def take(self, slots: int) -> list[W]:
        """Up to ``slots`` requests to admit, by deficit round-robin over the tenants under their batch
        share; they count as running from now on (cancelled ones are dropped, not returned)."""
        out: list[W] = []
        while len(out) < slots:
            item = self._pop(self._may_run)
            if item is None:
                break
            if item.is_cancelled():
                continue
            self._running[id(item)] = item
            out.append(item)
        return out

    def drain(self) -> list[W]:
        """Every waiting request, removed."""
        items = list(self)
        self._queues.clear()
        self._deficit.clear()
        self._size = 0
        return items

    def _may_run(self, tenant: str) -> bool:
        cap = self.limits.max_batch
        return cap is None or sum(1 for i in self._running.values() if i.tenant == tenant) < cap

    def _pop(self, may_run: Callable[[str], bool]) -> W | None:
        """The next request by deficit round-robin among the tenants ``may_run`` allows.

        The first tenant in turn whose credit (in tokens) pays for its next request is served. If none can,
        every allowed tenant receives the same credit, just enough for the first to pay (the quantum is one
        token, and the rounds that would serve nobody are granted at once): tenants waiting earn work at
        one rate, and each request spends its own. A tenant keeps its turn while its credit pays for its
        next request; one whose queue empties loses its credit (an idle tenant saves nothing up)."""
        ready = [t for t in self._queues if may_run(t)]
        if not ready:
            return None
        pick = next((t for t in ready if self._queues[t][0].cost <= self._deficit[t]), None)
        if pick is None:
            grant = min(self._queues[t][0].cost - self._deficit[t] for t in ready)
            for t in ready:
                self._deficit[t] += grant
            pick = next(t for t in ready if self._queues[t][0].cost <= self._deficit[t])
        q = self._queues[pick]
        item = q.popleft()
        self._size -= 1
        self._deficit[pick] -= item.cost
        if not q:
            self._forget(pick)
        elif q[0].cost > self._deficit[pick]:
            self._queues.move_to_end(pick)  # its turn is over
        return item

    def _forget(self, tenant: str) -> None:
        del self._queues[tenant]
        del self._deficit[tenant]
