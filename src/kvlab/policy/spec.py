"""One cache policy: which slots stay (a layout) x how they are stored (a codec) x when it acts.

A policy is named everywhere by one compact spec string (``--cache SPEC``), read only here:

* ``full`` — every slot, full precision (the reference);
* ``sinks=4,window=2048`` — attention sinks + a recent window, rolled on overflow (StreamingLLM);
  ``chunk=N`` evicts N at a time;
* ``h2o,keep=0.25`` — the top-scored quarter of the prompt's slots, chosen once after the prefill
  (any registered score: :data:`kvlab.policy.evict.POLICIES`); ``ratio=0.75`` is the fraction
  *removed* (kvpress's ``compression_ratio``), ``budget=N`` a slot count; ``every=256`` keeps that
  budget while decoding, re-scoring every 256 new tokens; ``sinks=``/``window=`` set the slots a
  score can never evict;
* ``codec=kivi4`` (any registered codec, :data:`kvlab.policy.quant.methods.QUANTIZERS`, with its
  bits: ``int4`` = ``pertoken4``, ``kivi2``, ``rotation4``, ``prerope4``, ``fp8``) — how the held
  slots are stored; combines with any layout, e.g. ``sinks=4,window=2048,codec=kivi4``; ``tail=N``
  keeps the newest N slots in full precision.

The older short forms stay valid: ``int4``, ``kivi:int2`` (a codec alone) and ``snapkv:0.5`` (a score
and the fraction removed; ``window:R`` is sinks + window, ``keynorm`` is ``knorm``).

Layouts are small classes, one file each under :mod:`kvlab.policy.layouts`, registered by name
(:data:`LAYOUTS`): each reads its own items of a spec and answers what it means (its live cache, its offline
application, what the eval and the server may do with it); scores and codecs register themselves where they
are defined and are named in :mod:`kvlab.policy.catalogue`, so a new one reaches every command that reads a
spec. Parsing builds nothing heavy, loads no model and imports no torch; a bad spec is one
:class:`~kvlab.errors.BadInputError` naming what is known.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvlab.errors import BadInputError
from kvlab.policy.catalogue import CODECS, SUPPORTED_BITS, VARIANTS, codec_facts
from kvlab.policy.layouts import LAYOUTS, Items
from kvlab.policy.layouts.base import CachePolicy as CachePolicy  # re-exported
from kvlab.policy.layouts.base import number
from kvlab.policy.layouts.full import FullLayout
from kvlab.policy.layouts.rolling import SinksWindowLayout as SinksWindowLayout  # re-exported
from kvlab.policy.layouts.scored import ScoredLayout as ScoredLayout  # re-exported

if TYPE_CHECKING:
    from kvlab.policy.layouts.base import Model

CODEC_KEYS = ("codec", "tail")  # the policy's own keys; every other key is a layout's


def keys() -> tuple[str, ...]:
    """Every key a spec may give: the layouts' (:attr:`~kvlab.policy.layouts.Layout.keys`) and the codec's."""
    return tuple(dict.fromkeys(k for c in LAYOUTS.values() for k in (*c.keys, *CODEC_KEYS)))


FULL = CachePolicy(FullLayout())


# -- reading specs ------------------------------------------------------------------------------
def known() -> str:
    """What a cache spec may say, in one line (for errors and ``--help``): each layout's syntax, then codecs."""
    names = [k if c.fixed_bits is not None else f"{k}<bits>" for k, c in CODECS.items()]
    return (
        f"{'; '.join(c.syntax for c in LAYOUTS.values() if c.syntax)}; add codec=<codec>[,tail=N] with codec "
        f"one of {', '.join(names)} (bits {'/'.join(map(str, SUPPORTED_BITS))}; int<bits> = pertoken), "
        "e.g. sinks=4,window=2048,codec=kivi4 or h2o,keep=0.25,every=256; short forms int4, kivi:int2, snapkv:0.5"
    )


def _codec(word: str, spec: str) -> tuple[str, int | None]:
    """``kivi4`` -> ``("kivi", 4)``; ``int4`` -> pertoken; ``fp8`` -> ``("fp8", 8)``; checked as
    :func:`~kvlab.policy.quant.methods.make_quantizer` checks them."""
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


#: the longest spec read: a longer one is refused without being echoed back
MAX_SPEC_CHARS = 256


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
    word, opts = None, {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if not eq:
            if word is None and any(c.takes_word(key) for c in LAYOUTS.values()):
                word = key  # a layout's name: a score
                continue
            if "codec" not in opts and (key in CODECS or re.fullmatch(r"(int|[a-z+]+)\d+", key)):
                opts["codec"] = key  # a bare codec name: int4, kivi2, fp8
                continue
            raise BadInputError(f"cache spec '{spec}': unknown item '{item}'; known: {known()}")
        if key not in keys():
            raise BadInputError(
                f"cache spec '{spec}': unknown key '{key}' (keys: {', '.join(keys())}); known: {known()}"
            )
        if key in opts:
            raise BadInputError(f"cache spec '{spec}': {key} is given twice")
        opts[key] = value
    return _build(spec, word, opts)


def _build(spec: str, word: str | None, opts: dict[str, str]) -> CachePolicy:
    """The policy of a spec's items: the codec read here, the layout that claims them reads the rest."""
    codec, bits = _codec(opts["codec"], spec) if "codec" in opts else (None, None)
    tail = number("tail", opts["tail"], spec, int) if "tail" in opts else None
    if tail is not None and codec is None:
        raise BadInputError(f"cache spec '{spec}': tail= sets a codec's full-precision slots; add codec=")
    items = Items(spec, word, opts, codec)
    cls = next((c for c in LAYOUTS.values() if c.claims(items)), FullLayout)
    foreign = [k for k in opts if k not in (*cls.keys, *CODEC_KEYS)]
    if foreign:
        owner = next(c for c in LAYOUTS.values() if foreign[0] in c.keys)
        given = [k for k in foreign if k in owner.keys]
        raise BadInputError(f"cache spec '{spec}': {', '.join(given)} {owner.refusal}")
    layout = cls.read(items)
    policy = CachePolicy(layout, codec, bits, tail, layout.codec_sinks(items))
    layout.check(policy, spec)
    return policy


def parse_many(specs: Sequence[str]) -> list[CachePolicy]:
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


def cache_for(policy: CachePolicy | str, handle: Model, *, packed_path: str = "auto", pinned: int = 0) -> Any:
    """A new, empty live cache running ``policy`` (a :class:`CachePolicy` or its spec string) for
    ``handle`` (a :class:`~kvlab.model.ModelHandle`, read as a :class:`~kvlab.hf.runner.Runner`, or a Hugging
    Face causal LM), bound to the model, ready for ``model.generate(..., past_key_values=...)``, kvlab's own
    loop or the server: its layout builds it (:meth:`~kvlab.policy.layouts.Layout.cache`; each layout's file
    says which cache; ``pinned`` first tokens stay where the layout rolls a window)."""
    if isinstance(policy, str):
        policy = parse(policy)
    return policy.layout.cache(policy, handle, packed_path=packed_path, pinned=pinned)
