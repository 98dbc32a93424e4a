"""Scored eviction: the top slots by a registered score, per KV head, once after the prefill or kept while
decoding.

``h2o,keep=0.25`` keeps the top quarter of the prompt's slots (``ratio=0.75``: the fraction removed;
``budget=N``: a slot count); ``every=256`` keeps that budget while decoding; ``sinks=``/``window=`` are
never evicted; ``heads=ada`` / ``layers=pyramid`` share the budget across a layer's heads or across layers,
``heads=global`` (offline only) across every layer and head together (kvpress's KVzip).
``prefix=SCORE`` (``kvlab serve`` only) names the score that compresses a conversation's shared system prompt
once, alone, to the budget (default: the layout's own score), so every request sharing it starts from the same
compressed prefix (:meth:`ScoredLayout.compress_prefix`; stored under the policy, never as an exact prefix).
Live it is a :class:`~kvlab.hf.compressed_cache.CompressedCache`; offline :func:`kvlab.policy.evict.evict`
masks the same slots (a ragged cache for shared budgets), survivors through the codec where there is one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.policy.catalogue import OFFLINE_SCORES, SCORES, codec_facts
from kvlab.policy.layouts.base import Items, Layout, context

if TYPE_CHECKING:
    from kvlab.cache.snapshot import KVSnapshot
    from kvlab.model.handle import ModelHandle
    from kvlab.policy.evict import Policy
    from kvlab.policy.layouts.base import Applied, CachePolicy, Kept, Model, Source

#: aliases of score names in specs: ``keynorm`` is kvlab's ``knorm``
ALIASES = {"keynorm": "knorm"}
#: how a scored layout shares its budget: across the KV heads of a layer and across layers
HEAD_SHARES = ("uniform", "ada", "global")  # ada: AdaKV's top slots over a layer's heads; global: over all
LAYER_SHARES = ("uniform", "pyramid")  # pyramid: PyramidKV's budgets falling linearly with depth


@dataclass(frozen=True)
class ScoredLayout(Layout):
    """The top-``keep`` (fraction of the prompt) or top-``budget`` slots by ``score`` per KV head;
    ``every`` re-scores and evicts back to the budget each time that many tokens were added (0: once,
    after the prefill). ``sinks``/``window`` (None: the score's own) are never evicted."""

    score: str = "h2o"
    keep: float | None = None
    budget: int | None = None
    every: int = 0
    sinks: int | None = None
    window: int | None = None
    heads: str = "uniform"
    layers: str = "uniform"
    prefix: str | None = None  # the score that compresses a served system prompt (None: ``score``)
    name: ClassVar[str] = "scored"
    kind: ClassVar[str] = "evict"
    keys: ClassVar[tuple[str, ...]] = (
        "sinks",
        "window",
        "keep",
        "ratio",
        "budget",
        "every",
        "heads",
        "layers",
        "prefix",
    )
    refusal: ClassVar[str] = "only apply to a score (e.g. h2o,keep=0.5)"
    syntax: ClassVar[str] = (
        f"<score>,keep=F|ratio=F|budget=N[,every=N][,sinks=N][,window=N]"
        f"[,heads={'|'.join(HEAD_SHARES)}][,layers={'|'.join(LAYER_SHARES)}][,prefix=<score>] with score one of "
        + ", ".join([*SCORES, *(f"{a} (= {b})" for a, b in ALIASES.items())])
    )
    serves: ClassVar[str] = (
        "scored eviction that keeps its budget while decoding (POLICY,budget=N|keep=F,every=N"
        "[,layers=pyramid][,codec=C][,prefix=SCORE], e.g. h2o,budget=1024,every=64; a system prompt longer "
        "than the budget is compressed once, alone, and shared)"
    )

    @classmethod
    def takes_word(cls, word: str) -> bool:
        return ALIASES.get(word, word) in SCORES

    @classmethod
    def claims(cls, items: Items) -> bool:
        return items.word is not None and cls.takes_word(items.word)

    @classmethod
    def read(cls, items: Items) -> Layout:
        assert items.word is not None  # claims() saw it
        score, opts = ALIASES.get(items.word, items.word), items.opts
        if len([k for k in ("keep", "ratio", "budget") if k in opts]) != 1:
            items.refuse(f"give one budget for '{score}': keep=F, ratio=F or budget=N")
        keep, ratio = items.float("keep"), items.float("ratio")
        if ratio is not None:
            if not 0.0 <= ratio < 1.0:
                items.refuse(f"ratio (the fraction removed) must lie in [0, 1), got {opts['ratio']}")
            keep = 1.0 - ratio
        if keep is not None and not 0.0 < keep <= 1.0:
            items.refuse(f"keep must be a fraction in (0, 1], got {opts['keep']}")
        budget = items.int("budget")
        if budget is not None and budget < 1:
            items.refuse("budget must be >= 1 slot")
        for key, allowed in (("heads", HEAD_SHARES), ("layers", LAYER_SHARES)):
            if key in opts and opts[key] not in allowed:
                items.refuse(f"{key}= is one of {', '.join(allowed)}, got {opts[key]}")
        prefix = ALIASES.get(opts["prefix"], opts["prefix"]) if "prefix" in opts else None
        if prefix is not None and prefix not in SCORES:
            items.refuse(f"prefix= names a score ({', '.join(SCORES)}), got {opts['prefix']}")
        return cls(
            score,
            keep,
            budget,
            items.int("every", 0) or 0,
            items.int("sinks"),
            items.int("window"),
            opts.get("heads", "uniform"),
            opts.get("layers", "uniform"),
            prefix,
        )

    def policy(self) -> Policy:
        """The registered score as a :class:`kvlab.policy.evict.Policy` with these protected slots."""
        from kvlab.policy.evict import make_policy

        return make_policy(self.score, **self._protected())

    def _protected(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("sinks", "window") if getattr(self, k) is not None}

    @property
    def shared(self) -> bool:
        """Whether the budget is shared across KV heads (``heads=ada|global``) or layers (``layers=pyramid``)."""
        return (self.heads, self.layers) != ("uniform", "uniform")

    def items(self) -> list[str]:
        parts = [self.score, f"keep={self.keep!r}" if self.keep is not None else f"budget={self.budget}"]
        parts += [f"{k}={getattr(self, k)}" for k in ("sinks", "window") if getattr(self, k) is not None]
        parts += [f"{k}={getattr(self, k)}" for k in ("heads", "layers") if getattr(self, k) != "uniform"]
        parts += [f"every={self.every}"] if self.every else []
        return parts + ([f"prefix={self.prefix}"] if self.prefix is not None else [])

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.score,
            "every": self.every,
            "heads": self.heads,
            "layers": self.layers,
        }
        if self.prefix is not None:
            out["prefix"] = self.prefix
        if self.keep is not None:
            return {**out, "keep": self.keep, "compression_ratio": round(1.0 - self.keep, 12)}
        return {**out, "budget": self.budget}

    def describe(self) -> str:
        size = f"{self.keep:g} of the prompt's slots" if self.keep is not None else f"{self.budget} slots"
        when = f", re-scored every {self.every} tokens" if self.every else ", once after the prefill"
        shared = f"; a shared system prompt compressed once by {self.prefix}" if self.prefix else ""
        return f"the top {size} by {self.score}{when}{shared}"

    def cache(self, policy: CachePolicy, handle: Model, *, packed_path: str = "auto", pinned: int = 0) -> Any:
        """A :class:`~kvlab.hf.compressed_cache.CompressedCache` (nothing pinned: the score's own sinks stay)."""
        from kvlab.hf.compressed_cache import CompressedCache
        from kvlab.hf.policy_cache import model_parts

        self.live_check(policy, policy.spec)
        config, model, codec = model_parts(policy, handle)
        budget: dict[str, Any] = {"keep": self.keep} if self.keep is not None else {"budget": self.budget}
        return CompressedCache(
            config,
            quantizer=codec,
            policy=self.policy(),
            every=self.every or None,
            heads=self.heads,
            layers=self.layers,
            model=model,
            packed_path=packed_path,
            **budget,
        )

    def needs_queries(self) -> bool:
        return self.policy().needs_queries

    # -- a shared prefix (kvlab serve's system prompt), compressed once ------------------------------------
    def live(self) -> Layout:
        return dataclasses.replace(self, prefix=None)

    def _prefix_keep(self, n: int) -> int:
        from kvlab.policy.evict.select import budget_slots

        return budget_slots(n, self.keep) if self.keep is not None else min(int(self.budget or 1), n)

    def compresses_prefix(self, n: int) -> bool:
        return self.every > 0 and self.layers == self.heads == "uniform" and self._prefix_keep(n) < n

    def compress_prefix(self, handle: ModelHandle, ids: list[int]) -> Kept:
        """``ids`` alone, evicted to the budget by the prefix score (``prefix=``, else the layout's own) as the
        eval evicts a context (:func:`kvlab.policy.evict.evict`), in full precision: per layer the kept
        keys and values ``[1, Hkv, n, D]`` and their original positions ``[1, Hkv, n]``."""
        from kvlab.policy.evict import evict, make_policy, observe
        from kvlab.policy.evict.select import kept_per_head

        score = make_policy(self.prefix or self.score, **self._protected())
        source = (
            observe(handle, ids) if score.needs_queries else handle.prefill(ids, all_logits=False).snapshot
        )
        ev = evict(source, score, n_keep=self._prefix_keep(len(ids)))
        keys, values, slots = kept_per_head(ev)
        return tuple(
            (k, v, ev.positions.to(idx.device)[idx].cpu())
            for k, v, idx in zip(keys, values, slots, strict=True)
        )

    def apply(self, policy: CachePolicy, source: Source, handle: ModelHandle) -> Applied:
        """The evicted context as a masked snapshot (a shared budget: a ragged cache, run masked), its kept
        slots through the codec where there is one."""
        from kvlab.policy.evict import evict
        from kvlab.rope.layers import sliding_windows

        snap = context(source)
        windows = tuple(sliding_windows(handle.config))
        windows = windows if any(w is not None for w in windows) else ()
        if self.shared and windows:
            raise UnsupportedModelError(
                "shared budgets (heads=, layers=) are not modelled on sliding-window layers; use uniform ones"
            )
        if self.shared:
            from kvlab.policy.evict.budgets import evict_ragged

            rc = evict_ragged(source, self.policy(), keep=self.keep, heads=self.heads, layers=self.layers)
            counts = rc.counts
            extra = {
                "kv_bytes_padded": int(rc.padded_nbytes),
                "kv_bytes_masked": int(rc.masked_nbytes),
                "kept_per_layer": [sum(c) for c in counts],
                "kept_per_head_min": min(min(c) for c in counts),
                "kept_per_head_max": max(max(c) for c in counts),
            }
            return rc.masked(snap), rc.nbytes, extra
        budget = (
            {"keep": self.keep}
            if self.keep is not None
            else {"n_keep": min(int(self.budget or 1), snap.seq_len)}
        )
        ev = evict(source, self.policy(), windows=windows, **budget)
        if policy.codec is None:
            return ev, ev.held_nbytes, {}
        return (*_encoded(policy, ev), {})

    def eval_check(self, policy: CachePolicy, spec: str) -> None:
        if self.prefix is not None:
            raise BadInputError(
                f"cache spec '{spec}': prefix= is how kvlab serve compresses a shared system prompt; the eval "
                "compresses each context by the layout's score: name that score instead"
            )
        if self.shared and (self.budget is not None or policy.codec is not None):
            raise BadInputError(
                f"cache spec '{spec}': shared budgets (heads=, layers=) run in the eval with keep= and no codec"
            )
        if self.every:
            raise BadInputError(
                f"cache spec '{spec}': every= keeps a budget while decoding; the eval compresses the context "
                "once (drop every=)"
            )
        facts = codec_facts(policy.codec) if policy.codec is not None else None
        if facts is not None and (facts.along_tokens or facts.uses_positions):
            raise BadInputError(
                f"cache spec '{spec}': the {policy.codec} codec reads slots along tokens or their "
                "positions, which a scored eviction makes different per head; use int<bits> or fp8 with it"
            )

    def live_check(self, policy: CachePolicy, spec: str) -> None:
        """A live cache scores with what its forward sees: no extra pass (KVzip), no ranking across layers
        (``heads=global``), no prefix shared with other conversations (``prefix=``, the server's)."""
        self._refuse_offline_score(spec)
        if self.heads == "global":
            raise BadInputError(
                f"cache spec '{spec}': heads=global runs offline only (kvlab eval): it ranks every layer's scores "
                "together, and a live cache evicts each layer inside the forward, before the later layers are scored"
            )
        if self.prefix is not None:
            raise BadInputError(
                f"cache spec '{spec}': prefix= says how kvlab serve compresses a shared system prompt; a cache "
                "of its own shares no prefix: drop prefix="
            )

    def _refuse_offline_score(self, spec: str) -> None:
        if self.score in OFFLINE_SCORES:
            raise BadInputError(
                f"cache spec '{spec}': {self.score} scores slots by an extra pass after the context, which runs "
                "offline only (kvlab eval, kvlab.policy.evict); a live cache cannot run it yet"
            )

    def serve_check(self, policy: CachePolicy, spec: str) -> None:
        """A conversation grows without end: the budget must be kept while decoding (``every=``), uniform over
        the heads (a per-head cache cannot join a batched decode step); a score must run live."""
        self._refuse_offline_score(spec)
        if not self.every:
            raise BadInputError(
                f"--cache '{spec}': a conversation grows without end, so a scored layout must keep its budget "
                f"while decoding: add every=N (e.g. {spec},every=64)"
            )
        if self.heads != "uniform":
            raise BadInputError(
                f"--cache '{spec}': per-head budgets (heads={self.heads}) cannot join a batched decode step; "
                "use per-layer budgets (layers=pyramid) or uniform ones"
            )
        if self.prefix is not None and self.layers != "uniform":
            raise BadInputError(
                f"--cache '{spec}': prefix= compresses a system prompt to one budget for every layer; drop "
                f"layers={self.layers} or prefix="
            )


def _encoded(policy: CachePolicy, snap: KVSnapshot) -> tuple[KVSnapshot, int]:
    """An evicted (masked) snapshot's kept slots through the policy's codec, encoded and decoded back (what
    the cache attends over), written into the kept slots of a copy; and the bytes the codes hold. Only
    per-token codecs reach here (:meth:`ScoredLayout.eval_check`), so no codec reads positions."""
    from kvlab.policy.evict import kept_per_head
    from kvlab.rope.spec import rope_for_layer

    keys, values, slots = kept_per_head(snap)
    q = policy.quantizer(snap.head_dim)
    assert q is not None  # apply() encodes only where the policy has a codec
    ks, vs, nbytes = [], [], 0
    for i, (k, v, idx) in enumerate(zip(keys, values, slots, strict=True)):
        seg = q.encode(k, v, snap.positions.to(idx.device)[idx][0, 0], rope_for_layer(snap.rope, i))
        dk, dv = seg.decode()
        at_k = idx[..., None].expand(-1, -1, -1, k.shape[-1])
        at_v = idx[..., None].expand(-1, -1, -1, v.shape[-1])
        ks.append(snap.keys[i].clone().scatter_(2, at_k, dk.to(k.dtype)))
        vs.append(snap.values[i].clone().scatter_(2, at_v, dv.to(v.dtype)))
        nbytes += seg.nbytes
    return snap.replace(keys=tuple(ks), values=tuple(vs)), nbytes
