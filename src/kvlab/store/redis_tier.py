"""The Redis tier: blocks shared by every process (or machine) that can reach one Redis server.

Keys (``prefix`` defaults to ``kvlab``): ``<prefix>:b:<hash>`` holds a block's bytes (the same
self-checking safetensors bytes as a disk file, written with one ``SET``, so a reader gets a whole
block or nothing); ``<prefix>:c:<parent>`` is a hash from child block hash to its token ids (JSON),
for partial-block matching. A put writes the index entry first, then the block: a put cut between the
two leaves an entry without its block, which a lookup takes as a clean miss and the next put of the
block completes. Capacity and eviction are Redis's own (``maxmemory`` with an ``allkeys-lru`` policy).

Failures never cost a request. An unreachable server raises :class:`StoreUnavailableError` on open;
after that, on the paths a lookup or a put takes, *every* error redis-py raises (a lost or refused
connection, a timeout, ``WRONGTYPE`` from a key of the wrong type, ``OOM`` from a full server with the
``noeviction`` policy, ``READONLY`` from a replica, ``MISCONF`` from a server that cannot save, anything
else) is a counted miss on a read and a counted skipped write (``counters.skipped``) on a put, logged at
most once per kind every 30 s, never a traceback per call. Every call is bounded: ``timeout_s`` (1 s by
default) on each socket read and ``connect_timeout_s`` on connecting, with no retries but one reconnect
after a dropped connection. Every error also trips the tier's one :class:`Breaker`: for ``backoff_s``
(5 s by default) calls are not made (reads miss, writes are skipped, at once, without touching the
socket), then one call probes the server again. A timeout or a lost connection stops every call; an error
reply stops only calls of its kind (a full server refuses writes but still serves reads). So a paused
(SIGSTOP), dead or full server costs one failed call per back-off, not one per block of every request.

Writes can be made *behind* the caller (:meth:`RedisTier.put_later`, what ``KVStore.put(...,
write_behind=True)`` uses and ``kvlab serve`` asks for): the block joins a queue bounded by
``queue_bytes`` that one writer thread empties; a full queue drops the block (``counters.dropped``).

Block writes are single commands, never a pipeline: redis-py rewrites a failed pipeline command's error
into ``Command # N (<its arguments>) of pipeline caused error`` (``Pipeline.annotate_exception``), joining
every argument as text and shortening it with ``textwrap.shorten``: seconds of CPU over a block's
megabytes, on every put refused by a full Redis (issue 48). A single command's error carries only the
server's reply.
Maintenance calls (``find``, ``verify``, ``gc``, ``usage``, listing) raise :class:`StoreUnavailableError`
on any Redis error, which the CLI prints as one line.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from kvlab.cache.io import loads_bounded
from kvlab.errors import BadInputError
from kvlab.store.block import Block, decode_block, encode_block
from kvlab.store.errors import CorruptBlockError, StoreUnavailableError
from kvlab.store.keys import block_problem
from kvlab.store.tier import RateLimitedLog, TierCounters

log = logging.getLogger("kvlab.store")

T = TypeVar("T")
DEFAULT_CONNECT_TIMEOUT_S = 1.0
DEFAULT_TIMEOUT_S = 1.0
DEFAULT_BACKOFF_S = 5.0
DEFAULT_QUEUE_BYTES = 256 * 2**20  # blocks waiting for the writer thread (a SmolLM2 block: 2.9 MB)
_MAX_INDEX_ENTRY_BYTES = 1 << 20  # one child's token ids as JSON (a 64-token block: ~500 bytes)
_HASH_RE = re.compile(r"[0-9a-f]{64}")


def _seconds(name: str, value: float) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise BadInputError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


class Breaker:
    """The one circuit breaker of a :class:`RedisTier`, with a state per kind of call (``read``, ``write``).

    Closed, a call goes to the server. A failure opens it for ``backoff_s``: for every kind after a timeout or
    a lost connection (the server does not answer), for the failed call's kind after an error reply (a full
    Redis refuses writes with OOM but still serves reads). While it is open, calls of that kind are not made.
    Once the back-off has passed, the next call of that kind probes the server, and the others keep waiting
    for another back-off: the probe's success closes the breaker for its kind, its failure opens it again.
    Thread-safe (the tier's writer thread and the caller's thread share it).
    """

    KINDS = ("read", "write")

    def __init__(self, backoff_s: float) -> None:
        self.backoff_s = backoff_s
        self._until = dict.fromkeys(self.KINDS, 0.0)  # per kind: 0 closed, else monotonic end of the back-off
        self._lock = threading.Lock()

    def is_open(self, kind: str | None = None) -> bool:
        """Whether calls of ``kind`` (of any kind: None) are held back now."""
        now = time.monotonic()
        return any(now < self._until[k] for k in ((kind,) if kind else self.KINDS))

    def allow(self, kind: str) -> bool:
        """Whether a call of ``kind`` may go to the server now (the probe, when the back-off has passed)."""
        with self._lock:
            until = self._until[kind]
            if until == 0.0:
                return True
            now = time.monotonic()
            if now < until:
                return False
            self._until[kind] = now + self.backoff_s  # this call probes; the others wait meanwhile
            return True

    def trip(self, kinds: tuple[str, ...]) -> None:
        with self._lock:
            until = time.monotonic() + self.backoff_s
            for kind in kinds:
                self._until[kind] = until

    def close(self, kind: str) -> bool:
        """A call of ``kind`` succeeded: closed for that kind; True when it was open (the server is back)."""
        with self._lock:
            was_open, self._until[kind] = self._until[kind] != 0.0, 0.0
            return was_open


class RedisTier:
    name = "redis"
    persistent = True

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "kvlab",
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        backoff_s: float = DEFAULT_BACKOFF_S,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
    ):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise StoreUnavailableError("the Redis tier needs redis-py: pip install 'kvlab[redis]'") from None
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise BadInputError(f"a Redis store URL looks like redis://host:port/db, got {url!r}")
        self.url = url
        self.prefix = prefix
        self.connect_timeout_s = _seconds("connect_timeout_s", connect_timeout_s)
        self.timeout_s = _seconds("timeout_s", timeout_s)
        self.backoff_s = _seconds("backoff_s", backoff_s)
        if isinstance(queue_bytes, bool) or not isinstance(queue_bytes, int) or queue_bytes < 1:
            raise BadInputError(f"queue_bytes must be a positive number of bytes, got {queue_bytes!r}")
        self.queue_bytes = queue_bytes
        self.counters = TierCounters()
        self._counting = threading.Lock()  # counters the writer thread and the caller's thread both move
        self._redis = redis
        self._errors = (redis.RedisError,)  # the base of every error redis-py raises
        # no answer at all (every kind of call stops); any other error is a reply refusing that call
        self._down: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError)
        self.breaker = Breaker(self.backoff_s)
        self._log = RateLimitedLog(log)
        # write-behind: blocks waiting for the writer thread, by hash (a block queued twice is queued once)
        self._queue: collections.deque[Block] = collections.deque()
        self._queued: dict[str, int] = {}  # hash -> bytes, until its write is over
        self._queued_bytes = 0
        self._queue_cv = threading.Condition()
        self._writer: threading.Thread | None = None
        try:
            self.client = redis.Redis.from_url(
                url,
                socket_connect_timeout=self.connect_timeout_s,
                socket_timeout=self.timeout_s,
                # no retry after a timeout (a paused server would cost it again); one after a dropped
                # connection (a restarted server: the pooled socket is stale, a new one works at once)
                retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
                health_check_interval=0,
            )
            self.client.ping()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailableError(
                f"cannot reach Redis at {url} ({exc}); start redis-server or fix --store"
            ) from None
        except ValueError as exc:
            raise BadInputError(f"bad Redis URL {url!r}: {exc}") from None
        except redis.RedisError as exc:  # e.g. "DB index is out of range", auth required
            raise StoreUnavailableError(f"Redis at {url} refused the connection: {exc}") from None

    def _bkey(self, block_hash: str) -> str:
        return f"{self.prefix}:b:{block_hash}"

    def _get_block_bytes(self, block_hash: str) -> bytes | None:
        """GET of a block's key. The client is made without ``decode_responses``, so replies are bytes;
        redis-py types them ``bytes | str`` whatever the client's setting."""
        return cast("bytes | None", self.client.get(self._bkey(block_hash)))

    def _ckey(self, parent: str) -> str:
        return f"{self.prefix}:c:{parent}"

    # -- failure handling --------------------------------------------------------------------------
    @property
    def backing_off(self) -> bool:
        """True while the breaker holds some calls back (after a failure, for ``backoff_s``)."""
        return self.breaker.is_open()

    def _count(self, name: str) -> None:
        with self._counting:
            setattr(self.counters, name, getattr(self.counters, name) + 1)

    def _call(
        self, what: str, fn: Callable[[], T], fallback: T, then: str = "a miss", kind: str = "read"
    ) -> T:
        """``fn()``, or ``fallback`` when the breaker holds calls of ``kind`` back or Redis fails (counted,
        logged, and the breaker tripped)."""
        if not self.breaker.allow(kind):
            return fallback
        try:
            out = fn()
        except self._errors as exc:
            self._failed(what, exc, then, kind)
            return fallback
        self._answered(kind)
        return out

    def _answered(self, kind: str) -> None:
        if self.breaker.close(kind):
            log.warning("kvlab store: Redis at %s answers %ss again", self.url, kind)

    def _failed(self, what: str, exc: BaseException, then: str = "a miss", kind: str = "read") -> None:
        """Count and log a failed call, and trip the breaker: for every call after no answer (a timeout, a
        lost connection), for calls of ``kind`` after an error reply (OOM, READONLY, MISCONF, WRONGTYPE...)."""
        self._count("errors")
        name = type(exc).__name__
        silent = isinstance(exc, self._down)
        self.breaker.trip(Breaker.KINDS if silent else (kind,))
        then += f"; Redis {'is' if silent else kind + 's are'} skipped for {self.backoff_s:g} s"
        self._log.warn(
            f"{name}:{what}", f"kvlab store: Redis at {self.url} failed to {what} ({name}: {exc}); {then}"
        )

    def _unavailable(self, exc: Exception) -> StoreUnavailableError:
        self.counters.errors += 1
        return StoreUnavailableError(f"Redis at {self.url} failed ({type(exc).__name__}: {exc})")

    def _wrong_type(self, exc: BaseException) -> bool:
        return isinstance(exc, self._redis.ResponseError) and str(exc).startswith("WRONGTYPE")

    # -- reads -------------------------------------------------------------------------------------
    def contains(self, parent: str, block_hash: str) -> bool:
        return bool(self._call("read a block", lambda: self.client.exists(self._bkey(block_hash)), 0))

    def read(self, what: str, fn: Callable[[], T]) -> tuple[T | None, bool]:
        """``fn()`` through the breaker, as :meth:`_call` makes it: ``(its reply, False)``; ``(None, False)``
        when it is held back or fails (counted, logged); ``(None, True)`` for a WRONGTYPE reply (another
        Redis type at the key: the caller drops it; the breaker is not tripped)."""
        if not self.breaker.allow("read"):
            return None, False
        try:
            out = fn()
        except self._errors as exc:
            if self._wrong_type(exc):
                return None, True
            self._failed(what, exc)
            return None, False
        self._answered("read")
        return out, False

    def get(self, parent: str, block_hash: str, scratch: Any = None) -> Block | None:
        started = time.perf_counter()
        data, wrong_type = self.read("read a block", lambda: self._get_block_bytes(block_hash))
        if wrong_type:  # something else under a block's key: not a block, drop it
            self._corrupt(block_hash, "the key holds another Redis type than a block's string")
            return None
        if data is None:
            self.counters.misses += 1
            return None
        try:
            block = decode_block(data, expect_hash=block_hash)
            if block.parent != parent:
                raise CorruptBlockError("stored under another parent")
        except CorruptBlockError as exc:
            self._corrupt(block_hash, str(exc))
            return None
        self.counters.hit(block.nbytes, started)
        return block

    def _corrupt(self, block_hash: str, why: str) -> None:
        self.counters.misses += 1
        self.discard("", block_hash, why)

    def discard(self, parent: str, block_hash: str, why: str) -> None:
        """Delete a block that is not what its key says (reported; a failure to delete is only counted)."""
        self._delete_corrupt(
            "block",
            self._bkey(block_hash),
            f"block {block_hash[:12]} is corrupt ({why}); deleted and treated as a miss",
        )

    def _delete_corrupt(self, what: str, key: str, message: str) -> None:
        self._count("corrupt")
        log.warning("kvlab store: Redis %s", message)
        self._call(f"delete a corrupt {what}", lambda: self.client.delete(key), 0, "left", "write")

    def children(self, parent: str) -> dict[str, tuple[int, ...]]:
        reply, wrong_type = self.read("read a block index", lambda: self.client.hgetall(self._ckey(parent)))
        if wrong_type:
            self._drop_index(parent)  # something else under an index's key
        raw: dict = reply or {}
        out: dict[str, tuple[int, ...]] = {}
        for k, v in raw.items():
            # a damaged or crafted index entry is a miss (counted), never a crash of the lookup
            try:
                name = k.decode("ascii")
                ids = loads_bounded(v, max_bytes=_MAX_INDEX_ENTRY_BYTES)
                if (
                    not _HASH_RE.fullmatch(name)
                    or not isinstance(ids, list)
                    or not all(type(t) is int for t in ids)
                ):
                    raise ValueError("not a block entry")
                out[name] = tuple(ids)
            except (UnicodeDecodeError, ValueError, TypeError):
                self.counters.corrupt += 1
        return out

    def find(self, block_hash: str) -> Block | None:
        try:
            return self._stored(block_hash)
        except CorruptBlockError:
            self.counters.corrupt += 1
            return None

    def _stored(self, block_hash: str) -> Block | None:
        """The block at its key, None when there is none, CorruptBlockError when what is there is not it (a
        maintenance call: any other Redis error raises StoreUnavailableError)."""
        try:
            data = self._get_block_bytes(block_hash)
        except self._errors as exc:
            if not self._wrong_type(exc):
                raise self._unavailable(exc) from None
            raise CorruptBlockError("holds another Redis type than a block's string") from None
        return None if data is None else decode_block(data, expect_hash=block_hash)

    def _drop_index(self, parent: str) -> None:
        key = self._ckey(parent)
        self._delete_corrupt("index", key, f"index {key[:40]} is not a hash; deleted")

    # -- writes ------------------------------------------------------------------------------------
    def put(self, block: Block) -> list[Block]:
        """Store the block unless present, in the caller's thread; a write Redis refuses or cannot take is
        skipped (counted). Single commands, never a pipeline (see the module's docstring)."""

        def write() -> bool:
            if self.client.exists(self._bkey(block.hash)):
                return False
            try:  # the index entry first: without its block it is a miss, and the next put completes it
                self.client.hset(self._ckey(block.parent), block.hash, json.dumps(list(block.token_ids)))
            except self._errors as exc:
                if self._wrong_type(exc):  # another type under the index's key: the next put writes it
                    self._drop_index(block.parent)
                raise
            self.client.set(self._bkey(block.hash), encode_block(block))
            return True

        written = self._call("store a block", write, None, "not stored", "write")
        if written is None:
            self._count("skipped")
        elif written:
            self._count("puts")
        return []

    def put_later(self, block: Block) -> bool:
        """Queue ``block`` for the tier's writer thread (write-behind) and return at once: True when it is
        queued (or already was). False when it will not be written: the breaker holds writes back (counted
        in ``skipped``) or the queue already holds ``queue_bytes`` (counted in ``skipped`` and ``dropped``)."""
        if self.breaker.is_open("write"):
            self._count("skipped")
            return False
        with self._queue_cv:
            if block.hash in self._queued:
                return True
            full = self._queued_bytes + block.nbytes > self.queue_bytes
            if not full:
                self._queue.append(block)
                self._queued[block.hash] = block.nbytes
                self._queued_bytes += block.nbytes
                if self._writer is None:
                    self._writer = threading.Thread(
                        target=self._drain, name="kvlab-redis-writer", daemon=True
                    )
                    self._writer.start()
                self._queue_cv.notify()
        if full:
            self._count("skipped")
            self._count("dropped")
            self._log.warn(
                "queue-full",
                f"kvlab store: the Redis write queue holds {self.queue_bytes} bytes; a block was dropped",
            )
        return not full

    def _drain(self) -> None:
        """The writer thread: each queued block through :meth:`put` (the breaker and the counters apply)."""
        while True:
            with self._queue_cv:
                while not self._queue:
                    self._queue_cv.wait()
                block = self._queue.popleft()
            try:
                self.put(block)
            except Exception as exc:  # not Redis's (those put counts): the thread must outlive it
                self._count("skipped")
                self._log.warn("writer", f"kvlab store: the Redis writer could not store a block ({exc!r})")
            finally:
                with self._queue_cv:
                    self._queued_bytes -= self._queued.pop(block.hash)
                    self._queue_cv.notify_all()

    def pending(self) -> tuple[int, int]:
        """``(blocks, bytes)`` queued for the writer thread and not yet written (or refused)."""
        with self._queue_cv:
            return len(self._queued), self._queued_bytes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written or refused; False when ``timeout`` passed first."""
        with self._queue_cv:
            return self._queue_cv.wait_for(lambda: not self._queued, timeout)

    def delete(self, block_hash: str) -> bool:
        try:
            return bool(self.client.delete(self._bkey(block_hash)))
        except self._errors as exc:
            raise self._unavailable(exc) from None

    # -- maintenance -------------------------------------------------------------------------------
    def block_hashes(self) -> list[str]:
        try:
            return [
                k.decode(errors="replace").rsplit(":", 1)[1]
                for k in self.client.scan_iter(f"{self.prefix}:b:*", count=500)
            ]
        except self._errors as exc:
            raise self._unavailable(exc) from None

    def usage(self) -> tuple[int, int]:
        hashes = self.block_hashes()
        if not hashes:
            return 0, 0
        try:
            pipe = self.client.pipeline(transaction=False)
            for h in hashes:
                pipe.strlen(self._bkey(h))
            sizes = pipe.execute(raise_on_error=False)
        except self._errors as exc:
            raise self._unavailable(exc) from None
        return len(hashes), int(sum(n for n in sizes if isinstance(n, int)))

    def verify(self, *, repair: bool = False) -> dict:
        ok, corrupt = 0, []
        for h in self.block_hashes():
            try:
                block = self._stored(h)
                if block is None:
                    continue
                problem = block_problem(block)
                if problem:
                    raise CorruptBlockError(f"block {h[:16]}: {problem}")
                ok += 1
            except CorruptBlockError as exc:
                corrupt.append({"key": self._bkey(h), "reason": str(exc)})
                if repair:
                    self.delete(h)
        return {"ok": ok, "corrupt": corrupt, "temp_files": []}

    def gc(self, **_: object) -> dict:
        """Drop child-index entries whose blocks Redis has evicted (and index keys of another type)."""
        dropped = 0
        try:
            for key in self.client.scan_iter(f"{self.prefix}:c:*", count=500):
                try:
                    kids = cast("list[bytes]", self.client.hkeys(key))  # bytes replies, see _get_block_bytes
                except self._errors as exc:
                    if not self._wrong_type(exc):
                        raise
                    self.client.delete(key)
                    dropped += 1
                    continue
                if not kids:
                    continue
                pipe = self.client.pipeline(transaction=False)
                for k in kids:
                    pipe.exists(self._bkey(k.decode(errors="replace")))
                for k, alive in zip(kids, pipe.execute(), strict=True):
                    if not alive:
                        self.client.hdel(key, k)
                        dropped += 1
        except self._errors as exc:
            raise self._unavailable(exc) from None
        return {"stale_index_entries_removed": dropped}
