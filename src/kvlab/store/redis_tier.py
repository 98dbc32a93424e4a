"""The Redis tier: blocks shared by every process (or machine) that can reach one Redis server.

Keys (``prefix`` defaults to ``kvlab``): ``<prefix>:b:<hash>`` holds a block's bytes (the same
self-checking safetensors bytes as a disk file, written with one ``SET``, so a reader gets a whole
block or nothing); ``<prefix>:c:<parent>`` is a hash from child block hash to its token ids (JSON),
for partial-block matching. Capacity and eviction are Redis's own (``maxmemory`` with an
``allkeys-lru`` policy); a child entry whose block was evicted is a clean miss and is dropped.
An unreachable server raises :class:`StoreUnavailableError` on open and on writes, and is a counted
miss on reads.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from kvlab.errors import BadInputError
from kvlab.store.block import Block, decode_block, encode_block
from kvlab.store.errors import CorruptBlockError, StoreUnavailableError
from kvlab.store.keys import block_problem
from kvlab.store.tier import TierCounters

log = logging.getLogger("kvlab.store")


class RedisTier:
    name = "redis"
    persistent = True

    def __init__(
        self, url: str, *, prefix: str = "kvlab", connect_timeout_s: float = 1.0, timeout_s: float = 10.0
    ):
        try:
            import redis
        except ImportError:
            raise StoreUnavailableError("the Redis tier needs redis-py: pip install 'kvlab[redis]'") from None
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise BadInputError(f"a Redis store URL looks like redis://host:port/db, got {url!r}")
        self.url = url
        self.prefix = prefix
        self.counters = TierCounters()
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        try:
            self.client = redis.Redis.from_url(
                url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s
            )
            self.client.ping()
        except self._errors as exc:
            raise StoreUnavailableError(
                f"cannot reach Redis at {url} ({exc}); start redis-server or fix --store"
            ) from None
        except ValueError as exc:
            raise BadInputError(f"bad Redis URL {url!r}: {exc}") from None
        except redis.RedisError as exc:  # e.g. "DB index is out of range", auth required
            raise StoreUnavailableError(f"Redis at {url} refused the connection: {exc}") from None

    def _bkey(self, block_hash: str) -> str:
        return f"{self.prefix}:b:{block_hash}"

    def _ckey(self, parent: str) -> str:
        return f"{self.prefix}:c:{parent}"

    def _unavailable(self, exc: Exception) -> StoreUnavailableError:
        self.counters.errors += 1
        return StoreUnavailableError(f"lost the connection to Redis at {self.url} ({exc})")

    # -- reads -------------------------------------------------------------------------------------
    def contains(self, parent: str, block_hash: str) -> bool:
        try:
            return bool(self.client.exists(self._bkey(block_hash)))
        except self._errors:
            self.counters.errors += 1
            return False

    def get(self, parent: str, block_hash: str, scratch: Any = None) -> Block | None:
        started = time.perf_counter()
        try:
            data = self.client.get(self._bkey(block_hash))
        except self._errors as exc:
            self.counters.errors += 1
            log.warning("kvlab store: Redis read failed (%s); treated as a miss", exc)
            data = None
        if data is None:
            self.counters.misses += 1
            return None
        try:
            block = decode_block(data, expect_hash=block_hash)
            if block.parent != parent:
                raise CorruptBlockError("stored under another parent")
        except CorruptBlockError as exc:
            self.counters.corrupt += 1
            self.counters.misses += 1
            log.warning(
                "kvlab store: Redis block %s is corrupt (%s); deleted and treated as a miss",
                block_hash[:12],
                exc,
            )
            self.delete(block_hash)
            return None
        self.counters.hits += 1
        self.counters.bytes_loaded += block.nbytes
        self.counters.load_seconds += time.perf_counter() - started
        return block

    def children(self, parent: str) -> dict[str, tuple[int, ...]]:
        try:
            raw = self.client.hgetall(self._ckey(parent))
        except self._errors:
            self.counters.errors += 1
            return {}
        out: dict[str, tuple[int, ...]] = {}
        for k, v in raw.items():
            # a damaged or crafted index entry is a miss (counted), never a crash of the lookup
            try:
                name, ids = k.decode("ascii"), json.loads(v)
                if len(name) != 64 or not isinstance(ids, list) or not all(type(t) is int for t in ids):
                    raise ValueError("not a block entry")
                out[name] = tuple(ids)
            except (UnicodeDecodeError, ValueError, TypeError):
                self.counters.corrupt += 1
        return out

    def find(self, block_hash: str) -> Block | None:
        try:
            data = self.client.get(self._bkey(block_hash))
        except self._errors as exc:
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
        try:
            if self.client.exists(self._bkey(block.hash)):
                return []
            pipe = self.client.pipeline(transaction=True)
            pipe.set(self._bkey(block.hash), encode_block(block))
            pipe.hset(self._ckey(block.parent), block.hash, json.dumps(list(block.token_ids)))
            pipe.execute()
        except self._errors as exc:
            raise self._unavailable(exc) from None
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
                k.decode().rsplit(":", 1)[1] for k in self.client.scan_iter(f"{self.prefix}:b:*", count=500)
            ]
        except self._errors as exc:
            raise self._unavailable(exc) from None

    def usage(self) -> tuple[int, int]:
        hashes = self.block_hashes()
        if not hashes:
            return 0, 0
        pipe = self.client.pipeline(transaction=False)
        for h in hashes:
            pipe.strlen(self._bkey(h))
        return len(hashes), int(sum(pipe.execute()))

    def verify(self, *, repair: bool = False) -> dict:
        ok, corrupt = 0, []
        for h in self.block_hashes():
            data = self.client.get(self._bkey(h))
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
        """Drop child-index entries whose blocks Redis has evicted."""
        dropped = 0
        try:
            for key in self.client.scan_iter(f"{self.prefix}:c:*", count=500):
                kids = self.client.hkeys(key)
                if not kids:
                    continue
                pipe = self.client.pipeline(transaction=False)
                for k in kids:
                    pipe.exists(self._bkey(k.decode()))
                for k, alive in zip(kids, pipe.execute(), strict=True):
                    if not alive:
                        self.client.hdel(key, k)
                        dropped += 1
        except self._errors as exc:
            raise self._unavailable(exc) from None
        return {"stale_index_entries_removed": dropped}
