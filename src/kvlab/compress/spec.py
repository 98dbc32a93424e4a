"""One cache policy: which slots stay (a layout) x how they are stored (a codec) x when it acts.

A policy is named everywhere by one compact spec string (``--cache SPEC``), read only here:

* ``full`` — every slot, full precision (the reference);
* ``sinks=4,window=2048`` — attention sinks + a recent window, rolled on overflow (StreamingLLM);
  ``chunk=N`` evicts N at a time;
* ``h2o,keep=0.25`` — the top-scored quarter of the prompt's slots, chosen once after the prefill
  (any registered score: :data:`kvlab.compress.evict.POLICIES`); ``ratio=0.75`` is the fraction
  *removed* (kvpress's ``compression_ratio``), ``budget=N`` a slot count; ``every=256`` keeps that
  budget while decoding, re-scoring every 256 new tokens; ``sinks=``/``window=`` set the slots a
  score can never evict;
* ``codec=kivi4`` (any registered codec, :data:`kvlab.compress.quant.methods.QUANTIZERS`, with its
  bits: ``int4`` = ``pertoken4``, ``kivi2``, ``rotation4``, ``prerope4``, ``fp8``) — how the held
  slots are stored; combines with any layout, e.g. ``sinks=4,window=2048,codec=kivi4``; ``tail=N``
  keeps the newest N slots in full precision.

The older short forms stay valid: ``int4``, ``kivi:int2`` (a codec alone) and ``snapkv:0.5`` (a score
and the fraction removed; ``window:R`` is sinks + window, ``keynorm`` is ``knorm``).

Layouts are small classes registered by name (:data:`LAYOUTS`); scores and codecs register
themselves where they are defined and are named in :mod:`kvlab.compress.catalogue`, so a new one
reaches every command that reads a spec. Parsing builds nothing heavy, loads no model and imports no
torch (the catalogue names what the registries hold); a bad spec is one
:class:`~kvlab.errors.BadInputError` naming what is known.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvlab.compress.catalogue import CODECS, SCORES, SUPPORTED_BITS, VARIANTS, codec_facts
from kvlab.errors import BadInputError

#: aliases of score names in specs: ``keynorm`` is kvlab's ``knorm``
ALIASES = {"keynorm": "knorm"}
DEFAULT_SINKS = 4  # a sinks + window layout without ``sinks=`` keeps StreamingLLM's four
MAX_INT = 2**31 - 1  # slot counts past this are typos, not caches
KEYS = ("sinks", "window", "keep", "ratio", "budget", "every", "chunk", "codec", "tail", "heads", "layers")
#: how a scored layout shares its budget: across the KV heads of a layer and across layers
HEAD_SHARES = ("uniform", "ada")  # ada: AdaKV's top slots over all heads of a layer together
LAYER_SHARES = ("uniform", "pyramid")  # pyramid: PyramidKV's budgets falling linearly with depth


# -- layouts: which slots stay ------------------------------------------------------------------
LAYOUTS: dict[str, type[Layout]] = {}


@dataclass(frozen=True)
class Layout:
    """Base: which slots a cache keeps. ``exact`` layouts keep every slot."""

    name: ClassVar[str] = "layout"
    exact: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            LAYOUTS[cls.name] = cls

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class FullLayout(Layout):
    """Every slot stays."""

    name: ClassVar[str] = "full"
    exact: ClassVar[bool] = True

    def describe(self) -> str:
        return "every slot"


@dataclass(frozen=True)
class SinksWindowLayout(Layout):
    """The first ``sinks`` slots and the last ``window``; a full cache evicts ``chunk`` at a time
    (0: the rolling cache's default for the window)."""

    sinks: int = DEFAULT_SINKS
    window: int = 0
    chunk: int = 0
    name: ClassVar[str] = "sinks_window"

    def describe(self) -> str:
        return f"{self.sinks} sinks + the last {self.window} slots"


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
    name: ClassVar[str] = "scored"

    def policy(self) -> Any:
        """The registered score as a :class:`kvlab.compress.evict.Policy` with these protected slots."""
        from kvlab.compress.evict import make_policy

        opts = {k: getattr(self, k) for k in ("sinks", "window") if getattr(self, k) is not None}
        return make_policy(self.score, **opts)

    def describe(self) -> str:
        size = f"{self.keep:g} of the prompt's slots" if self.keep is not None else f"{self.budget} slots"
        when = f", re-scored every {self.every} tokens" if self.every else ", once after the prefill"
        return f"the top {size} by {self.score}{when}"


# -- the policy ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class CachePolicy:
    """A layout x a codec (None: full precision) x when it acts (in the layout: ``every``, ``chunk``).

    ``spec`` is the canonical string (same policy, same string: the store's namespace and the report
    labels use it); :meth:`to_json` is what a response or report says the cache held.
    """

    layout: Layout = field(default_factory=FullLayout)
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
        """``full``, ``quant`` (full layout + codec), ``evict`` (scored), ``window`` (sinks + window)."""
        if isinstance(self.layout, ScoredLayout):
            return "evict"
        if isinstance(self.layout, SinksWindowLayout):
            return "window"
        return "full" if self.codec is None else "quant"

    @property
    def codec_name(self) -> str | None:
        if self.codec is None:
            return None
        return self.codec if codec_facts(self.codec).fixed_bits is not None else f"{self.codec}{self.bits}"

    @property
    def spec(self) -> str:
        lay, parts = self.layout, []
        if isinstance(lay, SinksWindowLayout):
            parts += [f"sinks={lay.sinks}", f"window={lay.window}"] + (
                [f"chunk={lay.chunk}"] if lay.chunk else []
            )
        elif isinstance(lay, ScoredLayout):
            parts.append(lay.score)
            parts.append(f"keep={lay.keep!r}" if lay.keep is not None else f"budget={lay.budget}")
            parts += [f"{k}={getattr(lay, k)}" for k in ("sinks", "window") if getattr(lay, k) is not None]
            parts += [f"{k}={getattr(lay, k)}" for k in ("heads", "layers") if getattr(lay, k) != "uniform"]
            parts += [f"every={lay.every}"] if lay.every else []
        elif self.codec_sinks:
            parts.append(f"sinks={self.codec_sinks}")
        if self.codec is not None:
            parts.append(f"codec={self.codec_name}")
            parts += [f"tail={self.tail}"] if self.tail is not None else []
        return ",".join(parts) or "full"

    def quantizer(self, head_dim: int | None = None) -> Any:
        """The codec as a :class:`~kvlab.compress.quant.Quantizer` (None for full precision); with
        ``head_dim`` its group size is cut to the largest that divides a small head."""
        if self.codec is None:
            return None
        import math

        from kvlab.compress.quant.methods import make_quantizer

        opts: dict[str, Any] = {"sinks": self.codec_sinks}
        if self.tail is not None:
            opts["window"] = self.tail
        q = make_quantizer(self.codec, self.bits, **opts)
        if head_dim is not None and head_dim % q.group_size:
            q = make_quantizer(self.codec, self.bits, **opts, group_size=math.gcd(q.group_size, head_dim))
        return q

    def to_json(self) -> dict:
        out: dict[str, Any] = {"spec": self.spec, "kind": self.kind, "layout": self.layout.name}
        lay = self.layout
        if isinstance(lay, SinksWindowLayout):
            out.update(sinks=lay.sinks, window=lay.window)
        if isinstance(lay, ScoredLayout):
            out.update(policy=lay.score, every=lay.every, heads=lay.heads, layers=lay.layers)
            if lay.keep is not None:
                out.update(keep=lay.keep, compression_ratio=round(1.0 - lay.keep, 12))
            else:
                out.update(budget=lay.budget)
        if self.codec is not None:
            out.update(codec=self.codec_name, quantizer=self.codec, bits=self.bits)
        return out

    def describe(self) -> str:
        stored = "full precision" if self.codec is None else f"{self.codec_name} codes"
        return f"{self.layout.describe()}, in {stored}"


FULL = CachePolicy()


# -- reading specs ------------------------------------------------------------------------------
def known() -> str:
    """What a cache spec may say, in one line (for errors and ``--help``)."""
    names = [k if c.fixed_bits is not None else f"{k}<bits>" for k, c in CODECS.items()]
    scores = [*SCORES, *(f"{a} (= {b})" for a, b in ALIASES.items())]
    return (
        f"full; sinks=N,window=N[,chunk=N]; <score>,keep=F|ratio=F|budget=N[,every=N][,sinks=N][,window=N]"
        f"[,heads={'|'.join(HEAD_SHARES)}][,layers={'|'.join(LAYER_SHARES)}] "
        f"with score one of {', '.join(scores)}; add codec=<codec>[,tail=N] with codec one of "
        f"{', '.join(names)} (bits {'/'.join(map(str, SUPPORTED_BITS))}; int<bits> = pertoken), "
        "e.g. sinks=4,window=2048,codec=kivi4 or h2o,keep=0.25,every=256; short forms int4, kivi:int2, snapkv:0.5"
    )


def _codec(word: str, spec: str) -> tuple[str, int | None]:
    """``kivi4`` -> ``("kivi", 4)``; ``int4`` -> pertoken; ``fp8`` -> ``("fp8", 8)``; checked as
    :func:`~kvlab.compress.quant.methods.make_quantizer` checks them."""
    word = word.replace(":int", "").replace(":", "")
    if word.startswith("int") and word[3:].isdigit():
        word = "pertoken" + word[3:]
    if word in CODECS and CODECS[word].fixed_bits is not None:
        return word, CODECS[word].fixed_bits
    m = re.fullmatch(r"([a-z0-9_+]*?[a-z_+])(\d+)", word)
    if m is None or m.group(1) not in [*CODECS, *VARIANTS]:
        raise BadInputError(f"cache spec '{spec}': unknown codec '{word}'; known: {known()}")
    name, bits = m.group(1), int(m.group(2))
    fixed = codec_facts(name).fixed_bits
    if fixed is not None and bits != fixed:
        raise BadInputError(f"cache spec '{spec}': quantizer '{name}' has {fixed} bits, got {bits}")
    if bits not in SUPPORTED_BITS:
        raise BadInputError(
            f"cache spec '{spec}': unsupported bit width {bits}; choose one of "
            f"{', '.join(map(str, SUPPORTED_BITS))}"
        )
    return name, bits


#: how numbers in a spec are written: ASCII digits only (Python's int() and float() also take fullwidth and
#: other Unicode digits, "1_000", "nan" and "inf"; a spec says what it means in one spelling)
_NUMBER = {int: re.compile(r"[0-9]+"), float: re.compile(r"[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?")}
#: the longest spec read: a longer one is refused without being echoed back
MAX_SPEC_CHARS = 256


def _number(key: str, value: str, spec: str, kind: type) -> Any:
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


def _legacy(text: str, spec: str) -> str:
    """The short forms as key=value items: ``snapkv:0.5`` -> ``snapkv,ratio=0.5``, ``window:0.25`` ->
    ``streaming_llm,ratio=0.25``, ``kivi:int2`` / ``int4`` -> ``codec=...``."""
    if "=" in text or "," in text:
        return text
    head, sep, tail = text.partition(":")
    if (sep and tail.startswith("int")) or (not sep and head.startswith("int") and head[3:].isdigit()):
        return f"codec={text}"
    if sep:
        name = "streaming_llm" if head == "window" else head
        return f"{name},ratio={tail}"
    return text


def parse(spec: str) -> CachePolicy:
    """The one reader of cache specs (see the module docstring); raises :class:`BadInputError`."""
    if not isinstance(spec, str) or not spec.strip():
        raise BadInputError(f"empty cache spec; known: {known()}")
    if len(spec) > MAX_SPEC_CHARS:
        raise BadInputError(
            f"cache spec '{spec[:40]}...' is {len(spec):,} characters long (at most {MAX_SPEC_CHARS})"
        )
    odd = next((i for i, c in enumerate(spec) if not (" " <= c <= "~")), None)
    if odd is not None:
        raise BadInputError(
            f"cache spec '{spec[:40]}{'...' if len(spec) > 40 else ''}': character {odd + 1} "
            f"({spec[odd]!a}) is not printable ASCII; specs are written in ASCII (e.g. window=256)"
        )
    text = _legacy(spec.strip().lower().replace(" ", ""), spec)
    if text == "full":
        return FULL
    score, opts = None, {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if not eq:
            name = ALIASES.get(key, key)
            if name in SCORES and score is None:
                score = name
                continue
            if "codec" not in opts and (key in CODECS or re.fullmatch(r"(int|[a-z+]+)\d+", key)):
                opts["codec"] = key  # a bare codec name: int4, kivi2, fp8
                continue
            raise BadInputError(f"cache spec '{spec}': unknown item '{item}'; known: {known()}")
        if key not in KEYS:
            raise BadInputError(
                f"cache spec '{spec}': unknown key '{key}' (keys: {', '.join(KEYS)}); known: {known()}"
            )
        if key in opts:
            raise BadInputError(f"cache spec '{spec}': {key} is given twice")
        opts[key] = value
    return _build(spec, score, opts)


def _build(spec: str, score: str | None, opts: dict[str, str]) -> CachePolicy:
    ints = {
        k: _number(k, opts[k], spec, int)
        for k in ("sinks", "window", "budget", "every", "chunk", "tail")
        if k in opts
    }
    fracs = {k: _number(k, opts[k], spec, float) for k in ("keep", "ratio") if k in opts}
    codec, bits = _codec(opts["codec"], spec) if "codec" in opts else (None, None)
    if "tail" in ints and codec is None:
        raise BadInputError(f"cache spec '{spec}': tail= sets a codec's full-precision slots; add codec=")

    def refuse(keys: tuple[str, ...], why: str) -> None:
        given = [k for k in keys if k in opts]
        if given:
            raise BadInputError(f"cache spec '{spec}': {', '.join(given)} {why}")

    layout: Layout
    codec_sinks = 0
    if score is None:
        refuse(("heads", "layers"), "share a score's budget: add a score (e.g. h2o,keep=0.5,heads=ada)")
    if score is not None:
        refuse(("chunk",), "applies to sinks + window only")
        budgets = [k for k in ("keep", "ratio", "budget") if k in opts]
        if len(budgets) != 1:
            raise BadInputError(
                f"cache spec '{spec}': give one budget for '{score}': keep=F, ratio=F or budget=N"
            )
        keep = fracs.get("keep")
        if "ratio" in fracs:
            if not 0.0 <= fracs["ratio"] < 1.0:
                raise BadInputError(
                    f"cache spec '{spec}': ratio (the fraction removed) must lie in [0, 1), got {opts['ratio']}"
                )
            keep = 1.0 - fracs["ratio"]
        if keep is not None and not 0.0 < keep <= 1.0:
            raise BadInputError(f"cache spec '{spec}': keep must be a fraction in (0, 1], got {opts['keep']}")
        if "budget" in ints and ints["budget"] < 1:
            raise BadInputError(f"cache spec '{spec}': budget must be >= 1 slot")
        shares = {}
        for key, allowed in (("heads", HEAD_SHARES), ("layers", LAYER_SHARES)):
            if key in opts:
                if opts[key] not in allowed:
                    raise BadInputError(
                        f"cache spec '{spec}': {key}= is one of {', '.join(allowed)}, got {opts[key]}"
                    )
                shares[key] = opts[key]
        layout = ScoredLayout(
            score,
            keep,
            ints.get("budget"),
            ints.get("every", 0),
            ints.get("sinks"),
            ints.get("window"),
            **shares,
        )
    elif "window" in ints:
        refuse(
            ("keep", "ratio", "budget", "every"),
            "only apply to a score (e.g. h2o,keep=0.5); sinks + window keeps the newest slots",
        )
        if ints["window"] < 1:
            raise BadInputError(f"cache spec '{spec}': window must be >= 1")
        layout = SinksWindowLayout(ints.get("sinks", DEFAULT_SINKS), ints["window"], ints.get("chunk", 0))
        if codec is not None:
            _check_coded_window(spec, CachePolicy(layout, codec, bits, ints.get("tail")))
    else:
        refuse(("keep", "ratio", "budget", "every"), "only apply to a score (e.g. h2o,keep=0.5)")
        refuse(("chunk",), "applies to sinks + window only (add window=N)")
        if "sinks" in ints and codec is None:
            raise BadInputError(f"cache spec '{spec}': sinks= alone keeps everything; add window=N or codec=")
        layout, codec_sinks = FullLayout(), ints.get("sinks", 0)
    return CachePolicy(layout, codec, bits, ints.get("tail"), codec_sinks)


def _check_coded_window(spec: str, policy: CachePolicy) -> None:
    """A window over codes must hold at least one block of codes besides its chunk and full-precision tail
    (checked again, for the model's head size, when the cache is built)."""
    import math

    from kvlab.policy.window import default_chunk

    lay, facts = policy.layout, codec_facts(str(policy.codec))
    assert isinstance(lay, SinksWindowLayout)
    tail = facts.tail if policy.tail is None else policy.tail
    chunk = facts.block * math.ceil((lay.chunk or default_chunk(lay.window)) / facts.block)
    need = chunk + facts.block + tail
    if lay.window < need:
        raise BadInputError(
            f"cache spec '{spec}': a window of {lay.window} over {policy.codec_name} codes holds none: it "
            f"needs the eviction chunk ({chunk}) + one block of codes ({facts.block}) + the full-precision "
            f"tail ({tail}) = {need} slots (a larger window, chunk=, or tail=)"
        )


def parse_many(specs: list[str] | tuple[str, ...]) -> list[CachePolicy]:
    """Several specs, each parsed once; the same policy twice is refused (a duplicate column)."""
    parsed = [parse(s) for s in specs]
    if not parsed:
        raise BadInputError(f"give at least one cache spec; known: {known()}")
    seen: set[str] = set()
    for p in parsed:
        if p.spec in seen:
            raise BadInputError(f"cache spec '{p.spec}' is given twice")
        seen.add(p.spec)
    return parsed
