"""Running trials under cache policies: prefill the context once, compress it, ask the question, score.

For each trial the context is prefilled once (with the queries captured when an attention-based
eviction policy is asked for: :func:`kvlab.compress.evict.observe`). Each cache policy then turns that
prefill into the per-layer K/V its cache would hold after the context:

* ``full``: the prefill's K/V as they are;
* ``<policy>:<ratio>`` (``snapkv:0.5``): :func:`kvlab.compress.evict.evict` with ``keep = 1 - ratio`` —
  ``ratio`` is the fraction *removed*, kvpress's ``compression_ratio`` and :class:`kvlab.ops.press.Press`'s
  convention; this is the scoring and selection a :class:`~kvlab.hf.compressed_cache.CompressedCache`
  applies after its first forward, so the answer equals ``Press(policy, ratio).generate`` (a test checks
  it); kept keys stay at their original positions;
* ``int4`` / ``<method>:int<b>`` (``kivi:int2``): :func:`kvlab.compress.quant.quantize_snapshot`
  with :func:`kvlab.compress.quant.make_quantizer`, dequantized — what the cache attends over after
  encoding its prompt.

The question and the answer then run on top in full precision (kvpress's convention: the question is
never compressed), at the positions after the context: greedy decoding
(:func:`kvlab.hf.compressed_cache.greedy_on_layers`, cut at the first end-of-sequence token) gives the
scored answer, and one teacher-forced pass over the question plus the *full* cache's answer gives the
logits compared with the full cache's (:mod:`kvlab.metrics.divergence`): every policy is measured on
the same tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.errors import BadInputError

#: aliases accepted in cache specs: ``keynorm`` is kvlab's ``knorm``; ``window`` means sinks + recent
#: window (StreamingLLM), as the issue names it
ALIASES = {"keynorm": "knorm", "window": "streaming_llm"}
#: the quantizer ``int<b>`` alone names
DEFAULT_QUANTIZER = "pertoken"


@dataclass(frozen=True)
class CacheSpec:
    """One cache policy, parsed from its spec string (see :func:`parse_cache_spec`)."""

    spec: str
    kind: str  # full, evict or quant
    method: str = ""  # eviction policy or quantizer name
    ratio: float = 0.0  # eviction: the fraction of the context removed
    bits: int = 16

    @property
    def needs_queries(self) -> bool:
        from kvlab.compress.evict import make_policy

        return self.kind == "evict" and make_policy(self.method).needs_queries

    def to_json(self) -> dict:
        out: dict[str, Any] = {"spec": self.spec, "kind": self.kind}
        if self.kind == "evict":
            out.update(policy=self.method, compression_ratio=self.ratio, keep=1.0 - self.ratio)
        elif self.kind == "quant":
            out.update(quantizer=self.method, bits=self.bits)
        return out


def known_specs() -> str:
    """What a cache spec may be, in one line (for errors and help)."""
    from kvlab.compress.evict import POLICIES
    from kvlab.compress.quant.methods import QUANTIZERS
    from kvlab.compress.quant.scalar import SUPPORTED_BITS

    policies = ", ".join(
        [*(p for p in POLICIES if p not in ALIASES), *(f"{a} (= {b})" for a, b in ALIASES.items())]
    )
    bits = "/".join(map(str, SUPPORTED_BITS))
    return (
        f"full; <policy>:<fraction removed in [0, 1)> with policy one of {policies} (e.g. snapkv:0.5); "
        f"int<bits> ({DEFAULT_QUANTIZER}) or <quantizer>:int<bits> with quantizer one of "
        f"{', '.join([*QUANTIZERS, 'rotation+qjl'])} and bits {bits} (e.g. int4, kivi:int2)"
    )


def parse_cache_spec(spec: str) -> CacheSpec:
    """The one reader of cache specs: ``full``, ``snapkv:0.5``, ``window:0.25``, ``int4``, ``kivi:int2``.

    A bad spec raises :class:`~kvlab.errors.BadInputError` naming the known forms. Nothing is loaded.
    """
    from kvlab.compress.evict import POLICIES, make_policy
    from kvlab.compress.quant.methods import make_quantizer

    text = spec.strip().lower()
    bad = f"unknown cache spec '{spec}'; known: {known_specs()}"
    if text == "full":
        return CacheSpec(text, "full")
    head, sep, tail = text.partition(":")
    quant_method, quant_bits = (DEFAULT_QUANTIZER, head) if not sep else (head, tail)
    if quant_bits.startswith("int") and quant_bits[3:].isdigit():
        try:
            make_quantizer(quant_method, int(quant_bits[3:]))
        except BadInputError as exc:
            raise BadInputError(f"cache spec '{spec}': {exc}; known: {known_specs()}") from None
        return CacheSpec(text, "quant", quant_method, bits=int(quant_bits[3:]))
    if not sep:
        raise BadInputError(bad)
    name = ALIASES.get(head, head)
    if name not in POLICIES:
        raise BadInputError(bad)
    try:
        ratio = float(tail)
    except ValueError:
        raise BadInputError(
            f"cache spec '{spec}': '{tail}' is not a fraction; known: {known_specs()}"
        ) from None
    if not 0.0 <= ratio < 1.0:
        raise BadInputError(f"cache spec '{spec}': the fraction removed must lie in [0, 1), got {tail}")
    make_policy(name)  # a policy that cannot be built without options fails here
    return CacheSpec(text, "evict", name, ratio=ratio)


def parse_cache_specs(specs: Sequence[str]) -> list[CacheSpec]:
    """Several specs, each parsed once; a repeated one is refused (it would be a duplicate column)."""
    parsed = [parse_cache_spec(s) for s in specs]
    seen: set[str] = set()
    for p in parsed:
        if p.spec in seen:
            raise BadInputError(f"cache spec '{p.spec}' is given twice")
        seen.add(p.spec)
    if not parsed:
        raise BadInputError(f"give at least one cache spec; known: {known_specs()}")
    return parsed


def _layers(spec: CacheSpec, source: Any) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], int]:
    """The per-layer K/V the cache of ``spec`` holds after the context, and its K/V bytes.

    ``source`` is an :class:`~kvlab.compress.evict.Observation` or a :class:`~kvlab.cache.KVSnapshot`.
    """
    from kvlab.compress.evict import Observation, evict, make_policy
    from kvlab.compress.quant import make_quantizer, quantize_snapshot

    snap = source.snapshot if isinstance(source, Observation) else source
    if spec.kind == "full":
        return snap.keys, snap.values, snap.nbytes
    if spec.kind == "evict":
        ev = evict(source, make_policy(spec.method), keep=1.0 - spec.ratio)
        return ev.keys, ev.values, ev.nbytes
    quantizer = make_quantizer(spec.method, spec.bits)
    if snap.head_dim % quantizer.group_size:  # a small head: the largest group size that divides it
        quantizer = make_quantizer(
            spec.method, spec.bits, group_size=math.gcd(quantizer.group_size, snap.head_dim)
        )
    qs = quantize_snapshot(snap, quantizer)
    dec = qs.decompress()
    return dec.keys, dec.values, qs.nbytes


def _until_stop(tokens: list[int], stop: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[:i]
    return tokens


@torch.no_grad()
def run_trial(
    handle: Any, trial: Any, specs: Sequence[CacheSpec], *, max_new_tokens: int | None = None
) -> list[dict]:
    """One row per spec: the answer, its score, and KL / top-1 against the full cache on the same tokens.

    The full cache is always run (it is the reference); its row is returned only when ``full`` is in
    ``specs``. ``max_new_tokens`` defaults to the task's own answer budget.
    """
    from kvlab.compress.evict import observe
    from kvlab.eval.score import score
    from kvlab.eval.tasks import encoder
    from kvlab.hf.compressed_cache import greedy_on_layers, logits_on_layers
    from kvlab.metrics.divergence import compare_logits

    encode = encoder(handle)
    ctx, question = encode(trial.context), encode(trial.question)
    n_new = int(max_new_tokens or trial.max_new_tokens)
    t0 = time.perf_counter()
    source: Any = (
        observe(handle, ctx)
        if any(s.needs_queries for s in specs)
        else handle.prefill(ctx, all_logits=False).snapshot
    )
    prefill_s = time.perf_counter() - t0
    start = len(ctx)
    stop = handle.eos_ids()
    full = CacheSpec("full", "full")
    reference: dict[str, Any] = {}
    rows = []
    for spec in [full, *(s for s in specs if s.kind != "full")]:
        t1 = time.perf_counter()
        keys, values, nbytes = _layers(spec, source)
        tokens = greedy_on_layers(handle, keys, values, question, start, n_new)
        if spec.kind == "full":
            reference["answer"] = tokens
        forced = question + reference["answer"][:-1]
        logits = logits_on_layers(handle, keys, values, forced, start)
        if spec.kind == "full":
            reference["logits"] = logits
        div = compare_logits(reference["logits"], logits)
        answer_rows = slice(len(question) - 1, None)
        div_answer = compare_logits(reference["logits"][answer_rows], logits[answer_rows])
        answer = _until_stop(tokens, stop)
        text = handle.decode(answer)
        row = {
            **spec.to_json(),
            "task": trial.task,
            "length": trial.length,
            "seed": trial.seed,
            "context_tokens": len(ctx),
            "question_tokens": len(question),
            "kept_slots": int(keys[0].shape[-2]),
            "kv_bytes": int(nbytes),
            "output": text,
            "answers": list(trial.answers),
            "rule": trial.rule,
            "score": score(text, trial.answers, trial.rule),
            "kld": div.kl,
            "top1": div.top1,
            "kld_answer": div_answer.kl,
            "top1_answer": div_answer.top1,
            "compared_tokens": div.n,
            "prefill_s": prefill_s,
            "seconds": time.perf_counter() - t1,
        }
        if spec.kind != "full" or any(s.kind == "full" for s in specs):
            rows.append(row)
    return rows


def trial_seed(seed: int, index: int) -> int:
    """The seed of trial ``index`` of a run seeded ``seed`` (trials of one run differ; runs repeat)."""
    return int(seed) * 100_003 + int(index)


def run_suite(
    handle: Any,
    specs: Sequence[CacheSpec],
    *,
    tasks: Sequence[str],
    lengths: Sequence[int],
    trials: int,
    seed: int = 0,
    haystack_text: str | None = None,
    max_new_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """Every ``(task, length, trial)`` under every spec: the raw rows (see :func:`run_trial`), with ``trial``."""
    from kvlab.eval.tasks import TASKS, make_trial

    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise BadInputError(f"unknown eval task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    if trials < 1:
        raise BadInputError(f"trials must be >= 1, got {trials}")
    total, done, rows = len(tasks) * len(lengths) * trials, 0, []
    for name in tasks:
        for length in lengths:
            for i in range(trials):
                trial = make_trial(name, handle, length, trial_seed(seed, i), haystack_text)
                for row in run_trial(handle, trial, specs, max_new_tokens=max_new_tokens):
                    rows.append({**row, "trial": i})
                done += 1
                if progress is not None:
                    progress(done, total)
    return rows


def _interval(values: Sequence[float], seed: int) -> dict | None:
    """The mean with its bootstrap interval (JSON), or None when no value is finite."""
    from kvlab.metrics.stats import bootstrap_ci

    if not any(math.isfinite(v) for v in values):
        return None
    return bootstrap_ci(list(values), seed=seed).to_json()


def summarize(rows: Sequence[dict], *, seed: int = 0) -> list[dict]:
    """Per (task, cache, length): accuracy, KL and top-1 means with bootstrap intervals over trials."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["spec"], r["length"]), []).append(r)
    out = []
    for (task_name, spec, length), rs in groups.items():
        kld = [r["kld"] for r in rs]
        out.append(
            {
                "task": task_name,
                "cache": spec,
                "length": length,
                "trials": len(rs),
                "accuracy": _interval([r["score"] for r in rs], seed),
                "kld": _interval(kld, seed),
                "kld_infinite": sum(1 for k in kld if k == float("inf")),
                "top1": _interval([r["top1"] for r in rs], seed),
                "kld_answer": _interval([r["kld_answer"] for r in rs], seed),
                "seconds": sum(r["seconds"] for r in rs),
            }
        )
    return out
