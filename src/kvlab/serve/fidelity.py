"""Fidelity per response: what the cache policy cost an answer, scored on the exact full cache.

A scored response (``kvlab serve --fidelity-sample``, or a body's ``"kvlab": {"fidelity": true}``) keeps
the logits each of its tokens was picked from (the served side). Once it is answered, its conversation's
prompt and reply are teacher-forced through a full-precision full cache (:func:`kvlab.hf.cache.new_hf_cache`:
no window, no eviction, no codec) a piece at a time, at low priority (:class:`ScoringJob`, run by the
engine's worker when no prompt is being computed), and each response token's two distributions are
compared (:func:`kvlab.metrics.divergence.compare_logits`: mean ``KL(full || served)`` in nats and top-1
agreement).

:class:`FidelityBoard` holds every scored response's record, by id, for the reply (which waits a bounded
time for it) and for ``GET /v1/fidelity/{id}`` (its owner's key only). A record is pending, done (``kl``,
``top1``, ``tokens``, ``policy``) or skipped (``skipped``: why, and no score: never a score not computed).
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvlab.hf.cache import new_hf_cache
from kvlab.metrics.divergence import compare_logits

if TYPE_CHECKING:
    from kvlab.model.handle import ModelHandle

#: records kept (pending, done or skipped); the oldest is dropped beyond it (its URL then answers 404)
MAX_RECORDS = 4096


@dataclass
class _Record:
    owner: str  # the caller's tenant salt (an API key's digest; "" on a server without keys)
    result: dict[str, Any] | None = None  # None while pending


class FidelityBoard:
    """Scored responses' records by id (thread-safe): opened by the HTTP side, finished by the worker."""

    def __init__(self) -> None:
        self._records: collections.OrderedDict[str, _Record] = collections.OrderedDict()
        self._lock = threading.Lock()

    def open(self, owner: str) -> str:
        """A new pending record of ``owner``; its id."""
        fid = "fid-" + uuid.uuid4().hex
        with self._lock:
            self._records[fid] = _Record(owner)
            while len(self._records) > MAX_RECORDS:
                self._records.popitem(last=False)
        return fid

    def finish(self, fid: str, result: dict[str, Any]) -> None:
        """Record ``fid``'s result (a score or a skip), once; a dropped or finished record is left as it is."""
        with self._lock:
            record = self._records.get(fid)
            if record is not None and record.result is None:
                record.result = result

    def discard(self, fid: str) -> None:
        """Forget ``fid`` (its request was refused before it was queued)."""
        with self._lock:
            self._records.pop(fid, None)

    def read(self, fid: str, owner: str) -> tuple[bool, dict[str, Any] | None]:
        """(whether ``owner`` may see a record ``fid``, its result or None while pending). Another key's record
        reads as unknown."""
        with self._lock:
            record = self._records.get(fid)
        if record is None or record.owner != owner:
            return False, None
        return True, record.result

    async def wait(self, fid: str, seconds: float) -> dict[str, Any] | None:
        """``fid``'s result once it is recorded, or None after ``seconds`` (or when the record is gone)."""
        deadline = time.monotonic() + seconds
        while True:
            with self._lock:
                record = self._records.get(fid)
            if record is None or record.result is not None:
                return None if record is None else record.result
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await asyncio.sleep(min(0.005, left))


def skipped(why: str, tokens: int, policy: str) -> dict[str, Any]:
    """A record's result when no score was computed: why, and nothing that reads as a score."""
    return {"skipped": why, "tokens": tokens, "policy": policy}


@dataclass
class ScoringJob:
    """One answered response to score: ``ids`` (the prompt, then every response token but the last) fed
    through a full cache; the logits at positions ``start`` onward (``len(prompt) - 1``) are the full side's
    distributions of the response tokens, compared with ``served`` (``[n, vocab]``, the picks' logits)."""

    fid: str
    ids: list[int]
    start: int
    served: torch.Tensor
    policy: str
    reserved: int  # bytes of the engine's fidelity memory this job holds until it ends
    at: int = 0  # tokens of ``ids`` fed
    cache: object | None = None  # the full cache (kvlab.hf.cache.new_hf_cache) while being fed
    full: list[torch.Tensor] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return int(self.served.shape[0])

    def refusal(self, handle: ModelHandle) -> str | None:
        """Why the exact reference cannot be computed for this conversation, or None."""
        most = handle.max_positions
        if most and len(self.ids) > most:
            return (
                f"the conversation holds {len(self.ids) + 1} tokens, past the model's {most} positions: "
                "there is no full-cache reference"
            )
        return None

    def feed(self, handle: ModelHandle, budget: int) -> int:
        """Feed up to ``budget`` more tokens through the full cache; returns how many."""
        if self.cache is None:
            self.cache = new_hf_cache(handle.config)
        a = self.at
        piece = self.ids[a : a + budget]
        b = a + len(piece)
        keep = b - max(a, self.start)  # positions of this piece whose logits score a response token
        x = torch.tensor([piece], dtype=torch.long, device=handle.device)
        logits = handle.run(x, self.cache, logits_to_keep=keep if keep > 0 else 1).logits
        if keep > 0:
            self.full.append(logits[0, -keep:].to("cpu", torch.float32))
        self.at = b
        return len(piece)

    @property
    def finished(self) -> bool:
        return self.at >= len(self.ids)

    def result(self) -> dict[str, Any]:
        """The score (``kl``: mean KL(full || served) in nats; ``top1``: the share of tokens whose argmax both
        sides share), once every token is fed; the full cache is released."""
        self.cache = None
        div = compare_logits(torch.cat(self.full), self.served)
        out = {"kl": div.kl, "top1": div.top1, "tokens": div.n, "policy": self.policy}
        if not math.isfinite(div.kl):  # JSON has no infinity: said in words, never as a finite number
            out.update(kl=None, kl_infinite="the served cache ruled out a token the full cache allows")
        return out
