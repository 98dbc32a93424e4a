"""What an experiment is: a function from a context (model, profile, output folder) to a result.

Each experiment lives in one module of ``kvlab.study.experiments`` and exposes ``EXPERIMENT``, an
:class:`Experiment`. The study runner discovers them, runs them in ``order`` (their names and titles
are also listed in :data:`kvlab.study.experiments.CATALOGUE`, read without importing them), and the report renders every :class:`ExperimentResult` the same way: summary numbers,
tables, figures with captions, notes, and the raw arrays saved beside them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvlab.errors import BadInputError

if TYPE_CHECKING:  # listing experiments (kvlab experiments) imports no numpy
    import numpy as np
    from rich.progress import Progress as RichProgress

Profile = Literal["quick", "default", "full"]
PROFILES: tuple[str, ...] = ("quick", "default", "full")


@dataclass
class Figure:
    """A PNG written into the experiment's folder, with the one-line caption the report shows."""

    filename: str
    caption: str


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]
    caption: str = ""

    @staticmethod
    def header(row: str) -> list[str]:
        """Column headers written as one row: ``Table.header("n | sinks | 95% CI")`` (no header holds " | ")."""
        return row.split(" | ")

    def to_json(self) -> dict:
        return {"title": self.title, "columns": self.columns, "rows": self.rows, "caption": self.caption}


@dataclass
class ExperimentResult:
    """Everything an experiment measured; ``arrays`` are saved to ``arrays.npz`` next to ``result.json``."""

    name: str
    title: str
    summary: dict[str, Any] = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    data_sources: list[str] = field(default_factory=list)
    status: Literal["ok", "not_applicable", "failed"] = "ok"
    description: str = ""
    #: the section's answer in one sentence, written from the numbers it computed
    finding: str = ""
    #: a few (quantity, value with interval) rows that carry the finding; the full summary stays below
    headline: list[tuple[str, str]] = field(default_factory=list)

    def table(self, title: str, columns: list[str], rows: list[list[Any]], caption: str = "") -> Table:
        """A :class:`Table` of this result, appended to its tables."""
        self.tables.append(Table(title, columns, rows, caption))
        return self.tables[-1]


def _no_progress(n: int = 1) -> None:
    """The ``advance`` of a task that nobody watches."""


class Progress:
    """The slice of a rich progress display an experiment may use (a no-op when there is none)."""

    def __init__(self, rich_progress: RichProgress | None = None):
        self._p = rich_progress

    @contextlib.contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
        """``with ctx.progress.task("rolls", total=n) as advance: ... advance(1)``."""
        p = self._p
        if p is None:
            yield _no_progress
            return
        task_id = p.add_task(description, total=total)
        try:
            yield functools.partial(p.advance, task_id)
        finally:
            p.update(task_id, completed=total if total is not None else 1, total=total or 1, visible=False)

    def log(self, message: str) -> None:
        if self._p is not None:
            self._p.console.print(message)


@dataclass
class ExperimentContext:
    """What an experiment gets: where to write, how much to do, and the model (loaded on first use)."""

    out_dir: Path
    profile: Profile = "default"
    seed: int = 0
    model_spec: str = "smollm2-135m"
    dtype: str = "float32"
    #: where the model runs: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (see :func:`kvlab.model.resolve_device`)
    device: str = "cpu"
    #: load the weights in 4-bit NF4 (the Phase 1 set-up; CUDA and bitsandbytes only)
    load_in_4bit: bool = False
    progress: Progress = field(default_factory=Progress)
    options: dict[str, Any] = field(default_factory=dict)
    #: the loaded :class:`~kvlab.model.ModelHandle`, or None until :meth:`handle` loads ``model_spec``
    model_handle: Any = None
    #: summaries of the experiments this study has already run, by name (filled by the runner)
    upstream: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise BadInputError(f"unknown profile '{self.profile}'; choose one of {', '.join(PROFILES)}")
        self.out_dir = Path(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def handle(self):
        """The :class:`~kvlab.model.ModelHandle` for ``model_spec`` (loaded once, shared across a study)."""
        if self.model_handle is None:
            self.model_handle = self.load_model(self.model_spec, load_in_4bit=self.load_in_4bit)
        return self.model_handle

    def load_model(self, spec: str, *, dtype: Any = None, load_in_4bit: bool = False):
        """Another model (a reference in another dtype, a transplant target) on this study's device:
        ``dtype`` defaults to the study's."""
        from kvlab.model import load_model

        return load_model(
            spec,
            dtype=self.dtype if dtype is None else dtype,
            device=self.device,
            load_in_4bit=load_in_4bit,
            progress=self.progress.log,
        )

    def device_info(self) -> dict[str, Any]:
        """Where this context's model runs, for the manifest: device and dtype (and the GPU on CUDA)."""
        from kvlab.model import describe_device, resolve_device

        device, dtype = None, self.dtype
        if self.model_handle is not None:  # as loaded (a stand-in handle in a test may have no device)
            with contextlib.suppress(AttributeError, StopIteration, TypeError):
                device = str(self.model_handle.device)
                dtype = str(self.model_handle.dtype).replace("torch.", "")
        info = {**describe_device(device or resolve_device(self.device)), "dtype": dtype}
        if self.load_in_4bit:
            info["load_in_4bit"] = True
        return info

    def pick(self, quick: Any, default: Any, full: Any = None) -> Any:
        """A setting by profile: ``ctx.pick(quick=4, default=20, full=100)``."""
        return {"quick": quick, "default": default, "full": default if full is None else full}[self.profile]

    def count(self, name: str, value: int | None, quick: int, default: int, full: int | None = None) -> int:
        """A size the caller may set (``value``) or leave to the profile (None): always an int >= 1.

        An explicit 0 or negative number is a clear error, not a silent fallback to the default.
        """
        if value is None:
            return int(self.pick(quick, default, full))
        if int(value) < 1:
            raise BadInputError(f"{name} must be >= 1, got {value}")
        return int(value)

    def figure(self, name: str, fig: Any, caption: str, into: list[Figure] | None = None) -> Figure:
        """Save a matplotlib figure as ``<name>.png`` in the experiment folder and close it (and append
        it to ``into``, a result's figures, when given)."""
        import matplotlib.pyplot as plt

        filename = f"{name}.png"
        if fig.get_suptitle() and fig.get_layout_engine() is None:
            import warnings

            with warnings.catch_warnings():  # a suptitle gets its own row instead of overlapping axes titles
                warnings.simplefilter("ignore")
                fig.tight_layout()
        # bbox_inches="tight" grows the saved area to every artist: suptitles and outside legends included
        fig.savefig(self.out_dir / filename, dpi=110, bbox_inches="tight")
        plt.close(fig)
        figure = Figure(filename=filename, caption=caption)
        if into is not None:
            into.append(figure)
        return figure


@dataclass(frozen=True)
class Experiment:
    """A registered experiment: ``run(ctx, **options) -> ExperimentResult``."""

    name: str
    title: str
    run: Callable[..., ExperimentResult]
    order: int = 100
    description: str = ""
    in_study: bool = True
    #: ``describe(summary) -> (finding, headline rows)``: the section's one-sentence answer, from its numbers
    describe: Callable[[dict], tuple[str, list[tuple[str, str]]]] | None = None
    #: experiments whose summaries this one uses (:func:`kvlab.study.experiments.needed`); a study runs them first
    needs: tuple[str, ...] = ()
    #: an experiment whose in-process measurements this one reuses (a memo of prefills): a study with
    #: several workers runs this one in the same process, right after it
    reuses: str | None = None
    #: what the study's seed changes in this experiment's samples (``_sampling.py``; the table in
    #: docs/sweeps.md); empty for an experiment that samples nothing (the same numbers for every seed)
    seed_changes: str = ""

    def result(self, doc: str | None) -> ExperimentResult:
        """An empty result of this experiment, described by the first line of ``doc`` (its module's docstring)."""
        return ExperimentResult(
            name=self.name, title=self.title, description=(doc or "").strip().split("\n")[0]
        )
