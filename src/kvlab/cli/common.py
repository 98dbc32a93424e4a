"""Options and output shared by every experiment command (``--out``, ``--json``, ``--model``, profile)."""

from __future__ import annotations

import inspect
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table as RichTable

from kvlab.errors import BadInputError
from kvlab.experiments import Experiment, ExperimentContext, ExperimentResult
from kvlab.report.writer import run_dir, to_jsonable

ModelOpt = Annotated[
    str, typer.Option("--model", "-m", help="smollm2-135m (bundled), a local folder, or a cached HF id.")
]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Folder for run directories.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
QuickOpt = Annotated[bool, typer.Option("--quick", help="Smoke-test profile (a few minutes at most).")]
FullOpt = Annotated[bool, typer.Option("--full", help="Thorough profile (slower; says how long).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for sampling windows and permutations.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="Model dtype: float32, bfloat16, float16.")]

console = Console()
err_console = Console(stderr=True)


def profile_from(quick: bool, full: bool) -> str:
    if quick and full:
        raise BadInputError("choose --quick or --full, not both")
    return "quick" if quick else "full" if full else "default"


_SHARED_OPTIONS = (
    ("model", ModelOpt, "smollm2-135m"),
    ("out", OutOpt, Path("runs")),
    ("json_out", JsonOpt, False),
    ("quick", QuickOpt, False),
    ("full", FullOpt, False),
    ("seed", SeedOpt, 0),
)


def experiment_command(
    app: typer.Typer, name: str, experiment: str, *, help: str | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a function as ``kvlab <name>``, running ``experiment`` with the shared options added.

    The function declares only the command's own options (its docstring is the help) and returns
    the experiment's options as a dict, or None to pass its own arguments through unchanged.
    ``--model --out --json --quick --full --seed`` are appended here, once for every command.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = list(inspect.signature(fn, eval_str=True).parameters.values())
        shared = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=a)
            for n, a, d in _SHARED_OPTIONS
        ]

        def command(**kwargs: Any) -> None:
            common = {n: kwargs.pop(n) for n, _, _ in _SHARED_OPTIONS}
            options = fn(**kwargs)
            from kvlab.experiments import get_experiment

            run_and_report(
                get_experiment(experiment),
                out=common["out"],
                json_out=common["json_out"],
                model=common["model"],
                profile=profile_from(common["quick"], common["full"]),
                seed=common["seed"],
                **(kwargs if options is None else options),
            )

        command.__signature__ = inspect.Signature([*own, *shared])  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in [*own, *shared]}
        command.__name__, command.__doc__ = fn.__name__, fn.__doc__
        app.command(name, help=help)(command)
        return fn

    return decorate


def run_and_report(
    experiment: Experiment,
    *,
    out: Path,
    json_out: bool,
    model: str = "smollm2-135m",
    profile: str = "default",
    seed: int = 0,
    dtype: str = "float32",
    **options: Any,
) -> ExperimentResult:
    """Run one experiment into ``<out>/<name>-<timestamp>/`` and print a summary (or JSON)."""
    from kvlab.runner import progress_display, run_experiment

    folder = run_dir(out, experiment.name)
    with progress_display(enabled=not json_out and sys.stderr.isatty()) as progress:
        ctx = ExperimentContext(
            out_dir=folder,
            profile=profile,
            seed=seed,
            model_spec=model,
            dtype=dtype,
            progress=progress,
            options={k: v for k, v in options.items() if v is not None},
        )
        try:
            result = run_experiment(experiment, ctx)
        except BaseException:
            # Bad input (or an interrupt) leaves no half-written run folder behind.
            shutil.rmtree(folder, ignore_errors=True)
            raise
    if json_out:
        doc = json.loads((folder / "result.json").read_text())
        doc["report_dir"] = str(folder)
        sys.stdout.write(json.dumps(to_jsonable(doc), indent=2) + "\n")
    else:
        print_result(result)
        console.print(f"\nreport: [bold]{folder / 'index.html'}[/bold]")
    return result


def print_result(result: ExperimentResult) -> None:
    console.print(f"[bold]{result.title}[/bold] ({result.status})")
    for table in result.tables:
        rt = RichTable(title=table.title, title_justify="left")
        for col in table.columns:
            rt.add_column(str(col))
        for row in table.rows:
            rt.add_row(*[_cell(v) for v in row])
        console.print(rt)
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {note}")


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)
