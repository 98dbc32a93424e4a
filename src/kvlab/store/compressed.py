"""Compressed prefixes: a shared prefix's K/V as a scored cache policy left it, kept apart from exact blocks.

A compressed prefix keeps some slots per layer, each with its original position. It is not what a prefill
gives, so it has its own namespace: key ``sha256(format, namespace root, policy, len(ids), sha256(ids))``
(the root binds model, dtype, RoPE, geometry and salt), an LRU dict in memory, files
``<store folder>/compressed/<key>.kvc`` beside (not in) ``blocks/``, and Redis keys
``<prefix>:compressed:<key>``. A put writes through to every tier; a get walks memory, disk, Redis and
promotes. A record is safetensors (``k<i>``, ``v<i>``, ``p<i>``) whose ``kvlab_compressed`` header entry
(not ``kvlab_block``: the exact reader refuses it) holds format ``kvlab-compressed-prefix/1``, key, policy,
token count, ids digest, namespace root, geometry, dtype, slots per layer and a sha256 of that JSON and
the tensor bytes. A get checks all of it and every tensor's shape, dtype and positions: anything wrong is
a miss (``rejected``, logged at most every 30 s) and the record is deleted. A failing tier never fails a
call: a get misses, a put counts ``put_failures`` and logs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
import torch
from safetensors.torch import load, save

from kvlab.cache.io import atomic_write_bytes
from kvlab.errors import BadInputError
from kvlab.store.block import read_meta
from kvlab.store.disk import DiskTier, evict_lru, read_file
from kvlab.store.errors import CorruptBlockError
from kvlab.store.keys import Namespace, _dtype_name
from kvlab.store.redis_tier import RedisTier
from kvlab.store.store import KVStore
from kvlab.store.tier import RateLimitedLog

log = logging.getLogger("kvlab.store")

FORMAT = "kvlab-compressed-prefix/1"
META_KEY = "kvlab_compressed"
FOLDER = "compressed"
SUFFIX = ".kvc"
Layer = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Device = str | torch.device | None


@dataclass(frozen=True, eq=False)
class CompressedPrefix:
    """What a cache policy kept of prefix ``ids``, per layer: keys ``[1, Hkv, n, Dk]``, values
    ``[1, Hkv, n, Dv]`` and each slot's original position ``[1, Hkv, n]`` (int64, strictly increasing per
    head, in ``[0, len(ids))``); ``n`` may differ per layer."""

    ids: tuple[int, ...]
    policy: str
    layers: tuple[Layer, ...]
    #: the tier a get found it in (memory, disk, redis); "" for a record not read from a store
    source: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of K and V (positions not counted)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v, _ in self.layers)


@dataclass
class Counters:
    hits: dict[str, int] = field(default_factory=lambda: {"memory": 0, "disk": 0, "redis": 0})
    misses: int = 0
    rejected: int = 0  # records a get refused: corrupt, tampered or not fitting the namespace
    errors: int = 0  # disk reads that failed (Redis's failures count in its tier)
    puts: int = 0
    put_failures: int = 0  # writes a persistent tier did not take
    evictions: int = 0  # from memory and disk


def ids_digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray([int(t) for t in ids], dtype="<i8").tobytes()).hexdigest()


def prefix_key(namespace: Namespace, policy: str, ids: Sequence[int]) -> str:
    """The address of the compressed prefix of ``ids`` under ``policy`` in ``namespace``."""
    doc = {"format": FORMAT, "ns": namespace.root, "policy": policy, "n": len(ids), "ids": ids_digest(ids)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def prefix_problem(prefix: CompressedPrefix, namespace: Namespace) -> str | None:
    """Why ``prefix`` cannot be a compressed prefix in ``namespace``, or None."""
    geo, layers = namespace.geometry, prefix.layers
    if not isinstance(prefix.policy, str) or not prefix.policy:
        return "it names no policy"
    if any(len(layer) != 3 for layer in layers):
        return "a layer is not (keys, values, positions)"
    if not layers or (geo is not None and len(layers) != geo[0]):
        return f"it has {len(layers)} layers, the namespace {geo[0] if geo else 'at least 1'}"
    k0, v0 = layers[0][0], layers[0][1]
    for i, (k, v, p) in enumerate(layers):
        shapes = f"layer {i}: K {tuple(k.shape)}, V {tuple(v.shape)}, positions {tuple(p.shape)}"
        if k.dim() != 4 or v.dim() != 4 or k.shape[0] != 1 or not v.shape[:3] == k.shape[:3] == p.shape:
            return f"{shapes} are not [1, heads, n, head] and [1, heads, n]"
        want = (geo[1], geo[2], geo[2]) if geo else (k0.shape[1], k0.shape[3], v0.shape[3])
        if (k.shape[1], k.shape[3], v.shape[3]) != want:
            return f"{shapes}: (heads, K head, V head) are not {want}"
        if _dtype_name(k.dtype) != namespace.dtype or v.dtype != k.dtype:
            return f"layer {i}: dtype {_dtype_name(k.dtype)}/{_dtype_name(v.dtype)}, not {namespace.dtype}"
        if p.dtype != torch.int64:
            return f"layer {i}: positions are {_dtype_name(p.dtype)}, not int64"
        if p.numel() and (int(p.min()) < 0 or int(p.max()) >= len(prefix.ids)):
            return f"layer {i}: a position lies outside the prefix's {len(prefix.ids)} tokens"
        if not bool((p[..., 1:] > p[..., :-1]).all()):
            return f"layer {i}: positions are not strictly increasing per head"
    return None


def _header(namespace: Namespace, key: str, prefix: CompressedPrefix) -> dict:
    return {
        "format": FORMAT,
        "key": key,
        "policy": prefix.policy,
        "tokens": len(prefix.ids),
        "ids_sha256": ids_digest(prefix.ids),
        "namespace": namespace.root,
        "geometry": list(namespace.geometry) if namespace.geometry is not None else None,
        "dtype": namespace.dtype,
        "n": [int(k.shape[2]) for k, _, _ in prefix.layers],
    }


def _digest(meta: dict, data: bytes | memoryview) -> str:
    """sha256 of the header's JSON (all but its digest, sorted keys) and then the tensor bytes."""
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "sha256"}, sort_keys=True).encode())
    h.update(data)
    return h.hexdigest()


def encode(namespace: Namespace, key: str, prefix: CompressedPrefix) -> bytes:
    """The record's bytes: safetensors with a self-checking ``kvlab_compressed`` header."""
    names = ("k", "v", "p")
    tensors = {
        f"{n}{i}": t.contiguous()
        for i, kvp in enumerate(prefix.layers)
        for n, t in zip(names, kvp, strict=True)
    }
    meta = _header(namespace, key, prefix)
    raw = save(tensors, metadata={META_KEY: json.dumps(meta)})
    meta["sha256"] = _digest(meta, memoryview(raw)[8 + int.from_bytes(raw[:8], "little") :])
    return save(tensors, metadata={META_KEY: json.dumps(meta)})


def decode(data: bytes, namespace: Namespace, policy: str, ids: tuple[int, ...]) -> CompressedPrefix:
    """The prefix in ``data`` if it is exactly the one asked for, else CorruptBlockError (why)."""
    meta, _, offset = read_meta(data, META_KEY, "header")
    expected = _header(namespace, prefix_key(namespace, policy, ids), CompressedPrefix(ids, policy, ()))
    wrong = [k for k, v in expected.items() if k != "n" and meta.get(k) != v]
    if wrong:
        raise CorruptBlockError(f"it is not what was asked: its {', '.join(wrong)} differ")
    if meta.get("sha256") != _digest(meta, memoryview(data)[offset:]):
        raise CorruptBlockError("its sha256 does not match its bytes")
    try:
        tensors, counts = load(data), [int(c) for c in meta["n"]]
        layers = tuple(
            (tensors.pop(f"k{i}"), tensors.pop(f"v{i}"), tensors.pop(f"p{i}")) for i in range(len(counts))
        )
    except Exception as exc:  # safetensors' errors, missing or odd entries: a finding, never a crash
        raise CorruptBlockError(f"unreadable tensors ({type(exc).__name__}: {exc})") from None
    prefix = CompressedPrefix(ids, policy, layers)
    problem = "it holds tensors of no layer" if tensors else prefix_problem(prefix, namespace)
    if problem is None and [int(k.shape[2]) for k, _, _ in layers] != counts:
        problem = "its slot counts are not its header's"
    if problem:
        raise CorruptBlockError(problem)
    return prefix


class CompressedPrefixes:
    """Compressed prefixes beside a :class:`KVStore`: in memory, and in its disk and Redis tiers if any.

    ``memory_bytes`` caps the K/V held in memory, ``disk_bytes`` the files in ``<folder>/compressed/``
    (default: the disk tier's cap); least recently used first out. The memory dict is locked, so threads
    may share one object (its counters may then miss a count).
    """

    def __init__(
        self, store: KVStore, *, memory_bytes: int = 256 * 2**20, disk_bytes: int | None = None
    ) -> None:
        disk = next((t for t in store.tiers if isinstance(t, DiskTier)), None)
        self.folder: Path | None = disk.root / FOLDER if disk is not None else None
        self.disk_bytes = int(disk_bytes if disk_bytes is not None else disk.max_bytes if disk else 0)
        self.redis = next((t for t in store.tiers if isinstance(t, RedisTier)), None)
        self.memory_bytes = memory_bytes
        self.counters = Counters()
        self._memory: OrderedDict[str, CompressedPrefix] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self._log = RateLimitedLog(log)

    def key(self, namespace: Namespace, policy: str, ids: Sequence[int]) -> str:
        return prefix_key(namespace, policy, ids)

    def get(
        self, namespace: Namespace, policy: str, ids: Sequence[int], *, device: Device = None
    ) -> CompressedPrefix | None:
        """A copy of the stored prefix on ``device`` (default: the host), or None; never raises for a tier."""
        want = tuple(int(t) for t in ids)
        key = prefix_key(namespace, policy, want)
        with self._lock:
            found = self._memory.get(key)
            if found is not None:  # (the key binds the policy and the ids)
                self._memory.move_to_end(key)
                self.counters.hits["memory"] += 1
                return _copy(found, device, "memory")
        for tier in ("disk", "redis"):
            data = self._disk_read(key) if tier == "disk" else self._redis("read", key)
            if not isinstance(data, bytes):
                continue
            try:
                found = decode(data, namespace, policy, want)
            except CorruptBlockError as exc:
                self._reject(tier, key, str(exc))
                continue
            self.counters.hits[tier] += 1
            self._remember(key, found)
            if tier == "redis":
                self._disk_write(key, data)
            return _copy(found, device, tier)
        self.counters.misses += 1
        return None

    def put(self, namespace: Namespace, prefix: CompressedPrefix) -> None:
        """A copy of ``prefix`` into every tier; BadInputError (nothing stored) for a misfit."""
        host = _copy(prefix, "cpu")
        problem = prefix_problem(host, namespace)
        if problem:
            raise BadInputError(f"this compressed prefix does not fit the store namespace: {problem}")
        key = prefix_key(namespace, host.policy, host.ids)
        data = encode(namespace, key, host)
        self.counters.puts += 1
        self._remember(key, host)
        self._disk_write(key, data)
        if self._redis("store", key, data) is None:
            self._put_failed("redis", "Redis did not take it")

    def stats(self) -> dict:
        with self._lock:
            return asdict(self.counters) | {"memory_bytes": self._held, "memory_entries": len(self._memory)}

    def _remember(self, key: str, prefix: CompressedPrefix) -> None:
        if prefix.nbytes > self.memory_bytes:
            return
        with self._lock:
            old = self._memory.pop(key, None)
            self._held += prefix.nbytes - (old.nbytes if old is not None else 0)
            self._memory[key] = prefix
            while self._held > self.memory_bytes:
                self._held -= self._memory.popitem(last=False)[1].nbytes
                self.counters.evictions += 1

    # -- disk --------------------------------------------------------------------------------------
    def _disk_read(self, key: str) -> bytes | None:
        """The file's bytes (b"": it cannot be a record), None when absent or unreadable (counted, logged)."""
        if self.folder is None:
            return None
        path = self.folder / f"{key}{SUFFIX}"
        try:  # never through a link, never a FIFO or a device; mtime = last use (eviction order)
            return bytes(read_file(path, self.disk_bytes, touch=True))
        except FileNotFoundError:
            return None
        except CorruptBlockError:
            return b""  # a folder, link or FIFO at its name, over the cap, or it shrank while read
        except OSError as exc:
            self.counters.errors += 1
            self._log.warn("disk-read", f"kvlab store: cannot read {path} ({exc.strerror or exc}); a miss")
            return None

    def _disk_write(self, key: str, data: bytes) -> None:
        """Write the record atomically, then evict least recently used records beyond the cap."""
        if self.folder is None:
            return
        if len(data) > self.disk_bytes:
            return self._put_failed("disk", f"{len(data):,} bytes, over the cap of {self.disk_bytes:,}")
        try:
            self.folder.mkdir(exist_ok=True)
            atomic_write_bytes(self.folder / f"{key}{SUFFIX}", data)
        except OSError as exc:
            return self._put_failed("disk", exc.strerror or str(exc))
        with contextlib.suppress(OSError):  # the record is written; eviction tries again on the next put
            files = [(p.stat().st_mtime, p.stat().st_size, p) for p in self.folder.glob(f"*{SUFFIX}")]
            self.counters.evictions += evict_lru(files, self.disk_bytes, lambda path, exc: None)[0]

    # -- Redis and failures ------------------------------------------------------------------------
    def _redis(self, what: str, key: str, data: bytes = b"") -> object:
        """``what`` ("read", "store", "delete") the record through the Redis tier's breaker and timeouts:
        its reply, or None when the call failed (counted in that tier, logged) or there is no Redis tier."""
        tier = self.redis
        if tier is None:
            return None if what != "store" else True
        k, c = f"{tier.prefix}:{FOLDER}:{key}", tier.client
        if what == "read":  # another Redis type at its key (b""): rejected (deleted), no back-off
            reply, wrong_type = tier.read("read a compressed prefix", lambda: c.get(k))
            return b"" if wrong_type else reply
        call = {"store": lambda: c.set(k, data), "delete": lambda: c.delete(k)}[what]
        then = {"store": "not stored", "delete": "left"}[what]
        return tier._call(f"{what} a compressed prefix", call, None, then, "write")

    def _reject(self, tier: str, key: str, why: str) -> None:
        """A record that is not what its key says: counted, logged, deleted (a failed delete is ignored)."""
        self.counters.rejected += 1
        self._log.warn(f"rejected:{tier}", f"kvlab store: compressed prefix {key[:12]} refused ({why})")
        if tier == "disk" and self.folder is not None:
            with contextlib.suppress(OSError):
                (self.folder / f"{key}{SUFFIX}").unlink()
        elif tier == "redis":
            self._redis("delete", key)

    def _put_failed(self, tier: str, why: str) -> None:
        self.counters.put_failures += 1
        self._log.warn(f"put:{tier}", f"kvlab store: a compressed prefix was not stored in {tier} ({why})")


def _copy(prefix: CompressedPrefix, device: str | torch.device | None, source: str = "") -> CompressedPrefix:
    """A copy on ``device`` (the host by default): no caller can change what the store holds."""
    to = device if device is not None else "cpu"
    layers = cast(
        "tuple[Layer, ...]", tuple(tuple(t.detach().to(to, copy=True) for t in x) for x in prefix.layers)
    )
    return CompressedPrefix(tuple(int(t) for t in prefix.ids), prefix.policy, layers, source)
