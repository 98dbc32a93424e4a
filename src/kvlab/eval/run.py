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

from kvlab.compress.spec import FULL, CachePolicy, FullLayout, ScoredLayout, known, parse
from kvlab.errors import BadInputError


@dataclass(frozen=True)
class CacheSpec:
    """One cache policy of a run: ``spec`` as the user wrote it (lower-cased: the column label) and the
    :class:`~kvlab.compress.spec.CachePolicy` it names (parsed by :func:`kvlab.compress.spec.parse`)."""

    spec: str
    policy: CachePolicy = FULL

    @property
    def kind(self) -> str:
        return self.policy.kind

    @property
    def method(self) -> str:
        """The score (eviction) or codec kind (quantization); empty for the full cache."""
        lay = self.policy.layout
        return lay.score if isinstance(lay, ScoredLayout) else (self.policy.codec or "")

    @property
    def ratio(self) -> float:
        """The fraction of the context removed (eviction with ``keep``), else 0."""
        lay = self.policy.layout
        return round(1.0 - lay.keep, 12) if isinstance(lay, ScoredLayout) and lay.keep is not None else 0.0

    @property
    def bits(self) -> int:
        return self.policy.bits or 16

    @property
    def needs_queries(self) -> bool:
        lay = self.policy.layout
        return isinstance(lay, ScoredLayout) and lay.policy().needs_queries

    def to_json(self) -> dict:
        return {**self.policy.to_json(), "spec": self.spec, "policy_spec": self.policy.spec}


def known_specs() -> str:
    """What a cache spec may be, in one line (for errors and help)."""
    return known()


def parse_cache_spec(spec: str) -> CacheSpec:
    """A cache spec for a run (:func:`kvlab.compress.spec.parse`), checked for what an offline run
    can do: ``every=`` acts while decoding, and the context is compressed once here."""
    policy = parse(spec)
    lay = policy.layout
    if (
        isinstance(lay, ScoredLayout)
        and _shared(policy)
        and (lay.budget is not None or policy.codec is not None)
    ):
        raise BadInputError(
            f"cache spec '{spec}': shared budgets (heads=, layers=) run in the eval with keep= and no codec"
        )
    if isinstance(lay, ScoredLayout) and lay.every:
        raise BadInputError(
            f"cache spec '{spec}': every= keeps a budget while decoding; the eval compresses the context "
            "once (drop every=)"
        )
    if isinstance(lay, ScoredLayout) and policy.codec is not None:
        q = policy.quantizer()
        if q.token_multiple() > 1 or q.uses_positions:
            raise BadInputError(
                f"cache spec '{spec}': the {policy.codec} codec reads slots along tokens or their "
                "positions, which a scored eviction makes different per head; use int<bits> or fp8 with it"
            )
    return CacheSpec(spec.strip().lower(), policy)


def _shared(policy: CachePolicy) -> bool:
    """A scored layout whose budget is shared across KV heads (``heads=ada``) or layers (``layers=pyramid``):
    the eval holds it as a :class:`~kvlab.compress.evict.budgets.RaggedCache` and runs it through
    :mod:`kvlab.hf.ragged`."""
    lay = policy.layout
    return isinstance(lay, ScoredLayout) and (lay.heads, lay.layers) != ("uniform", "uniform")


def _ragged(spec: CacheSpec, source: Any) -> Any:
    """The ragged cache of a shared-budget spec after the context."""
    from kvlab.compress.evict.budgets import evict_ragged

    lay = spec.policy.layout
    assert isinstance(lay, ScoredLayout)  # _shared() specs are scored
    return evict_ragged(source, lay.policy(), keep=lay.keep, heads=lay.heads, layers=lay.layers)


def parse_cache_specs(specs: Sequence[str]) -> list[CacheSpec]:
    """Several specs, each parsed once; the same policy twice is refused (it would be a duplicate column)."""
    parsed = [parse_cache_spec(s) for s in specs]
    if not parsed:
        raise BadInputError(f"give at least one cache spec; known: {known()}")
    seen: set[str] = set()
    for p in parsed:
        if p.policy.spec in seen:
            raise BadInputError(f"cache spec '{p.spec}' is given twice")
        seen.add(p.policy.spec)
    return parsed


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
        probe = parse(f"{t},ratio=0.5")
    except BadInputError:
        return None  # not a score's spec: let the one reader say what is wrong with it
    return t if isinstance(probe.layout, ScoredLayout) else None


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


def _encoded(policy: CachePolicy, keys, values, positions, rope) -> tuple[tuple, tuple, int]:
    """Per-layer K/V through the policy's codec (encoded and decoded back, as the cache attends over
    them) and the bytes held; positions ``[B, H, n]`` are only read by codecs that need them."""
    from kvlab.rope.spec import rope_for_layer

    q = policy.quantizer(keys[0].shape[-1])
    ks, vs, nbytes = [], [], 0
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        seg = q.encode(k, v, positions[i][0, 0], rope_for_layer(rope, i))
        dk, dv = seg.decode()
        ks.append(dk.to(k.dtype))
        vs.append(dv.to(v.dtype))
        nbytes += seg.nbytes
    return tuple(ks), tuple(vs), nbytes


def _rolled(policy: CachePolicy, snap: Any, handle: Any) -> tuple[tuple, tuple, int]:
    """Sinks + window (over codes or not): the context's K/V fed to the live cache's own layers (no model
    forward: the prompt attends to itself in full precision in the live cache too), so what the question
    sees is exactly what :func:`kvlab.hf.policy_cache.cache_for` would hold after the context: the sinks
    re-positioned before the window, whole eviction chunks dropped, codes where the cache keeps codes."""
    from kvlab.hf.policy_cache import cache_for

    cache = cache_for(policy, handle)
    for layer, k, v in zip(cache.layers, snap.keys, snap.values, strict=True):
        layer.update(k, v)
    kept = cache.kept_layers()
    if policy.codec is not None:
        nbytes = sum(layer.visible_nbytes() for layer in cache.layers)
    else:
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kept)
    return tuple(k for k, _ in kept), tuple(v for _, v in kept), nbytes


def _layers(
    spec: CacheSpec, source: Any, handle: Any = None
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], int]:
    """The per-layer K/V the cache of ``spec`` holds after the context, and its K/V bytes.

    ``source`` is an :class:`~kvlab.compress.evict.Observation` or a :class:`~kvlab.cache.KVSnapshot`.
    """
    from kvlab.compress.evict import Observation, evict
    from kvlab.compress.quant import quantize_snapshot

    snap = source.snapshot if isinstance(source, Observation) else source
    policy, lay = spec.policy, spec.policy.layout
    if isinstance(lay, FullLayout):
        if policy.codec is None:
            return snap.keys, snap.values, snap.nbytes
        qs = quantize_snapshot(snap, policy.quantizer(snap.head_dim))
        dec = qs.decompress()
        return dec.keys, dec.values, qs.nbytes
    if isinstance(lay, ScoredLayout):
        budget = (
            {"keep": lay.keep}
            if lay.keep is not None
            else {"n_keep": min(int(lay.budget or 1), snap.seq_len)}
        )
        ev = evict(source, lay.policy(), **budget)
    else:
        return _rolled(policy, snap, handle)
    if policy.codec is None:
        return ev.keys, ev.values, ev.nbytes
    return _encoded(policy, ev.keys, ev.values, ev.positions, snap.rope)


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
    full = CacheSpec("full")
    reference: dict[str, Any] = {}
    rows = []
    for spec in [full, *(s for s in specs if s.kind != "full")]:
        t1 = time.perf_counter()
        extra: dict[str, Any] = {}
        if _shared(spec.policy):  # per-head / per-layer budgets: a ragged cache, its own forward
            from kvlab.hf.ragged import ragged_greedy, ragged_logits

            rc = _ragged(spec, source)
            nbytes, counts = rc.nbytes, rc.counts
            kept = round(rc.held_slots / sum(len(c) for c in counts))
            extra = {
                "kv_bytes_padded": int(rc.padded_nbytes),
                "kv_bytes_masked": int(rc.masked_nbytes),
                "kept_per_layer": [sum(c) for c in counts],
                "kept_per_head_min": min(min(c) for c in counts),
                "kept_per_head_max": max(max(c) for c in counts),
            }
            tokens = ragged_greedy(handle, rc, question, start, n_new)
            forced = question + reference["answer"][:-1]
            logits = ragged_logits(handle, rc, forced, start)
        else:
            keys, values, nbytes = _layers(spec, source, handle)
            kept = int(keys[0].shape[-2])
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
            "kept_slots": kept,
            "kv_bytes": int(nbytes),
            **extra,
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
