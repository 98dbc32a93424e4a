"""The serving engine: conversations that never re-prefill, decoded together in one batched forward.

One worker thread owns the model. Requests wait in a bounded queue; the worker loops: it admits waiting
requests (up to ``max_batch`` prefilling or decoding at once), computes up to ``prefill_chunk`` prompt
tokens of the requests being prefilled, then runs one batched forward over every decoding request
(:func:`kvlab.hf.batch.step_rolling_rows`), so requests join and leave between steps (continuous
batching) and a long prompt delays the others' next token by one prefill budget at most (chunked
prefill). While no row decodes the budget is ``prefill_alone`` (1,024 tokens): a piece re-reads every
weight, so a lone conversation's turn is fed in few large forwards. A row that fails fails alone: its
pick, its text or its part of the forward.

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
instead of failing. With a cache spec (``EngineSettings.cache``, ``kvlab serve --cache``, a spec of
:mod:`kvlab.policy.spec`) every session runs that policy's live cache (:func:`kvlab.policy.cache_for`):

* a sinks + window layout, e.g. ``sinks=4,window=2048,codec=kivi4``: the window stored as that codec's packed
  codes (:mod:`kvlab.hf.coded_rolling`). The system prompt is pinned: it is part of the cache's sinks,
  never evicted. A prompt computed in pieces ends in the cache it would have in one go: each forward of the
  unchunked path is split with the cache's roll held between its pieces (:meth:`~kvlab.hf.live_cache.LiveCache.hold_roll`);
* a scored layout that keeps its budget while decoding, e.g. ``h2o,budget=1024,every=64`` (optionally
  ``layers=pyramid`` and a per-token codec for the survivors): each conversation holds at most its budget
  plus ``every`` slots per layer and head, whatever its length. Such a cache evicts inside its update, so a
  prompt cannot be cut into pieces that equal one forward: each new part of a conversation is fed in one
  forward (a long prompt holds the other rows' next token for that long), nothing is pinned (the policy
  scores the system prompt like any token, and its own sinks keep the first tokens), and the store is not
  used (an attention-scored eviction cannot start from a stored prefix: it scores the prompt's queries).
  A system prompt longer than the budget is the exception: it is compressed once, alone, by the layout's
  prefix score, stored under the policy and shared by every conversation that starts with it
  (:mod:`kvlab.serve.prefixes`); the rest of the first prompt follows in one forward;
* a strided layout, e.g. ``stride=4,recent=64``: one slot in ``stride`` plus the most recent, fed like a scored
  layout (each new part in one forward, nothing pinned, no store). Its cache grows with the conversation, but
  its slots, like a scored layout's, keep their original positions: a request whose conversation would pass
  the model's position limit is refused (:func:`check_request_fits`), which bounds the cache
  (:meth:`~kvlab.policy.layouts.Layout.held_at_most`).

``rolls`` in each response's ``kvlab`` field counts the times a conversation's cache dropped tokens: a roll
of the window, or an eviction back to the budget.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from kvlab.cache import KVSnapshot
from kvlab.errors import BadInputError, KvlabError
from kvlab.hf.batch import step_rolling_rows_isolated
from kvlab.hf.captured_rows import CapturedRows
from kvlab.hf.live_cache import LiveCache
from kvlab.hf.rolling_cache import RollingCache
from kvlab.hf.static_rolling import check_ring_model
from kvlab.loop import Sampling
from kvlab.policy.spec import CachePolicy, SinksWindowLayout, cache_for
from kvlab.policy.spec import parse as parse_cache_spec
from kvlab.policy.window import default_chunk
from kvlab.serve.fidelity import FidelityBoard, ScoringJob, skipped
from kvlab.serve.heap import Trimmer
from kvlab.serve.policy import serve_policy
from kvlab.serve.prefixes import SharedPrefixes
from kvlab.serve.tenants import FairQueue, KeyLimits
from kvlab.store.errors import StoreError
from kvlab.store.store import KVStore

if TYPE_CHECKING:
    from kvlab.model.handle import ModelHandle

log = logging.getLogger("kvlab.serve")


class ShuttingDownError(KvlabError):
    """The engine is stopping (HTTP 503)."""


@dataclass(frozen=True)
class EngineSettings:
    window: int = 1024
    sinks: int = 4
    evict_chunk: int = 64
    max_batch: int = 4  # requests served at once (prefilling or decoding)
    max_queue: int = 16  # requests waiting beyond those decoding
    # per tenant (Request.tenant, an API key): requests open, requests running, tokens of work in flight;
    # None: only the limits above (see kvlab.serve.tenants)
    max_open_per_key: int | None = None
    max_batch_per_key: int | None = None
    max_work_per_key: int | None = None
    max_sessions: int = 64  # idle conversations kept for reuse (least recently used dropped)
    prefill_chunk: int = 256  # prompt tokens computed per worker iteration, between two decode steps
    # ... and while no row decodes (at least prefill_chunk): one piece re-reads every weight, so a lone
    # prompt goes in few large forwards; a request arriving meanwhile waits this much prefill at most
    prefill_alone: int = 1024
    # a cache spec (kvlab.policy.spec) its layout lets the server run (serve_policy); it replaces window,
    # sinks and evict_chunk, which then say its window where it rolls one (the status page shows them)
    cache: str | None = None
    # fidelity per response (kvlab.serve.fidelity): the share of responses scored against the exact full cache,
    # how long a scored non-streaming reply waits for its score, the teacher-forced tokens a scoring pass
    # computes between two decode steps while any request is live (none in an iteration that computes a
    # prompt; --prefill-chunk when nothing else runs), and the memory the scored responses' kept logits may take
    fidelity_sample: float = 0.0
    fidelity_wait_s: float = 0.5
    fidelity_chunk: int = 32
    fidelity_memory_mb: int = 512
    # decode steps through one captured step over ring rows (kvlab.hf.captured_rows): off, compile, cuda-graph,
    # or eager (the rows uncaptured)
    capture: Literal["off", "eager", "compile", "cuda-graph"] = "off"

    def __post_init__(self) -> None:
        if self.cache is None:
            return
        policy = serve_policy(self.cache)
        object.__setattr__(self, "cache", policy.spec)  # canonical: the same policy, the same string
        roll = policy.layout.rolls()
        if roll is not None:
            object.__setattr__(self, "window", roll.window)
            object.__setattr__(self, "sinks", roll.sinks)
            object.__setattr__(self, "evict_chunk", roll.chunk or default_chunk(roll.window))

    @functools.cached_property
    def policy(self) -> CachePolicy:
        """The cache policy every session follows (without a spec: full-precision sinks + window)."""
        if self.cache is not None:
            return parse_cache_spec(self.cache)
        return CachePolicy(SinksWindowLayout(self.sinks, self.window, self.evict_chunk))


@dataclass
class Session:
    """A conversation's cache: every token id it has seen (in order) and the live cache that holds them."""

    id: str
    salt: str
    ids: list[int]
    cache: LiveCache
    pinned: int
    sinks: int = 0  # the attention sinks asked for (--sinks); the cache keeps max(sinks, pinned) first slots
    requests: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    # [vocab] logits after the last id: they score the first token of the next request that continues
    last_logits: torch.Tensor | None = None
    # each id's log-probability where a request computed it (scoring or logprobs), else None; parallel to ids
    scores: list[LogProb | None] = field(default_factory=list)
    # the most slots its cache holds where only the model's position limit bounds it (Layout.held_at_most)
    most: int | None = None

    def scored(self, top: int) -> bool:
        """Whether every token but the first has a stored score with at least ``top`` alternatives."""
        return all(e is not None and len(e[2]) >= top for e in self.scores[1:])

    def layout(self) -> dict[str, Any]:
        """The cache's slots: ``sinks`` (the attention sinks), ``pinned`` (the system prompt's tokens, which
        start with the sinks when it is longer), the ``window`` it keeps (a scored layout: its budget plus
        ``every``; a layout bounded by the position limit: ``most``, and ``keeps`` its rule in words) and how
        many slots it ``kept``."""
        c = self.cache
        extra: dict[str, Any] = {}
        if isinstance(c, RollingCache):
            window = int(c.window)
        elif self.most is not None:
            window, extra = self.most, {"keeps": c.rule.describe()}
        else:  # a scored layout's budget is set by its first prompt (keep=) or given (budget=)
            window = int(c.layers[0].budget or c.kept) + int(c.rule.every or 0)
        return {
            **extra,
            "budget": not isinstance(c, RollingCache) and self.most is None,
            "sinks": min(self.sinks, c.kept),
            "pinned": min(self.pinned, c.kept),
            "window": window,
            "kept": c.kept,
            "seen": c.tokens_seen,
            "rolls": c.evictions,
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
    tenant: str = ""  # whose share it counts in (kvlab.serve.tenants): an API key's label
    fidelity: str | None = None  # score the response (kvlab.serve.fidelity): its record's id on the board

    @property
    def cost(self) -> int:
        """Tokens of work it may take: its prompt and the most it may generate."""
        return len(self.ids) + self.max_new_tokens

    def is_cancelled(self) -> bool:
        return self.cancelled.is_set()


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
    served: list[torch.Tensor] | None = None  # a scored response: each pick's [vocab] logits (on the CPU)
    slot: int | None = None  # its row of the captured step (kvlab serve --capture), while it decodes there


@dataclass
class _Head:
    """A new conversation's first ``sinks + window`` tokens with a store: the longest stored prefix,
    extended a piece at a time as a snapshot (what :func:`~kvlab.store.reuse.prefill_with_store` does in
    one forward), then stored and seeded into the rolling cache."""

    ids: list[int]
    at: int  # tokens of ``ids`` held by ``snapshot`` (the stored prefix's to start with)
    snapshot: KVSnapshot | None
    tiers: dict[str, int] = field(default_factory=dict)  # the stored prefix's blocks per tier


@dataclass
class _Prefill:
    """A request being prefilled: its prompt computed a piece at a time, between decode steps.

    ``forwards`` are the forwards the unchunked path would run (each at most the cache's headroom, or
    256 tokens when scoring); each is fed in pieces of at most the iteration's prefill budget with the
    cache's roll held between pieces (:meth:`~kvlab.hf.RollingCache.hold_roll`), so the cache ends as the
    unchunked path leaves it, whatever the pieces were.
    """

    req: Request
    session: Session
    taken: bool  # the session was an idle one: kept if cancelled before anything was fed
    source: str
    cached: int
    rolls_before: int
    t0: float
    forwards: collections.deque[list[int]]
    head: _Head | None = None  # the store's part, computed before ``forwards``
    shared: list[int] | None = None  # a system prompt to start from compressed (kvlab.serve.prefixes), first
    prefix: dict[str, object] | None = None  # what loading it did (reported in the response)
    tiers: dict[str, int] = field(default_factory=dict)
    at: int = 0  # tokens of ``forwards[0]`` fed
    fed: int = 0
    total: int = 0
    logits: torch.Tensor | None = None  # [vocab] after the last token fed
    prev: torch.Tensor | None = None  # scoring: the log-probabilities that score the next token
    scores: list[LogProb | None] = field(default_factory=list)  # scoring: the new tokens'

    @property
    def remaining(self) -> int:
        return self.total - self.fed


def _pieces(ids: list[int], size: int | None) -> list[list[int]]:
    """``ids`` in forwards of at most ``size`` tokens (``None``: one forward)."""
    if size is None:
        return [ids] if ids else []
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _feed_size(cache: LiveCache, scoring: bool) -> int | None:
    """The most tokens one forward may feed ``cache``: a rolling window's headroom (the scoring path's
    ``SCORE_CHUNK`` at most, whose logits it keeps), or None (one forward) for a cache that evicts inside
    its update and so cannot take a prompt in pieces."""
    if not isinstance(cache, RollingCache):
        return None
    return min(cache.headroom, SCORE_CHUNK) if scoring else int(cache.headroom)


def _emit(req: Request, event: tuple) -> None:
    """Emit ``event`` to ``req`` on a failure path, where its listener may be gone (this must not raise)."""
    try:
        req.emit(event)
    except Exception:
        log.warning("could not deliver a %s event", event[0], exc_info=True)


def captured_rows(
    handle: ModelHandle, policy: CachePolicy, rows: int, mode: Literal["eager", "compile", "cuda-graph"]
) -> CapturedRows:
    """The server's captured rows: ``policy``'s rule (refused where it has no captured step), sized for a
    pinned system prompt below half the window."""
    roll = policy.captured_roll(mode)
    rule = cache_for(policy.live(), handle).rule  # a conversation's rule without a pinned prompt
    return CapturedRows(handle, rule, rows, mode, most_sinks=max(roll.sinks, roll.window // 2))


# tokens per forward when a prompt is scored: every position's logits are kept ([chunk, vocab] at a time)
SCORE_CHUNK = 256


class Engine:
    """Owns the model, the sessions and the store; serves :class:`Request` s from one worker thread."""

    def __init__(
        self, handle: ModelHandle, settings: EngineSettings, *, store: KVStore | None = None, metrics=None
    ):
        check_settings(handle, settings)
        self.handle = handle
        self.settings = settings
        self.store = store
        self.metrics = metrics
        # idle sessions, least recently used first; written by the worker, read by the status page
        self.sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self._sessions_lock = threading.Lock()
        limits = KeyLimits(settings.max_open_per_key, settings.max_batch_per_key, settings.max_work_per_key)
        self._pending: FairQueue[Request] = FairQueue(max_queue=settings.max_queue, limits=limits)
        self._prefilling: list[_Prefill] = []  # admitted, their prompts being computed
        self._active: list[_Row] = []  # decoding
        self._admitted = 0  # taken from the queue, not yet prefilling
        self._cv = threading.Condition()
        self._stopping = False
        self.store_warnings = 0
        self.policy = settings.policy
        self.prefixes = SharedPrefixes.make(self.policy, handle, store)
        # what each response's kvlab field says the cache held: the policy, and whether it is exact
        self.cache_info = {**self.policy.to_json(), "exact": self.policy.exact}
        # fidelity per response: the records (any thread), the answered responses waiting to be scored and the
        # bytes of kept logits reserved by scored requests, by record id (the worker's)
        self.fidelity = FidelityBoard()
        mode = settings.capture
        self.captured = (
            None if mode == "off" else captured_rows(handle, self.policy, settings.max_batch, mode)
        )
        self._scoring: collections.deque[ScoringJob] = collections.deque()
        self._reserved: dict[str, int] = {}
        self.heap = Trimmer()  # freed pages back to the system (kvlab.serve.heap)
        if metrics is not None:
            metrics.watch(self)
        self._thread = threading.Thread(target=self._work, name="kvlab-engine", daemon=True)
        self._thread.start()

    # -- the public side (any thread) ----------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """The tokens a rolling window holds (what the store looks up); 0 where the layout keeps a budget."""
        roll = self.policy.layout.rolls()
        return roll.sinks + roll.window if roll is not None else 0

    def submit(self, req: Request) -> None:
        """Queue ``req``; raises as :meth:`submit_many`."""
        self.submit_many([req])

    def submit_many(self, reqs: list[Request]) -> None:
        """Queue every request of ``reqs`` (a batched completion's prompts, of one tenant) or none: raises
        :class:`~kvlab.serve.tenants.QueueFullError` when the queue has no room for all of them, its subclass
        :class:`~kvlab.serve.tenants.KeyLimitError` when their tenant has its share open, and
        :class:`~kvlab.serve.tenants.WorkTooLargeError` when they could never fit that share."""
        with self._cv:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            self._pending.offer(reqs)
            self._cv.notify()

    def queue_depth(self) -> int:
        return len(self._pending)

    def active(self) -> int:
        """Requests being served: prefilling (admitted) or decoding."""
        return len(self._active) + len(self._prefilling) + self._admitted

    def prefilling(self) -> int:
        """Requests whose prompts are being computed (admitted, not yet decoding)."""
        return len(self._prefilling) + self._admitted

    def device_description(self) -> str:
        """Where the model runs, in words: ``cuda:0 (NVIDIA H100 80GB HBM3), bfloat16`` or ``cpu, float32``."""
        info = self.device_info()
        gpu = f" ({info['gpu']})" if info.get("gpu") else ""
        captured = f", decode steps captured ({info['capture']})" if info["capture"] != "off" else ""
        return f"{info['device']}{gpu}, {info['dtype']}{captured}"

    def device_info(self) -> dict[str, Any]:
        """The model's device and dtype (and the GPU's name on CUDA) and how decode steps run (``capture``), for
        the status page and ``/health``."""
        from kvlab.model.loading import describe_device

        return {
            **describe_device(self.handle.device),
            "dtype": str(self.handle.dtype).replace("torch.", ""),
            "capture": self.settings.capture,
        }

    def status(self) -> dict[str, Any]:
        """Live and idle sessions with their cache layouts (for the status page and ``/health``): rows being
        prefilled (with ``prefilled`` of ``prompt_tokens`` computed so far) and decoded, then idle ones."""
        prefilling, rows = list(self._prefilling), list(self._active)
        with self._sessions_lock:
            idle = list(self.sessions.values())
        sessions = [_row(p.session, "prefilling", prefilled=p.fed, prompt_tokens=p.total) for p in prefilling]
        sessions += [self._decoding(r) for r in rows] + [_row(s, "idle") for s in idle]
        return {
            "queue": self.queue_depth(),
            "prefilling": len(prefilling),
            "decoding": len(rows),
            "sessions": sessions,
            "settings": dataclasses.asdict(self.settings),
            "device": self.device_info(),
        }

    def _decoding(self, row: _Row) -> dict[str, Any]:
        """A decoding session as the status page lists it; while it decodes in a captured row, with that row's
        counts (its eager cache is written back only when the reply ends). Read from another thread: a row
        that left, or changed hands, between the reads is listed from its eager cache."""
        listed, slot, captured = _row(row.session, "decoding"), row.slot, self.captured
        if slot is None or captured is None:
            return listed
        try:
            ring = captured.pool.row(slot)
            counts = {"kept": ring.kept, "seen": ring.tokens_seen, "rolls": ring.evictions}
        except BadInputError:  # it left: its eager cache holds the counts again
            return listed
        return {**listed, **counts} if row.slot == slot else listed

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
            "compressed_prefixes": self.prefixes.stats(),
        }

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout)

    # -- the worker ----------------------------------------------------------------------------------
    def _work(self) -> None:
        """One iteration: admit waiting requests, compute up to ``prefill_chunk`` prompt tokens, then one
        decode step for every decoding row. A long prompt thus delays the others' next token by one
        budget of prefill at most, and a request cancelled while prefilling stops between pieces."""
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                # what each tenant has running counts in its share (requests that ended have left)
                self._pending.running(self._serving())
                while not (
                    self._pending or self._prefilling or self._active or self._scoring or self._stopping
                ):
                    if not self._cv.wait(self.heap.wait):  # quiet for a while: freed pages go back (heap)
                        self.heap.idle()
                if self._stopping:
                    gone = ShuttingDownError("the server is shutting down")
                    for req in [*self._pending.drain(), *self._serving()]:
                        self._unscored(req, "the server is shutting down")
                        _emit(req, ("error", gone))
                    for job in self._scoring:
                        self._end_job(job, skipped("the server is shutting down", job.tokens, job.policy))
                    self._prefilling, self._active, self._scoring = [], [], collections.deque()
                    return
                # the free slots go to the tenants in turn (deficit round-robin), each under its batch share
                busy = len(self._active) + len(self._prefilling)
                admit = self._pending.take(self.settings.max_batch - busy)
                self._admitted = len(admit)
            for req in admit:
                try:
                    if not req.cancelled.is_set():
                        self._prefilling.append(self._admit(req))
                    else:
                        self._unscored(req, "the request was cancelled")
                except Exception as exc:  # a bad request must never kill the worker
                    self._fail(req, exc, "prefill")
                finally:
                    self._admitted -= 1
            spent = self._prefill_some() if self._prefilling else 0
            if self._active:
                try:
                    self._step()
                except Exception as exc:  # a fault outside any one row: the rows fail, the worker lives
                    log.exception("decode step failed")
                    rows, self._active = self._active, []
                    for row in rows:  # sessions not returned (a cache may hold half a step)
                        self._leave(row, keep=False)
                        self._fail(row.req, exc, None)
            if self._scoring and not spent:  # live work first: never in an iteration that computed a prompt
                live = self._active or self._prefilling or self._pending
                self._score_some(self.settings.fidelity_chunk if live else self.settings.prefill_chunk)
            self.heap.trim()

    def _serving(self) -> list[Request]:
        """The requests being prefilled or decoded."""
        return [*(p.req for p in self._prefilling), *(r.req for r in self._active)]

    def _fail(self, req: Request, exc: Exception, where: str | None) -> None:
        """``req`` fails alone: its error is emitted; its session, which may hold half a step, is dropped.
        An error that is not a :class:`KvlabError` is logged with ``where`` it happened (None: logged)."""
        if where is not None and not isinstance(exc, KvlabError):
            log.error("a request failed in its %s", where, exc_info=exc)
        self._release(req)
        self._unscored(req, "the request failed")
        _emit(req, ("error", exc))

    def _release(self, req: Request) -> None:
        """``req`` no longer counts in its tenant's share: called before its last event, so its client's
        next request finds the place free (the worker's snapshot of what runs is taken once per iteration)."""
        with self._cv:
            self._pending.release(req)

    # -- prefill ---------------------------------------------------------------------------------------
    def _admit(self, req: Request) -> _Prefill:
        """Find the longest cached prefix and plan the forwards that compute the rest (nothing runs yet but
        the store's lookup)."""
        t0 = time.perf_counter()
        top = req.logprobs or 0
        session = self._take_session(req.ids, req.salt, top if req.score_prompt else None)
        if session is not None:
            cached = len(session.ids)
            new = _pieces(req.ids[cached:], _feed_size(session.cache, req.score_prompt))
            p = _Prefill(
                req, session, True, "session", cached, session.cache.evictions, t0, collections.deque(new)
            )
            if req.score_prompt and session.last_logits is not None:  # scores the first new token
                p.prev = torch.log_softmax(session.last_logits.float(), -1)
        else:
            roll = self.policy.layout.rolls()  # a scored layout pins nothing (its policy keeps its own sinks)
            pinned, sinks = (req.pinned, roll.sinks) if roll is not None else (0, 0)
            cache = cache_for(self.policy.live(), self.handle, pinned=pinned)
            session = Session(uuid.uuid4().hex[:12], req.salt, [], cache, pinned, sinks)
            session.most = self.policy.layout.held_at_most(self.handle.max_positions)
            p = _Prefill(req, session, False, "none", 0, 0, t0, collections.deque())
            size = _feed_size(cache, req.score_prompt)
            if not req.score_prompt and self.prefixes.applies(req.pinned, len(req.ids)):
                p.shared = req.ids[: req.pinned]  # compressed once and shared (kvlab.serve.prefixes)
                p.forwards.append(req.ids[req.pinned :])
            elif req.score_prompt or size is None:  # computed here (the store keeps no scores; see above)
                p.forwards.extend(_pieces(req.ids, size))
            else:
                head, rest = req.ids[: self.capacity], req.ids[self.capacity :]
                p.head = self._lookup(head, req.salt)
                if p.head is not None:
                    p.cached, p.source = p.head.at, ("store" if p.head.at else "none")
                    p.tiers = p.head.tiers
                else:
                    p.forwards.extend(_pieces(head, size))
                p.forwards.extend(_pieces(rest, size))
        p.total = sum(len(f) for f in p.forwards) + (len(p.head.ids) - p.head.at if p.head else 0)
        p.total += len(p.shared or ())
        return p

    def _lookup(self, head: list[int], salt: str) -> _Head | None:
        """The longest stored prefix of ``head`` (all but its last token at most: one is always computed,
        for its logits); None without a store or when the store fails (the head is then computed)."""
        if self.store is None:
            return None
        try:
            ns = self.store.namespace(self.handle, salt=salt or None)
            match = self.store.lookup(head, ns, max_tokens=len(head) - 1, device=self.handle.device)
        except StoreError as exc:
            self.store_warnings += 1
            log.warning("kvlab serve: the store failed (%s); computing this prompt without it", exc)
            return None
        at = match.cached_tokens if match.snapshot is not None else 0
        return _Head(list(head), at, match.snapshot, dict(match.tier_blocks))

    def _prefill_some(self) -> int:
        """Spend this iteration's budget of prompt tokens: shortest remaining prompt first (a short prompt is
        not held behind a long one; the long one takes what the short ones leave). The budget is
        ``prefill_chunk`` while a row decodes (from the moment one does), else ``prefill_alone``. Returns the
        tokens spent."""
        chunk = self.settings.prefill_chunk
        budget, spent = (chunk if self._active else max(chunk, self.settings.prefill_alone)), 0
        for p in sorted(self._prefilling, key=lambda p: p.remaining):
            try:
                while spent < budget and p.remaining > 0 and not p.req.cancelled.is_set():
                    spent += self._piece(p, budget - spent)
            except Exception as exc:
                self._prefilling.remove(p)
                self._fail(p.req, exc, "prefill")
                continue
            if p.req.cancelled.is_set():
                self._prefilling.remove(p)
                if p.taken and p.fed == 0:  # untouched: the idle session it was goes back
                    self._return_session(p.session)
                self._unscored(p.req, "the request was cancelled")
                continue  # else dropped: its cache may end in the middle of a held roll
            if p.remaining == 0:
                self._prefilling.remove(p)
                try:
                    self._prefilled(p)
                except Exception as exc:
                    self._fail(p.req, exc, "prefill")
            if self._active:  # a prompt just done decodes: its next token waits one chunk at most
                budget = chunk
            if spent >= budget:
                break
        return spent

    def _piece(self, p: _Prefill, budget: int) -> int:
        """Compute the next piece of ``p``'s prompt, at most ``budget`` tokens; returns how many."""
        if p.shared is not None:  # the whole shared prefix, loaded or computed (counted against the budget)
            info = self.prefixes.load(p.session.cache, p.shared, p.req.salt)
            n, p.shared, p.prefix = len(p.shared), None, info
            p.fed += n
            if info["source"] != "computed":
                p.cached, p.source = n, "compressed-prefix"
            return n
        head = p.head
        if head is not None and head.at < len(head.ids):
            piece = head.ids[head.at : head.at + budget]
            fwd = (
                self.handle.extend(head.snapshot, piece, all_logits=False)
                if head.snapshot is not None
                else self.handle.prefill(piece, all_logits=False)
            )
            head.snapshot, head.at = fwd.snapshot, head.at + len(piece)
            p.logits, p.fed = fwd.logits[-1].float(), p.fed + len(piece)
            if head.at == len(head.ids):
                self._seed_head(p.session.cache, head.snapshot, p.req.salt)
            return len(piece)
        forward = p.forwards[0]
        cache = p.session.cache
        if not isinstance(
            cache, RollingCache
        ):  # evicts inside its update: the forward whole (module docstring)
            budget = len(forward)
        piece = forward[p.at : p.at + budget]
        ids = torch.tensor([piece], dtype=torch.long, device=self.handle.device)
        logits = self.handle.run(ids, cache, logits_to_keep=0 if p.req.score_prompt else 1).logits[0].float()
        p.at += len(piece)
        if p.at < len(forward):
            cache.hold_roll()  # the rest of this forward sees what this piece saw
        else:
            p.forwards.popleft()
            p.at = 0
        if p.req.score_prompt:
            log_probs = torch.log_softmax(logits, -1)
            top = p.req.logprobs or 0
            for j, tok in enumerate(piece):
                src = p.prev if j == 0 else log_probs[j - 1]
                p.scores.append(None if src is None else _logprob(src, tok, top))
            p.prev = log_probs[-1]
        p.logits, p.fed = logits[-1], p.fed + len(piece)
        return len(piece)

    def _seed_head(self, cache: LiveCache, snapshot: KVSnapshot, salt: str) -> None:
        """The computed head into the rolling cache, and its blocks into the store (a store that fails to
        write must not cost the request: it is only not shared this time).

        The store holds only full-precision prompt K/V, the same under every cache policy: the head (at most
        ``sinks + window`` tokens, so nothing was evicted) was computed by ``handle.prefill``/``extend`` from
        an exact stored prefix, with no policy's cache in the forward; the policy's codec applies only here,
        when the head is seeded into the session's cache (which encodes it). So the store's namespace need
        not name the policy: a stored prefix is never another policy's output.
        """
        device = self.handle.device  # a prefix read from the store may arrive on the CPU
        cache.seed(
            [(k.to(device), v.to(device)) for k, v in zip(snapshot.keys, snapshot.values, strict=True)]
        )
        assert self.store is not None
        try:
            # Redis writes go through the tier's write-behind queue: a slow or failing Redis never holds
            # this thread (the blocks are copied into the memory tier here, then queued)
            self.store.put(snapshot, salt=salt or None, model=self.handle, write_behind=True)
        except StoreError as exc:
            self.store_warnings += 1
            log.warning("kvlab serve: could not store this prompt's blocks (%s); serving it anyway", exc)

    def _prefilled(self, p: _Prefill) -> None:
        """``p``'s prompt is computed: record it in its session, report it, start decoding (or finish a
        scoring request, which generates nothing)."""
        req, session = p.req, p.session
        top = req.logprobs or 0
        new = len(req.ids) - p.cached
        # session.scores is parallel to session.ids: empty for a new session (whose cached tokens, from the
        # store or a compressed prefix, have no scores)
        scores: list[LogProb | None] = []
        if req.score_prompt:  # the cached tokens' stored scores, the new ones computed
            scores = [*(None if e is None else (e[0], e[1], e[2][:top]) for e in session.scores), *p.scores]
            session.scores = [*session.scores, *p.scores]
        else:
            session.scores = [*session.scores, *[None] * (len(req.ids) - len(session.scores))]
        session.ids = list(req.ids)
        session.requests += 1
        session.reused_tokens += p.cached
        session.computed_tokens += new
        info: dict[str, Any] = {
            "session": session.id,
            "source": p.source,
            "cached_tokens": p.cached,
            "computed_tokens": new,
            "rolls": session.cache.evictions - p.rolls_before,
            "prefill_ms": round((time.perf_counter() - p.t0) * 1000, 2),
            "store_tiers": p.tiers,
            "cache": dict(self.cache_info),
            **({"compressed_prefix": p.prefix} if p.prefix is not None else {}),
        }
        if self.metrics is not None:
            self.metrics.prefilled(info, tenant=req.tenant)
        if req.score_prompt:
            info["_prompt_logprobs"] = scores
        # a CPU generator wherever the model runs: Sampling.pick draws from probabilities on the CPU
        gen = None if req.sampling.greedy else torch.Generator().manual_seed(req.sampling.seed)
        assert p.logits is not None
        row = _Row(req, session, p.logits[None], gen, info)
        if self.captured is not None and req.max_new_tokens:
            assert isinstance(session.cache, RollingCache)  # a captured policy rolls (captured_roll)
            row.slot = slot = self.captured.join(session.cache)
            info["rolls"] += self.captured.evictions(slot) - session.cache.evictions  # a roll join applied
        if req.fidelity is not None:
            info["fidelity_url"] = f"/v1/fidelity/{req.fidelity}"
            row.served = self._reserve(req)
        if req.max_new_tokens == 0:  # scoring a prompt: nothing to generate
            req.emit(("start", info))
            row.finish = "length"
            self._finish(row)
            return
        self._active.append(row)  # counted as decoding before its first event reaches anyone
        try:
            req.emit(("start", info))
        except Exception:
            self._active.remove(row)
            self._leave(row, keep=False)
            raise

    # -- decode ----------------------------------------------------------------------------------------
    def _step(self) -> None:
        """Pick one token per row, report it, feed every row's token in one batched forward.

        A row that fails (its pick, log-probability or text, or its part of the forward) fails alone:
        its error is emitted and its session dropped, the other rows go on (the batched forward is undone
        and its rows run one by one when it raises: :func:`~kvlab.hf.batch.step_rolling_rows_isolated`).
        """
        now = time.perf_counter()
        failed: dict[int, Exception] = {}
        for row in self._active:
            if row.req.cancelled.is_set():
                row.finish = "cancelled"
                continue
            try:
                self._pick(row, now)
            except Exception as exc:
                failed[id(row)] = exc
        fed = [r for r in self._active if r.finish != "cancelled" and id(r) not in failed]
        if fed:
            rolls = [self._evictions(r) for r in fed]
            results = self._decode(fed)
            for i, (row, res) in enumerate(zip(fed, results, strict=True)):
                if isinstance(res, Exception):
                    failed[id(row)] = res
                    continue
                row.logits = res[None]
                row.session.ids.append(row.out[-1])
                row.session.scores.append(row.entry)
                dropped = self._evictions(row) - rolls[i]
                row.info["rolls"] += dropped
                if self.metrics is not None and dropped > 0:
                    self.metrics.rolls.inc(dropped)
        ended = [r for r in self._active if r.finish is not None or id(r) in failed]
        # no longer counted as served when their last event arrives (a gauge read right after must say so)
        self._active = [r for r in self._active if r.finish is None and id(r) not in failed]
        for row in ended:
            try:  # out of the captured rows, back into its own cache (dropped where the row failed)
                self._leave(row, keep=id(row) not in failed)
            except Exception as exc:
                failed[id(row)] = exc
            error = failed.get(id(row))
            if error is not None:
                self._fail(row.req, error, "decode step")
                continue
            try:
                self._finish(row)
            except Exception as exc:
                self._fail(row.req, exc, "reply")

    def _decode(self, fed: list[_Row]) -> list[torch.Tensor | Exception]:
        """One decode step for ``fed`` (each row's last picked token): each row's ``[vocab]`` logits or the error
        it failed with. Eager: each row's own cache, a row failing alone. Captured: the rows' one step, which
        fails for every row it carried (their rows' state may hold half a step: they are dropped)."""
        tokens = [r.out[-1] for r in fed]
        if self.captured is None:
            return step_rolling_rows_isolated(self.handle, [r.session.cache for r in fed], tokens)
        try:
            logits = self.captured.step([cast(int, r.slot) for r in fed], tokens)
        except Exception as exc:
            log.warning("a captured decode step failed for its %d rows", len(fed), exc_info=True)
            return [exc] * len(fed)
        return [logits[i] for i in range(len(fed))]

    def _evictions(self, row: _Row) -> int:
        """Rolls of ``row``'s conversation so far (its captured row's while it decodes there)."""
        if row.slot is None or self.captured is None:
            return row.session.cache.evictions
        return self.captured.evictions(row.slot)

    def _leave(self, row: _Row, keep: bool) -> None:
        """``row`` stops decoding in the captured rows: its state written back into its session's cache
        (``keep``), or dropped with the session."""
        if row.slot is None or self.captured is None:
            return
        slot, row.slot = row.slot, None
        self.captured.leave(slot, cast(RollingCache, row.session.cache) if keep else None)

    def _pick(self, row: _Row, now: float) -> None:
        """Pick ``row``'s next token from its logits and report it."""
        tok = int(row.req.sampling.pick(row.logits, row.generator)[0])
        row.out.append(tok)
        if row.served is not None:  # the distribution this token was picked from, for its fidelity score
            row.served.append(row.logits[0].to("cpu", torch.float32, copy=True))
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
            since = row.req.submitted if first else row.last_step
            self.metrics.token(now - since, first=first, tenant=row.req.tenant)
        row.last_step = now

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
        """Return ``row``'s session to the idle pool, then report the end of its reply: whoever reads the
        gauges or the status page once the reply has arrived sees the session idle, never missing."""
        events: list[tuple] = []
        if row.finish != "cancelled":
            reply = self.handle.decode([t for t in row.out if t not in row.req.stop_ids])
            text, _ = _cut_at_stop(reply, row.req.stop_strings)
            # the held-back tail, or a stop token's log-probability (no text of its own)
            tail = text[len(row.text) :] if len(text) > len(row.text) and text.startswith(row.text) else ""
            if tail or row.unsent:
                events.append(("token", None, tail, row.unsent))
                row.text, row.unsent = row.text + tail, []
            row.info["completion_tokens"] = len(row.out)
            row.info["completion_ids"] = list(row.out)
            row.info["kept_tokens"] = row.session.cache.kept
            row.info["pinned_tokens"] = row.session.pinned
            row.info["cache_bytes"] = row.session.cache.nbytes  # what the conversation's cache holds now
            if row.req.logprobs is not None:
                row.info["_logprobs"] = row.logprobs
            events.append(("done", row.finish, row.info, row.text))
        row.session.last_logits = row.logits[0]
        self._return_session(row.session)
        self._release(row.req)
        self._to_score(row)
        for event in events:
            row.req.emit(event)

    # -- fidelity per response (kvlab.serve.fidelity) ----------------------------------------------------
    def _reserve(self, req: Request) -> list[torch.Tensor] | None:
        """Room for a scored request's kept logits (``max_new_tokens`` rows of the vocabulary), or None (the
        response is then not scored, and its record says why) when the scored responses' would pass
        ``fidelity_memory_mb``."""
        assert req.fidelity is not None
        need = req.max_new_tokens * int(self.handle.config.vocab_size) * 4
        if sum(self._reserved.values()) + need > self.settings.fidelity_memory_mb * 2**20:
            self._unscored(req, "too many responses waiting to be scored (fidelity memory full)")
            return None
        self._reserved[req.fidelity] = need
        return []

    def _unscored(self, req: Request, why: str) -> None:
        """``req``'s response will not be scored: its record says why, its reserved memory is freed."""
        if req.fidelity is not None:
            self._reserved.pop(req.fidelity, None)
            self.fidelity.finish(req.fidelity, skipped(why, 0, self.policy.spec))

    def _to_score(self, row: _Row) -> None:
        """Queue an answered scored response for scoring (a cancelled or empty one is not scored)."""
        req = row.req
        if req.fidelity is None:
            return
        if row.served is None or row.finish == "cancelled" or not row.served:
            self._unscored(req, "the request was cancelled" if row.finish == "cancelled" else "no tokens")
            return
        ids, reserved = [*req.ids, *row.out[:-1]], self._reserved.pop(req.fidelity, 0)
        job = ScoringJob(
            req.fidelity, ids, len(req.ids) - 1, torch.stack(row.served), self.policy.spec, reserved
        )
        row.served = None
        why = job.refusal(self.handle)
        if why is not None:
            self._end_job(job, skipped(why, job.tokens, job.policy))
            return
        self._reserved[job.fid] = job.reserved  # held until the job ends
        self._scoring.append(job)

    def _score_some(self, budget: int) -> None:
        """Teacher-force up to ``budget`` tokens of the oldest answered scored response through its full cache;
        record its score once every token is fed. A failure skips that response alone."""
        job = self._scoring[0]
        try:
            while budget > 0 and not job.finished:
                budget -= job.feed(self.handle, budget)
            if not job.finished:
                return
            result = job.result()
        except Exception as exc:
            log.error("scoring a response's fidelity failed", exc_info=exc)
            result = skipped("scoring failed (logged on the server)", job.tokens, job.policy)
        self._scoring.popleft()
        self._end_job(job, result)

    def _end_job(self, job: ScoringJob, result: dict[str, Any]) -> None:
        self._reserved.pop(job.fid, None)
        job.cache, job.full = None, []
        self.fidelity.finish(job.fid, result)
        if self.metrics is not None and "kl" in result:
            self.metrics.fidelity(result)

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
        with self._sessions_lock:
            self.sessions[session.id] = session
            while len(self.sessions) > self.settings.max_sessions:
                _, dropped = self.sessions.popitem(last=False)
                dropped.cache.close()  # an attention-scored cache's query hooks go with it

    def idle_sessions(self) -> int:
        return len(self.sessions)

    def session_bytes(self) -> int:
        """Bytes the idle sessions' caches hold (bounded by ``max_sessions``)."""
        with self._sessions_lock:
            caches = [s.cache for s in self.sessions.values()]
        return sum(c.nbytes for c in caches)

    def store_memory_bytes(self) -> int:
        """K/V bytes the store's memory tier holds (bounded by its cap); 0 without one."""
        if self.store is None:
            return 0
        return sum(getattr(t, "held_bytes", 0) for t in self.store.tiers if t.name == "memory")


def _row(s: Session, state: str, **extra: int) -> dict[str, Any]:
    """``s`` as the status page lists it: its state, cache layout and reuse."""
    total = s.reused_tokens + s.computed_tokens
    reuse = round(s.reused_tokens / total, 3) if total else 0.0
    return {
        "session": s.id,
        "state": state,
        **s.layout(),
        "requests": s.requests,
        "reuse_ratio": reuse,
        **extra,
    }


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


def check_settings(handle: ModelHandle, settings: EngineSettings) -> None:
    """Refuse settings this model cannot be served with, before anything is created."""
    if settings.max_batch < 1 or settings.max_queue < 0 or settings.max_sessions < 1:
        raise BadInputError("need max_batch >= 1, max_queue >= 0 and max_sessions >= 1")
    for name in (
        "prefill_chunk",
        "prefill_alone",
        "max_open_per_key",
        "max_batch_per_key",
        "max_work_per_key",
    ):
        value = getattr(settings, name)
        if value is not None and value < 1:
            raise BadInputError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 0.0 <= settings.fidelity_sample <= 1.0:  # NaN too
        raise BadInputError(f"--fidelity-sample must lie in [0, 1], got {settings.fidelity_sample}")
    if not settings.fidelity_wait_s >= 0 or settings.fidelity_chunk < 1 or settings.fidelity_memory_mb < 1:
        raise BadInputError("need fidelity_wait_s >= 0, fidelity_chunk >= 1 and fidelity_memory_mb >= 1")
    if settings.capture not in ("off", "eager", "compile", "cuda-graph"):
        raise BadInputError(f"capture must be off, eager, compile or cuda-graph, got {settings.capture!r}")
    if settings.capture != "off":
        settings.policy.captured_roll(settings.capture)
        check_ring_model(handle.config)
    # builds nothing but the rule (buffers are allocated on first use): raises for a bad window or model
    cache_for(settings.policy.live(), handle)
    if settings.policy.layout.held_at_most(handle.max_positions) is not None and not handle.max_positions:
        raise BadInputError(
            f"--cache '{settings.policy.spec}' keeps a share of every token: its cache is bounded by the model's "
            "position limit, which this model's config does not state (max_position_embeddings)"
        )


def check_request_fits(
    ids: list[int], pinned: int, settings: EngineSettings, max_new: int = 0, max_positions: int = 0
) -> None:
    """Refuse what the engine could not serve faithfully, before it is queued. A layout that does not roll
    keeps its slots at their original positions (a scored or strided one): the conversation, ``ids`` and the
    ``max_new`` tokens it may add, must end within the model's ``max_positions`` (0: not stated)."""
    if not ids:
        raise BadInputError("the prompt is empty")
    roll = settings.policy.layout.rolls()
    if roll is None and max_positions and len(ids) + max_new > max_positions:
        raise BadInputError(
            f"{len(ids)} prompt tokens and max_tokens {max_new} need positions up to {len(ids) + max_new - 1}, "
            f"past the model's last ({max_positions - 1}); --cache '{settings.policy.spec}' keeps original "
            "positions, so a conversation ends there: ask for fewer tokens or start a new conversation"
        )
    if roll is not None and pinned >= roll.window // 2:
        raise BadInputError(
            f"the system prompt takes {pinned} tokens; it is pinned in the cache and must stay below half "
            f"the window ({roll.window // 2}); start the server with a larger --window"
        )
