"""The serving engine: conversations that never re-prefill, decoded together in one batched forward.

One worker thread owns the model. Requests wait in a bounded queue; between decode steps the worker
admits waiting requests (up to ``max_batch`` at once), prefills what is new in each, then runs one
batched forward per step over every live request (:func:`kvlab.hf.batch.step_rolling_rows`), so
requests join and leave between steps (continuous batching).

Where a prompt's cache comes from, in order:

1. **A live session.** A finished request leaves its :class:`Session` behind: the token ids its
   :class:`~kvlab.hf.RollingCache` has seen and the cache itself. A request whose ids start with a
   session's ids (the same conversation, sent again with the new turn, as clients do) takes the
   session over and feeds only the new tokens.
2. **The store.** Otherwise the first ``sinks + window`` tokens are looked up in the
   :class:`~kvlab.store.KVStore` (chained block keys, longest prefix, salted per tenant) and only
   the rest is computed; the computed blocks are stored for every later request, agent or replica.
3. **Nothing**: the prompt is computed.

Prompts and replies beyond the window **roll** (attention sinks + window, exact RoPE re-rotation)
instead of failing. The system prompt is pinned: it is part of the cache's sinks, never evicted.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.errors import BadInputError, KvlabError
from kvlab.hf.batch import step_rolling_rows
from kvlab.hf.rolling_cache import RollingCache, rolling_cache_for
from kvlab.loop import Sampling
from kvlab.store.errors import StoreError
from kvlab.store.reuse import prefill_with_store
from kvlab.store.store import KVStore
from kvlab.streaming.generate import feed

log = logging.getLogger("kvlab.serve")


class QueueFullError(KvlabError):
    """More requests are waiting than the server accepts (HTTP 429)."""


class ShuttingDownError(KvlabError):
    """The engine is stopping (HTTP 503)."""


@dataclass(frozen=True)
class EngineSettings:
    window: int = 1024
    sinks: int = 4
    evict_chunk: int = 64
    max_batch: int = 4  # requests decoded together
    max_queue: int = 16  # requests waiting beyond those decoding
    max_sessions: int = 64  # idle conversations kept for reuse (least recently used dropped)


@dataclass
class Session:
    """A conversation's cache: every token id it has seen (in order) and the rolling cache that holds them."""

    id: str
    salt: str
    ids: list[int]
    cache: RollingCache
    pinned: int
    sinks: int = 0  # the attention sinks asked for (--sinks); the cache keeps max(sinks, pinned) first slots
    requests: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    last_used: float = field(default_factory=time.time)
    # [vocab] logits after the last id: they score the first token of the next request that continues
    last_logits: torch.Tensor | None = None
    # each id's log-probability where a request computed it (scoring or logprobs), else None; parallel to ids
    scores: list[LogProb | None] = field(default_factory=list)

    def scored(self, top: int) -> bool:
        """Whether every token but the first has a stored score with at least ``top`` alternatives."""
        return all(e is not None and len(e[2]) >= top for e in self.scores[1:])

    def layout(self) -> dict[str, int]:
        """The cache's slots: ``sinks`` (the attention sinks), ``pinned`` (the system prompt's tokens, which
        start with the sinks when it is longer), the ``window`` it keeps and how many slots it ``kept``."""
        c = self.cache
        return {
            "sinks": min(self.sinks, c.kept),
            "pinned": min(self.pinned, c.kept),
            "window": c.window,
            "kept": c.kept,
            "seen": c.tokens_seen,
            "rolls": c.rolls,
        }


# A token's log-probability: (token id, log p, [(alternative id, log p), ...] best first)
LogProb = tuple[int, float, list[tuple[int, float]]]


def _logprob(log_probs: torch.Tensor, token: int, top: int) -> LogProb:
    """``token``'s entry from a ``[vocab]`` row of log-probabilities (the model's, before sampling settings)."""
    alts: list[tuple[int, float]] = []
    if top:
        values, ids = log_probs.topk(top)
        alts = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
    return int(token), float(log_probs[token]), alts


@dataclass
class Request:
    """One completion request as the engine sees it (token ids in, events out)."""

    ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    emit: Callable[[tuple], None]  # called from the worker thread with ("start"|"token"|"done"|"error", ...)
    salt: str = ""
    pinned: int = 0
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    logprobs: int | None = None  # report each generated token's log-probability and this many alternatives
    logprob_stop: bool = False  # that of a stop token too (legacy completions list it; chat does not)
    # also each prompt token's (all but the first: computed here, or stored by the session continued; never
    # from the store, which keeps no scores)
    score_prompt: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class _Row:
    """A request being decoded."""

    req: Request
    session: Session
    logits: torch.Tensor
    generator: torch.Generator | None
    info: dict[str, Any]
    out: list[int] = field(default_factory=list)
    text: str = ""  # text emitted so far
    finish: str | None = None
    logprobs: list[LogProb] = field(default_factory=list)  # per generated token (when asked)
    unsent: list[LogProb] = field(default_factory=list)  # those not yet attached to an emitted chunk
    entry: LogProb | None = None  # the last picked token's (when reported)
    last_step: float = field(default_factory=time.perf_counter)


class Engine:
    """Owns the model, the sessions and the store; serves :class:`Request` s from one worker thread."""

    def __init__(self, handle: Any, settings: EngineSettings, *, store: KVStore | None = None, metrics=None):
        check_settings(handle, settings)
        self.handle = handle
        self.settings = settings
        self.store = store
        self.metrics = metrics
        # idle sessions, least recently used first; written by the worker, read by the status page
        self.sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self._sessions_lock = threading.Lock()
        self._pending: collections.deque[Request] = collections.deque()
        self._active: list[_Row] = []
        self._admitted = 0  # taken from the queue, not yet decoding (being prefilled)
        self._cv = threading.Condition()
        self._stopping = False
        self.store_warnings = 0
        if metrics is not None:
            metrics.watch(self)
        self._thread = threading.Thread(target=self._work, name="kvlab-engine", daemon=True)
        self._thread.start()

    # -- the public side (any thread) ----------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.settings.sinks + self.settings.window

    def submit(self, req: Request) -> None:
        """Queue ``req``; raises :class:`QueueFullError` when ``max_queue`` requests already wait."""
        self.submit_many([req])

    def submit_many(self, reqs: list[Request]) -> None:
        """Queue every request of ``reqs`` (a batched completion's prompts) or none: raises
        :class:`QueueFullError` when the queue has no room for all of them."""
        with self._cv:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            if len(self._pending) + len(reqs) > self.settings.max_queue:
                raise QueueFullError(f"{len(self._pending)} requests are already waiting; retry shortly")
            self._pending.extend(reqs)
            self._cv.notify()

    def queue_depth(self) -> int:
        return len(self._pending)

    def active(self) -> int:
        """Requests being served: prefilling (admitted) or decoding."""
        return len(self._active) + self._admitted

    def device_description(self) -> str:
        """Where the model runs, in words: ``cuda:0 (NVIDIA H100 80GB HBM3), bfloat16`` or ``cpu, float32``."""
        info = self.device_info()
        gpu = f" ({info['gpu']})" if info.get("gpu") else ""
        return f"{info['device']}{gpu}, {info['dtype']}"

    def device_info(self) -> dict[str, Any]:
        """The model's device and dtype (and the GPU's name on CUDA), for the status page and ``/health``."""
        from kvlab.model.loading import describe_device

        return {
            **describe_device(self.handle.device),
            "dtype": str(self.handle.dtype).replace("torch.", ""),
        }

    def status(self) -> dict[str, Any]:
        """Live and idle sessions with their cache layouts (for the status page and ``/health``)."""
        rows = list(self._active)
        live = [
            {"session": r.session.id, "state": "decoding", **r.session.layout(), **_reuse(r.session)}
            for r in rows
        ]
        with self._sessions_lock:
            sessions = list(self.sessions.values())
        idle = [{"session": s.id, "state": "idle", **s.layout(), **_reuse(s)} for s in sessions]
        return {
            "queue": self.queue_depth(),
            "decoding": len(rows),
            "sessions": live + idle,
            "settings": dataclasses.asdict(self.settings),
            "device": self.device_info(),
        }

    def store_stats(self) -> dict[str, Any]:
        """The store's tiers with their hit counters (counters only: walking a disk or Redis tier for its
        size takes too long for a status page, and the worker may be writing it)."""
        if self.store is None:
            return {}
        tiers = {t.name: t.counters.to_json() for t in self.store.tiers}
        return {
            "describe": self.store.describe(),
            "warnings": self.store_warnings,
            "tiers": tiers,
            "hit_tokens": self.store.hit_tokens,
            "miss_tokens": self.store.miss_tokens,
        }

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout)

    # -- the worker ----------------------------------------------------------------------------------
    def _work(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not self._pending and not self._active and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    for req in self._pending:
                        req.emit(("error", ShuttingDownError("the server is shutting down")))
                    self._pending.clear()
                    return
                admit: list[Request] = []
                while self._pending and len(self._active) + len(admit) < self.settings.max_batch:
                    admit.append(self._pending.popleft())
                self._admitted = len(admit)
            for req in admit:
                if req.cancelled.is_set():
                    self._admitted -= 1
                    continue
                try:
                    row = self._start(req)
                    if req.max_new_tokens == 0:  # scoring a prompt: nothing to generate
                        row.finish = "length"
                        self._finish(row)
                    else:
                        self._active.append(row)
                except Exception as exc:  # a bad request must never kill the worker
                    if not isinstance(exc, KvlabError):
                        log.exception("prefill failed")
                    req.emit(("error", exc))
                finally:
                    self._admitted -= 1
            if self._active:
                try:
                    self._step()
                except Exception as exc:
                    # the step's rows fail; their sessions are not returned (a cache may hold half a step)
                    log.exception("decode step failed")
                    for row in self._active:
                        row.req.emit(("error", exc))
                    self._active = []

    def _start(self, req: Request) -> _Row:
        """Find the longest cached prefix, compute the rest, return the row ready to pick its first token."""
        t0 = time.perf_counter()
        top = req.logprobs or 0
        session = self._take_session(req.ids, req.salt, top if req.score_prompt else None)
        tiers: dict[str, int] = {}
        rolls_before = 0
        scores: list[LogProb | None] = []
        if session is not None:
            source, cached = "session", len(session.ids)
            rolls_before = session.cache.rolls
            if req.score_prompt:  # the cached tokens' stored scores, the new ones computed
                logits, fresh = self._feed_scored(session.cache, req.ids[cached:], session.last_logits, req)
                stored = [None if e is None else (e[0], e[1], e[2][:top]) for e in session.scores]
                scores = [*stored, *fresh]
                session.scores = [*session.scores, *fresh]
            else:
                logits = feed(self.handle, session.cache, req.ids[cached:])
                session.scores = [*session.scores, *(None for _ in req.ids[cached:])]
        else:
            cache = rolling_cache_for(
                self.handle,
                window=self.settings.window,
                sinks=max(self.settings.sinks, req.pinned),
                evict_chunk=self.settings.evict_chunk,
            )
            session = Session(uuid.uuid4().hex[:12], req.salt, [], cache, req.pinned, self.settings.sinks)
            if req.score_prompt:  # every token computed here, so every token but the first is scored
                logits, scores = self._feed_scored(cache, req.ids, None, req)
                source, cached = "none", 0
                session.scores = list(scores)
            else:
                logits, source, cached, tiers = self._prefill_new(cache, req)
                session.scores = [None] * len(req.ids)
        session.ids = list(req.ids)
        session.requests += 1
        session.reused_tokens += cached
        session.computed_tokens += len(req.ids) - cached
        info = {
            "session": session.id,
            "source": source,
            "cached_tokens": cached,
            "computed_tokens": len(req.ids) - cached,
            "rolls": session.cache.rolls - rolls_before,
            "prefill_ms": round((time.perf_counter() - t0) * 1000, 2),
            "store_tiers": tiers,
        }
        if self.metrics is not None:
            self.metrics.prefilled(info)
        if req.score_prompt:
            info["_prompt_logprobs"] = scores
        # a CPU generator wherever the model runs: Sampling.pick draws from probabilities on the CPU
        gen = None if req.sampling.greedy else torch.Generator().manual_seed(req.sampling.seed)
        req.emit(("start", info))
        return _Row(req, session, logits[None], gen, info)

    def _prefill_new(self, cache: RollingCache, req: Request) -> tuple[torch.Tensor, str, int, dict]:
        """A new conversation: its head from the store where it can, the rest computed."""
        head = req.ids[: self.capacity]
        logits, cached, tiers = self._prefill_head(cache, head, req.salt)
        if len(req.ids) > len(head):
            logits = feed(self.handle, cache, req.ids[len(head) :])
        return logits, ("store" if cached else "none"), cached, tiers

    def _feed_scored(
        self, cache: RollingCache, ids: list[int], before: torch.Tensor | None, req: Request
    ) -> tuple[torch.Tensor, list[LogProb | None]]:
        """Feed ``ids`` keeping every position's logits: each token's log-probability given what precedes
        it in the cache (the first from ``before``, the logits that ended the cache, where known)."""
        top = req.logprobs or 0
        scores: list[LogProb | None] = []
        prev = None if before is None else torch.log_softmax(before.float(), -1)
        logits = torch.empty(0, device=self.handle.device)
        chunk = min(cache.headroom, 256)  # [chunk, vocab] logits at a time
        for start in range(0, len(ids), chunk):
            piece = ids[start : start + chunk]
            fed = torch.tensor([piece], dtype=torch.long, device=self.handle.device)
            logits = self.handle.run(fed, cache).logits[0].float()
            log_probs = torch.log_softmax(logits, -1)
            for j, tok in enumerate(piece):
                src = prev if j == 0 else log_probs[j - 1]
                scores.append(None if src is None else _logprob(src, tok, top))
            prev = log_probs[-1]
        return logits[-1], scores

    def _prefill_head(
        self, cache: RollingCache, head: list[int], salt: str
    ) -> tuple[torch.Tensor, int, dict]:
        """The first ``sinks + window`` tokens: from the store where it has them (then stored), else computed."""
        if self.store is not None:
            # a tier that fails to read is a miss (the store logs it); one that fails to write must
            # not cost the request: the cache is already computed, it just is not shared this time
            try:
                pre = prefill_with_store(self.handle, self.store, head, salt=salt or None, store_prompt=False)
            except StoreError as exc:
                self.store_warnings += 1
                log.warning("kvlab serve: the store failed (%s); computing this prompt without it", exc)
                return feed(self.handle, cache, head), 0, {}
            device = self.handle.device  # a prefix read from the store may arrive on the CPU
            cache.seed(
                [
                    (k.to(device), v.to(device))
                    for k, v in zip(pre.snapshot.keys, pre.snapshot.values, strict=True)
                ]
            )
            try:
                self.store.put(pre.snapshot, salt=salt or None, model=self.handle)
            except StoreError as exc:
                self.store_warnings += 1
                log.warning("kvlab serve: could not store this prompt's blocks (%s); serving it anyway", exc)
            return pre.last_logits, pre.cached_tokens, dict(pre.match.tier_blocks)
        return feed(self.handle, cache, head), 0, {}

    def _step(self) -> None:
        """Pick one token per row, report it, feed every row's token in one batched forward."""
        now = time.perf_counter()
        for row in self._active:
            if row.req.cancelled.is_set():
                row.finish = "cancelled"
                continue
            tok = int(row.req.sampling.pick(row.logits, row.generator)[0])
            row.out.append(tok)
            row.entry = None
            if row.req.logprobs is not None and (tok not in row.req.stop_ids or row.req.logprob_stop):
                row.entry = _logprob(torch.log_softmax(row.logits[0].float(), -1), tok, row.req.logprobs)
                row.logprobs.append(row.entry)
                row.unsent.append(row.entry)
            if tok in row.req.stop_ids:
                row.finish = "stop"
            else:
                self._emit_text(row)
                if row.finish is None and len(row.out) >= row.req.max_new_tokens:
                    row.finish = "length"
            if self.metrics is not None:
                first = len(row.out) == 1
                self.metrics.token(now - (row.req.submitted if first else row.last_step), first=first)
            row.last_step = now
        fed = [r for r in self._active if r.finish != "cancelled"]
        if fed:
            rolls = [r.session.cache.rolls for r in fed]
            logits = step_rolling_rows(self.handle, [r.session.cache for r in fed], [r.out[-1] for r in fed])
            for i, row in enumerate(fed):
                row.logits = logits[i : i + 1]
                row.session.ids.append(row.out[-1])
                row.session.scores.append(row.entry)
                row.info["rolls"] += row.session.cache.rolls - rolls[i]
                if self.metrics is not None and row.session.cache.rolls > rolls[i]:
                    self.metrics.rolled(row.session.cache.rolls - rolls[i])
        still = []
        for row in self._active:
            if row.finish is None:
                still.append(row)
                continue
            self._finish(row)
        self._active = still

    def _emit_text(self, row: _Row) -> None:
        """Emit the new text of ``row`` (held back while it may be a partial character or stop string)."""
        text, stopped = _cut_at_stop(self.handle.decode(row.out), row.req.stop_strings)
        if stopped:
            row.finish = "stop"
        hold = 0 if stopped else _holdback(text, row.req.stop_strings)
        ready = text[: len(text) - hold]
        if len(ready) > len(row.text) and ready.startswith(row.text):
            row.req.emit(("token", row.out[-1], ready[len(row.text) :], row.unsent))
            row.text, row.unsent = ready, []

    def _finish(self, row: _Row) -> None:
        if row.finish != "cancelled":
            reply = self.handle.decode([t for t in row.out if t not in row.req.stop_ids])
            text, _ = _cut_at_stop(reply, row.req.stop_strings)
            if len(text) > len(row.text) and text.startswith(row.text):  # the held-back tail
                row.req.emit(("token", None, text[len(row.text) :], row.unsent))
                row.text, row.unsent = text, []
            elif row.unsent:  # a stop token's log-probability (no text of its own)
                row.req.emit(("token", None, "", row.unsent))
                row.unsent = []
            row.info["completion_tokens"] = len(row.out)
            row.info["completion_ids"] = list(row.out)
            row.info["kept_tokens"] = row.session.cache.kept
            row.info["pinned_tokens"] = row.session.pinned
            if row.req.logprobs is not None:
                row.info["_logprobs"] = row.logprobs
            row.req.emit(("done", row.finish, row.info, row.text))
        row.session.last_logits = row.logits[0]
        self._return_session(row.session)

    # -- sessions --------------------------------------------------------------------------------------
    def _take_session(self, ids: list[int], salt: str, scored: int | None = None) -> Session | None:
        """Remove and return the idle session of ``salt`` whose ids are the longest proper prefix of ``ids``
        (with ``scored``: only a session whose tokens all have stored scores with that many alternatives,
        so that a scoring request reports every token but the first)."""
        best = None
        with self._sessions_lock:
            for s in self.sessions.values():
                n = len(s.ids)
                if (
                    s.salt == salt
                    and n < len(ids)
                    and (best is None or n > len(best.ids))
                    and ids[:n] == s.ids
                    and (scored is None or s.scored(scored))
                ):
                    best = s
            if best is not None:
                del self.sessions[best.id]
        return best

    def _return_session(self, session: Session) -> None:
        session.last_used = time.time()
        with self._sessions_lock:
            self.sessions[session.id] = session
            while len(self.sessions) > self.settings.max_sessions:
                self.sessions.popitem(last=False)

    def idle_sessions(self) -> int:
        return len(self.sessions)


def _reuse(s: Session) -> dict[str, Any]:
    total = s.reused_tokens + s.computed_tokens
    return {"requests": s.requests, "reuse_ratio": round(s.reused_tokens / total, 3) if total else 0.0}


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the earliest stop string, and whether one occurred."""
    cuts = [at for at in (text.find(stop) for stop in stops) if at >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def _holdback(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that must wait: a partial UTF-8 character, or the start of a stop string."""
    if text.endswith("\ufffd"):
        return len(text) - len(text.rstrip("\ufffd"))
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                hold = max(hold, n)
                break
    return hold


def check_settings(handle: Any, settings: EngineSettings) -> None:
    """Refuse settings this model cannot be served with, before anything is created."""
    if settings.max_batch < 1 or settings.max_queue < 0 or settings.max_sessions < 1:
        raise BadInputError("need max_batch >= 1, max_queue >= 0 and max_sessions >= 1")
    # builds nothing but the rule (buffers are allocated on first use): raises for a bad window or model
    rolling_cache_for(handle, window=settings.window, sinks=settings.sinks, evict_chunk=settings.evict_chunk)


def check_request_fits(ids: list[int], pinned: int, settings: EngineSettings) -> None:
    """Refuse what the engine could not serve faithfully, before it is queued."""
    if not ids:
        raise BadInputError("the prompt is empty")
    if pinned >= settings.window // 2:
        raise BadInputError(
            f"the system prompt takes {pinned} tokens; it is pinned in the cache and must stay below half "
            f"the window ({settings.window // 2}); start the server with a larger --window"
        )
