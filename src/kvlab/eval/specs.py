"""Reading the cache specs of an eval run (``kvlab eval ruler --cache``, ``--ratios``), without torch.

A run's policies are :class:`~kvlab.policy.spec.CachePolicy` objects read by
:func:`kvlab.policy.spec.parse`, checked here for what an offline run can do; ``kvlab eval ruler``
refuses a bad one while reading its options, before torch or a model loads. :mod:`kvlab.eval.run` runs
them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.errors import BadInputError
from kvlab.policy.spec import FULL, CachePolicy, parse, parse_many

if TYPE_CHECKING:
    from kvlab.policy.layouts.base import Roll


@dataclass(frozen=True)
class CacheSpec:
    """One cache policy of a run: ``spec`` as the user wrote it (lower-cased: the column label) and the
    :class:`~kvlab.policy.spec.CachePolicy` it names (parsed by :func:`kvlab.policy.spec.parse`)."""

    spec: str
    policy: CachePolicy = FULL

    @property
    def kind(self) -> str:
        return self.policy.kind

    @property
    def method(self) -> str:
        """The score (eviction) or codec kind (quantization); empty for the full cache."""
        return str(self.policy.layout.fields().get("policy") or self.policy.codec or "")

    @property
    def ratio(self) -> float:
        """The fraction of the context removed (eviction with ``keep``), else 0."""
        return float(self.policy.layout.fields().get("compression_ratio", 0.0))

    @property
    def bits(self) -> int:
        return self.policy.bits or 16

    @property
    def needs_queries(self) -> bool:
        return self.policy.layout.needs_queries()

    def to_json(self) -> dict:
        return {**self.policy.to_json(), "spec": self.spec, "policy_spec": self.policy.spec}


def parse_cache_spec(spec: str) -> CacheSpec:
    """A cache spec for a run (:func:`kvlab.policy.spec.parse`), checked by its layout for what an offline
    run can do (:meth:`~kvlab.policy.layouts.Layout.eval_check`: the context is compressed once here)."""
    policy = parse(spec)
    policy.layout.eval_check(policy, spec)
    return CacheSpec(spec.strip().lower(), policy)


def parse_cache_specs(specs: Sequence[str]) -> list[CacheSpec]:
    """Several specs, none given twice (a duplicate column) and at least one (:func:`~kvlab.policy.spec.parse_many`),
    each checked for the eval."""
    parse_many(specs)
    return [parse_cache_spec(s) for s in specs]


def parse_ratios(text: str) -> list[float]:
    """``--ratios 0.25,0.5,0.75``: fractions removed, each in [0, 1), none repeated, in the order given."""
    items = [v.strip() for v in str(text).split(",")]
    try:
        ratios = [float(v) for v in items]
    except ValueError:
        raise BadInputError(
            f"ratios {text!r} is not a comma-separated list of fractions (e.g. 0.25,0.5)"
        ) from None
    for r in ratios:
        if not 0.0 <= r < 1.0:  # also refuses nan
            raise BadInputError(f"ratio {r:g} (the fraction removed) must lie in [0, 1)")
    if len(set(ratios)) != len(ratios):
        raise BadInputError(f"ratios {text!r} repeat a ratio")
    return ratios


def bare_score(text: str) -> str | None:
    """The spec written as key=value items when it names a score and no budget (``snapkv``,
    ``h2o,sinks=4``; ``window`` is sinks + window), else None: it is complete (or not a score)."""
    t = text.strip().lower().replace(" ", "")
    t = "streaming_llm" if t == "window" else t
    if ":" in t or any(item.partition("=")[0] in ("keep", "ratio", "budget") for item in t.split(",")):
        return None
    try:
        parse(t)
        return None  # complete as written: full, a codec, sinks + window
    except BadInputError:
        pass
    try:
        parse(f"{t},ratio=0.5")  # ratio= is read by a scored layout only
    except BadInputError:
        return None  # not a score's spec: let the one reader say what is wrong with it
    return t


def expand_specs(texts: Sequence[str], ratios: Sequence[float] | None) -> list[str]:
    """Each spec naming a score without a budget, once per ratio (the fraction removed): ``snapkv`` ->
    ``snapkv:0.25``, ``snapkv:0.5``...; ``h2o,sinks=4`` -> ``h2o,sinks=4,ratio=0.25``... Full specs and
    codecs pass unchanged. Without ratios the specs pass unchanged (a bare score is then refused by the
    reader: "give one budget"); ratios with nothing to expand are refused (they would be ignored)."""
    if not ratios:
        for text in texts:
            if bare_score(text) is not None:
                raise BadInputError(
                    f"cache spec '{text}': give one budget ({text.strip()}:0.5, keep=F, ratio=F or "
                    "budget=N) or --ratios 0.25,0.5,0.75"
                )
        return list(texts)
    out, expanded = [], False
    for text in texts:
        base = bare_score(text)
        if base is None:
            out.append(text)
            continue
        expanded, label = True, text.strip().lower().replace(" ", "")  # "window" stays "window:R"
        out += [f"{base},ratio={r:g}" if "," in base else f"{label}:{r:g}" for r in ratios]
    if not expanded:
        raise BadInputError(
            "--ratios expands a cache spec naming a score without a budget (e.g. --cache snapkv "
            "--cache h2o); none was given"
        )
    return out


def captured_rolls(specs: Sequence[CacheSpec]) -> dict[str, Roll]:
    """The specs a captured step runs (sinks + window in the model's dtype), by name: the window each rolls."""
    rolls = {s.spec: s.policy.capturable() for s in specs if s.kind != "full"}
    return {name: roll for name, roll in rolls.items() if roll is not None}


def check_capture(specs: Sequence[CacheSpec], capture: str) -> None:
    """``--capture compile|cuda-graph`` runs the sinks + window caches in the model's dtype through a captured
    step (the others as without it): refused in one line where no cache asked is one."""
    if not captured_rolls(specs):
        asked = ", ".join(s.spec for s in specs)
        raise BadInputError(
            f"--capture {capture} runs sinks + window caches in the model's dtype (--cache sinks=N,window=M); "
            f"none of {asked} is one: drop --capture"
        )
