"""Progress for the commands a user waits on: k of n units done, the time elapsed, an estimate of what is left.

One helper for ``kvlab study`` (experiments), ``kvlab eval ruler`` (trials), ``kvlab sweep`` (cells) and
an experiment command's own loops (``kvlab stream-ppl``'s windows), all on stderr so stdout stays clean:

* ``rich`` (stderr is a terminal): a live bar with k/n, elapsed and the estimate;
* ``plain`` (stderr is not a terminal: a CI log, a pipe): at most one line per finished unit, e.g.
  ``[3/18] roll_sweep ok 12.3 s · 1 min 02 s elapsed · ETA ~1 min 40 s (estimate)``;
* ``off`` (``--json``): nothing.

The estimate (:class:`Estimate`) is labelled one: per-unit weights (typical seconds, or any relative
cost such as tokens) scaled by what the finished units of this run actually took. No torch here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO, Literal

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as RichProgress
from rich.text import Text

Mode = Literal["rich", "plain", "off"]


def choose_mode(quiet: bool = False, stream: IO[str] | None = None) -> Mode:
    """``off`` when ``quiet`` (``--json``), ``rich`` when ``stream`` (stderr) is a terminal, else ``plain``."""
    if quiet:
        return "off"
    stream = sys.stderr if stream is None else stream
    try:
        return "rich" if stream.isatty() else "plain"
    except (AttributeError, ValueError):  # a closed or odd stream
        return "plain"


def duration(seconds: float) -> str:
    """``0.4 s``, ``12.3 s``, ``1 min 40 s``, ``2 h 05 min``."""
    s = max(0.0, float(seconds))
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        m, r = divmod(round(s), 60)
        return f"{m} min {r:02d} s"
    h, r = divmod(round(s) // 60, 60)
    return f"{h} h {r:02d} min"


class Estimate:
    """Seconds left in a run, from a weight per unit calibrated by the units this run has finished.

    ``weights`` are typical seconds per unit when ``seconds`` is true (then an estimate exists before
    any unit finishes), else relative costs (tokens, say: the first estimate comes after the first unit).
    Once units finish, every weight is scaled by (their seconds) / (their weights); a unit without a
    weight counts as the mean finished unit. ``parallel`` units run at once. ``source`` says where the
    weights came from (shown with the first estimate)."""

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        *,
        seconds: bool = False,
        parallel: int = 1,
        source: str = "",
    ) -> None:
        self.weights = {k: float(v) for k, v in (weights or {}).items() if v is not None and v >= 0}
        self.seconds = seconds
        self.parallel = max(1, parallel)
        self.source = source

    def left(self, finished: Mapping[str, float], pending: Collection[str]) -> float | None:
        """Seconds until the ``pending`` units are done, given the ``finished`` ones' seconds (None: no basis)."""
        if not pending:
            return 0.0
        if not finished and not any(k in self.weights for k in pending):
            return None  # no unit of this run is known yet
        paired = [(finished[k], self.weights[k]) for k in finished if k in self.weights]
        weight_done = sum(w for _, w in paired)
        if weight_done > 0:
            scale: float | None = sum(s for s, _ in paired) / weight_done
        else:
            scale = 1.0 if self.seconds else None
        mean_done = sum(finished.values()) / len(finished) if finished else None
        costs = []
        for k in pending:
            if k in self.weights and scale is not None:
                costs.append(self.weights[k] * scale)
            elif mean_done is not None:
                costs.append(mean_done)
            elif self.seconds and self.weights:
                costs.append(sum(self.weights.values()) / len(self.weights))
            else:
                return None
        return max(sum(costs) / min(self.parallel, len(costs)), max(costs))


class EtaColumn(ProgressColumn):
    """The estimate a :class:`Counter` keeps in its rich task's fields, counting down between updates."""

    def render(self, task: Task) -> Text:
        eta, at = task.fields.get("eta"), task.fields.get("eta_at")
        if eta is None or at is None or task.finished:
            return Text("")
        left = eta - (time.monotonic() - at)
        if left <= 0:
            return Text("past the estimate", style="dim")
        return Text(f"ETA ~{duration(left)} (estimate)", style="dim")


def rich_display(console: Console) -> RichProgress:
    """The bar every kvlab command shows on a terminal: spinner, what, bar, k/n, elapsed, estimate."""
    return RichProgress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        EtaColumn(),
        console=console,
        transient=False,
    )


class Counter:
    """k of n named units of one run (``done(name, seconds)`` as each finishes), shown as :data:`Mode` says.

    ``finished`` are units a resumed run already holds (counted as done, their seconds calibrating the
    estimate). In ``rich`` mode the bar lives on ``display``; ``lines`` also prints each finished unit's
    line above it (a study's experiments; not an eval's hundreds of trials)."""

    def __init__(
        self,
        what: str,
        names: Sequence[str],
        *,
        mode: Mode,
        console: Console,
        display: RichProgress | None = None,
        estimate: Estimate | None = None,
        finished: Mapping[str, float] | None = None,
        lines: bool = True,
    ) -> None:
        self.what, self.mode, self.console = what, mode, console
        self.estimate, self.lines = estimate, lines
        self.finished: dict[str, float] = dict(finished or {})
        self.pending = [n for n in names if n not in self.finished]
        self.total = len(self.finished) + len(self.pending)
        self.started = time.monotonic()
        self.task: TaskID | None = None
        self.attach(display)

    def attach(self, display: RichProgress | None) -> None:
        """Show the bar on ``display`` (a rich display another part of the command owns), in ``rich`` mode."""
        self.display = display
        if self.mode == "rich" and display is not None:
            self.task = display.add_task(self.what, total=self.total or 1, completed=len(self.finished))
            self._set_eta()

    def left(self) -> float | None:
        return None if self.estimate is None else self.estimate.left(self.finished, self.pending)

    def _set_eta(self) -> None:
        if self.display is not None and self.task is not None:
            self.display.update(self.task, eta=self.left(), eta_at=time.monotonic())

    def say(self, message: str) -> None:
        """A line of its own (plain and rich modes)."""
        if self.mode != "off":
            self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def start_line(self, detail: str = "") -> str:
        """``study: 18 experiments (3 already done) · ETA ~9 min 10 s (estimate from ...)``."""
        parts = [f"{self.what}: {self.total} {detail}".rstrip()]
        if self.finished:
            parts[0] += f" ({len(self.finished)} already done)"
        left = self.left()
        if left is not None and self.pending:
            source = f" from {self.estimate.source}" if self.estimate and self.estimate.source else ""
            parts.append(f"ETA ~{duration(left)} (estimate{source})")
        return " · ".join(parts)

    def done(self, name: str, seconds: float, status: str = "ok", label: str | None = None) -> None:
        """Unit ``name`` finished after ``seconds`` (its own time) with ``status``."""
        self.finished[name] = float(seconds)
        if name in self.pending:
            self.pending.remove(name)
        if self.mode == "off":
            return
        line = self.line(label or name, seconds, status)
        if self.mode == "plain" or self.lines:
            self.say(line)
        if self.display is not None and self.task is not None:
            self.display.advance(self.task, 1)
            self._set_eta()

    def line(self, label: str, seconds: float, status: str) -> str:
        k = len(self.finished)
        elapsed = duration(time.monotonic() - self.started)
        tail = f"{elapsed} elapsed"
        if self.pending:
            left = self.left()
            tail += f" · ETA ~{duration(left)} (estimate)" if left is not None else ""
        else:
            tail = f"done in {elapsed}"
        return f"[{k}/{self.total}] {label} {status} {duration(seconds)} · {tail}"


@contextmanager
def counting(
    what: str,
    names: Sequence[str],
    *,
    mode: Mode,
    console: Console | None = None,
    estimate: Estimate | None = None,
    finished: Mapping[str, float] | None = None,
    lines: bool = True,
    detail: str = "",
) -> Iterator[Counter]:
    """A :class:`Counter` with its own display (a rich bar on a terminal), its start line said first."""
    console = console or Console(stderr=True)
    if mode != "rich":
        counter = Counter(
            what, names, mode=mode, console=console, estimate=estimate, finished=finished, lines=lines
        )
        counter.say(counter.start_line(detail))
        yield counter
        return
    with rich_display(console) as display:
        counter = Counter(
            what,
            names,
            mode=mode,
            console=console,
            display=display,
            estimate=estimate,
            finished=finished,
            lines=lines,
        )
        counter.say(counter.start_line(detail))
        yield counter
