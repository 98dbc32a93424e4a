"""The sweep grid: a TOML file of models, texts, experiments (with options) and seeds, and where the
cells run (``device``, ``dtype``, and on Ray ``gpus_per_actor``).

Everything is validated before anything is created; each problem is one BadInputError.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvlab.errors import BadInputError

PROFILES = ("quick", "default", "full")
GRID_KEYS = ("models", "texts", "experiments", "seeds", "profile", "device", "dtype", "gpus_per_actor")
TEXT_OPTIONS = ("text_file", "text")  # how experiments name their text-file option


@dataclass(frozen=True)
class Cell:
    """One experiment on one model (and text) with one seed, on one device in one dtype; ``key`` decides
    whether it must run. ``device`` is what the cell's process loads the model on (``cpu``, ``cuda:N``,
    or on Ray ``cuda``: the GPU Ray gave the actor)."""

    model: str
    experiment: str
    options: dict[str, Any]
    seed: int
    text: str | None
    profile: str
    key: str = ""
    device: str = "cpu"
    dtype: str = "float32"

    def placed(self, key: str, device: str, dtype: str) -> Cell:
        """This cell keyed, on ``device`` in ``dtype``."""
        return replace(self, key=key, device=device, dtype=dtype)

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
            "device": self.device,
            "dtype": self.dtype,
        }

    @classmethod
    def from_json(cls, d: dict) -> Cell:
        return cls(
            d["model"],
            d["experiment"],
            dict(d["options"]),
            int(d["seed"]),
            d["text"],
            d["profile"],
            d["key"],
            d.get("device", "cpu"),
            d.get("dtype", "float32"),
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
    #: where cells run: auto (CUDA when there is one), cpu, cuda or cuda:N; and the model's dtype
    device: str = "auto"
    dtype: str = "float32"
    #: GPUs each Ray actor asks for (None: 1 when the cells run on CUDA, else 0); fractions share a GPU
    gpus_per_actor: float | None = None


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
    unknown = set(doc) - set(GRID_KEYS)
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
    device, dtype, gpus = _placement(path, doc)
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
    return Grid(
        tuple(models),
        tuple(text_paths),
        tuple(parsed),
        tuple(seeds),
        profile,
        path,
        tuple(cells),
        device=device,
        dtype=dtype,
        gpus_per_actor=gpus,
    )


def _placement(path: Path, doc: dict) -> tuple[str, str, float | None]:
    """The grid's ``device``, ``dtype`` and ``gpus_per_actor``, checked for form (whether this machine
    or cluster has the device is checked where the sweep runs)."""
    from kvlab.model.loading import check_device_name, parse_dtype

    device = doc.get("device", "auto")
    if not isinstance(device, str):
        raise BadInputError(f'{path}: \'device\' must be a string such as "cuda" or "cpu"')
    try:
        device = check_device_name(device)
    except BadInputError as exc:
        raise BadInputError(f"{path}: {exc}") from None
    dtype = doc.get("dtype", "float32")
    if not isinstance(dtype, str):
        raise BadInputError(f"{path}: 'dtype' must be a string such as \"bfloat16\"")
    try:
        dtype = str(parse_dtype(dtype)).removeprefix("torch.")
    except BadInputError as exc:
        raise BadInputError(f"{path}: {exc}") from None
    gpus = doc.get("gpus_per_actor")
    if gpus is not None and (
        isinstance(gpus, bool) or not isinstance(gpus, int | float) or not 0 <= gpus <= 64
    ):
        raise BadInputError(f"{path}: 'gpus_per_actor' must be a number of GPUs from 0 to 64 (e.g. 1 or 0.5)")
    return device, dtype, None if gpus is None else float(gpus)


def file_sha256(path: str | None) -> str | None:
    if path is None:
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cell_key(cell: Cell, fingerprint: str, device: str = "cpu", dtype: str = "float32") -> str:
    """sha256 of what decides a cell's result: model fingerprint, text content, experiment, options,
    seed, profile, the kind of device (cpu or cuda: which GPU of a kind does not change a result) and
    dtype, and kvlab version. A changed input changes the key, so --resume re-runs it (and never takes a
    CPU result for a GPU one)."""
    from kvlab import __version__

    payload = {
        "fingerprint": fingerprint,
        "device": device.split(":")[0],
        "dtype": dtype,
        "text_sha256": file_sha256(cell.text),
        "experiment": cell.experiment,
        "options": {k: v for k, v in sorted(cell.options.items()) if k not in TEXT_OPTIONS},
        "seed": cell.seed,
        "profile": cell.profile,
        "kvlab": __version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
