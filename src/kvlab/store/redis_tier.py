"""The Redis tier: blocks shared by every process (or machine) that can reach one Redis server.

Keys (``prefix`` defaults to ``kvlab``): ``<prefix>:b:<hash>`` holds a block's bytes (the same
self-checking safetensors bytes as a disk file, written with one ``SET``, so a reader gets a whole
block or nothing); ``<prefix>:c:<parent>`` is a hash from child block hash to its token ids (JSON),
for partial-block matching. Capacity and eviction are Redis's own (``maxmemory`` with an
``allkeys-lru`` policy); a child entry whose block was evicted is a clean miss and is dropped.

Failures never cost a request. An unreachable server raises :class:`StoreUnavailableError` on open;
after that, on the paths a lookup or a put takes, *every* error redis-py raises (a lost or refused
connection, a timeout, ``WRONGTYPE`` from a key of the wrong type, ``OOM`` from a full server with the
``noeviction`` policy, anything else) is a counted miss on a read and a counted skipped write
(``counters.skipped``) on a put, logged at most once per kind every 30 s, never a traceback per call.
Every call is bounded: ``timeout_s`` (1 s by default) on each socket read and ``connect_timeout_s`` on
connecting, with no retries but one reconnect after a dropped connection; and after a timeout or a
lost connection the tier *backs off* for ``backoff_s`` (5 s by default): reads miss and writes are
skipped at once, without touching the socket, then one call probes the server again. A paused (SIGSTOP)
or dead server therefore costs one timeout per back-off, not one per block of every request.
Maintenance calls (``find``, ``verify``, ``gc``, ``usage``, listing) raise :class:`StoreUnavailableError`
on any Redis error, which the CLI prints as one line.
"""

from __future__ import annotations

import json
import logging
import math
import re
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
        self.counters = TierCounters()
        self._redis = redis
        self._errors = (redis.RedisError,)  # the base of every error redis-py raises
        self._down: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError)
        self._down_until = 0.0  # monotonic time before which the server is not called (back-off)
        self._failing = False
        self._log = RateLimitedLog(log)
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
        """True while the tier skips the server after a timeout or a lost connection."""
        return time.monotonic() < self._down_until

    def _call(self, what: str, fn: Callable[[], T], fallback: T, then: str = "a miss") -> T:
        """``fn()``, or ``fallback`` when the tier is backing off or Redis fails (counted and logged)."""
        if self.backing_off:
            return fallback
        try:
            out = fn()
        except self._errors as exc:
            self._failed(what, exc, then)
            return fallback
        if self._failing:
            self._failing = False
            log.warning("kvlab store: Redis at %s answers again", self.url)
        return out

    def _failed(self, what: str, exc: BaseException, then: str = "a miss") -> None:
        self.counters.errors += 1
        self._failing = True
        kind = type(exc).__name__
        if isinstance(exc, self._down):
            self._down_until = time.monotonic() + self.backoff_s
            then += f"; Redis is skipped for {self.backoff_s:g} s"
        self._log.warn(
            f"{kind}:{what}", f"kvlab store: Redis at {self.url} failed to {what} ({kind}: {exc}); {then}"
        )

    def _unavailable(self, exc: Exception) -> StoreUnavailableError:
        self.counters.errors += 1
        return StoreUnavailableError(f"Redis at {self.url} failed ({type(exc).__name__}: {exc})")

    def _wrong_type(self, exc: BaseException) -> bool:
        return isinstance(exc, self._redis.ResponseError) and str(exc).startswith("WRONGTYPE")

    # -- reads -------------------------------------------------------------------------------------
    def contains(self, parent: str, block_hash: str) -> bool:
        return bool(self._call("read a block", lambda: self.client.exists(self._bkey(block_hash)), 0))

    def get(self, parent: str, block_hash: str, scratch: Any = None) -> Block | None:
        started = time.perf_counter()
        data: Any = None
        if not self.backing_off:
            try:
                data = self._get_block_bytes(block_hash)
            except self._errors as exc:
                if self._wrong_type(exc):  # something else under a block's key: not a block, drop it
                    self._corrupt(block_hash, "the key holds another Redis type than a block's string")
                    return None
                self._failed("read a block", exc)
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
        self.counters.hits += 1
        self.counters.bytes_loaded += block.nbytes
        self.counters.load_seconds += time.perf_counter() - started
        return block

    def _corrupt(self, block_hash: str, why: str) -> None:
        self.counters.misses += 1
        self.discard("", block_hash, why)

    def discard(self, parent: str, block_hash: str, why: str) -> None:
        """Delete a block that is not what its key says (reported; a failure to delete is only counted)."""
        self.counters.corrupt += 1
        log.warning(
            "kvlab store: Redis block %s is corrupt (%s); deleted and treated as a miss", block_hash[:12], why
        )
        self._call("delete a corrupt block", lambda: self.client.delete(self._bkey(block_hash)), 0, "left")

    def children(self, parent: str) -> dict[str, tuple[int, ...]]:
        raw: dict = {}
        if not self.backing_off:
            try:
                raw = self.client.hgetall(self._ckey(parent))
            except self._errors as exc:
                if not self._wrong_type(exc):
                    self._failed("read a block index", exc)
                    return {}
                self.counters.corrupt += 1  # something else under an index's key: drop it
                log.warning("kvlab store: Redis index %s is not a hash; deleted", self._ckey(parent)[:40])
                self._call(
                    "delete a corrupt index", lambda: self.client.delete(self._ckey(parent)), 0, "left"
                )
                return {}
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
            data = self._get_block_bytes(block_hash)
        except self._errors as exc:
            if self._wrong_type(exc):
                self.counters.corrupt += 1
                return None
            raise self._unavailable(exc) from None
        if data is None:
            return None
        try:
            return decode_block(data, expect_hash=block_hash)
        except CorruptBlockError:
            self.counters.corrupt += 1
            return None

    # -- writes ------------------------------------------------------------------------------------
    def put(self, block: Block) -> list[Block]:
        """Store the block unless present; a write Redis refuses or cannot take is skipped (counted)."""

        def write() -> bool:
            if self.client.exists(self._bkey(block.hash)):
                return False
            pipe = self.client.pipeline(transaction=True)
            pipe.set(self._bkey(block.hash), encode_block(block))
            pipe.hset(self._ckey(block.parent), block.hash, json.dumps(list(block.token_ids)))
            pipe.execute()
            return True

        written = self._call("store a block", write, None, "not stored")
        if written is None:
            self.counters.skipped += 1
        elif written:
            self.counters.puts += 1
        return []

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
                data = self._get_block_bytes(h)
            except self._errors as exc:
                if not self._wrong_type(exc):
                    raise self._unavailable(exc) from None
                corrupt.append(
                    {"key": self._bkey(h), "reason": "holds another Redis type than a block's string"}
                )
                if repair:
                    self.delete(h)
                continue
            if data is None:
                continue
            try:
                problem = block_problem(decode_block(data, expect_hash=h))
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
