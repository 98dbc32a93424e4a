"""Running trials under cache policies: prefill the context once, compress it, ask the question, score.

For each trial the context is prefilled once (with the queries captured when an attention-based
eviction policy is asked for: :func:`kvlab.policy.evict.observe`). Each cache policy's layout then turns
that prefill into the per-layer K/V its live cache would hold after the context
(:meth:`~kvlab.policy.layouts.Layout.apply`): the full cache's K/V as they are, or encoded and decoded
back over a codec; a scored eviction masked (kept keys at their original positions, the selection a
:class:`~kvlab.hf.compressed_cache.CompressedCache` makes after its first forward; a shared budget as a
ragged cache, run masked); sinks + window fed to the live rolling cache's own layers. An eviction's kept
keys may instead be re-rotated to contiguous positions (:mod:`kvlab.eval.positions`, ``--positions``).

Every one of them is a :class:`~kvlab.cache.KVSnapshot`; those of equal length and positions run as the
rows of one live batch (:meth:`~kvlab.model.ModelHandle.live_rows`: each row copied once into the batch's
buffers, every step written in place).

The question and the answer then run on top in full precision (kvpress's convention: the question is
never compressed), at the positions after the context: the question is fed once, greedy decoding
(:meth:`~kvlab.model.LiveRows.greedy`, each row ending at its first end-of-sequence token) gives the scored
answer, and after rewinding to the question's end the *full* cache's answer (up to its end-of-sequence
token) is teacher-forced: the question's logits and the forced answer's are compared with the full cache's
(:mod:`kvlab.metrics.divergence`), so every policy is measured on the same tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvlab.errors import BadInputError
from kvlab.eval.positions import DEFAULT, check_positions, place
from kvlab.eval.specs import CacheSpec, captured_rolls, check_capture
from kvlab.eval.tasks import trial_seed
from kvlab.policy.layouts.base import context

if TYPE_CHECKING:
    from kvlab.cache.snapshot import KVSnapshot
    from kvlab.eval.captured import CapturedAnswers
    from kvlab.model.handle import ModelHandle
    from kvlab.policy.layouts.base import Roll, Source

    External = Callable[[KVSnapshot], dict[str, tuple[KVSnapshot, int]]]  # caches made elsewhere, by name


def _kept(snap: Any) -> int:
    """Slots per layer and KV head (the mean over them for a ragged cache)."""
    return round(snap.held_slots / (snap.num_layers * snap.batch_size * snap.num_kv_heads))


def _until_stop(tokens: list[int], stop: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[:i]
    return tokens


def _caches(
    handle: ModelHandle,
    specs: Sequence[CacheSpec],
    source: Source,
    external: External | None,
    positions: Sequence[str] = (DEFAULT,),
) -> tuple:
    """Each spec's cache after the context (its layout applied offline: :meth:`~kvlab.policy.layouts.Layout.apply`),
    the full cache first, then the external ones: ``{name: (snapshot, K/V bytes, extra columns, the position
    the question starts at)}``, the seconds each took and each row's labels. An eviction (a masked snapshot)
    is placed under each of ``positions`` (:func:`kvlab.eval.positions.place`: one cache each, named
    ``spec @convention`` but for ``original``, labelled ``positions``)."""
    order = [CacheSpec("full"), *(s for s in specs if s.kind != "full")]
    caches, seconds, labels = {}, {}, {}
    for spec in order:
        t1 = time.perf_counter()
        snap, nbytes, extra = spec.policy.layout.apply(spec.policy, source, handle)
        took = time.perf_counter() - t1
        if not snap.is_masked:
            caches[spec.spec], seconds[spec.spec] = (snap, nbytes, extra, snap.next_position), took
            labels[spec.spec] = spec.to_json()
            continue
        for convention in positions:
            name = spec.spec if convention == DEFAULT else f"{spec.spec} @{convention}"
            t2 = time.perf_counter()
            placed, start = place(snap, convention)
            caches[name], seconds[name] = (placed, nbytes, extra, start), took + time.perf_counter() - t2
            labels[name] = {**spec.to_json(), "positions": convention}
    if external is not None:
        t1 = time.perf_counter()
        made = external(context(source))
        for name, (snap, nbytes) in made.items():
            if name in caches:
                raise BadInputError(f"external cache '{name}' repeats a cache spec's name")
            caches[name] = (snap, nbytes, {}, snap.next_position)
            seconds[name] = (time.perf_counter() - t1) / len(made)
            labels[name] = {"kind": "external", "spec": name, "policy_spec": name}
    return caches, seconds, labels


def _answer(
    handle: ModelHandle,
    caches: dict,
    seconds: dict,
    question: list[int],
    n_new: int,
    stop: set[int],
    captured: Mapping[str, Roll] | None = None,
    capture: CapturedAnswers | None = None,
) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """Each cache's greedy answer, and its logits on the question and the full cache's answer (teacher-forced),
    batched over the caches of equal length, positions and question start; each batch's seconds shared
    among its rows. The caches in ``captured`` (name: the window it rolls) answer through ``capture``
    instead (:mod:`kvlab.eval.captured`)."""
    from kvlab.cache.snapshot import batchable_groups

    captured = captured or {}
    answers: dict[str, list[int]] = {}
    logits: dict[str, torch.Tensor] = {}
    starts: dict[int, dict[str, KVSnapshot]] = {}  # the full cache's start first
    for name, c in caches.items():
        if name not in captured:
            starts.setdefault(c[3], {})[name] = c[0]
    groups = [(start, names) for start, named in starts.items() for names in batchable_groups(named)]
    for start, names in groups:  # the full cache's group first
        t1 = time.perf_counter()
        with handle.live_rows([caches[n][0] for n in names], room=len(question) + n_new, start=start) as live:
            asked = live.feed(question)  # [rows, question, vocab]
            answers.update(zip(names, live.greedy(asked[:, -1], n_new, stop_ids=stop), strict=True))
            live.rewind(len(question))  # back to after the question: teacher-force the full cache's answer
            reference = answers["full"]
            tail = [live.feed(reference[:-1])] if len(reference) > 1 else []
        out = torch.cat([asked, *tail], dim=1)  # on question + reference[:-1]
        logits.update(zip(names, out.unbind(0), strict=True))
        for n in names:
            seconds[n] += (time.perf_counter() - t1) / len(names)
    for name, roll in captured.items():
        assert capture is not None
        t1 = time.perf_counter()
        answers[name], logits[name] = capture.answer(
            roll, caches[name][0], question, n_new, stop, answers["full"]
        )
        seconds[name] += time.perf_counter() - t1
    return answers, logits


@torch.no_grad()
def run_trial(
    handle: ModelHandle,
    trial: Any,
    specs: Sequence[CacheSpec],
    *,
    max_new_tokens: int | None = None,
    on_reference: Callable[[dict], None] | None = None,
    external: External | None = None,
    positions: Sequence[str] = (DEFAULT,),
    capture: CapturedAnswers | None = None,
) -> list[dict]:
    """One row per spec: the answer, its score, and KL / top-1 against the full cache on the same tokens.

    The full cache is always run (it is the reference); its row is returned only when ``full`` is in
    ``specs``. ``max_new_tokens`` defaults to the task's own answer budget. Caches of equal length and
    positions (the full cache, evictions, codecs) run as the rows of one batch, so the weights stream
    once per step for all of them; a row's ``seconds`` is its share of its batch plus its own
    compression. ``on_reference`` receives the ids run and the full cache's answer and logits.
    ``external(prefill snapshot)`` adds caches made elsewhere (another library's quantizer): ``{name:
    (snapshot it attends over, K/V bytes it holds)}``, each a row with ``kind`` ``"external"``. An
    eviction gives one row per convention of ``positions`` (:mod:`kvlab.eval.positions`), all on the
    same kept slots. With ``capture``, each sinks + window cache it can run answers through its captured
    step (:mod:`kvlab.eval.captured`; the row's ``runtime`` says so).
    """
    from kvlab.eval.tasks import encoder
    from kvlab.policy.evict import observe

    check_positions(positions, specs)
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
    stop = handle.eos_ids()
    caches, seconds, labels = _caches(handle, specs, source, external, positions)
    captured, labels = _runtimes(specs, labels, capture)
    answers, logits = _answer(handle, caches, seconds, question, n_new, stop, captured, capture)
    forced = question + answers["full"][:-1]
    if on_reference is not None:
        on_reference(
            {
                "trial": trial,
                "context": ctx,
                "question": question,
                "start": len(ctx),
                "answer": answers["full"],
                "max_new_tokens": n_new,
                "forced": forced,
                "full_logits": logits["full"],
            }
        )
    rows = []
    for name in caches:
        if name == "full" and not any(s.kind == "full" for s in specs):
            continue
        snap, nbytes, extra, _ = caches[name]
        text = handle.decode(_until_stop(answers[name], stop))
        rows.append(
            {
                **labels[name],
                "task": trial.task,
                "length": trial.length,
                "seed": trial.seed,
                "context_tokens": len(ctx),
                "question_tokens": len(question),
                "kept_slots": _kept(snap),
                "kv_bytes": int(nbytes),
                **extra,
                **_measures(trial, text, logits["full"], logits[name], len(question)),
                "prefill_s": prefill_s,
                "seconds": seconds[name],
            }
        )
    return rows


def _runtimes(
    specs: Sequence[CacheSpec], labels: dict[str, dict], capture: CapturedAnswers | None
) -> tuple[dict[str, Roll], dict[str, dict]]:
    """The caches ``capture`` runs (sinks + window in the model's dtype), by name: the window each rolls; and
    the labels, each with its row's ``runtime`` (the captured step, or ``eager``: the live batch) under it."""
    if capture is None:
        return {}, labels
    captured = captured_rolls(specs)
    runtime = {n: capture.mode if n in captured else "eager" for n in labels}
    return captured, {n: {**label, "runtime": runtime[n]} for n, label in labels.items()}


def _measures(trial: Any, text: str, full: torch.Tensor, logits: torch.Tensor, n_question: int) -> dict:
    """A row's answer and score, and its KL / top-1 against the full cache's logits (all, and the answer's)."""
    from kvlab.eval.score import score
    from kvlab.metrics.divergence import compare_logits

    answer_rows = slice(n_question - 1, None)
    div, div_answer = compare_logits(full, logits), compare_logits(full[answer_rows], logits[answer_rows])
    return {
        "output": text,
        "answers": list(trial.answers),
        "rule": trial.rule,
        "score": score(text, trial.answers, trial.rule),
        "kld": div.kl,
        "top1": div.top1,
        "kld_answer": div_answer.kl,
        "top1_answer": div_answer.top1,
        "compared_tokens": div.n,
    }


def run_suite(
    handle: ModelHandle,
    specs: Sequence[CacheSpec],
    *,
    tasks: Sequence[str],
    lengths: Sequence[int],
    trials: int,
    seed: int = 0,
    first_trial: int = 0,
    haystack_text: str | None = None,
    max_new_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    on_reference: Callable[[dict], None] | None = None,
    external: External | None = None,
    done: Mapping[tuple[str, int, int], list[dict]] | None = None,
    on_trial: Callable[[tuple[str, int, int], list[dict], float], None] | None = None,
    positions: Sequence[str] = (DEFAULT,),
    knobs: Mapping[tuple[str, int], Mapping[str, int]] | None = None,
    capture: CapturedAnswers | None = None,
) -> list[dict]:
    """Every ``(task, length, trial)`` under every spec: the raw rows (see :func:`run_trial`), with ``trial``.

    Trials ``first_trial .. first_trial + trials - 1`` run (each seeded by :func:`trial_seed`), so a long
    run can be cut into pieces that together equal one run. ``done`` holds the rows of trials an earlier,
    interrupted part ran (by ``(task, length, trial)``): they are not run again, and take their place in
    the rows. ``on_trial(key, rows, seconds)`` receives each trial this call runs, as it finishes.
    ``positions``: see :func:`run_trial`. ``knobs[(task, length)]``: that task's difficulty at that length
    (:mod:`kvlab.eval.calibrate`; the task's defaults where absent). ``capture``
    (:func:`capture_for`): the sinks + window caches answer through a captured step."""
    from kvlab.eval.tasks import TASKS, make_trial

    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise BadInputError(f"unknown eval task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    if trials < 1:
        raise BadInputError(f"trials must be >= 1, got {trials}")
    if first_trial < 0:
        raise BadInputError(f"first_trial must be >= 0, got {first_trial}")
    done = done or {}
    total, rows = len(tasks) * len(lengths) * trials, []
    count = sum(
        (t, n, i) in done for t in tasks for n in lengths for i in range(first_trial, first_trial + trials)
    )
    for name in tasks:
        for length in lengths:
            for i in range(first_trial, first_trial + trials):
                if (name, length, i) in done:
                    rows += done[(name, length, i)]
                    continue
                t0 = time.perf_counter()
                trial = make_trial(
                    name,
                    handle,
                    length,
                    trial_seed(seed, i),
                    haystack_text,
                    (knobs or {}).get((name, length)),
                )
                rows_of_trial = run_trial(
                    handle,
                    trial,
                    specs,
                    max_new_tokens=max_new_tokens,
                    on_reference=on_reference,
                    external=external,
                    positions=positions,
                    capture=capture,
                )
                rows_of_trial = [{**row, "trial": i} for row in rows_of_trial]
                rows += rows_of_trial
                if on_trial is not None:
                    on_trial((name, length, i), rows_of_trial, time.perf_counter() - t0)
                count += 1
                if progress is not None:
                    progress(count, total)
    return rows


def capture_for(handle: ModelHandle, specs: Sequence[CacheSpec], capture: str) -> CapturedAnswers | None:
    """The captured step of a run under ``specs`` (``capture``: ``off``, ``compile`` or ``cuda-graph``;
    :mod:`kvlab.eval.captured`), or None; refused where no spec is a cache a captured step runs, or the model
    is one the ring cannot hold. Nothing is compiled until the first captured answer."""
    if capture == "off":
        return None
    if capture not in ("compile", "cuda-graph"):
        raise BadInputError(f"capture must be off, compile or cuda-graph, got {capture!r}")
    check_capture(specs, capture)
    from kvlab.eval.captured import CapturedAnswers

    return CapturedAnswers(handle, "compile" if capture == "compile" else "cuda-graph")


def interval(values: Sequence[float], seed: int, *, share: bool = False) -> dict | None:
    """The mean with its 95% interval (JSON), or None when no value is finite. A ``share`` (accuracy: each
    trial's score in [0, 1], mostly 0 or 1) gets Wilson's interval, which keeps its width at 0/n and n/n where a
    bootstrap collapses to a point; any other mean (KL, top-1 agreement per token) a bootstrap over trials.
    Fewer than 5 finite values: the value and no interval."""
    from kvlab.metrics.stats import bootstrap_ci, wilson_ci

    if not any(math.isfinite(v) for v in values):
        return None
    return (wilson_ci(list(values)) if share else bootstrap_ci(list(values), seed=seed)).to_json()


def summarize(rows: Sequence[dict], *, seed: int = 0) -> list[dict]:
    """Per (task, cache, positions, length): accuracy (Wilson interval), KL and top-1 (bootstrap intervals)
    over trials; ``positions`` only for an eviction's rows (:mod:`kvlab.eval.positions`)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["spec"], r.get("positions"), r["length"]), []).append(r)
    out = []
    for (task_name, spec, positions, length), rs in groups.items():
        kld = [r["kld"] for r in rs]
        out.append(
            {
                "task": task_name,
                "cache": spec,
                **({"positions": positions} if positions is not None else {}),
                "length": length,
                "trials": len(rs),
                "accuracy": interval([r["score"] for r in rs], seed, share=True),
                "kld": interval(kld, seed),
                "kld_infinite": sum(1 for k in kld if k == float("inf")),
                "top1": interval([r["top1"] for r in rs], seed),
                "kld_answer": interval([r["kld_answer"] for r in rs], seed),
                "seconds": sum(r["seconds"] for r in rs),
            }
        )
    return out
