"""Calibrating the RULER-style tasks per model and length, so that the full cache has headroom both ways.

A task whose full cache scores 0 or 1 cannot show what a cache policy costs. For one model and one
length, :func:`calibrate` walks each task's difficulty ladder (:data:`LADDERS`: settings of the task's
knobs, :mod:`kvlab.eval.tasks`, easiest first, the default among them) on the FULL cache only, and picks
the setting whose accuracy lies in the band ``[0.6, 0.95]`` (:data:`BAND`), the one nearest 0.8
(:data:`TARGET`) when several do. A task with no setting in the band is marked *apart*: an eval reports
it on its own and leaves it out of the pooled figure.

* **Seeds.** Calibration trials use seeds ``-1, -2, ...`` (:func:`calibration_seed`); an eval's trials
  use ``trial_seed(seed, i) = seed * 100003 + i`` with ``seed, i >= 0`` (:func:`kvlab.eval.tasks.trial_seed`),
  never negative, so no calibration trial is ever an evaluation trial (:func:`check_disjoint`). Every
  setting of a ladder runs on the same calibration seeds.
* **The walk.** A bisection over the ladder, assuming each rung is harder than the one before: it starts
  at the default rung; a setting above the band rules out every easier rung, one below every harder
  rung; it stops at the first setting in the band, then (``refine``) tries the next rung towards 0.8 once
  when the estimate is more than 0.1 from it, and stops when no rung is left (the task is then apart).
* **A setting** runs ``n`` trials (at least 30: :data:`MIN_TRIALS`); its accuracy is the mean score with
  Wilson's interval (:func:`kvlab.metrics.stats.wilson_ci`). It is *in the band* when that mean is
  (whether the whole interval is too is recorded beside it). With ``stop_early`` a setting stops as soon
  as its remaining trials cannot bring the mean into the band, whatever they score (a verdict the full
  ``n`` would give too); such a setting reports the trials it ran. A chosen setting always ran all ``n``.

The model is behind ``score(task, length, seed, knobs)``: a number in [0, 1], or a row with a ``score``
(kept as the setting's raw rows). ``benchmarks/calibrate_ruler.py`` scores with the full cache
(:func:`kvlab.eval.run.run_trial`); :func:`calibrate` returns the JSON it writes and :class:`Calibration`
reads back (``benchmarks/eval_ruler.py --calibration``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvlab.errors import BadInputError
from kvlab.eval.tasks import TASKS

#: the full cache's accuracy a calibrated task is held in, and the value preferred within it
BAND = (0.6, 0.95)
TARGET = 0.8
#: the fewest trials a setting is judged on
MIN_TRIALS = 30
#: the distance from :data:`TARGET` beyond which ``refine`` tries one rung more
REFINE_OFF = 0.1

#: per task, settings of its knobs from the easiest to the hardest (each over the task's defaults; ``{}``
#: is the default). More keys, values, hops, chains, common words or people make a task harder; more
#: repeats of the common words make common-words easier.
LADDERS: dict[str, tuple[dict[str, int], ...]] = {
    "niah_single": ({}, {"keys": 2}, {"keys": 3}, {"keys": 4}, {"keys": 6}, {"keys": 8}),
    "niah_multikey": (
        {"keys": 2},
        {"keys": 3},
        {},
        {"keys": 6},
        {"keys": 8},
        {"keys": 12},
        {"keys": 16},
    ),
    "niah_multivalue": ({"values": 2}, {"values": 3}, {}, {"values": 6}, {"values": 8}),
    "vt": ({"hops": 1}, {"hops": 2}, {"hops": 3}, {}, {"chains": 2}, {"hops": 6, "chains": 2}),
    "cwe": (
        {"words": 1, "common_repeats": 20},
        {"words": 2, "common_repeats": 20},
        {"words": 3, "common_repeats": 12},
        {"words": 3},
        {"words": 5},
        {"words": 7},
        {},
    ),
    "qa": ({"people": 1}, {"people": 2}, {}, {"people": 8}, {"people": 12}, {"people": 16}, {"people": 24}),
}

Score = Callable[[str, int, int, Mapping[str, int]], float | Mapping]


def calibration_seed(index: int) -> int:
    """The seed of calibration trial ``index`` (0, 1, ...): -1, -2, ...; an eval's seeds are never negative."""
    if index < 0:
        raise BadInputError(f"a calibration trial's index must be >= 0, got {index}")
    return -(int(index) + 1)


def check_disjoint(evaluation_seeds: Iterable[int]) -> None:
    """Refuse evaluation seeds a calibration may use (negative ones)."""
    bad = sorted({int(s) for s in evaluation_seeds if int(s) < 0})
    if bad:
        raise BadInputError(
            f"evaluation seeds {bad[:3]} are negative: calibration trials use seeds -1, -2, ...; give --seed >= 0"
        )


@dataclass
class Setting:
    """One rung tried: its knobs (over the task's defaults), the trials' seeds and scores (and raw rows)."""

    knobs: dict[str, int]
    n: int
    seeds: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)

    @property
    def value(self) -> float:
        return sum(self.scores) / len(self.scores)

    def verdict(self, band: tuple[float, float]) -> str:
        """``in band``, ``above`` or ``below``; a setting stopped early is decided by its trials so far."""
        lo, hi = band
        total, left = sum(self.scores), self.n - len(self.scores)
        if total > hi * self.n:
            return "above"
        if total + left < lo * self.n:
            return "below"
        return "in band" if not left else "undecided"

    def to_json(self, band: tuple[float, float]) -> dict:
        from kvlab.metrics.stats import wilson_ci

        acc = wilson_ci(self.scores).to_json()
        inside = acc["low"] is not None and acc["low"] >= band[0] and acc["high"] <= band[1]
        return {
            "knobs": dict(self.knobs),
            "n": len(self.scores),
            "accuracy": acc,
            "verdict": self.verdict(band),
            "interval_in_band": inside,
            "stopped_early": len(self.scores) < self.n,
            "seeds": list(self.seeds),
            "scores": list(self.scores),
            **({"rows": list(self.rows)} if self.rows else {}),
        }


def try_setting(
    score: Score,
    task: str,
    length: int,
    knobs: Mapping[str, int],
    *,
    n: int = MIN_TRIALS,
    band: tuple[float, float] = BAND,
    stop_early: bool = True,
) -> Setting:
    """``n`` full-cache trials of ``task`` at ``length`` with ``knobs`` on the calibration seeds (fewer with
    ``stop_early`` once the verdict is certain)."""
    setting = Setting(dict(knobs), n)
    for i in range(n):
        seed = calibration_seed(i)
        got = score(task, length, seed, dict(knobs))
        row = dict(got) if isinstance(got, Mapping) else {}
        value = float(row["score"]) if isinstance(got, Mapping) else float(got)
        if not 0.0 <= value <= 1.0:
            raise BadInputError(f"a score must lie in [0, 1], got {value} ({task}, seed {seed})")
        setting.seeds.append(seed)
        setting.scores.append(value)
        if row:
            setting.rows.append(row)
        if stop_early and setting.verdict(band) in ("above", "below"):
            break
    return setting


def _default_rung(task: str, ladder: Sequence[Mapping[str, int]]) -> int:
    spec = TASKS[task]
    for i, knobs in enumerate(ladder):
        if spec.resolve(knobs) == dict(spec.knobs):
            return i
    raise BadInputError(f"the ladder of '{task}' has no rung at the task's default knobs")


def _walk(
    run: Callable[[int], Setting], ladder_size: int, start: int, band: tuple[float, float], refine: bool
) -> dict[int, Setting]:
    """The rungs tried by the bisection (see the module's docstring), by index."""
    tried: dict[int, Setting] = {}
    lo, hi, rung = 0, ladder_size - 1, start
    while lo <= hi:
        tried[rung] = run(rung)
        verdict = tried[rung].verdict(band)
        if verdict == "in band":
            value = tried[rung].value
            step = 1 if value > TARGET + REFINE_OFF else -1 if value < TARGET - REFINE_OFF else 0
            nxt = rung + step
            if refine and step and lo <= nxt <= hi and nxt not in tried:
                tried[nxt] = run(nxt)
            break
        lo, hi = (rung + 1, hi) if verdict == "above" else (lo, rung - 1)
        rung = (lo + hi) // 2
    return tried


def calibrate_task(
    score: Score,
    task: str,
    length: int,
    *,
    ladder: Sequence[Mapping[str, int]] | None = None,
    n: int = MIN_TRIALS,
    band: tuple[float, float] = BAND,
    stop_early: bool = True,
    refine: bool = True,
    on_setting: Callable[[str, int, dict], None] | None = None,
) -> dict:
    """One task at one length: the settings tried, and the chosen one (``status`` ``pooled``) or, when none
    lies in the band, ``status`` ``apart`` with the setting nearest :data:`TARGET`."""
    if task not in TASKS:
        raise BadInputError(f"unknown eval task '{task}'; choose one of {', '.join(TASKS)}")
    if n < MIN_TRIALS:
        raise BadInputError(f"a setting needs at least {MIN_TRIALS} trials, got {n}")
    rungs = list(LADDERS[task] if ladder is None else ladder)
    for knobs in rungs:
        TASKS[task].resolve(knobs)  # refuse an unknown knob before anything runs

    def run(i: int) -> Setting:
        setting = try_setting(score, task, length, rungs[i], n=n, band=band, stop_early=stop_early)
        if on_setting is not None:
            on_setting(task, length, setting.to_json(band))
        return setting

    tried = _walk(run, len(rungs), _default_rung(task, rungs), band, refine)
    ranked = sorted(tried.values(), key=lambda s: abs(s.value - TARGET))  # stable: the first tried on a tie
    in_band = [s for s in ranked if s.verdict(band) == "in band"]
    best = (in_band or ranked)[0]
    return {
        "task": task,
        "length": int(length),
        "status": "pooled" if in_band else "apart",
        "knobs": dict(best.knobs),
        **{k: v for k, v in best.to_json(band).items() if k in ("n", "accuracy")},
        "tried": [tried[i].to_json(band) for i in sorted(tried)],
    }


def calibrate(
    score: Score,
    tasks: Sequence[str],
    lengths: Sequence[int],
    *,
    n: int = MIN_TRIALS,
    band: tuple[float, float] = BAND,
    stop_early: bool = True,
    refine: bool = True,
    on_setting: Callable[[str, int, dict], None] | None = None,
    about: Mapping | None = None,
) -> dict:
    """Every task at every length (:func:`calibrate_task`), as the JSON a :class:`Calibration` reads;
    ``about`` (the model, dtype, haystack ...) is kept beside the results."""
    return {
        "kind": "kvlab eval calibration",
        "band": list(band),
        "target": TARGET,
        "n": n,
        "stop_early": stop_early,
        "seeds": {"first": calibration_seed(0), "last": calibration_seed(n - 1)},
        **dict(about or {}),
        "tasks": [
            calibrate_task(
                score,
                task,
                length,
                n=n,
                band=band,
                stop_early=stop_early,
                refine=refine,
                on_setting=on_setting,
            )
            for length in lengths
            for task in tasks
        ],
    }


@dataclass(frozen=True)
class Calibration:
    """A calibration read back: each (task, length)'s knobs and whether it is pooled or apart."""

    entries: Mapping[tuple[str, int], dict]
    doc: Mapping

    @classmethod
    def read(cls, path: str | Path) -> Calibration:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise BadInputError(f"calibration {path}: cannot read it ({exc})") from None
        return cls.from_json(doc)

    @classmethod
    def from_json(cls, doc: Mapping) -> Calibration:
        if doc.get("kind") != "kvlab eval calibration":
            raise BadInputError("not a kvlab eval calibration (no 'kind': 'kvlab eval calibration')")
        entries = {(e["task"], int(e["length"])): dict(e) for e in doc["tasks"]}
        for (task, _), e in entries.items():
            if task not in TASKS or e["status"] not in ("pooled", "apart"):
                raise BadInputError(f"calibration: unknown task '{task}' or status '{e['status']}'")
            TASKS[task].resolve(e["knobs"])
        return cls(entries, doc)

    def knobs(self, task: str, length: int) -> dict[str, int]:
        """The calibrated knobs of ``task`` at ``length``; refused when the calibration lacks them."""
        if (task, int(length)) not in self.entries:
            raise BadInputError(f"the calibration has no entry for {task} at {length} tokens")
        return dict(self.entries[(task, int(length))]["knobs"])

    def apart(self) -> set[tuple[str, int]]:
        """The (task, length) pairs that reached no setting in the band: reported apart, never pooled."""
        return {key for key, e in self.entries.items() if e["status"] == "apart"}

    def check_model(self, model: str) -> None:
        """Refuse a run on another model than the one calibrated (a task's difficulty is the model's own).
        A calibration written before it named its model (``model_spec``) is of the bundled model."""
        from kvlab.model.loading import BUNDLED_NAME, model_name

        calibrated = str(self.doc.get("model_spec") or BUNDLED_NAME)
        if model_name(calibrated) != model_name(model):
            raise BadInputError(f"it calibrates {calibrated}, the run is of {model}: calibrate {model} first")

    def check_seeds(self, evaluation_seeds: Iterable[int]) -> None:
        """Refuse evaluation seeds that are among this calibration's."""
        check_disjoint(evaluation_seeds)
        used = {s for e in self.entries.values() for t in e.get("tried", []) for s in t.get("seeds", [])}
        clash = used & {int(s) for s in evaluation_seeds}
        if clash:
            raise BadInputError(f"evaluation seeds {sorted(clash)[:3]} were calibration trials")
