"""``kvlab study`` (the main job) and ``kvlab experiments`` (what a study runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli.common import (
    RunOptions,
    check_output_dir,
    checked,
    console,
    err_console,
    group_command,
    print_json,
    print_table,
    profile_from,
    workers_option,
)


def _only_names(value: list[str] | None) -> list[str] | None:
    """``--only``'s names, each option split at commas (``--only kv_swap,store_reuse``), checked before any work."""
    names = [n.strip() for v in value for n in v.split(",")] if value else value
    return checked("kvlab.study.experiments", "check_study_names")(names)


def study_cmd(
    run: RunOptions = RunOptions(),
    only: Annotated[
        list[str] | None,
        typer.Option(
            callback=_only_names,
            help="Run only these experiments (repeatable, or comma-separated).",
        ),
    ] = None,
    workers: Annotated[
        int | None,
        workers_option(
            "Experiments run at once, each in its own process with its own model copy "
            "(default: one per core, at most 4, and 1 on CUDA; 1 runs them one after another in this process)."
        ),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            help="Finish an interrupted study in this folder (runs/study-...): keep the experiments that "
            "finished ok, run the others, write the report. Give the same model, profile, seed, "
            "device, dtype and --only as the first run (others are refused).",
        ),
    ] = None,
) -> None:
    """Run every registered experiment on the model and write one HTML report.

    Progress (experiments done of all, elapsed, an estimate of the time left) goes to stderr: a bar
    on a terminal, one line per finished experiment otherwise, nothing with --json."""
    from kvlab.model.loading import resolve_device
    from kvlab.study.runner import default_workers, run_study

    profile = profile_from(run.quick, run.full)
    device = resolve_device(run.device)
    check_output_dir(run.out)
    if profile == "full" and not run.json_out:
        err_console.print(
            "[yellow]--full runs every experiment at its largest size; expect an hour or more here.[/yellow]"
        )
    outcome = run_study(
        out=run.out,
        model_spec=run.model,
        profile=profile,
        seed=run.seed,
        only=only,
        dtype=run.dtype,
        device=device,
        workers=workers or default_workers(device),
        resume=resume,
        show_progress=not run.json_out,
    )
    if run.json_out:
        doc = json.loads((outcome.run_dir / "result.json").read_text())
        print_json({**doc, "report_dir": str(outcome.run_dir)})
        raise typer.Exit(1 if outcome.failed else 0)
    rows = [(name, result.status, f"{outcome.seconds[name]:.1f}") for name, result in outcome.results]
    print_table("kvlab study", ("experiment", "status", "seconds"), rows)
    console.print(f"report: [bold]{outcome.run_dir / 'index.html'}[/bold]")
    if outcome.failed:
        raise typer.Exit(1)


def experiments_cmd() -> None:
    """List the experiments a study runs, in order."""
    from kvlab.study.experiments import CATALOGUE

    rows = [(name, title, "yes" if in_study else "no") for name, (title, in_study) in CATALOGUE.items()]
    print_table("experiments", ("name", "title", "in study"), rows)  # listed without importing them (torch)


def register(app: typer.Typer) -> None:
    app.command("study")(group_command(study_cmd))
    app.command("experiments")(experiments_cmd)
