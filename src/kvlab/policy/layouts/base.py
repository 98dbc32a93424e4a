"""What a layout is: which slots a cache keeps, and everything that follows from it, asked of the layout.

A layout is a small frozen class registered by ``name`` in :data:`LAYOUTS` (one file each under
:mod:`kvlab.policy.layouts`; the package imports every file in it, so a new file is a new layout). The spec
reader (:func:`kvlab.policy.spec.parse`) asks each registered layout whether it ``claims`` a spec's items
(the full layout is the fallback) and lets it ``read`` them; every caller then asks the layout, never its
class, what it means:

==============================  ==========================================================================
``items()`` / ``fields()``      its part of the canonical spec string / of the policy's JSON
``describe()``                  the slots it keeps, in words
``check(policy, spec)``         refuse a policy it cannot hold (raised while reading the spec)
``cache(policy, handle)``       the live cache running it (:func:`kvlab.policy.cache_for`)
``apply(policy, source, h)``    offline: what that cache holds after a context (the eval's rows)
``eval_check(policy, spec)``    refuse what a one-shot offline run cannot do
``serve_check(policy, spec)``   refuse what ``kvlab serve`` cannot run (default: everything)
``live_check(policy, spec)``    refuse what a live cache cannot run (generate, stream-ppl)
``rolls()``                     the sinks, window and chunk of a layout that rolls a window, else None
``held_at_most(limit)``         the most slots a cache that only the model's position limit bounds holds
``for_feed(feed)``              itself as a stream fed ``feed`` tokens at a time runs it
``compresses_prefix(n)``        whether a server compresses a shared prefix of ``n`` tokens once (and reuses it)
``compress_prefix(h, ids)``     that prefix compressed: per layer kept K/V and original positions
``live()``                      itself as one conversation's live cache runs it (without what is shared)
==============================  ==========================================================================

A :class:`CachePolicy` is a layout x a codec. Reading a spec imports no torch: the heavy imports sit inside
``cache`` and ``apply``, which are also the only places a layout reaches the layers above it (``kvlab.hf``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from kvlab.errors import BadInputError
from kvlab.policy.catalogue import codec_facts

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from kvlab.cache.snapshot import KVSnapshot
    from kvlab.hf.runner import Runner
    from kvlab.model.handle import ModelHandle
    from kvlab.policy.evict import Observation
    from kvlab.policy.quant import Quantizer

    Model = Runner | PreTrainedModel  # what a live cache is built for: a kvlab handle or a Hugging Face LM
    Source = KVSnapshot | Observation  # a context's snapshot, or an Observation (with its queries)
    Applied = tuple[KVSnapshot, int, dict]  # the snapshot a question runs on, K/V bytes held, extra columns
    # per layer: kept keys, values [1, Hkv, n, D] and their original positions [1, Hkv, n]
    Kept = tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]

#: registered layouts by name, in registration order (:meth:`Layout.claims` is asked in this order)
LAYOUTS: dict[str, type[Layout]] = {}
MAX_INT = 2**31 - 1  # slot counts past this are typos, not caches
#: how numbers in a spec are written: ASCII digits only (Python's int() and float() also take fullwidth and
#: other Unicode digits, "1_000", "nan" and "inf"; a spec says what it means in one spelling)
_NUMBER = {int: re.compile(r"[0-9]+"), float: re.compile(r"[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?")}


def number(key: str, value: str, spec: str, kind: type) -> Any:
    """``value`` of ``key`` read as ``kind`` (int: a slot count in [0, MAX_INT]; float)."""
    try:
        if not _NUMBER[kind].fullmatch(value):
            raise ValueError(value)
        v = kind(value)
    except ValueError:
        raise BadInputError(
            f"cache spec '{spec}': {key}={value} is not {'an integer' if kind is int else 'a number'}"
        ) from None
    if kind is int and not 0 <= v <= MAX_INT:
        raise BadInputError(f"cache spec '{spec}': {key} must lie in [0, {MAX_INT}], got {value}")
    return v


@dataclass(frozen=True)
class Items:
    """A spec's items as written: ``word`` (a bare name such as a score, or None), ``opts`` (key -> text)
    and the codec it names (None: full precision)."""

    spec: str
    word: str | None
    opts: dict[str, str]
    codec: str | None = None

    def int(self, key: str, default: int | None = None) -> int | None:
        return number(key, self.opts[key], self.spec, int) if key in self.opts else default

    def float(self, key: str) -> float | None:
        return number(key, self.opts[key], self.spec, float) if key in self.opts else None

    def refuse(self, why: str) -> None:
        raise BadInputError(f"cache spec '{self.spec}': {why}")


class Roll(NamedTuple):
    """A rolling window: the first ``sinks`` slots and the last ``window``, evicting ``chunk`` at a time
    (0: the rolling cache's default)."""

    sinks: int
    window: int
    chunk: int


@dataclass(frozen=True)
class Layout:
    """Base: which slots a cache keeps (module docstring). ``exact`` layouts keep every slot."""

    name: ClassVar[str] = "layout"
    exact: ClassVar[bool] = False
    kind: ClassVar[str] = ""  # a report's kind ("": "full", or "quant" over a codec)
    keys: ClassVar[tuple[str, ...]] = ()  # the spec keys it reads
    refusal: ClassVar[str] = ""  # why its keys are refused under another layout
    syntax: ClassVar[str] = ""  # its spec, for known()
    serves: ClassVar[str] = ""  # what `kvlab serve` runs of it, in words ("": nothing)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            LAYOUTS[cls.name] = cls

    # -- reading ---------------------------------------------------------------------------------
    @classmethod
    def takes_word(cls, word: str) -> bool:
        """Whether a bare item ``word`` names this layout (a score)."""
        return False

    @classmethod
    def claims(cls, items: Items) -> bool:
        """Whether a spec's items name this layout (the full layout is the fallback)."""
        return False

    @classmethod
    def read(cls, items: Items) -> Layout:
        raise NotImplementedError

    def codec_sinks(self, items: Items) -> int:
        """Full-precision first slots the codec keeps (read from the spec by the full layout only)."""
        return 0

    def check(self, policy: CachePolicy, spec: str) -> None:
        """Refuse a policy this layout cannot hold (raised while the spec is read)."""

    # -- naming ----------------------------------------------------------------------------------
    def items(self) -> list[str]:
        return []

    def fields(self) -> dict[str, Any]:
        return {}

    def describe(self) -> str:
        raise NotImplementedError

    # -- running ---------------------------------------------------------------------------------
    def cache(self, policy: CachePolicy, handle: Model, *, packed_path: str = "auto", pinned: int = 0) -> Any:
        """A new, empty live cache running ``policy`` for ``handle``, bound to the model; ``pinned`` first
        tokens (a server's system prompt) stay where the layout rolls a window."""
        raise NotImplementedError

    def apply(self, policy: CachePolicy, source: Source, handle: ModelHandle) -> Applied:
        """Offline: the snapshot :meth:`cache` holds after the context ``source`` (evictions masked, codecs
        decoded; an :class:`~kvlab.policy.evict.Observation` where the score reads queries), the K/V bytes
        it holds, and extra report columns."""
        raise NotImplementedError

    def needs_queries(self) -> bool:
        """Whether :meth:`apply` needs the context's queries (an Observation)."""
        return False

    def eval_check(self, policy: CachePolicy, spec: str) -> None:
        """Refuse what the eval, which compresses a context once, cannot run."""

    def live_check(self, policy: CachePolicy, spec: str) -> None:
        """Refuse what a live cache (``kvlab generate``, stream-ppl, :meth:`cache`) cannot run, before any model
        loads."""

    def serve_check(self, policy: CachePolicy, spec: str) -> None:
        """Refuse what ``kvlab serve`` cannot run: each layout that it can says so (:attr:`serves`)."""
        raise BadInputError(f"--cache '{spec}' keeps {policy.describe()}; {serve_caches()}")

    def rolls(self) -> Roll | None:
        """The window a rolling layout keeps (the server pins a system prompt in its sinks), else None."""
        return None

    def held_at_most(self, limit: int) -> int | None:
        """The most slots one conversation's live cache holds where nothing but the model's position limit
        (``limit`` positions) bounds it: a layout that keeps a share of every token it sees (a server serves it
        only within that limit). None where a window or a budget bounds the cache."""
        return None

    def for_feed(self, feed: int) -> Layout:
        """Itself as a stream fed ``feed`` tokens at a time runs it (a rolling window evicts that many)."""
        return self

    def compresses_prefix(self, n: int) -> bool:
        """Whether a server compresses a shared prefix (a system prompt) of ``n`` tokens once, alone, and starts
        every conversation that shares it from the result (an exact layout shares exact prefixes instead)."""
        return False

    def compress_prefix(self, handle: ModelHandle, ids: list[int]) -> Kept:
        """The shared prefix ``ids`` compressed (:meth:`compresses_prefix`): per layer the kept keys and values
        ``[1, Hkv, n, D]`` in full precision and their original positions ``[1, Hkv, n]``."""
        raise NotImplementedError

    def live(self) -> Layout:
        """Itself as one conversation's live cache runs it (what is shared between conversations left out)."""
        return self


@dataclass(frozen=True)
class CachePolicy:
    """A layout x a codec (None: full precision) x when it acts (in the layout: ``every``, ``chunk``).

    ``spec`` is the canonical string (same policy, same string: the store's namespace and the report
    labels use it); :meth:`to_json` is what a response or report says the cache held.
    """

    layout: Layout
    codec: str | None = None  # codec kind, e.g. "kivi"
    bits: int | None = None
    tail: int | None = None  # full-precision newest slots of the codec (None: the codec's default)
    codec_sinks: int = 0  # full-precision first slots of a codec over the full layout

    @property
    def exact(self) -> bool:
        """Holds every slot in full precision: its outputs equal the model's own."""
        return self.layout.exact and self.codec is None

    @property
    def kind(self) -> str:
        """The layout's kind (``evict``: scored, ``window``: sinks + window...), else ``full`` or ``quant``
        (the full layout over a codec)."""
        return self.layout.kind or ("full" if self.codec is None else "quant")

    @property
    def codec_name(self) -> str | None:
        if self.codec is None:
            return None
        return self.codec if codec_facts(self.codec).fixed_bits is not None else f"{self.codec}{self.bits}"

    @property
    def spec(self) -> str:
        parts = self.layout.items() + ([f"sinks={self.codec_sinks}"] if self.codec_sinks else [])
        if self.codec is not None:
            parts.append(f"codec={self.codec_name}")
            parts += [f"tail={self.tail}"] if self.tail is not None else []
        return ",".join(parts) or "full"

    def quantizer(self, head_dim: int | None = None) -> Quantizer | None:
        """The codec as a :class:`~kvlab.policy.quant.Quantizer` (None for full precision); with
        ``head_dim`` its group size is cut to the largest that divides a small head."""
        if self.codec is None:
            return None
        import math

        from kvlab.policy.quant.methods import make_quantizer

        opts: dict[str, Any] = {"sinks": self.codec_sinks}
        if self.tail is not None:
            opts["window"] = self.tail
        q = make_quantizer(self.codec, self.bits, **opts)
        if head_dim is not None and head_dim % q.group_size:
            q = make_quantizer(self.codec, self.bits, **opts, group_size=math.gcd(q.group_size, head_dim))
        return q

    def capturable(self) -> Roll | None:
        """The window a captured decode of this policy rolls, or None where it has no captured step (see
        :meth:`captured_roll`, which says why)."""
        roll = self.layout.rolls()
        return roll if self.codec is None else None

    def captured_roll(self, capture: str) -> Roll:
        """The window a captured decode (``--capture compile|cuda-graph``) of this policy rolls: its steps run
        on the ring (:class:`~kvlab.hf.static_rolling.StaticRollingCache`, the dense rolling cache's rule in
        fixed buffers), which holds sinks + a window in the model's dtype; any other policy is refused in one
        line naming why."""
        roll = self.capturable()
        if roll is not None:
            return roll
        if self.layout.rolls() is None:
            raise BadInputError(
                f"--capture {capture} runs sinks + window caches (--cache sinks=N,window=M[,chunk=K]); "
                f"'{self.spec}' keeps {self.describe()}: drop --capture"
            )
        raise BadInputError(
            f"--capture {capture} holds the window in the model's dtype: {self.codec_name} codes (written a "
            "block at a time behind full-precision sinks and tail) have no captured step; drop codec= or --capture"
        )

    def live(self) -> CachePolicy:
        """Itself as one conversation's live cache runs it (:meth:`Layout.live`)."""
        return dataclasses.replace(self, layout=self.layout.live())

    def to_json(self) -> dict:
        out: dict[str, Any] = {"spec": self.spec, "kind": self.kind, "layout": self.layout.name}
        out.update(self.layout.fields())
        if self.codec is not None:
            out.update(codec=self.codec_name, quantizer=self.codec, bits=self.bits)
        return out

    def describe(self) -> str:
        stored = "full precision" if self.codec is None else f"{self.codec_name} codes"
        return f"{self.layout.describe()}, in {stored}"


def context(source: Source) -> KVSnapshot:
    """The context's snapshot (an :class:`~kvlab.policy.evict.Observation` carries one with its queries)."""
    from kvlab.policy.evict import Observation

    return source.snapshot if isinstance(source, Observation) else source


def serve_caches() -> str:
    """What ``kvlab serve --cache`` runs, in words (for the one-line refusal of any other layout)."""
    return "kvlab serve runs " + ", and ".join(c.serves for c in LAYOUTS.values() if c.serves)
