"""Options and output shared by every experiment command (``--out``, ``--json``, ``--model``, profile)."""

from __future__ import annotations

import contextlib
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
from kvlab.study.experiments import Experiment, ExperimentContext, ExperimentResult
from kvlab.study.report.writer import run_dir, to_jsonable

ModelOpt = Annotated[
    str, typer.Option("--model", "-m", help="smollm2-135m (bundled), a local folder, or a cached HF id.")
]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Folder for run directories.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
QuickOpt = Annotated[bool, typer.Option("--quick", help="Smoke-test profile (a few minutes at most).")]
FullOpt = Annotated[bool, typer.Option("--full", help="Thorough profile (slower; says how long).")]
SeedOpt = Annotated[
    int, typer.Option("--seed", help="Seed for choosing text samples, permutations and bootstrap intervals.")
]


def device_name_value(value: str | None) -> str | None:
    """Typer callback for a ``--device`` that may name a device of another machine (``kvlab sweep --ray``:
    the cluster's GPUs): its form only, here; where it runs checks the rest."""
    if value is None:
        return None
    from kvlab.errors import KvlabError
    from kvlab.model.loading import check_device_name

    try:
        return check_device_name(value)
    except KvlabError as exc:
        raise typer.BadParameter(str(exc)) from None


def device_value(value: str | None) -> str | None:
    """Typer callback for ``--device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``, checked here, before any
    work: a name kvlab does not know, CUDA that this torch build or machine lacks, or a device index past
    the device count is one line and exit code 2. ``auto`` stays ``auto`` (the library resolves it)."""
    name = device_name_value(value)
    if name is not None and name.startswith("cuda"):
        from kvlab.errors import KvlabError
        from kvlab.model.loading import resolve_device

        try:
            resolve_device(name)
        except KvlabError as exc:
            raise typer.BadParameter(str(exc)) from None
    return name


def dtype_value(value: str | None) -> str | None:
    """Typer callback for ``--dtype``: a dtype the model can be loaded in, checked before any work."""
    if not value:
        return value
    from kvlab.errors import KvlabError
    from kvlab.model.loading import parse_dtype

    try:
        parse_dtype(value)
    except KvlabError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


DEVICE_HELP = "Where the model runs: auto (CUDA when there is a GPU, else cpu), cpu, cuda or cuda:N."
DTYPE_HELP = "Model dtype: float32, bfloat16, float16."
DeviceOpt = Annotated[str, typer.Option("--device", callback=device_value, help=DEVICE_HELP)]
DtypeOpt = Annotated[str, typer.Option("--dtype", callback=dtype_value, help=DTYPE_HELP)]
#: ``--load-in-4bit``: the Phase 1 set-up (NF4 weights via bitsandbytes, CUDA only)
FourBitOpt = Annotated[
    bool,
    typer.Option(
        "--load-in-4bit",
        help="Load the weights in 4-bit NF4 (bitsandbytes; needs a CUDA GPU), as in Phase 1.",
    ),
]


# One vocabulary for every command (validated at parse time, so bad values fail before any model loads):
# --text/-T a UTF-8 text file, --model/-m, --context/-c tokens per sample, --window/-w cache window,
# --roll/-r tokens rolled off, --sinks/-s, --max-new-tokens/-n, --samples text samples, --seed,
# --out/-o, --json, and on every command that loads a model --device and --dtype.
def text_file(value: Path | None) -> Path | None:
    """Typer callback: an existing, readable UTF-8 text file (checked before any work starts)."""
    if value is None:
        return None
    if not value.is_file():
        raise typer.BadParameter(f"{value} is not a file")
    try:
        data = value.read_bytes()
        data.decode("utf-8")
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {value}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise typer.BadParameter(f"{value} is not UTF-8 text (byte {exc.start})") from None
    if not data.strip():
        raise typer.BadParameter(f"{value} is empty")
    return value


def finite(value):
    """Typer callback: refuse nan and inf (one value or a list), which would otherwise run silently
    (a nan temperature would mean greedy decoding)."""
    import math

    for v in value if isinstance(value, list | tuple) else [value]:
        if v is not None and not math.isfinite(v):
            raise typer.BadParameter(f"{v} is not a finite number")
    return value


def roll_specs(value: list[str] | None) -> list[str] | None:
    """Typer callback: roll amounts are a positive token count or a share like ``25%`` (0-100 exclusive)."""
    for item in value or []:
        text = item.strip()
        try:
            amount = float(text[:-1]) if text.endswith("%") else int(text)
        except ValueError:
            raise typer.BadParameter(f"{item!r} is neither a token count nor a share like 25%") from None
        if text.endswith("%") and not 0 < amount < 100:
            raise typer.BadParameter(f"{item!r}: a share must be between 0% and 100% (exclusive)")
        if not text.endswith("%") and amount < 1:
            raise typer.BadParameter(f"{item!r}: roll at least one token")
    return value


def check_output_dir(out: Path) -> None:
    """Refuse an --out that cannot hold run folders, before any work: an existing file, or a place where
    no folder can be created. Creates nothing."""
    import os

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise BadInputError(f"--out {out} is a file, not a folder")
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise BadInputError(f"--out {out}: cannot create folders under {probe}")


TextOpt = Annotated[
    Path | None,
    typer.Option(
        "--text", "-T", callback=text_file, help="A UTF-8 text file (default: the experiment's own texts)."
    ),
]
SamplesOpt = Annotated[
    int | None,
    typer.Option("--samples", min=1, help="Text samples (windows) to average over (default: by profile)."),
]
ContextOpt = Annotated[
    int | None, typer.Option("--context", "-c", min=2, help="Tokens per sample (default: by profile).")
]

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
    ("device", DeviceOpt, "auto"),
    ("dtype", DtypeOpt, "float32"),
)


def experiment_command(
    app: typer.Typer, name: str, experiment: str, *, help: str | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a function as ``kvlab <name>``, running ``experiment`` with the shared options added.

    The function declares only the command's own options (its docstring is the help) and returns
    the experiment's options as a dict, or None to pass its own arguments through unchanged.
    ``--model --out --json --quick --full --seed --device --dtype`` are appended here, once for every
    command.
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
            from kvlab.study.experiments import get_experiment

            run_and_report(
                get_experiment(experiment),
                out=common["out"],
                json_out=common["json_out"],
                model=common["model"],
                profile=profile_from(common["quick"], common["full"]),
                seed=common["seed"],
                device=common["device"],
                dtype=common["dtype"],
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
    device: str = "auto",
    load_in_4bit: bool = False,
    **options: Any,
) -> ExperimentResult:
    """Run one experiment into ``<out>/<name>-<timestamp>/`` and print a summary (or JSON)."""
    from kvlab.model.loading import check_4bit, resolve_device
    from kvlab.study.runner import progress_display, run_experiment

    device = check_4bit(device) if load_in_4bit else resolve_device(device)  # before anything is written
    check_output_dir(out)
    out_existed = Path(out).exists()
    try:
        folder = run_dir(out, experiment.name)
    except OSError as exc:
        raise BadInputError(
            f"--out {out}: cannot create a run folder there ({exc.strerror or exc})"
        ) from None
    with progress_display(enabled=not json_out and sys.stderr.isatty()) as progress:
        ctx = ExperimentContext(
            out_dir=folder,
            profile=profile,
            seed=seed,
            model_spec=model,
            dtype=dtype,
            device=device,
            load_in_4bit=load_in_4bit,
            progress=progress,
            options={k: v for k, v in options.items() if v is not None},
        )
        try:
            result = run_experiment(experiment, ctx)
        except BaseException:
            # Bad input (or an interrupt) leaves no half-written run folder behind.
            shutil.rmtree(folder, ignore_errors=True)
            if not out_existed:
                with contextlib.suppress(OSError):
                    Path(out).rmdir()  # only if empty: it was created for this run
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
