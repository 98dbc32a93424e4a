"""Running experiments and writing their reports (what ``kvlab study`` and each experiment command call).

Data flow: a command builds an :class:`ExperimentContext` -> the experiment's ``run`` loads the model
on first use, measures, saves figures into its folder -> :func:`finish` writes ``result.json``,
``arrays.npz`` and ``index.html``. A study does this for every registered experiment, one sub-folder
each, and writes a top-level ``index.html`` with every section.

A study with ``workers > 1`` runs experiments in that many worker processes at once, each with its
own copy of the model and ``cores / workers`` torch threads: a small model's forward passes use two
threads poorly, and report figures and statistics are single-threaded Python, so on this 2-core
machine two one-thread workers ran the default study in 0.6x the time of one two-thread process
(692 s against about 1,170 s) and the quick one in about 0.85x (benchmarks/study_timing.py).
On CUDA the default is one worker: processes sharing one GPU each hold a model copy and its caches
in the GPU's memory and queue for the same device, so they add memory, not speed.
Every experiment still runs exactly as alone (same sizes, samples, seeds); one that ``needs``
another starts after it; sections keep study order; the workers' progress reaches this display.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from kvlab.errors import BadInputError, KvlabError
from kvlab.progress import Counter, Estimate, Mode, choose_mode, duration, rich_display
from kvlab.study.experiments import (
    Experiment,
    ExperimentContext,
    ExperimentResult,
    check_study_names,
    registry,
)
from kvlab.study.experiments.base import Figure, Progress, Table
from kvlab.study.report.html import write_experiment_page, write_study_index
from kvlab.study.report.writer import manifest, run_dir, to_jsonable, write_result

stderr = Console(stderr=True)


class PlainProgress(Progress):
    """An experiment's progress where stderr is not a terminal: one line as each of its tasks ends."""

    def __init__(self, console: Console) -> None:
        super().__init__(None)
        self.console = console

    @contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
        done, started = [0], time.monotonic()

        def advance(n: int = 1) -> None:
            done[0] += n

        try:
            yield advance
        finally:
            count = f"{done[0]:,}/{total:,}" if total is not None else f"{done[0]:,}"
            self.log(f"{description}: {count} in {duration(time.monotonic() - started)}")

    def log(self, message: str) -> None:
        self.console.print(message, highlight=False, soft_wrap=True)


@contextmanager
def progress_display(enabled: bool = True, *, detail: bool = True) -> Iterator[Progress]:
    """An experiment's progress on stderr (so ``--json`` output on stdout stays clean): a rich display on
    a terminal, else (``detail``) one plain line per finished task (:class:`PlainProgress`) or nothing;
    nothing when not ``enabled`` (``kvlab.progress.choose_mode``)."""
    mode = choose_mode(not enabled, stderr.file)
    if mode == "rich":
        with rich_display(stderr) as p:
            yield Progress(p)
    else:
        yield PlainProgress(stderr) if mode == "plain" and detail else Progress(None)


def _manifest_line(m: dict) -> str:
    model = m.get("model") or {}
    where = m.get("device") or {}
    device = ""
    if where:
        gpu = f" ({where['gpu']})" if where.get("gpu") else ""
        device = f" · {where.get('device')}{gpu} {where.get('dtype', '')}".rstrip()
    return (
        f"{m.get('command', '')} · model {model.get('name', m.get('model_spec', ''))} "
        f"{model.get('fingerprint', '')[:12]} · profile {m.get('profile')} · seed {m.get('seed')}{device} · "
        f"kvlab {m['versions']['kvlab']}, torch {m['versions']['torch']}, transformers {m['versions']['transformers']}"
    )


def finish(result: ExperimentResult, ctx: ExperimentContext, started: float) -> dict:
    """Write ``result.json``, ``arrays.npz`` and ``index.html`` for one experiment; returns the manifest."""
    extra: dict[str, Any] = {"device": ctx.device_info()}
    if ctx.options:
        extra["options"] = {k: str(v) for k, v in ctx.options.items()}
    m = manifest(
        model=ctx.model_handle,
        model_spec=ctx.model_spec,
        profile=ctx.profile,
        seed=ctx.seed,
        started=started,
        extra=extra,
    )
    write_result(result, ctx.out_dir, m)
    write_experiment_page(result, ctx.out_dir, _manifest_line(m), profile=ctx.profile)
    return m


def _run_one(exp: Experiment, ctx: ExperimentContext) -> tuple[ExperimentResult, float, bool]:
    """Run one experiment of a study into ``ctx.out_dir`` and write its report, whatever happens.
    Returns the result, its seconds and whether it failed (a failure becomes a failed section)."""
    started = time.perf_counter()
    failed = False
    try:
        result = exp.run(ctx)
    except Exception as exc:  # a study records failures and carries on
        detail = str(exc) if isinstance(exc, KvlabError) else traceback.format_exc(limit=6)
        result = ExperimentResult(
            name=exp.name, title=exp.title, status="failed", notes=[f"{type(exc).__name__}: {detail}"]
        )
        failed = True
        ctx.progress.log(f"[red]{exp.name} failed: {exc}[/red]")
    describe(exp, result)
    finish(result, ctx, started)
    return result, round(time.perf_counter() - started, 2), failed


def run_experiment(experiment: Experiment, ctx: ExperimentContext) -> ExperimentResult:
    """Run one experiment into ``ctx.out_dir`` and write its report. Errors propagate."""
    started = time.perf_counter()
    result = experiment.run(ctx, **ctx.options)
    describe(experiment, result)
    finish(result, ctx, started)
    return result


def describe(experiment: Experiment, result: ExperimentResult) -> None:
    """Fill the section's finding and headline from its summary (in place). A summary that lacks what the
    sentence needs is said in a note, never papered over."""
    if result.status != "ok" or result.finding or experiment.describe is None:
        return
    try:
        result.finding, result.headline = experiment.describe(to_jsonable(result.summary))
    except Exception as exc:  # a report-writing gap must not lose the measured results
        result.notes.append(
            f"the one-sentence finding could not be written from this summary ({type(exc).__name__}: {exc})"
        )


@dataclass
class StudyOutcome:
    run_dir: Path
    results: list[tuple[str, ExperimentResult]]
    failed: list[str]
    seconds: dict[str, float]


def _check_model(model_spec: str, dtype: str, say: Any) -> None:
    """What loading would refuse before anything is written (name, folder, config, dtype), without
    loading the weights here: a parallel study's workers load them (the device is resolved by the caller)."""
    from kvlab.model.facts import load_config_file
    from kvlab.model.loading import parse_dtype, resolve_model_dir

    parse_dtype(dtype)
    path, _ = resolve_model_dir(model_spec, say)
    if (path / "config.json").is_file():
        load_config_file(path / "config.json")


def default_workers(device: str = "cpu") -> int:
    """Worker processes for a study on this machine: one per core, at most 4 (each holds a model copy);
    one on CUDA (processes sharing one GPU add memory, not speed)."""
    from kvlab.model.loading import resolve_device

    if resolve_device(device) != "cpu":
        return 1
    return max(1, min(4, os.cpu_count() or 1))


def _selected(only: Sequence[str] | None) -> list[Experiment]:
    """The study's experiments (or ``only`` these), each after those it ``needs``."""
    experiments = [e for e in registry().values() if e.in_study]
    if only:
        check_study_names(only, [e.name for e in experiments])
        experiments = [e for e in experiments if e.name in only]
    return dependencies_first(experiments)


def run_study(
    *,
    out: str | Path = "runs",
    model_spec: str = "smollm2-135m",
    profile: str = "default",
    seed: int = 0,
    only: Sequence[str] | None = None,
    show_progress: bool = True,
    dtype: str = "float32",
    device: str = "cpu",
    workers: int = 1,
    resume: str | Path | None = None,
) -> StudyOutcome:
    """Run every registered experiment (or ``only`` these) into one report folder.

    A failing experiment is recorded as a failed section with its error, and the study goes on.
    ``workers > 1`` runs experiments in that many processes at once (see the module docstring); each
    loads its model copy on ``device`` (resolved here once: ``auto`` is CUDA when there is one) in ``dtype``.
    ``resume`` is the folder of an interrupted study: its sections that finished ok are kept, the others
    run there, and the report covers them all; a folder made with other settings (model, profile, seed,
    dtype, device, experiments) is refused in one line before anything runs. Progress (k of n, elapsed,
    an estimate of what is left: :func:`typical_seconds`) goes to stderr when ``show_progress``.
    """
    from kvlab.model.loading import resolve_device

    if workers < 1:
        raise BadInputError(f"--workers must be >= 1, got {workers}")
    device = resolve_device(device)
    settings = {"profile": profile, "seed": seed, "model_spec": model_spec, "dtype": dtype, "device": device}
    experiments = _selected(only)
    names = [e.name for e in experiments]
    kept = _resumable(Path(resume), {**settings, "experiments": names}) if resume is not None else {}
    todo = [e for e in experiments if e.name not in kept]
    parallel = workers > 1 and len(todo) > 1
    # The model is checked before the report folder exists: an unknown model is one error and no
    # report of N identical failures. One process loads it; in parallel each worker loads its own.
    from kvlab.model import load_model

    say = (
        (lambda msg: print(msg, file=sys.stderr)) if show_progress else None
    )  # e.g. the first GGUF conversion
    model: Any = None
    if parallel or not todo:
        _check_model(model_spec, dtype, say)
    else:
        model = load_model(model_spec, dtype=dtype, device=device, progress=say)
    root = _study_folder(out, resume, {**settings, "experiments": names}, [e.name for e in todo])
    pool = _Workers(min(workers, len(todo)), model_spec, dtype, device) if parallel else None
    by_name = {name: (result, seconds, False) for name, (result, seconds) in kept.items()}
    t0 = time.perf_counter()
    mode = choose_mode(not show_progress, stderr.file)
    with progress_display(show_progress, detail=False) as progress:
        counter = _study_counter(root, settings, experiments, todo, kept, mode, pool.n if pool else 1)
        counter.attach(progress._p)
        workers_text = f" on {pool.n} workers" if pool else ""
        counter.say(counter.start_line(f"experiments, profile {profile}{workers_text}"))
        if pool is None:
            tasks = [(e.name, root / e.name, _upstream(e, kept)) for e in todo]
            outcomes = _run_in_order(tasks, settings, model, progress)
        else:
            outcomes = _run_parallel(
                todo, root, settings, pool, progress, kept={n: r for n, (r, _) in kept.items()}
            )
        for name, outcome in outcomes:
            by_name[name] = outcome
            counter.done(name, outcome[1], "failed" if outcome[2] else outcome[0].status)
    return _write_study(root, experiments, by_name, model, settings, workers, t0, sorted(kept))


def _study_counter(
    root: Path,
    settings: dict,
    experiments: list[Experiment],
    todo: list[Experiment],
    kept: dict[str, tuple[ExperimentResult, float]],
    mode: Mode,
    at_once: int,
) -> Counter:
    """The study's experiments done of all (kept sections count as done), with an estimate of the time
    left from :func:`typical_seconds`; the caller attaches the rich display, if any."""
    weights, source = typical_seconds(root.parent, settings["profile"], settings["model_spec"], skip=root)
    running = {e.name for e in todo}
    for e in todo:  # a typical time that counts on another's memo is no guide without it
        if e.reuses and e.reuses not in running:
            weights.pop(e.name, None)
    return Counter(
        "study",
        [e.name for e in experiments],
        mode=mode,
        console=stderr,
        estimate=Estimate(weights, seconds=True, parallel=at_once, source=source),
        finished={name: seconds for name, (_, seconds) in kept.items()},
    )


def _upstream(exp: Experiment, kept: dict[str, tuple[ExperimentResult, float]]) -> dict[str, dict]:
    """The summaries of the kept sections (a resumed study) that ``exp`` needs."""
    return {n: to_jsonable(kept[n][0].summary) for n in exp.needs if n in kept}


def _write_study(
    root: Path,
    experiments: list[Experiment],
    by_name: dict[str, tuple[ExperimentResult, float, bool]],
    model: Any,
    settings: dict,
    workers: int,
    t0: float,
    resumed: list[str],
) -> StudyOutcome:
    """The study's own ``result.json`` and ``index.html`` over every section."""
    results = [(e.name, by_name[e.name][0]) for e in experiments]
    seconds = {e.name: by_name[e.name][1] for e in experiments}
    failed = [e.name for e in experiments if by_name[e.name][2]]
    model_spec, profile = settings["model_spec"], settings["profile"]
    where = ExperimentContext(
        out_dir=root,
        model_spec=model_spec,
        dtype=settings["dtype"],
        device=settings["device"],
        model_handle=model,
    )
    m = manifest(
        model=model,
        model_spec=model_spec,
        profile=profile,
        seed=settings["seed"],
        started=t0,
        extra={"experiments": seconds, "workers": workers, "device": where.device_info()},
    )
    if model is None:  # parallel: the model as the workers loaded it (each section's manifest has it)
        m["model"] = _model_from_sections(root, [name for name, _ in results])
    summary: dict[str, Any] = {
        "seconds": seconds,
        "failed": failed,
        "workers": workers,
        "wall_seconds": round(time.perf_counter() - t0, 2),
    }
    if resumed:
        summary["resumed"] = resumed  # sections kept from the interrupted run (wall_seconds: this part)
    write_result(ExperimentResult(name="study", title="kvlab study", summary=summary), root, m)
    subtitle = (
        f"{(m.get('model') or {}).get('name', model_spec)} · profile {profile} · {len(results)} experiments"
    )
    write_study_index(root, results, subtitle, _manifest_line(m), profile=profile)
    return StudyOutcome(run_dir=root, results=results, failed=failed, seconds=seconds)


# -- resuming a study, and its estimate --------------------------------------------------------------

#: a study folder's settings, written when it starts; ``--resume`` compares them with the command's
STUDY_SETTINGS = "settings.json"
_SETTING_NAMES = {
    "model_spec": "model (--model)",
    "profile": "profile (--quick/--full)",
    "seed": "seed (--seed)",
    "dtype": "dtype (--dtype)",
    "device": "device (--device)",
    "experiments": "experiments (--only)",
}


def _resumable(folder: Path, settings: dict) -> dict[str, tuple[ExperimentResult, float]]:
    """The sections of the interrupted study in ``folder`` that finished ok, with their seconds. A folder
    that is not a study's, or whose study ran with other ``settings``, is refused in one line."""
    path = folder / STUDY_SETTINGS
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        what = "no such folder" if not folder.is_dir() else f"not a study folder (no {STUDY_SETTINGS})"
        raise BadInputError(f"--resume {folder}: {what}") from None
    except (OSError, ValueError) as exc:
        raise BadInputError(f"--resume {folder}: cannot read {STUDY_SETTINGS} ({exc})") from None
    if not isinstance(stored, dict):
        raise BadInputError(f"--resume {folder}: {STUDY_SETTINGS} is not a study's settings")

    def shown(value: Any) -> str:
        return ",".join(map(str, value)) if isinstance(value, list) else str(value)

    for key, value in settings.items():
        if stored.get(key) != value:
            raise BadInputError(
                f"--resume {folder}: that study ran with {_SETTING_NAMES[key]} {shown(stored.get(key))}, "
                f"this command asks for {shown(value)}; resume it with the same settings or start a new study"
            )
    kept = {}
    for name in settings["experiments"]:
        section = _load_section(folder / name)
        if section is not None:
            kept[name] = section
    return kept


def _load_section(folder: Path) -> tuple[ExperimentResult, float] | None:
    """A finished section (``result.json`` with status ok, and its page) read back, with its seconds."""
    import numpy as np

    try:
        doc = json.loads((folder / "result.json").read_text())
        if doc["status"] != "ok" or not (folder / "index.html").is_file():
            return None
        arrays_file = (doc.get("arrays") or {}).get("file")
        arrays = dict(np.load(folder / arrays_file, allow_pickle=False)) if arrays_file else {}
        result = ExperimentResult(
            name=doc["name"],
            title=doc["title"],
            summary=doc.get("summary") or {},
            tables=[Table(t["title"], t["columns"], t["rows"], t.get("caption", "")) for t in doc["tables"]],
            figures=[Figure(f["file"], f["caption"]) for f in doc["figures"]],
            arrays=arrays,
            notes=list(doc["notes"]),
            data_sources=list(doc.get("data_sources") or []),
            description=doc.get("description", ""),
            finding=doc.get("finding") or doc.get("smoke_result") or "",
            headline=[(str(a), str(b)) for a, b in doc.get("headline") or []],
        )
        return result, float(doc["manifest"].get("duration_s", 0.0))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unfinished or unreadable: it runs again


def _study_folder(out: str | Path, resume: str | Path | None, settings: dict, todo: list[str]) -> Path:
    """A new study folder in ``out`` with its settings written, or the ``resume`` folder with the sections
    that run again emptied (a failed or unfinished section's old files would linger)."""
    if resume is not None:
        root = Path(resume)
        for name in todo:
            shutil.rmtree(root / name, ignore_errors=True)
        return root
    try:
        root = run_dir(out, "study")
    except OSError as exc:
        raise BadInputError(
            f"--out {out}: cannot create a report folder there ({exc.strerror or exc})"
        ) from None
    (root / STUDY_SETTINGS).write_text(json.dumps(settings, indent=1) + "\n")
    return root


def typical_seconds(
    folder: Path, profile: str, model_spec: str, skip: Path | None = None
) -> tuple[dict[str, float], str]:
    """Typical seconds per experiment for a study's estimate, and where they come from: the newest finished
    study in ``folder`` with the same profile and model (this machine's own timings; not ``skip``), else
    :data:`TYPICAL_SECONDS` for the profile (measured on a 2-core CPU), else none (the estimate then
    starts from the first experiments this study finishes)."""
    for prev in sorted(Path(folder).glob("study-*"), key=lambda p: p.name, reverse=True)[:50]:
        if skip is not None and prev.resolve() == Path(skip).resolve():
            continue
        try:
            doc = json.loads((prev / "result.json").read_text())
            man, summary = doc["manifest"], doc["summary"]
            if man.get("profile") != profile or man.get("model_spec") != model_spec:
                continue
            failed = set(summary.get("failed") or [])
            found = {k: float(v) for k, v in summary["seconds"].items() if k not in failed}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if found:
            return found, f"the earlier run {prev.name}"
    if profile in TYPICAL_SECONDS:
        return dict(TYPICAL_SECONDS[profile]), f"timings measured {TIMED[profile]}"
    return {}, ""


def _model_from_sections(root: Path, names: list[str]) -> dict | None:
    import json

    for name in names:
        try:
            found = json.loads((root / name / "result.json").read_text())["manifest"].get("model")
        except (OSError, ValueError, KeyError):
            continue
        if found:
            return found
    return None


# -- experiments in worker processes ----------------------------------------------------------------

_WORKER: dict[str, Any] = {}


class _ForwardedProgress(Progress):
    """A worker's progress, sent to the study's display as messages (``task``/``advance``/``end``/``log``)."""

    def __init__(self, queue: Any) -> None:
        super().__init__(None)
        self._queue = queue
        self._ids = itertools.count()

    @contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
        key = f"{os.getpid()}-{next(self._ids)}"
        self._queue.put(("task", key, description, total))

        def advance(n: int = 1) -> None:
            self._queue.put(("advance", key, n))

        try:
            yield advance
        finally:
            self._queue.put(("end", key, total))

    def log(self, message: str) -> None:
        self._queue.put(("log", message))


def _worker_start(model_spec: str, dtype: str, device: str, threads: int, queue: Any) -> None:
    """A study worker's start: its own copy of the model, on the study's device and in its dtype."""
    import torch

    torch.set_num_threads(threads)
    from kvlab.model import load_model

    _WORKER["model"] = load_model(model_spec, dtype=dtype, device=device)
    _WORKER["queue"] = queue


def _run_in_order(
    tasks: list[tuple[str, Path, dict]], settings: dict, model: Any, progress: Progress
) -> Iterator[tuple[str, tuple[ExperimentResult, float, bool]]]:
    """Run ``(name, folder, upstream summaries)`` one after another in this process, on ``model``;
    each gets the summaries of the earlier ones it ``needs``. Yields ``(name, outcome)`` as each ends."""
    local: dict[str, dict] = {}
    for name, out_dir, upstream in tasks:
        exp = registry()[name]
        progress.log(f"[bold]{exp.title}[/bold]")
        given = {**upstream, **{n: local[n] for n in exp.needs if n in local}}
        ctx = ExperimentContext(
            out_dir=out_dir, progress=progress, model_handle=model, upstream=given, **settings
        )
        outcome = _run_one(exp, ctx)
        if outcome[0].status == "ok":
            local[name] = to_jsonable(outcome[0].summary)
        yield name, outcome


def _worker_run(
    chain: list[tuple[str, Path, dict]], settings: dict
) -> list[tuple[ExperimentResult, float, bool]]:
    """Run a chain of experiments in this worker process, in order (a later one may reuse an earlier
    one's in-process measurements)."""
    progress = _ForwardedProgress(_WORKER["queue"])
    return [outcome for _, outcome in _run_in_order(chain, settings, _WORKER["model"], progress)]


def _chains(experiments: list[Experiment]) -> list[list[Experiment]]:
    """Experiments grouped into what one worker runs in a row: each one that ``reuses`` another's
    in-process measurements joins that one's chain (study order otherwise)."""
    chains: list[list[Experiment]] = []
    where: dict[str, list[Experiment]] = {}
    for exp in experiments:
        chain = where.get(exp.reuses) if exp.reuses else None
        if chain is None:
            chain = []
            chains.append(chain)
        chain.append(exp)
        where[exp.name] = chain
    return chains


def _show_forwarded(queue: Any, progress: Progress) -> None:
    """Apply the workers' progress messages to this process's display, until the None sentinel."""
    rich = progress._p
    tasks: dict[str, Any] = {}
    while (msg := queue.get()) is not None:
        if rich is None:
            continue
        kind = msg[0]
        if kind == "log":
            rich.console.print(msg[1])
        elif kind == "task":
            tasks[msg[1]] = rich.add_task(msg[2], total=msg[3])
        elif kind == "advance" and msg[1] in tasks:
            rich.advance(tasks[msg[1]], msg[2])
        elif kind == "end" and msg[1] in tasks:
            total = msg[2]
            rich.update(tasks.pop(msg[1]), completed=total or 1, total=total or 1, visible=False)


# Seconds each experiment took in the default profile (benchmarks/study_timing.py, 2026-11-25): a
# scheduling hint only, so the longest start first and the workers finish together (the report keeps
# study order). An experiment without a hint starts after these.
EXPECTED_SECONDS: dict[str, float] = {
    "roll_long": 281, "suffix_caching": 102, "attention": 87, "roll_sweep": 85, "transplant": 84,
    "compaction": 83, "caching_numerics": 73, "compression": 72, "context_retention": 61,
    "streaming_ppl": 57, "kv_swap": 43, "layer_transfer": 34, "transfer_equivalence": 27,
    "store_reuse": 20, "findings": 14, "inspect": 4, "rope_derotation": 1,
    "ruler": 240,  # estimated from its quick run (not yet timed by benchmarks/study_timing.py)
    "positions": 167,  # `kvlab study --only positions`, alone, 2026-12-01 (not yet timed by study_timing.py)
}  # fmt: skip
# Seconds each experiment took in the quick profile, in its worker (benchmarks/results/study_timing_quick.md:
# 2 workers of 1 torch thread on a 2-core Linux x86_64 CPU, 2026-11-26 08:13 UTC; ruler was not in it).
QUICK_SECONDS: dict[str, float] = {
    "roll_long": 27.6, "compaction": 25.3, "compression": 18.9, "suffix_caching": 16.4,
    "context_retention": 16.1, "attention": 14.6, "caching_numerics": 14.3, "roll_sweep": 13.7,
    "kv_swap": 13.1, "store_reuse": 12.2, "streaming_ppl": 11.5, "transfer_equivalence": 8.6,
    "layer_transfer": 4.9, "inspect": 4.3, "findings": 2.5, "rope_derotation": 0.6, "transplant": 0.1,
}  # fmt: skip
#: A study's first estimate per profile, before an earlier run in the same folder says better
#: (:func:`typical_seconds`); none measured for ``full``. Each is scaled by what the study's finished
#: experiments took against their entries, so a faster or slower machine corrects it as it goes.
TYPICAL_SECONDS: dict[str, dict[str, float]] = {"default": EXPECTED_SECONDS, "quick": QUICK_SECONDS}
TIMED = {
    "default": "on a 2-core CPU, 2026-11-25, benchmarks/study_timing.py",
    "quick": "on a 2-core CPU, 2026-11-26, benchmarks/results/study_timing_quick.md",
}


class _Workers:
    """The worker processes of a parallel study (spawned at once, each loading its model copy) and
    the queue their progress messages come back on."""

    def __init__(self, n: int, model_spec: str, dtype: str, device: str = "cpu") -> None:
        self.n = n
        self.spawn = multiprocessing.get_context("spawn")  # no fork of a process holding torch's threads
        self.queue = self.spawn.Queue()
        self.args = (model_spec, dtype, device, max(1, (os.cpu_count() or 1) // n), self.queue)
        self.pool = self._start()

    def _start(self) -> cf.ProcessPoolExecutor:
        pool = cf.ProcessPoolExecutor(
            self.n, mp_context=self.spawn, initializer=_worker_start, initargs=self.args
        )
        for _ in range(self.n):  # workers are spawned on demand: ask for all of them now
            pool.submit(os.getpid)
        return pool

    def restart(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool = self._start()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _died(exp: Experiment, root: Path, settings: dict, note: str) -> tuple[ExperimentResult, float, bool]:
    """The failed section of an experiment whose worker process died (its report says so)."""
    result = ExperimentResult(name=exp.name, title=exp.title, status="failed", notes=[note])
    finish(result, ExperimentContext(out_dir=root / exp.name, **settings), time.perf_counter())
    return result, 0.0, True


def _run_parallel(
    experiments: list[Experiment],
    root: Path,
    settings: dict,
    workers: _Workers,
    progress: Progress,
    kept: dict[str, ExperimentResult] | None = None,
) -> Iterator[tuple[str, tuple[ExperimentResult, float, bool]]]:
    """Run ``experiments`` on the ``workers``, longest first (:data:`EXPECTED_SECONDS`), each as soon as
    what it ``needs`` has finished (``kept``: sections a resumed study already holds); yields ``(name,
    (result, seconds, failed))`` as they finish. A worker that dies fails its experiments (with the
    reason) and the rest go on in fresh workers."""
    shower = threading.Thread(target=_show_forwarded, args=(workers.queue, progress), daemon=True)
    shower.start()
    names = {e.name for e in experiments}
    pending = sorted(_chains(experiments), key=lambda c: -sum(EXPECTED_SECONDS.get(e.name, 0) for e in c))
    done: dict[str, ExperimentResult] = dict(kept or {})
    running: dict[cf.Future, list[Experiment]] = {}

    def ready(chain: list[Experiment]) -> bool:
        inside = {e.name for e in chain}
        return all(n not in names or n in done or n in inside for e in chain for n in e.needs)

    def upstream(exp: Experiment) -> dict:
        return {n: to_jsonable(done[n].summary) for n in exp.needs if n in done and done[n].status == "ok"}

    fruitless = 0  # pools in a row that broke before finishing anything (a worker cannot even start)
    try:
        while pending or running:
            for chain in list(pending):
                if len(running) >= workers.n:
                    break
                if not ready(chain):
                    continue  # waits for what it needs
                tasks = [(e.name, root / e.name, upstream(e)) for e in chain]
                running[workers.pool.submit(_worker_run, tasks, settings)] = chain
                pending.remove(chain)
            if not running:  # dependencies_first refuses cycles, so this is a runner bug: say so
                raise RuntimeError(f"no experiment can start: {[e.name for c in pending for e in c]}")
            finished, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                if fut not in running:
                    continue  # re-queued when its pool broke (below)
                chain = running.pop(fut)
                try:
                    outcomes = fut.result()
                except Exception as exc:  # the worker process died (killed, out of memory, a crash)
                    note = f"{type(exc).__name__}: the worker process running it died ({exc})"
                    outcomes = [_died(exp, root, settings, note) for exp in chain]
                    progress.log(f"[red]{', '.join(e.name for e in chain)} failed: {note}[/red]")
                    if isinstance(exc, BrokenProcessPool):
                        lost = [running.pop(other) for other in list(running)]
                        fruitless += 1
                        if fruitless >= 2:  # workers die before finishing anything: give up, say why
                            for exp in [e for c in lost + pending for e in c]:
                                done[exp.name] = (given_up := _died(exp, root, settings, note))[0]
                                yield exp.name, given_up
                            pending.clear()
                        else:
                            pending[:0] = lost  # lost with the pool: run them again on fresh workers
                            workers.restart()
                else:
                    fruitless = 0
                for exp, outcome in zip(chain, outcomes, strict=True):
                    done[exp.name] = outcome[0]
                    yield exp.name, outcome
    finally:
        workers.close()
        workers.queue.put(None)
        shower.join(timeout=5)


def dependencies_first(experiments: list[Experiment]) -> list[Experiment]:
    """The experiments in study order, except that each one runs after those it ``needs`` (if present)."""
    by_name = {e.name: e for e in experiments}
    done: list[Experiment] = []
    seen: set[str] = set()

    def visit(exp: Experiment, path: tuple[str, ...]) -> None:
        if exp.name in seen:
            return
        if exp.name in path:
            raise BadInputError(f"experiments need each other in a cycle: {' -> '.join((*path, exp.name))}")
        for name in exp.needs:
            if name in by_name:
                visit(by_name[name], (*path, exp.name))
        seen.add(exp.name)
        done.append(exp)

    for exp in experiments:
        visit(exp, ())
    return done
