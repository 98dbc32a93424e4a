"""An eval run that keeps its trials as they finish, and finishes an interrupted one (``--resume DIR``).

With ``--out DIR``, ``kvlab eval ruler`` appends each finished trial's rows (every cache policy's) to
``DIR/ruler.partial.jsonl`` and flushes it to disk: the first line holds the run's settings, each later
line one trial (``task``, ``length``, ``trial``, ``seconds``, ``rows``). When the run ends, ``ruler.json``
is written and the partial file removed, so a partial file means an unfinished run. ``--resume DIR``
reads it, skips the trials it holds and runs the rest: the final ``ruler.json`` equals an uninterrupted
run's except for the timings (rows' ``seconds`` and ``prefill_s``, summaries' ``seconds``,
``wall_seconds``: the sum of the kept trials' and this part's). A run with other settings (model,
dtype, device, caches, ratios, tasks, lengths, trials, seed, haystack and its text, answer tokens,
positions) is
refused in one line, as is a fresh run into a folder holding an unfinished one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlab.errors import BadInputError
from kvlab.eval.positions import DEFAULT
from kvlab.progress import Estimate, Mode, counting

if TYPE_CHECKING:
    from kvlab.eval.specs import CacheSpec
    from kvlab.model.handle import ModelHandle

PARTIAL = "ruler.partial.jsonl"
RESULT = "ruler.json"

#: one trial of a run: (task, length in tokens, trial index)
TrialKey = tuple[str, int, int]


def haystack_digest(haystack_text: str | None) -> str:
    """sha256 of the text the facts hide in (kvlab's default long text when None): a resumed run must use
    the same text, and the default differs between machines (Frankenstein where ../shared is present)."""
    if haystack_text is None:
        from kvlab.data import default_long_text

        haystack_text = default_long_text().text
    return hashlib.sha256(haystack_text.encode("utf-8")).hexdigest()


def trial_name(key: TrialKey) -> str:
    return f"{key[0]} {key[1]} #{key[2]}"


class PartialRun:
    """``DIR/ruler.partial.jsonl``: the settings and every finished trial of a run, appended and flushed."""

    def __init__(self, folder: Path, header: dict, kept: dict[TrialKey, tuple[list[dict], float]]):
        self.folder, self.header, self.kept = Path(folder), header, kept
        self.path = self.folder / PARTIAL

    @classmethod
    def fresh(cls, folder: Path, header: dict) -> PartialRun:
        """A new run into ``folder`` (nothing written yet); refused when it holds an unfinished run."""
        if (Path(folder) / PARTIAL).exists():
            raise BadInputError(
                f"--out {folder} holds an unfinished run ({PARTIAL}); finish it with --resume {folder}, "
                f"or remove that file or choose another --out"
            )
        return cls(folder, header, {})

    @classmethod
    def resume(cls, folder: Path, header: dict) -> PartialRun:
        """The unfinished run in ``folder``, checked against this command's ``header`` (all but the device,
        known once the model loads: :meth:`check_device`)."""
        path = Path(folder) / PARTIAL
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            done = (Path(folder) / RESULT).is_file()
            why = f"its run finished ({RESULT})" if done else f"no unfinished run there (no {PARTIAL})"
            raise BadInputError(f"--resume {folder}: {why}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInputError(f"--resume {folder}: cannot read {PARTIAL} ({exc})") from None
        docs = []
        for line in lines:
            try:
                docs.append(json.loads(line))
            except ValueError:
                break  # a line cut short by the interruption: that trial runs again
        if not docs or not isinstance(docs[0], dict) or "settings" not in docs[0]:
            raise BadInputError(f"--resume {folder}: {PARTIAL} does not start with a run's settings")
        stored = docs[0]
        _compare(folder, stored, header, skip=("device",))
        kept = {
            (d["task"], int(d["length"]), int(d["trial"])): (d["rows"], float(d["seconds"])) for d in docs[1:]
        }
        run = cls(folder, stored, kept)
        if len(docs) < len(lines):  # drop the cut line before appending after it
            run._rewrite(docs)
        return run

    def check_device(self, device: str) -> None:
        """Refuse a resumed run on another device than its first part's (one line, nothing written)."""
        was = {"settings": {"device": (self.header.get("settings") or {}).get("device")}}
        _compare(self.folder, was, {"settings": {"device": device}}, skip=())

    def _rewrite(self, docs: list[dict]) -> None:
        tmp = self.path.with_name(f".{PARTIAL}.tmp")
        tmp.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
        tmp.replace(self.path)

    def begin(self) -> None:
        """Write the settings line of a fresh run (its folder created), or nothing for a resumed one."""
        if self.kept or self.path.exists():
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        self._append(self.header)

    def add(self, key: TrialKey, rows: list[dict], seconds: float) -> None:
        """Keep one finished trial (flushed to disk before the next starts)."""
        self._append({"task": key[0], "length": key[1], "trial": key[2], "seconds": seconds, "rows": rows})
        self.kept[key] = (rows, seconds)

    def _append(self, doc: dict) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(doc) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def finish(self, doc: dict) -> Path:
        """Write ``ruler.json`` (atomically) and remove the partial file: the run is complete."""
        path = self.folder / RESULT
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(path)
        self.path.unlink(missing_ok=True)
        return path


def _compare(folder: Path, stored: dict, header: dict, *, skip: Sequence[str]) -> None:
    """One line naming the first setting of ``header`` that ``stored`` (the first part's) ran otherwise."""
    was, now = stored.get("settings") or {}, header.get("settings") or {}
    for key in {**now, **was}:  # a setting only one of them names (positions) differs too
        value = now.get(key)
        if key not in skip and was.get(key) != value:
            raise BadInputError(
                f"--resume {folder}: that run had {key} {was.get(key)!r}, this command asks for {value!r}; "
                "resume it with the same options or start a new run in another --out"
            )
    if header.get("haystack_sha256") and stored.get("haystack_sha256") != header["haystack_sha256"]:
        raise BadInputError(f"--resume {folder}: the haystack's text differs from the first part's")


def run_kept(
    handle: ModelHandle,
    specs: Sequence[CacheSpec],
    settings: dict,
    *,
    partial: PartialRun | None,
    haystack_text: str | None,
    mode: Mode,
) -> tuple[list[dict], float]:
    """Every trial of ``settings`` (tasks x lengths x trials) under ``specs``, skipping those ``partial``
    holds and keeping each new one there as it finishes; progress as ``mode`` says (trials done of all,
    an estimate of the time left weighting each trial by its length). Returns the rows in run order and
    the wall seconds (the kept trials' and this part's)."""
    from kvlab.eval.run import capture_for, run_suite

    capture = capture_for(handle, specs, settings.get("capture", "off"))  # refused before anything is written
    tasks, lengths, trials = settings["tasks"], settings["lengths"], settings["trials"]
    keys = [(t, n, i) for t in tasks for n in lengths for i in range(trials)]
    kept = dict(partial.kept) if partial is not None else {}
    if partial is not None:
        partial.begin()
    estimate = Estimate({trial_name(k): float(k[1]) for k in keys})  # tokens: the relative cost
    detail = (
        f"trials ({len(tasks)} tasks x {len(lengths)} lengths x {trials}), each under {len(specs)} caches"
    )
    with counting(
        "ruler",
        [trial_name(k) for k in keys],
        mode=mode,
        estimate=estimate,
        finished={trial_name(k): s for k, (_, s) in kept.items()},
        lines=False,
        detail=detail,
    ) as counter:

        def on_trial(key: TrialKey, rows: list[dict], seconds: float) -> None:
            if partial is not None:
                partial.add(key, rows, seconds)
            counter.done(trial_name(key), seconds)

        t0 = time.perf_counter()
        rows = run_suite(
            handle,
            specs,
            tasks=tasks,
            lengths=lengths,
            trials=trials,
            seed=settings["seed"],
            haystack_text=haystack_text,
            max_new_tokens=settings["max_new_tokens"],
            done={k: r for k, (r, _) in kept.items()},
            on_trial=on_trial,
            positions=[settings.get("positions", DEFAULT)],
            capture=capture,
            knobs={
                (k.rsplit("@", 1)[0], int(k.rsplit("@", 1)[1])): v
                for k, v in settings.get("knobs", {}).items()
            },
        )
    return rows, sum(s for _, s in kept.values()) + time.perf_counter() - t0


def run_ruler(
    settings: dict,
    specs: Sequence[Any],
    *,
    out: Path | None,
    resume: bool,
    haystack_text: str | None,
    mode: Mode,
) -> dict:
    """``kvlab eval ruler`` from its ``settings`` (the ``settings`` of ruler.json, ``device`` as asked):
    refuses an unfinished run in ``out`` (or, ``resume``, one with other settings) before the model loads,
    runs the trials (:func:`run_kept`), and with ``out`` writes ruler.json; returns its document. An
    interrupt says on stderr how many trials were kept and how to finish the run, and propagates."""
    import sys

    from kvlab import load_model
    from kvlab.eval.run import summarize

    partial = None
    if out is not None:
        header = {"settings": settings, "haystack_sha256": haystack_digest(haystack_text)}
        partial = PartialRun.resume(out, header) if resume else PartialRun.fresh(out, header)
    handle = load_model(settings["model"], device=settings["device"], dtype=settings["dtype"])
    settings["device"] = str(handle.device)
    if resume and partial is not None:
        partial.check_device(settings["device"])
    try:
        rows, wall = run_kept(
            handle, specs, settings, partial=partial, haystack_text=haystack_text, mode=mode
        )
    except KeyboardInterrupt:
        if partial is not None:
            print(
                f"kvlab: {len(partial.kept)} finished trials kept in {partial.path}; "
                f"finish the run with the same command and --resume {out}",
                file=sys.stderr,
            )
        raise
    doc = {
        "settings": settings,
        "wall_seconds": wall,
        "summary": summarize(rows, seed=settings["seed"]),
        "rows": rows,
    }
    if partial is not None:
        partial.finish(doc)
    return doc
