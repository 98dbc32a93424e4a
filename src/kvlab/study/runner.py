"""Running experiments and writing their reports (what ``kvlab study`` and each experiment command call).

Data flow: a command builds an :class:`ExperimentContext` -> the experiment's ``run`` loads the model
on first use, measures, saves figures into its folder -> :func:`finish` writes ``result.json``,
``arrays.npz`` and ``index.html``. A study does this for every registered experiment, one sub-folder
each, and writes a top-level ``index.html`` with every section.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from kvlab.errors import BadInputError, KvlabError
from kvlab.study.experiments import Experiment, ExperimentContext, ExperimentResult, Progress, registry
from kvlab.study.report.html import write_experiment_page, write_study_index
from kvlab.study.report.writer import manifest, run_dir, to_jsonable, write_result

stderr = Console(stderr=True)


@contextmanager
def progress_display(enabled: bool = True):
    """A rich progress display on stderr (so ``--json`` output on stdout stays clean)."""
    if not enabled:
        yield Progress(None)
        return
    with RichProgress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr,
        transient=False,
    ) as p:
        yield Progress(p)


def _manifest_line(m: dict) -> str:
    model = m.get("model", {})
    return (
        f"{m.get('command', '')} · model {model.get('name', m.get('model_spec', ''))} "
        f"{model.get('fingerprint', '')[:12]} · profile {m.get('profile')} · seed {m.get('seed')} · "
        f"kvlab {m['versions']['kvlab']}, torch {m['versions']['torch']}, transformers {m['versions']['transformers']}"
    )


def finish(result: ExperimentResult, ctx: ExperimentContext, started: float) -> dict:
    """Write ``result.json``, ``arrays.npz`` and ``index.html`` for one experiment; returns the manifest."""
    m = manifest(
        model=ctx.model_handle,
        model_spec=ctx.model_spec,
        profile=ctx.profile,
        seed=ctx.seed,
        started=started,
        extra={"options": {k: str(v) for k, v in ctx.options.items()}} if ctx.options else None,
    )
    write_result(result, ctx.out_dir, m)
    write_experiment_page(result, ctx.out_dir, _manifest_line(m))
    return m


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


def run_study(
    *,
    out: str | Path = "runs",
    model_spec: str = "smollm2-135m",
    profile: str = "default",
    seed: int = 0,
    only: Sequence[str] | None = None,
    show_progress: bool = True,
    dtype: str = "float32",
) -> StudyOutcome:
    """Run every registered experiment (or ``only`` these) into one report folder.

    A failing experiment is recorded as a failed section with its error, and the study goes on.
    """
    experiments = [e for e in registry().values() if e.in_study]
    if only:
        known = {e.name for e in experiments}
        missing = [n for n in only if n not in known]
        if missing:
            raise BadInputError(
                f"unknown experiment(s) {', '.join(missing)}; known: {', '.join(sorted(known))}"
            )
        experiments = [e for e in experiments if e.name in only]
    # The model is loaded once, before the report folder exists: an unknown model is one error and
    # no report of N identical failures.
    from kvlab.model import load_model

    say = (
        (lambda msg: print(msg, file=sys.stderr)) if show_progress else None
    )  # e.g. the first GGUF conversion
    model: Any = load_model(model_spec, dtype=dtype, progress=say)
    try:
        root = run_dir(out, "study")
    except OSError as exc:
        raise BadInputError(
            f"--out {out}: cannot create a report folder there ({exc.strerror or exc})"
        ) from None
    experiments = dependencies_first(experiments)
    results: list[tuple[str, ExperimentResult]] = []
    upstream: dict[str, dict] = {}  # summaries of the experiments run so far, for those that need them
    failed: list[str] = []
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    with progress_display(show_progress) as progress:
        with progress.task("study", total=len(experiments)) as advance:
            for exp in experiments:
                ctx = ExperimentContext(
                    out_dir=root / exp.name,
                    profile=profile,
                    seed=seed,
                    model_spec=model_spec,
                    dtype=dtype,
                    progress=progress,
                    model_handle=model,
                    upstream={n: upstream[n] for n in exp.needs if n in upstream},
                )
                progress.log(f"[bold]{exp.title}[/bold]")
                started = time.perf_counter()
                try:
                    result = exp.run(ctx)
                except Exception as exc:  # a study records failures and carries on
                    detail = str(exc) if isinstance(exc, KvlabError) else traceback.format_exc(limit=6)
                    result = ExperimentResult(
                        name=exp.name,
                        title=exp.title,
                        status="failed",
                        notes=[f"{type(exc).__name__}: {detail}"],
                    )
                    failed.append(exp.name)
                    progress.log(f"[red]{exp.name} failed: {exc}[/red]")
                model = ctx.model_handle or model
                describe(exp, result)
                finish(result, ctx, started)
                seconds[exp.name] = round(time.perf_counter() - started, 2)
                results.append((exp.name, result))
                if result.status == "ok":
                    upstream[exp.name] = to_jsonable(result.summary)
                advance(1)
    m = manifest(
        model=model,
        model_spec=model_spec,
        profile=profile,
        seed=seed,
        started=t0,
        extra={"experiments": seconds},
    )
    summary = ExperimentResult(
        name="study", title="kvlab study", summary={"seconds": seconds, "failed": failed}
    )
    write_result(summary, root, m)
    subtitle = (
        f"{m.get('model', {}).get('name', model_spec)} · profile {profile} · {len(results)} experiments"
    )
    write_study_index(root, results, subtitle, _manifest_line(m))
    return StudyOutcome(run_dir=root, results=results, failed=failed, seconds=seconds)


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
