"""Options and output shared by every experiment command (``--out``, ``--json``, ``--model``, profile)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import json
import shutil
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, cast, get_type_hints

import typer
from rich.console import Console
from rich.table import Table as RichTable

from kvlab.errors import BadInputError

if TYPE_CHECKING:  # the modules every command imports at start-up stay light (kvlab --help, refusals)
    from kvlab.model.handle import ModelHandle
    from kvlab.study.experiments import Experiment, ExperimentResult
    from kvlab.study.experiments.base import Profile

T = TypeVar("T")
R = TypeVar("R")


def refuse_errors(read: Callable[[T], R], value: T) -> R:
    """``read(value)``, a :class:`~kvlab.errors.KvlabError` it raises turned into a usage error: one line
    and exit code 2 while the options are read, before any work."""
    from kvlab.errors import KvlabError

    try:
        return read(value)
    except KvlabError as exc:
        raise typer.BadParameter(str(exc)) from None


def refuse_unknown(values: Iterable[str], known: Sequence[str], what: str, choose: str = "known: ") -> None:
    """A usage error naming the ``values`` that are not among ``known`` (``what``: ``task(s)`` ...), if any."""
    unknown = [v for v in values if v not in known]
    if unknown:
        raise typer.BadParameter(
            f"unknown {what} {', '.join(map(repr, unknown))}; {choose}{', '.join(known)}"
        )


def checked(module: str, name: str, *, one: bool = False) -> Callable[[Any], Any]:
    """A typer callback: an option's value (None and [] pass) read by ``module.name``, imported only when
    the option is given (``kvlab --help`` stays light), on ``[value]`` where ``one`` asks for a list; what
    it raises is one line and exit code 2 (:func:`refuse_errors`), before any work."""

    def callback(value: Any) -> Any:
        if value is not None and value != []:
            refuse_errors(getattr(importlib.import_module(module), name), [value] if one else value)
        return value

    return callback


def model_spec(value: str | None) -> str | None:
    """Typer callback: a model spec names a model that is here (the bundled one, a local folder with a
    config.json, a cached Hugging Face id), checked before anything loads; the bundled model's conversion
    waits for the command."""
    if value is not None and not value.strip():
        raise typer.BadParameter("an empty model name; use smollm2-135m, a local folder, or a cached HF id")
    if value is not None:
        from kvlab.model.loading import local_model_dir

        refuse_errors(local_model_dir, value)
    return value


ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        callback=model_spec,
        help="smollm2-135m (bundled), a local folder, or a cached HF id.",
    ),
]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Folder for run directories.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
QuickOpt = Annotated[bool, typer.Option("--quick", help="Smoke-test profile (a few minutes at most).")]
FullOpt = Annotated[bool, typer.Option("--full", help="Thorough profile (slower; says how long).")]
#: The largest count any option takes (tokens, samples, steps, windows ...): a million, past anything
#: a run here can use; a larger one is a typo, refused before any work.
MAX_COUNT = 1_000_000
#: Seeds are 0 .. 2**32 - 1: what numpy's, torch's and Python's generators all take.
MAX_SEED = 2**32 - 1
#: The most worker processes ``--workers`` starts.
MAX_WORKERS = 256


def count_option(*names: str, help: str, least: int = 1) -> Any:
    """An option taking a count (tokens, samples, steps ...): ``least`` up to :data:`MAX_COUNT`."""
    return typer.Option(*names, min=least, max=MAX_COUNT, help=help)


def workers_option(help: str) -> Any:
    """``--workers``: worker processes, 1 up to :data:`MAX_WORKERS`, with a command's own help."""
    return typer.Option("--workers", min=1, max=MAX_WORKERS, help=help)


SeedOpt = Annotated[
    int,
    typer.Option(
        "--seed",
        min=0,
        max=MAX_SEED,
        help="Seed for choosing text samples, permutations and bootstrap intervals (0 to 2**32 - 1).",
    ),
]


def device_name_value(value: str | None) -> str | None:
    """Typer callback for a ``--device`` that may name a device of another machine (``kvlab sweep --ray``:
    the cluster's GPUs): its form only, here; where it runs checks the rest."""
    if value is None:
        return None
    from kvlab.model.loading import check_device_name

    return refuse_errors(check_device_name, value)


def device_value(value: str | None) -> str | None:
    """Typer callback for ``--device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``, checked here, before any
    work: a name kvlab does not know, CUDA that this torch build or machine lacks, or a device index past
    the device count is one line and exit code 2. ``auto`` stays ``auto`` (the library resolves it)."""
    name = device_name_value(value)
    if name is not None and name.startswith("cuda"):
        from kvlab.model.loading import resolve_device

        refuse_errors(resolve_device, name)
    return name


def dtype_value(value: str | None) -> str | None:
    """Typer callback for ``--dtype``: a dtype the model can be loaded in, checked before any work."""
    if not value:
        return value
    from kvlab.model.loading import dtype_name

    refuse_errors(dtype_name, value)
    return value


def _read_cache(value: Any, read: Callable[[list[str]], object]) -> Any:
    """A ``--cache`` value (one spec or a list) read by ``read``, a library function that imports no torch:
    a bad spec is one line and exit code 2 while the options are read, before anything loads."""
    if value is None or value == []:
        return value
    refuse_errors(read, value if isinstance(value, list) else [value])
    return value


def _live(specs: list[str]) -> None:
    """Each spec read (none twice), as a live cache runs it (:meth:`~kvlab.policy.layouts.Layout.live_check`)."""
    from kvlab.policy.spec import parse_many

    for spec, policy in zip(specs, parse_many(specs), strict=True):
        policy.layout.live_check(policy, spec)


def live_cache_specs(value: Any) -> Any:
    """Typer callback for a live command's ``--cache SPEC`` (generate), or its repeatable ``--cache``
    (stream-ppl): each a policy a live cache runs, none twice."""
    return _read_cache(value, _live)


def eval_cache_specs(value: list[str] | None) -> list[str] | None:
    """Typer callback for ``kvlab eval ruler --cache``: what an offline run can do
    (:func:`kvlab.eval.specs.parse_cache_specs`); a score without a budget (``snapkv``) waits for
    ``--ratios`` (checked once both are read)."""
    from kvlab.eval.specs import bare_score, parse_cache_specs

    return _read_cache(
        value, lambda v: parse_cache_specs([s for s in v if bare_score(s) is None] or ["full"])
    )


def serve_cache_spec(value: str | None) -> str | None:
    """Typer callback for ``kvlab serve --cache``: a policy the server runs (:func:`kvlab.serve.policy.serve_policy`:
    a scored layout must keep its budget while decoding, ``every=``)."""
    from kvlab.serve.policy import serve_policy

    return _read_cache(value, lambda v: serve_policy(v[0]))


CAPTURED = ("cuda-graph", "compile")  # --capture values that decode through the ring's captured step


def capture_mode(value: str) -> str:
    """Typer callback: ``--capture``'s choices, checked before any model loads."""
    if value not in ("auto", "off", *CAPTURED):
        raise typer.BadParameter(f"{value!r} is not one of auto, off, cuda-graph, compile")
    return value


def capture_on(
    capture: str, device: str, on_cpu: Literal["off", "compile"] = "off"
) -> Literal["off", "compile", "cuda-graph"]:
    """``--capture`` on ``device``: auto is CUDA graphs on a GPU and ``on_cpu`` on a CPU (what pays there,
    measured per command); cuda-graph needs a GPU."""
    from kvlab.model import resolve_device

    cuda = str(resolve_device(device)).startswith("cuda")
    if capture == "auto":
        return "cuda-graph" if cuda else on_cpu
    if capture == "cuda-graph" and not cuda:
        raise BadInputError("--capture cuda-graph needs a CUDA device (--device cuda)")
    if capture not in ("off", *CAPTURED):
        raise BadInputError(f"--capture {capture!r} is not one of auto, off, cuda-graph, compile")
    return cast('Literal["off", "compile", "cuda-graph"]', capture)


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
#: Typer callback: a readable UTF-8 text file (checked before any work starts): a regular file (not a
#: folder, FIFO or device) under the text-size limit (``kvlab.data.MAX_TEXT_BYTES``), not empty.
text_file = checked("kvlab.data", "read_user_text")


def json_list_file(value: Path | None) -> Path | None:
    """Typer callback: a JSON file holding a list of objects (``--conversations``), read with the
    text-size limit and checked before any work: not a file, not JSON, nested too deep or not a list
    of objects is one line."""
    if value is None:
        return None
    from kvlab.data import read_user_text

    try:
        doc = json.loads(read_user_text(value, what="JSON file"))
    except BadInputError as exc:
        raise typer.BadParameter(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"{value} is not JSON ({exc})") from None
    except RecursionError:
        raise typer.BadParameter(f"{value} is nested too deeply to be read as JSON") from None
    if not isinstance(doc, list) or not all(isinstance(c, dict) for c in doc):
        raise typer.BadParameter(
            f"{value} must hold a JSON list of {{'full': ..., 'compacted': ..., 'summary': ...}} objects"
        )
    return value


def finite(value):
    """Typer callback: refuse nan and inf (one value or a list), which would otherwise run silently
    (a nan temperature would mean greedy decoding)."""
    import math

    for v in value if isinstance(value, list | tuple) else [value]:
        if v is not None and not math.isfinite(v):
            raise typer.BadParameter(f"{v} is not a finite number")
    return value


def nonempty_texts(value):
    """Typer callback: prompts (one or a list) are not empty or whitespace only."""
    for v in value if isinstance(value, list | tuple) else [value]:
        if v is not None and not v.strip():
            raise typer.BadParameter("an empty prompt; give some text")
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


def _nearest_existing(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return probe


def _probe_writable(folder: Path) -> str | None:
    """Why no file can be created in the existing ``folder`` (None when one can): a temporary folder is
    made and removed at once, since permission bits say nothing on /proc or a read-only mount."""
    import os
    import tempfile

    if not folder.is_dir():
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"no permission to write in {folder}"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvlab-probe-", dir=folder))
    except OSError as exc:
        return f"{folder}: {exc.strerror or exc}"
    return None


def check_output_dir(out: Path, option: str = "--out") -> None:
    """Refuse an --out that cannot hold run folders, before any work: an existing file, or a place where
    no folder can be created (checked by making and removing a temporary folder in the nearest existing
    parent). Leaves nothing behind."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        what = "a file, not a folder" if out.is_file() else "not a folder"
        raise BadInputError(f"{option} {out} is {what}")
    why = _probe_writable(_nearest_existing(out))
    if why:
        raise BadInputError(f"{option} {out}: cannot create folders there ({why})")


def check_output_file(path: Path, option: str) -> None:
    """Refuse a file destination that cannot be written, before any work: a folder, something that is
    not a regular file, or a place where the file (and its missing parent folders) cannot be created.
    Leaves nothing behind."""
    path = Path(path)
    if path.is_dir():
        raise BadInputError(f"{option} {path} is a folder; give a file name")
    if path.exists() or path.is_symlink():
        import stat

        try:
            mode = path.stat().st_mode
        except OSError as exc:
            raise BadInputError(f"{option} {path}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(mode):
            raise BadInputError(f"{option} {path} exists and is not a regular file")
    why = _probe_writable(_nearest_existing(path.parent))
    if why:
        raise BadInputError(f"{option} {path}: cannot write there ({why})")


def text_option(help: str) -> Any:
    """``--text/-T``: a UTF-8 text file checked by :func:`text_file` before any work, with a command's own
    help (``text: Annotated[Path | None, text_option("...")] = None``)."""
    return typer.Option("--text", "-T", callback=text_file, help=help)


console = Console()
err_console = Console(stderr=True)


def profile_from(quick: bool, full: bool) -> Profile:
    if quick and full:
        raise BadInputError("choose --quick or --full, not both")
    return "quick" if quick else "full" if full else "default"


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """``--model --device --dtype``: an option group (see :func:`group_command`) for the model a command
    loads."""

    model: ModelOpt = "smollm2-135m"
    device: DeviceOpt = "auto"
    dtype: DtypeOpt = "float32"

    def load(self) -> ModelHandle:
        from kvlab.model import load_model

        return load_model(self.model, device=self.device, dtype=self.dtype)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """The option group every experiment command takes besides its own options."""

    model: ModelOpt = "smollm2-135m"
    out: OutOpt = Path("runs")
    json_out: JsonOpt = False
    quick: QuickOpt = False
    full: FullOpt = False
    seed: SeedOpt = 0
    device: DeviceOpt = "auto"
    dtype: DtypeOpt = "float32"


def group_command(
    fn: Callable[..., Any], call: Callable[..., Any] | None = None, added: dict[str, type] | None = None
) -> Callable[..., Any]:
    """``fn``'s parameters (then ``added``, name -> group) as a typer command, where a parameter annotated
    with an option group (a dataclass whose fields are typer options, like :class:`ModelOptions`) stands
    for the group's fields: typer reads each field as an option, and ``call`` (default ``fn``) gets the
    group built from them."""
    hints = {**get_type_hints(fn, include_extras=True), **(added or {})}
    kw = inspect.Parameter.KEYWORD_ONLY
    groups: dict[str, Any] = {}
    params: list[inspect.Parameter] = []
    for p in [*inspect.signature(fn).parameters.values(), *(inspect.Parameter(n, kw) for n in added or {})]:
        kind = hints.get(p.name, p.annotation)
        if not dataclasses.is_dataclass(kind):
            params.append(p.replace(kind=kw, annotation=kind))
            continue
        groups[p.name] = kind
        fields = get_type_hints(kind, include_extras=True)
        params += [
            inspect.Parameter(f.name, kw, default=f.default, annotation=fields[f.name])
            for f in dataclasses.fields(kind)
        ]

    def command(**kwargs: Any) -> Any:
        for name, kind in groups.items():
            kwargs[name] = kind(**{f.name: kwargs.pop(f.name) for f in dataclasses.fields(kind)})
        return (call or fn)(**kwargs)

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__name__, command.__doc__ = fn.__name__, fn.__doc__
    return command


def experiment_command(
    app: typer.Typer, name: str, experiment: str, *, help: str | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a function as ``kvlab <name>``, running ``experiment`` with the :class:`RunOptions` added.

    The function declares only the command's own options (its docstring is the help) and returns
    the experiment's options as a dict, or None to pass its own arguments through unchanged.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(run: RunOptions, **own: Any) -> None:
            from kvlab.study.experiments import get_experiment

            options = fn(**own)
            run_and_report(
                get_experiment(experiment),
                out=run.out,
                json_out=run.json_out,
                model=run.model,
                profile=profile_from(run.quick, run.full),
                seed=run.seed,
                device=run.device,
                dtype=run.dtype,
                **(own if options is None else options),
            )

        app.command(name, help=help)(group_command(fn, run, {"run": RunOptions}))
        return fn

    return decorate


def run_and_report(
    experiment: Experiment,
    *,
    out: Path,
    json_out: bool,
    model: str = "smollm2-135m",
    profile: Profile = "default",
    seed: int = 0,
    dtype: str = "float32",
    device: str = "auto",
    load_in_4bit: bool = False,
    **options: Any,
) -> ExperimentResult:
    """Run one experiment into ``<out>/<name>-<timestamp>/`` and print a summary (or JSON)."""
    from kvlab.model.loading import check_4bit, resolve_device
    from kvlab.study.experiments import ExperimentContext
    from kvlab.study.report.writer import run_dir, to_jsonable
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
    # a bar on a terminal, one line per finished loop (stream-ppl's windows ...) off one, nothing with --json
    with progress_display(enabled=not json_out) as progress:
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
        print_json(to_jsonable(doc))
    else:
        print_result(result)
        console.print(f"\nreport: [bold]{folder / 'index.html'}[/bold]")
    return result


def print_json(doc: Any, *, indent: int | None = 2, default: Callable[[Any], Any] | None = None) -> None:
    """``--json``: ``doc`` as one JSON document on stdout."""
    sys.stdout.write(json.dumps(doc, indent=indent, default=default) + "\n")


def print_table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
    """A table on the console, its title on the left."""
    rt = RichTable(title=title, title_justify="left")
    for col in columns:
        rt.add_column(col)
    for row in rows:
        rt.add_row(*row)
    console.print(rt)


def print_result(result: ExperimentResult) -> None:
    console.print(f"[bold]{result.title}[/bold] ({result.status})")
    for table in result.tables:
        print_table(
            table.title, [str(c) for c in table.columns], [[_cell(v) for v in row] for row in table.rows]
        )
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {note}")


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)
