"""``kvlab study`` (the main job) and ``kvlab experiments`` (what a study runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table as RichTable

from kvlab.cli.common import (
    MAX_WORKERS,
    DeviceOpt,
    DtypeOpt,
    FullOpt,
    JsonOpt,
    ModelOpt,
    OutOpt,
    QuickOpt,
    SeedOpt,
    check_output_dir,
    console,
    err_console,
    profile_from,
    refuse_errors,
)


def _study_names(value: list[str] | None) -> list[str] | None:
    """Typer callback for ``--only``: experiments a study runs, checked before any import of them."""
    if value:
        from kvlab.study.experiments import check_study_names

        refuse_errors(check_study_names, value)
    return value


def study_cmd(
    model: ModelOpt = "smollm2-135m",
    out: OutOpt = Path("runs"),
    quick: QuickOpt = False,
    full: FullOpt = False,
    seed: SeedOpt = 0,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
    only: Annotated[
        list[str] | None,
        typer.Option("--only", callback=_study_names, help="Run only these experiments (repeatable)."),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            min=1,
            max=MAX_WORKERS,
            help="Experiments run at once, each in its own process with its own model copy "
            "(default: one per core, at most 4, and 1 on CUDA; 1 runs them one after another in this process).",
        ),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            "--resume",
            help="Finish an interrupted study in this folder (runs/study-...): keep the experiments that "
            "finished ok, run the others, write the report. Give the same model, profile, seed, "
            "device, dtype and --only as the first run (others are refused).",
        ),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run every registered experiment on the model and write one HTML report.

    Progress (experiments done of all, elapsed, an estimate of the time left) goes to stderr: a bar
    on a terminal, one line per finished experiment otherwise, nothing with --json."""
    from kvlab.model.loading import resolve_device
    from kvlab.study.runner import default_workers, run_study

    profile = profile_from(quick, full)
    device = resolve_device(device)
    check_output_dir(out)
    if profile == "full" and not json_out:
        err_console.print(
            "[yellow]--full runs every experiment at its largest size; expect an hour or more here.[/yellow]"
        )
    outcome = run_study(
        out=out,
        model_spec=model,
        profile=profile,
        seed=seed,
        only=only,
        dtype=dtype,
        device=device,
        workers=workers or default_workers(device),
        resume=resume,
        show_progress=not json_out,
    )
    if json_out:
        import json
        import sys

        doc = json.loads((outcome.run_dir / "result.json").read_text())
        sys.stdout.write(json.dumps({**doc, "report_dir": str(outcome.run_dir)}, indent=2) + "\n")
        raise typer.Exit(1 if outcome.failed else 0)
    rt = RichTable(title="kvlab study", title_justify="left")
    for col in ("experiment", "status", "seconds"):
        rt.add_column(col)
    for name, result in outcome.results:
        rt.add_row(name, result.status, f"{outcome.seconds[name]:.1f}")
    console.print(rt)
    console.print(f"report: [bold]{outcome.run_dir / 'index.html'}[/bold]")
    if outcome.failed:
        raise typer.Exit(1)


def experiments_cmd() -> None:
    """List the experiments a study runs, in order."""
    from kvlab.study.experiments import CATALOGUE

    rt = RichTable(title="experiments", title_justify="left")
    for col in ("name", "title", "in study"):
        rt.add_column(col)
    for name, (title, in_study) in CATALOGUE.items():  # listed without importing them (torch)
        rt.add_row(name, title, "yes" if in_study else "no")
    console.print(rt)


def register(app: typer.Typer) -> None:
    app.command("study")(study_cmd)
    app.command("experiments")(experiments_cmd)
