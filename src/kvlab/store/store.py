"""The tiered KV store: put a cache as chained blocks, find the longest stored prefix of a prompt.

Tiers are ordered fastest first (memory, disk, Redis). A put writes new blocks to the first tier and,
with ``write_through`` (the default), to every persistent tier, so other processes see them at once.
A lookup walks the prompt's block hashes while some tier has them, then looks for the stored child
of the last matched block sharing the longest run of the remaining tokens (so a prefix that ends
inside a block, or is shorter than one, still hits). A block found in a slower tier is promoted to
the faster ones; a block evicted from a tier is demoted to the next one if that tier lacks it.
One :class:`KVStore` object is not thread-safe (the Redis tier's own writer thread, which ``put(...,
write_behind=True)`` feeds, touches nothing but that tier); processes share a store through disk and Redis.

A tier that fails never fails a lookup: an unreadable, hostile or corrupt block is a miss (reported),
and a block whose K/V do not have its namespace's geometry (layers, KV heads, K *and* V head size) or
dtype is never returned. A put refuses a snapshot of another geometry than its namespace's; a write
that Redis cannot take is skipped and counted (``PutReport.blocks_skipped``); a disk that cannot be
written raises :class:`~kvlab.store.errors.StoreWriteError`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import BadInputError, IncompatibleCacheError, KvlabError
from kvlab.metrics.text import agreement_length
from kvlab.model.handle import ModelHandle, ModelLike, as_handle
from kvlab.store.block import Block, BlockHeader, BlockPlace
from kvlab.store.disk import DECLINED, DiskTier, ReadBuffer
from kvlab.store.errors import BlockNotFoundError, CorruptBlockError, StoreError
from kvlab.store.keys import (
    DEFAULT_BLOCK_TOKENS,
    Namespace,
    _dtype_name,
    block_hash,
    geometry_problem,
    snapshot_geometry,
)
from kvlab.store.keys import block_hash as _hash_of
from kvlab.store.memory import MemoryTier
from kvlab.store.tier import QueuedWrites, RateLimitedLog, Tier

log = logging.getLogger("kvlab.store")


@dataclass(frozen=True)
class Match:
    """Result of a lookup: the reusable prefix (``cached_tokens`` slots at positions 0..) or nothing."""

    snapshot: KVSnapshot | None
    cached_tokens: int
    total_tokens: int
    blocks: tuple[str, ...] = ()
    tier_blocks: dict[str, int] = field(default_factory=dict)
    lookup_ms: float = 0.0

    @property
    def to_compute(self) -> int:
        """Tokens of the prompt that still need a forward pass."""
        return self.total_tokens - self.cached_tokens


@dataclass(frozen=True)
class PutReport:
    """What a put did: blocks written to the store's durable tier (or memory, for a memory-only store),
    blocks already there, blocks a durable tier could not take (Redis down, paused or full, or its
    write-behind queue full), and blocks queued for a durable tier's writer thread (``write_behind``: not
    yet written when the put returned; a write that fails later counts only in the tier's counters)."""

    blocks_written: int
    blocks_present: int
    bytes_written: int
    hashes: tuple[str, ...]
    blocks_skipped: int = 0
    blocks_queued: int = 0


_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def check_snapshot_matches_model(snapshot: KVSnapshot, model: ModelHandle) -> None:
    """Refuse a snapshot that ``model`` could not have produced: fingerprint, geometry, dtype, RoPE."""
    facts = model.facts
    want = (facts.num_layers, facts.num_kv_heads, facts.head_dim)
    v_want = getattr(facts, "value_head_dim", None) or facts.head_dim  # kvlab's models: V's head size is K's
    problems = []
    if snapshot.fingerprint != model.fingerprint:
        problems.append("model fingerprint")
    if snapshot_geometry(snapshot) != want:
        problems.append(f"geometry {snapshot_geometry(snapshot)} (the model's is {want})")
    if snapshot.value_head_dim != v_want:
        problems.append(f"V head size {snapshot.value_head_dim} (the model's is {v_want})")
    if snapshot.dtype != model.dtype or snapshot.values[0].dtype != model.dtype:
        problems.append(f"dtype {snapshot.dtype}/{snapshot.values[0].dtype} (the model's is {model.dtype})")
    if snapshot.rope != model.rope:
        problems.append("RoPE spec")
    if problems:
        raise IncompatibleCacheError(f"this cache was not made by {model.name}: {', '.join(problems)} differ")


class KVStore:
    """Content-addressed K/V blocks in tiers (see the module docstring for the policy)."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        write_through: bool = True,
        promote: bool = True,
    ):
        if not tiers:
            raise BadInputError("a store needs at least one tier")
        if not isinstance(block_tokens, int) or block_tokens < 1:
            raise BadInputError(f"block_tokens must be a positive integer, got {block_tokens!r}")
        self.tiers: list[Tier] = list(tiers)
        self.block_tokens = block_tokens
        self.write_through = write_through
        self.promote = promote
        self.lookups = self.hit_tokens = self.miss_tokens = 0
        self.malformed = 0  # crafted or damaged chains/indexes met (each answered as a miss or an error)
        self.misfit_blocks = 0  # blocks refused by a lookup: not their namespace's geometry or dtype
        self._log = RateLimitedLog(log)

    # -- namespaces --------------------------------------------------------------------------------
    def namespace(
        self, model: ModelLike | KVSnapshot, *, salt: str | None = None, quantization: str | None = None
    ) -> Namespace:
        """The namespace of a ModelHandle's, a Hugging Face model's or a snapshot's caches in this store."""
        if isinstance(model, KVSnapshot):
            return Namespace.for_snapshot(
                model, block_tokens=self.block_tokens, salt=salt, quantization=quantization
            )
        return Namespace.for_model(
            as_handle(model), block_tokens=self.block_tokens, salt=salt, quantization=quantization
        )

    # -- put ---------------------------------------------------------------------------------------
    def put(
        self,
        snapshot: KVSnapshot,
        *,
        salt: str | None = None,
        quantization: str | None = None,
        namespace: Namespace | None = None,
        model: ModelHandle | None = None,
        write_behind: bool = False,
    ) -> PutReport:
        """Store a prefix cache (positions ``0..T-1``, batch 1) as blocks; blocks already stored are skipped.

        The stored blocks are copies: later changes to ``snapshot``'s storage cannot reach the store.
        Only exact prefills (provenance ``"prefill"``) enter the exact namespace; with ``model`` the
        snapshot's fingerprint, geometry, dtype and RoPE are also checked against that model.
        With ``write_behind``, a tier that can write behind the caller (Redis) gets the blocks (and what the
        memory tier evicts to it) through its queue: this call does not wait for it (``flush`` does).
        """
        ns = self._put_namespace(snapshot, salt, quantization, namespace, model)
        ids = snapshot.token_list()
        parent, info, n = ns.root, ns.info(), self.block_tokens
        # per block: "written" (it reached the store's durable tier, or memory for a memory-only store: a
        # re-put from a new process fills its empty memory tier but writes nothing), "queued" (for a durable
        # tier's writer thread), "skipped" (a durable tier could not take it) or "present"
        outcomes: list[str] = []
        hashes = []
        nbytes = 0
        for start in range(0, len(ids), n):
            chunk = ids[start : start + n]
            h = block_hash(parent, chunk)
            hashes.append(h)
            missing = [
                i for i, t in enumerate(self.tiers) if (i == 0 or t.persistent) and not t.contains(parent, h)
            ]
            if not self.write_through:
                missing = [i for i in missing if i == 0]
            outcome = "present"
            if missing:
                block = Block(
                    hash=h,
                    parent=parent,
                    namespace=ns.root,
                    start=start,
                    token_ids=tuple(chunk),
                    keys=torch.stack([k[0, :, start : start + len(chunk)] for k in snapshot.keys])
                    .cpu()
                    .contiguous(),
                    values=torch.stack([v[0, :, start : start + len(chunk)] for v in snapshot.values])
                    .cpu()
                    .contiguous(),
                    namespace_info=info,
                )
                outcome = self._put_block(block, missing, write_behind)
                nbytes += block.nbytes if outcome == "written" else 0
            outcomes.append(outcome)
            if len(chunk) < n:
                break
            parent = h
        skipped = outcomes.count("skipped")
        if skipped:
            self._log.warn(
                "put-skipped",
                f"kvlab store: {skipped} block(s) of this cache could not be stored (a tier failed; see above)",
            )
        written, present, queued = (outcomes.count(k) for k in ("written", "present", "queued"))
        return PutReport(written, present, nbytes, tuple(hashes), skipped, queued)

    def _put_namespace(
        self,
        snapshot: KVSnapshot,
        salt: str | None,
        quantization: str | None,
        namespace: Namespace | None,
        model: ModelHandle | None,
    ) -> Namespace:
        """The namespace ``snapshot`` is put under, once it is checked to belong there (see :meth:`put`)."""
        snapshot.require_unmasked("storing a prefix cache")
        if snapshot.batch_size != 1:
            raise BadInputError(f"the store keeps one sequence per cache; got batch {snapshot.batch_size}")
        if not torch.equal(snapshot.positions.cpu(), torch.arange(snapshot.seq_len, device="cpu")):
            raise BadInputError(
                "only prefix caches (positions 0..T-1, as a prefill makes) can be stored; "
                "re-prefill a rolled or shifted cache first"
            )
        ns = namespace or self.namespace(snapshot, salt=salt, quantization=quantization)
        misfit = geometry_problem(snapshot, ns.geometry, ns.dtype)
        if ns.fingerprint != snapshot.fingerprint or ns.rope != snapshot.rope or misfit:
            raise IncompatibleCacheError(
                "the namespace names another model, geometry, dtype or RoPE than the snapshot"
                + (f" ({misfit})" if misfit else "")
            )
        if ns.quantization is None and not snapshot.is_prefill:
            # The exact namespace promises "what a prefill of these tokens by this model gives".
            raise IncompatibleCacheError(
                f"only exact prefills go in the store's exact namespace; this cache is {snapshot.provenance} "
                "(re-prefill its tokens, or store it under an explicit quantization=... namespace)"
            )
        if model is not None:
            check_snapshot_matches_model(snapshot, model)
        if ns.block_tokens != self.block_tokens:
            raise BadInputError(
                f"namespace block size {ns.block_tokens} differs from the store's {self.block_tokens}"
            )
        return ns

    def _put_block(self, block: Block, missing: list[int], write_behind: bool) -> str:
        """``block`` into the tiers ``missing`` it; what happened at the durable tier (see :meth:`put`)."""
        done: dict[int, str] = {i: self._insert(i, block, write_behind) for i in missing}
        durable = [i for i, t in enumerate(self.tiers) if t.persistent] or [0]
        for outcome in ("stored", "queued", "skipped"):
            if any(done.get(i) == outcome for i in durable):
                return "written" if outcome == "stored" else outcome
        return "present"

    def _insert(self, index: int, block: Block, write_behind: bool = False) -> str:
        """Put into tier ``index`` (through its queue with ``write_behind``, when it has one); demote whatever
        it evicts to the next tier that lacks it. Returns "stored", "queued" or "skipped" (the tier could
        not take it: Redis down, paused or full)."""
        tier = self.tiers[index]
        if write_behind and isinstance(tier, QueuedWrites):
            return "queued" if tier.put_later(block) else "skipped"
        before = tier.counters.skipped
        for evicted in tier.put(block):
            for lower in self.tiers[index + 1 :]:
                if lower.persistent and not lower.contains(evicted.parent, evicted.hash):
                    lower.counters.demotions_in += 1
                    self._insert(self.tiers.index(lower), evicted, write_behind)
                    break
        return "skipped" if tier.counters.skipped > before else "stored"

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every tier's write-behind queue is empty; False when ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(
            t.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))
            for t in self.tiers
            if isinstance(t, QueuedWrites)
        )

    # -- lookup ------------------------------------------------------------------------------------
    def _locate(self, parent: str, h: str) -> int | None:
        """Index of the fastest tier holding the block (no data read); counts misses on the way."""
        for i, tier in enumerate(self.tiers):
            if tier.contains(parent, h):
                return i
            tier.counters.misses += 1
        return None

    def lookup(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        namespace: Namespace,
        *,
        max_tokens: int | None = None,
        device: str | torch.device | None = None,
    ) -> Match:
        """The longest stored prefix of ``token_ids`` (at most ``max_tokens`` of them) as a snapshot.

        ``namespace`` must come from this store (:meth:`namespace`); blocks of any other model, dtype,
        RoPE or salt hash differently and are never found. Plans the chain first (which tier holds each
        block), then reads every block straight into one preallocated K and V: in host memory, where the
        tiers read (the default), or, for a GPU ``device`` (the model's, to feed it), on that device, each
        block copied there once. Assembling on the host and then moving the whole prefix copied every
        byte twice, and on an H100 that made a memory-tier hit of 8,192 tokens slower than the prefill
        (297 vs 267 ms, BENCHMARKS.md's GPU section).
        """
        started = time.perf_counter()
        ids = [
            int(t)
            for t in (token_ids.reshape(-1).tolist() if isinstance(token_ids, torch.Tensor) else token_ids)
        ]
        if namespace.block_tokens != self.block_tokens:
            raise BadInputError(
                f"namespace block size {namespace.block_tokens} differs from the store's {self.block_tokens}"
            )
        limit = len(ids) if max_tokens is None else max(0, min(len(ids), int(max_tokens)))
        n, parent = self.block_tokens, namespace.root
        plan: list[tuple[int, str, str, int]] = []  # (tier index, parent, hash, tokens to use)
        planned = 0
        while planned + n <= limit:
            h = block_hash(parent, ids[planned : planned + n])
            where = self._locate(parent, h)
            if where is None:
                break
            plan.append((where, parent, h, n))
            parent, planned = h, planned + n
        rest = ids[planned:limit]
        if rest:
            best: tuple[int, str, int] | None = None
            for i, tier in enumerate(self.tiers):
                for h, kid_ids in tier.children(parent).items():
                    common = agreement_length(kid_ids, rest)  # shared leading tokens
                    if common > (best[2] if best else 0):
                        best = (i, h, common)
            if best is not None:
                plan.append((best[0], parent, best[1], best[2]))
                planned += best[2]
        on = _assembles_on(device)
        snapshot, used, served = self._load(plan, namespace, ids, on) if plan else (None, [], {})
        if snapshot is not None and device is not None:
            snapshot = snapshot.to(device=device)
        cached = sum(p[3] for p in plan[: len(used)])
        self.lookups += 1
        self.hit_tokens += cached
        self.miss_tokens += len(ids) - cached
        return Match(snapshot, cached, len(ids), tuple(used), served, (time.perf_counter() - started) * 1000)

    def _load(
        self,
        plan: list[tuple[int, str, str, int]],
        namespace: Namespace,
        ids: list[int],
        device: torch.device | None = None,
    ) -> tuple[KVSnapshot | None, list[str], dict[str, int]]:
        """Read the planned blocks into one K and V (on ``device``, else the host); stops early at a block
        that vanished or is invalid.

        Into host memory, disk blocks are read straight into their slice of the output
        (``DiskTier.read_into``: one copy, checksum over the bytes where they landed); other tiers, a
        last block of which only part is used, and every block bound for a GPU go through ``get`` (the
        checksum verified on the host) and are copied in.
        """
        total = sum(p[3] for p in plan)
        out = _Output(namespace, total, device)
        scratch = ReadBuffer()
        used: list[str] = []
        served: dict[str, int] = {}
        at = 0
        # Ask tiers that can (disk: posix_fadvise WILLNEED) to start reading a few blocks ahead, so the
        # device read of block j+1.. overlaps the checksum and copy of block j. No threads involved.
        ahead = 8
        for j in range(min(ahead, len(plan))):
            self._prefetch(plan[j])
        for j, (where, parent, h, take) in enumerate(plan):
            if j + ahead < len(plan):
                self._prefetch(plan[j + ahead])
            read = self._read_block(out, where, parent, h, at, tuple(ids[at : at + take]), scratch)
            if read is None:
                break
            tier, where, block = read
            served[tier.name] = served.get(tier.name, 0) + 1
            if block is not None:
                self._promote(where, block)
            used.append(h)
            at += take
        if not out.kv or at == 0:
            return None, [], served
        keys, values = out.kv
        if at < total:  # a planned block vanished or failed its checks: keep what was loaded
            keys, values = host_copy(keys[:, :, :at]), host_copy(values[:, :, :at])
        # the exact namespace holds only prefills (checked at put); others say what they are
        provenance = "prefill" if namespace.quantization is None else "quantized"
        return _prefix_snapshot(keys, values, ids[:at], namespace, provenance), used, served

    def _read_block(
        self,
        out: _Output,
        where: int,
        parent: str,
        h: str,
        at: int,
        want: tuple[int, ...],
        scratch: ReadBuffer,
    ) -> tuple[Tier, int, Block | None] | None:
        """Planned block ``h`` (tokens ``want`` at ``at``) into its slice of ``out``: the tier that served it,
        that tier's index and a copy to promote (None: nothing to promote); None when the block vanished,
        is invalid or does not fit (the lookup stops there)."""
        tier, take = self.tiers[where], len(want)
        block: Block | None = None
        direct: Any = None
        if hasattr(tier, "read_into") and out.device is None:  # reads into host memory only
            out.misfit.clear()
            direct = tier.read_into(parent, h, out.destination(at, want))
            if direct == DECLINED and out.misfit:
                self._misfit(tier, parent, h, out.misfit[0], out.namespace)
                return None
            if isinstance(direct, BlockHeader) and self.promote and where > 0:
                block = _owned(direct.block(*out.slice(at, take)))
        if not isinstance(direct, BlockHeader):
            block, where = self._fetch(where, parent, h, scratch)
            tier = self.tiers[where]
            if block is None or not out.places(block, at, want):
                return None
            if not out.copy_in(at, take, block.keys, block.values):
                self._misfit(tier, parent, h, out.misfit[0], out.namespace)
                return None
            block = _owned(block) if self.promote and where > 0 else None  # the read buffer is reused
        return tier, where, block

    def _misfit(self, tier: Tier, parent: str, h: str, why: str, namespace: Namespace) -> None:
        """A block that passed its checksum but does not have its namespace's geometry or dtype: never
        served, reported, and (the namespace's root hashes its geometry, so the block cannot belong to
        its chain) removed from its tier so the next put can store the real one."""
        self.misfit_blocks += 1
        discard = getattr(tier, "discard", None)
        if namespace.geometry is not None and discard is not None:
            discard(parent, h, f"it has {why}")
        else:
            self._log.warn(
                f"misfit:{tier.name}", f"kvlab store: {tier.name} block {h[:12]} has {why}; not served"
            )

    def _prefetch(self, step: tuple[int, str, str, int]) -> None:
        tier = self.tiers[step[0]]
        if hasattr(tier, "prefetch"):
            tier.prefetch(step[1], step[2])

    def _fetch(self, where: int, parent: str, h: str, scratch: ReadBuffer) -> tuple[Block | None, int]:
        """Read a block from the tier the plan chose, else from any other (a promotion may have moved it)."""
        for i in [where, *(i for i in range(len(self.tiers)) if i != where)]:
            block = self.tiers[i].get(parent, h, scratch)
            if block is not None:
                return block, i
        return None, where

    def _promote(self, found_at: int, block: Block) -> None:
        """Copy a block found in a slower tier into the faster ones; a promotion that fails (a full
        disk) is only logged: the lookup already has the block."""
        for j, faster in enumerate(self.tiers[:found_at]):
            faster.counters.promotions_in += 1
            try:
                self._insert(j, block)
            except StoreError as exc:
                self._log.warn(f"promote:{faster.name}", f"kvlab store: could not promote a block ({exc})")

    # -- inspection --------------------------------------------------------------------------------
    def find_block(self, block_hash: str) -> Block:
        for tier in self.tiers:
            block = tier.find(block_hash)
            if block is not None:
                return block
        raise BlockNotFoundError(f"no block {block_hash[:16]} in this store (see `kvlab store ls`)")

    def prefix_snapshot(self, block_hash: str) -> KVSnapshot:
        """The whole cached prefix that ends with block ``block_hash``, rebuilt from the store (K/V on the
        host)."""
        chain = [self.find_block(block_hash)]
        seen = {chain[0].hash}
        while chain[-1].parent != chain[-1].namespace:
            parent = chain[-1].parent
            if parent in seen or len(chain) > 1_000_000:  # a crafted cycle, never a real chain
                self.malformed += 1
                raise CorruptBlockError(
                    f"block {block_hash[:16]}: its parent chain loops (block {parent[:16]})"
                )
            seen.add(parent)
            chain.append(self.find_block(parent))
        chain.reverse()
        info = chain[-1].namespace_info
        if info is None:
            raise BlockNotFoundError(
                f"block {block_hash[:16]} does not record its model; cannot rebuild a snapshot"
            )
        try:
            ns = Namespace.from_info(info)
        except (KeyError, TypeError, ValueError, KvlabError) as exc:
            self.malformed += 1
            raise CorruptBlockError(f"block {block_hash[:16]}: unreadable namespace record ({exc})") from None
        out, at = _Output(ns, sum(b.num_tokens for b in chain), None), 0
        for b in chain:  # every link must be what its hash says, in the namespace it claims, of its geometry
            if (
                not out.places(b, at, b.token_ids)
                or _hash_of(b.parent, b.token_ids) != b.hash
                or not out.copy_in(at, b.num_tokens, b.keys, b.values)
            ):
                self.malformed += 1
                raise CorruptBlockError(f"block {b.hash[:16]} does not fit the chain of {block_hash[:16]}")
            at += b.num_tokens
        keys, values = out.kv
        return _prefix_snapshot(keys, values, [t for b in chain for t in b.token_ids], ns, "prefill")

    def stats(self) -> dict:
        tiers = {}
        for t in self.tiers:
            blocks, nbytes = t.usage()
            tiers[t.name] = {
                "blocks": blocks,
                "bytes": nbytes,
                "max_bytes": getattr(t, "max_bytes", None),
                **t.counters.to_json(),
            }
        return {
            "block_tokens": self.block_tokens,
            "lookups": self.lookups,
            "hit_tokens": self.hit_tokens,
            "miss_tokens": self.miss_tokens,
            "tiers": tiers,
        }

    def verify(self, *, repair: bool = False) -> dict:
        return {t.name: t.verify(repair=repair) for t in self.tiers if hasattr(t, "verify")}

    def gc(self) -> dict:
        return {t.name: t.gc() for t in self.tiers if hasattr(t, "gc")}

    def describe(self) -> str:
        return (
            "KVStore("
            + ", ".join(
                f"{t.name}:{getattr(t, 'root', getattr(t, 'url', ''))}" if t.persistent else t.name
                for t in self.tiers
            )
            + f", {self.block_tokens} tokens/block)"
        )


class _Output:
    """A lookup's output K and V (``kv``: allocated once the first block's header is known) and the check that
    each block fits it; ``misfit`` says why the last block offered did not (then the lookup stops there)."""

    def __init__(self, namespace: Namespace, total: int, device: torch.device | None) -> None:
        self.namespace, self.total, self.device = namespace, total, device
        self.kv: list[torch.Tensor] = []
        self.misfit: list[str] = []

    def fits(
        self, k_shape: tuple[int, ...], v_shape: tuple[int, ...], dtype: torch.dtype, v_dtype: torch.dtype
    ) -> bool:
        """Whether a block's K/V have the namespace's full geometry (layers, KV heads, K and V head
        sizes) and dtype, and those of the blocks before it; records why not."""
        self.misfit.clear()
        k_geo, v_geo, geometry = _geometry(k_shape), _geometry(v_shape), self.namespace.geometry
        if geometry is not None and (k_geo != geometry or v_geo != geometry):
            self.misfit.append(f"K {tuple(k_shape)} / V {tuple(v_shape)}, not the geometry {geometry}")
        elif _dtype_name(dtype) != self.namespace.dtype or v_dtype != dtype:
            self.misfit.append(f"dtype {dtype}/{v_dtype}, not {self.namespace.dtype}")
        elif len(k_shape) != 4 or len(v_shape) != 4:
            self.misfit.append(
                f"K {tuple(k_shape)} / V {tuple(v_shape)} are not [layers, heads, tokens, head]"
            )
        else:
            if not self.kv:
                self.kv.append(_alloc((k_shape[0], k_shape[1], self.total, k_shape[3]), dtype, self.device))
                self.kv.append(_alloc((v_shape[0], v_shape[1], self.total, v_shape[3]), dtype, self.device))
            keys, values = self.kv
            if k_geo != _geometry(keys.shape) or v_geo != _geometry(values.shape) or dtype != keys.dtype:
                self.misfit.append(
                    f"K {tuple(k_shape)} / V {tuple(v_shape)} differ from the blocks before it"
                )
        return not self.misfit

    def places(self, block: BlockPlace, at: int, want: tuple[int, ...]) -> bool:
        """Whether ``block`` (or its header) is in the namespace, starts at ``at`` and begins with ``want``."""
        return (
            block.namespace == self.namespace.root
            and block.start == at
            and block.token_ids[: len(want)] == want
        )

    def slice(self, at: int, take: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The output's K and V for tokens ``at .. at + take - 1`` (views)."""
        return self.kv[0][:, :, at : at + take], self.kv[1][:, :, at : at + take]

    def copy_in(self, at: int, take: int, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Copy a block's first ``take`` tokens of ``keys`` and ``values`` to the output's tokens ``at ..`` if
        the block :meth:`fits` (else False, nothing copied)."""
        if not self.fits(tuple(keys.shape), tuple(values.shape), keys.dtype, values.dtype):
            return False
        k, v = self.slice(at, take)
        k.copy_(keys[:, :, :take])
        v.copy_(values[:, :, :take])
        return True

    def destination(
        self, at: int, want: tuple[int, ...]
    ) -> Callable[[BlockHeader], tuple[torch.Tensor, torch.Tensor] | None]:
        """``DiskTier.read_into``'s ``dest`` for the block planned with tokens ``want`` at ``at``."""

        def dest(hdr: BlockHeader) -> tuple[torch.Tensor, torch.Tensor] | None:
            # None declines: a block of which only part is used (num_tokens > take) takes the
            # general path, which copies that part; a mismatching block fails there too. A
            # block of another geometry is declined before a byte of its tensors is read.
            if (
                hdr.num_tokens != len(want)
                or not self.places(hdr, at, want)
                or not self.fits(hdr.k.shape, hdr.v.shape, hdr.k.dtype, hdr.v.dtype)
            ):
                return None
            return self.slice(at, len(want))

        return dest


def _geometry(shape: Sequence[int]) -> tuple[int, ...]:
    """(layers, KV heads, head size) of a ``[layers, kv_heads, tokens, head_dim]`` shape; another shape as is."""
    return (shape[0], shape[1], shape[3]) if len(shape) == 4 else tuple(shape)


def _prefix_snapshot(
    keys: torch.Tensor, values: torch.Tensor, ids: list[int], namespace: Namespace, provenance: str
) -> KVSnapshot:
    """The snapshot of a stored prefix: layer views of one ``[layers, kv_heads, T, head_dim]`` K and V."""
    return KVSnapshot(
        keys=tuple(keys[i].unsqueeze(0) for i in range(keys.shape[0])),
        values=tuple(values[i].unsqueeze(0) for i in range(values.shape[0])),
        token_ids=torch.tensor([ids], dtype=torch.long, device="cpu"),
        positions=torch.arange(len(ids), device="cpu"),
        rope=namespace.rope,
        fingerprint=namespace.fingerprint,
        model_name=namespace.model_name,
        provenance=provenance,
    )


def _owned(block: Block) -> Block:
    """A copy whose tensors live in process memory (not in an mmap or a Redis reply)."""
    return replace(block, keys=host_copy(block.keys), values=host_copy(block.values))


#: integer dtypes of each element size: a copy through numpy keeps the bits of any dtype (bfloat16 too)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` that owns its memory (``t.clone()``'s result, bit for bit).

    A host tensor is copied by numpy on the calling thread: measured here (2026-11-29, torch 2.13, 2
    threads) torch's parallel copy of a block's strided slice ``[30, 3, 64, 64]`` of a lookup's output
    took 10x longer (248 vs 24 ms for a 2,000-token prefix's 62 slices), which made promoting a disk
    hit to memory cost more than the read itself. Other devices use ``clone``."""
    if t.device.type != "cpu" or t.element_size() not in _BITS:
        return t.clone()
    bits = _BITS[t.element_size()]
    return torch.from_numpy(t.view(bits).numpy().copy()).view(t.dtype)  # device: a host tensor's copy


def _assembles_on(device: str | torch.device | None) -> torch.device | None:
    """Where a lookup for ``device`` assembles its prefix: on a GPU itself, else (None) in host memory."""
    target = None if device is None else torch.device(device)
    return target if target is not None and target.type != "cpu" else None


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """An uninitialised output tensor in host memory, where the tiers read (plain ``torch.empty``), or on
    the GPU ``device`` a lookup feeds.

    Transparent huge pages were tried (an anonymous map advised ``MADV_HUGEPAGE``). Measured here on
    97 MB outputs, 2026-11-25: in a long-lived process they make loads 2x faster once the kernel has
    2 MiB pages (23 vs 52 ms), but a fresh process's first touch can stall while the kernel compacts
    memory (98-244 ms vs 17-75 ms), and a lookup allocates two outputs, so even "plain pages first"
    stalled on the second. Plain pages are predictable; a server that wants the 2x can pool outputs.
    """
    return torch.empty(shape, dtype=dtype, device=device or "cpu")


def default_store_path() -> Path:
    """``$KVLAB_STORE`` or ``~/.cache/kvlab/store``."""
    return Path(os.environ.get("KVLAB_STORE") or Path.home() / ".cache" / "kvlab" / "store").expanduser()


def open_store(
    spec: str | Path | None = None,
    *,
    memory_bytes: int = 2 * 2**30,
    disk_bytes: int = 20 * 2**30,
    redis_url: str | None = None,
    create: bool = True,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    write_through: bool = True,
    redis_timeout_s: float | None = None,
    redis_backoff_s: float | None = None,
) -> KVStore:
    """A store from a spec: a folder (memory + disk), ``redis://host:port/db`` (memory + Redis), or ``memory``.

    ``redis_url`` adds a Redis tier behind the disk tier. ``create=False`` refuses a folder that is not
    already a store (for read-only commands). ``redis_timeout_s`` bounds every Redis call (connect and
    each read; default ``$KVLAB_REDIS_TIMEOUT_S`` or 1 s) and ``redis_backoff_s`` is how long a Redis
    that timed out or dropped the connection is skipped (default ``$KVLAB_REDIS_BACKOFF_S`` or 5 s).
    """
    import re

    spec_s = str(spec) if spec is not None else None
    for url in (spec_s, redis_url):
        scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", url or "")
        if scheme and scheme.group(1).lower() not in ("redis", "rediss", "unix"):
            # validated before anything is created: "ftp://x" must not become a local folder "ftp:"
            raise BadInputError(
                f"unknown store URL scheme {scheme.group(1)!r}: give a folder, redis://host:port/db or 'memory'"
            )
    if redis_url is not None and not redis_url.lower().startswith(_REDIS_SCHEMES):
        raise BadInputError(f"--redis must be a redis://, rediss:// or unix:// URL, got {redis_url!r}")
    redis_kw: dict[str, Any] = {}
    for names, value, env in (
        (("timeout_s", "connect_timeout_s"), redis_timeout_s, "KVLAB_REDIS_TIMEOUT_S"),
        (("backoff_s",), redis_backoff_s, "KVLAB_REDIS_BACKOFF_S"),
    ):
        if value is None and os.environ.get(env):
            try:
                value = float(os.environ[env])
            except ValueError:
                raise BadInputError(f"{env} must be a number of seconds, got {os.environ[env]!r}") from None
        if value is not None:
            redis_kw |= dict.fromkeys(names, value)
    tiers: list[Tier] = [MemoryTier(memory_bytes)]
    urls = [redis_url] if redis_url else []  # Redis tiers, behind the disk tier if any
    if spec_s is not None and spec_s.startswith(_REDIS_SCHEMES):
        urls.insert(0, spec_s)
    elif spec_s not in ("memory", ":memory:"):
        tiers.append(DiskTier(default_store_path() if spec is None else spec, disk_bytes, create=create))
    if urls:
        from kvlab.store.redis_tier import RedisTier

        tiers += [RedisTier(url, **redis_kw) for url in urls]
    return KVStore(tiers, block_tokens=block_tokens, write_through=write_through)
