"""The sweep grid: a TOML file of models, texts, experiments (with options) and seeds.

Everything is validated before anything is created; each problem is one BadInputError.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.errors import BadInputError

PROFILES = ("quick", "default", "full")
TEXT_OPTIONS = ("text_file", "text")  # how experiments name their text-file option


@dataclass(frozen=True)
class Cell:
    """One experiment on one model (and text) with one seed; ``key`` decides whether it must run."""

    model: str
    experiment: str
    options: dict[str, Any]
    seed: int
    text: str | None
    profile: str
    key: str = ""

    @property
    def folder_name(self) -> str:
        model = Path(self.model.removeprefix("tiny:")).stem or self.model
        safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in model)[:40]
        return f"{self.key[:12]}-{safe}-{self.experiment}-s{self.seed}"

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "model": self.model,
            "experiment": self.experiment,
            "options": self.options,
            "seed": self.seed,
            "text": self.text,
            "profile": self.profile,
        }

    @classmethod
    def from_json(cls, d: dict) -> Cell:
        return cls(
            d["model"], d["experiment"], dict(d["options"]), int(d["seed"]), d["text"], d["profile"], d["key"]
        )


@dataclass(frozen=True)
class Grid:
    models: tuple[str, ...]
    texts: tuple[str, ...]
    experiments: tuple[tuple[str, dict[str, Any]], ...]
    seeds: tuple[int, ...]
    profile: str
    source: Path
    cells: tuple[Cell, ...] = field(default=())


def _text_option(experiment) -> str | None:
    params = inspect.signature(experiment.run).parameters
    return next((name for name in TEXT_OPTIONS if name in params), None)


def load_grid(path: str | Path) -> Grid:
    """Parse and validate ``path``; cells are listed without keys (keys need the models' fingerprints)."""
    from kvlab.study.experiments import registry

    path = Path(path)
    if not path.is_file():
        raise BadInputError(f"no grid file at {path}")
    try:
        doc = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise BadInputError(f"{path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise BadInputError(f"{path} is not valid TOML: {exc}") from None
    unknown = set(doc) - {"models", "texts", "experiments", "seeds", "profile"}
    if unknown:
        raise BadInputError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}")
    models = doc.get("models")
    if (
        not isinstance(models, list)
        or not models
        or not all(isinstance(m, str) and m.strip() for m in models)
    ):
        raise BadInputError(f"{path}: 'models' must be a non-empty list of model specs")
    texts = doc.get("texts", [])
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise BadInputError(f"{path}: 'texts' must be a list of text files")
    text_paths = []
    for t in texts:
        p = (path.parent / t) if not Path(t).is_absolute() else Path(t)
        if not p.is_file():
            raise BadInputError(f"{path}: text file {t} does not exist")
        try:
            p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise BadInputError(f"{path}: text file {t} is not UTF-8") from None
        text_paths.append(str(p.resolve()))
    seeds = doc.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(type(s) is int and s >= 0 for s in seeds):
        raise BadInputError(f"{path}: 'seeds' must be a non-empty list of integers >= 0")
    profile = doc.get("profile", "quick")
    if profile not in PROFILES:
        raise BadInputError(f"{path}: 'profile' must be one of {', '.join(PROFILES)}")
    known = registry()
    exps = doc.get("experiments")
    if not isinstance(exps, list) or not exps:
        raise BadInputError(f"{path}: give at least one [[experiments]] table with a name")
    parsed = []
    for e in exps:
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            raise BadInputError(f'{path}: every [[experiments]] needs name = "..."')
        if e["name"] not in known:
            raise BadInputError(
                f"{path}: unknown experiment {e['name']!r}; known: {', '.join(sorted(known))}"
            )
        options = e.get("options", {})
        if not isinstance(options, dict) or set(e) - {"name", "options"}:
            raise BadInputError(
                f"{path}: experiment {e['name']}: only 'name' and an [options] table are allowed"
            )
        params = inspect.signature(known[e["name"]].run).parameters
        bad = [k for k in options if k not in params or k == "ctx"]
        if bad:
            raise BadInputError(f"{path}: experiment {e['name']} has no option(s) {', '.join(bad)}")
        parsed.append((e["name"], dict(options)))
    for m in models:
        if m.startswith("tiny:") and not Path(m.removeprefix("tiny:")).is_file():
            raise BadInputError(f"{path}: tiny model config {m.removeprefix('tiny:')} does not exist")
    cells = []
    for model in models:
        for name, options in parsed:
            opt = _text_option(known[name])
            for text in text_paths if (text_paths and opt) else [None]:
                for seed in seeds:
                    full = dict(options)
                    if text is not None:
                        full[opt] = text
                    cells.append(Cell(model, name, full, seed, text, profile))
    return Grid(tuple(models), tuple(text_paths), tuple(parsed), tuple(seeds), profile, path, tuple(cells))


def file_sha256(path: str | None) -> str | None:
    if path is None:
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cell_key(cell: Cell, fingerprint: str) -> str:
    """sha256 of what decides a cell's result: model fingerprint, text content, experiment, options,
    seed, profile and kvlab version. A changed input changes the key, so --resume re-runs it."""
    from kvlab import __version__

    payload = {
        "fingerprint": fingerprint,
        "text_sha256": file_sha256(cell.text),
        "experiment": cell.experiment,
        "options": {k: v for k, v in sorted(cell.options.items()) if k not in TEXT_OPTIONS},
        "seed": cell.seed,
        "profile": cell.profile,
        "kvlab": __version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
