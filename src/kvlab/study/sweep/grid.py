"""The sweep grid: a TOML file of models, texts, experiments (with options) and seeds, and where the
cells run (``device``, ``dtype``, and on Ray ``gpus_per_actor``).

Everything is validated before anything is created; each problem is one BadInputError.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvlab.errors import BadInputError, KvlabError
from kvlab.study.experiments.base import PROFILES, Experiment, Profile

GRID_KEYS = ("models", "texts", "experiments", "seeds", "profile", "device", "dtype", "gpus_per_actor")
TEXT_OPTIONS = ("text_file", "text")  # how experiments name their text-file option
#: A grid file is a few lines; one over 1 MiB is not a grid.
MAX_GRID_BYTES = 2**20
#: Seeds are 0 .. 2**32 - 1, what numpy's, torch's and Python's generators all take (as ``--seed``).
MAX_SEED = 2**32 - 1
#: The largest integer an experiment option takes (as the command line's counts).
MAX_COUNT = 1_000_000
#: The most cells one grid expands into.
MAX_CELLS = 10_000
#: Integer options for which 0 means something (no sinks, no kept or generated tokens, no timing);
#: every other integer option counts something and is at least 1.
ZERO_ALLOWED = frozenset({"sinks", "kept_generated", "generate_tokens", "timing_steps"})


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
    profile: Profile
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
    profile: Profile
    source: Path
    cells: tuple[Cell, ...] = field(default=())
    #: where cells run: auto (CUDA when there is one), cpu, cuda or cuda:N; and the model's dtype
    device: str = "auto"
    dtype: str = "float32"
    #: GPUs each Ray actor asks for (None: 1 when the cells run on CUDA, else 0); fractions share a GPU
    gpus_per_actor: float | None = None


def _text_option(experiment: Experiment) -> str | None:
    params = inspect.signature(experiment.run).parameters
    return next((name for name in TEXT_OPTIONS if name in params), None)


def load_grid(path: str | Path) -> Grid:
    """Parse and validate ``path``; cells are listed without keys (keys need the models' fingerprints)."""
    path = Path(path)
    doc = _read_grid(path)
    models = _models(path, doc)
    text_paths = _texts(path, doc)
    seeds = doc.get("seeds", [0])
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(type(s) is int and 0 <= s <= MAX_SEED for s in seeds)
    ):
        raise BadInputError(f"{path}: 'seeds' must be a non-empty list of integers from 0 to 2**32 - 1")
    profile = doc.get("profile", "quick")
    if profile not in PROFILES:
        raise BadInputError(f"{path}: 'profile' must be one of {', '.join(PROFILES)}")
    device, dtype, gpus = _placement(path, doc)
    parsed, text_option = _experiments(path, doc)
    _check_tiny_models(path, models)
    per_model = len(parsed) * max(1, len(text_paths)) * len(seeds)
    if len(models) * per_model > MAX_CELLS:
        raise BadInputError(
            f"{path}: the grid expands into {len(models) * per_model:,} cells, more than {MAX_CELLS:,}; "
            "split it into smaller sweeps"
        )
    cells = []
    for model in models:
        for name, options in parsed:
            opt = text_option[name]
            for text in text_paths if (text_paths and opt) else [None]:
                for seed in seeds:
                    full = dict(options)
                    if text is not None and opt is not None:
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


def _read_grid(path: Path) -> dict[str, Any]:
    """The grid file's TOML, with no keys but :data:`GRID_KEYS`."""
    from kvlab.data import read_user_text

    if not path.exists():
        raise BadInputError(f"no grid file at {path}")
    source = read_user_text(path, limit=MAX_GRID_BYTES, what="grid file (TOML)")
    try:
        doc = tomllib.loads(source)
    except tomllib.TOMLDecodeError as exc:
        raise BadInputError(f"{path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise BadInputError(f"{path} is not a grid: its TOML is nested too deeply") from None
    unknown = set(doc) - set(GRID_KEYS)
    if unknown:
        raise BadInputError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}")
    return doc


def _models(path: Path, doc: dict[str, Any]) -> list[str]:
    models = doc.get("models")
    if (
        not isinstance(models, list)
        or not models
        or not all(isinstance(m, str) and m.strip() for m in models)
    ):
        raise BadInputError(f"{path}: 'models' must be a non-empty list of model specs")
    return models


def _texts(path: Path, doc: dict[str, Any]) -> list[str]:
    """The grid's text files, resolved against its folder; each must be a readable text file."""
    from kvlab.data import read_user_text

    texts = doc.get("texts", [])
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise BadInputError(f"{path}: 'texts' must be a list of text files")
    text_paths = []
    for t in texts:
        p = (path.parent / t) if not Path(t).is_absolute() else Path(t)
        if not p.exists():
            raise BadInputError(f"{path}: text file {t} does not exist")
        try:
            read_user_text(p)  # a regular UTF-8 file under the text-size limit
        except BadInputError as exc:
            raise BadInputError(f"{path}: texts: {exc}") from None
        text_paths.append(str(p.resolve()))
    return text_paths


def _experiments(
    path: Path, doc: dict[str, Any]
) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, str | None]]:
    """``(name, options)`` of every ``[[experiments]]`` table, each option checked against the
    experiment's signature; and the name of each experiment's text-file option (None: it takes none)."""
    from kvlab.study.experiments import registry

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
        _check_options(f"{path}: experiment {e['name']}", known[e["name"]].run, options)
        parsed.append((e["name"], dict(options)))
    return parsed, {name: _text_option(known[name]) for name, _ in parsed}


def _check_tiny_models(path: Path, models: list[str]) -> None:
    """Each ``tiny:<config.json>`` model names a config file that loads."""
    for m in models:
        if m.startswith("tiny:"):
            config = m.removeprefix("tiny:")
            if not Path(config).exists():
                raise BadInputError(f"{path}: tiny model config {config} does not exist")
            from kvlab.model.facts import load_config_file

            try:
                load_config_file(config)
            except KvlabError as exc:
                raise BadInputError(f"{path}: tiny model: {exc}") from None


def _check_options(where: str, run: Any, options: dict[str, Any]) -> None:
    """Each option's value against the experiment's signature, before any cell runs or anything is
    written: its type (an integer, a number, a list of ...), integers from 1 (0 where it means something,
    :data:`ZERO_ALLOWED`) to :data:`MAX_COUNT`, numbers finite and >= 0, text and config files readable."""
    try:
        hints = typing.get_type_hints(run)
    except Exception:  # an experiment whose annotations cannot be resolved: nothing to check against
        return
    for name, value in options.items():
        hint = hints.get(name)
        if hint is not None and not _conforms(value, hint, name):
            raise BadInputError(f"{where}: option {name} = {_short(value)} must be {_describe(hint, name)}")
        if name in (*TEXT_OPTIONS, "config", "conversations") and isinstance(value, str):
            _check_file_option(where, name, value)


def _check_file_option(where: str, name: str, value: str) -> None:
    """A file an option names (a text, a model config, a conversations JSON), read as the experiment
    will read it: a regular file under the size limit, of the right kind."""
    from kvlab.data import read_user_text
    from kvlab.model.facts import load_config_file

    try:
        if name == "config":
            load_config_file(value)
        elif name == "conversations":
            doc = json.loads(read_user_text(value, what="JSON file"))
            if not isinstance(doc, list) or not all(isinstance(c, dict) for c in doc):
                raise BadInputError(f"{value} must hold a JSON list of objects")
        else:
            read_user_text(value)
    except KvlabError as exc:
        raise BadInputError(f"{where}: option {name}: {exc}") from None
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        raise BadInputError(f"{where}: option {name}: {value} is not JSON") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _arms(hint: Any) -> tuple[Any, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(a for a in typing.get_args(hint) if a is not type(None))
    return (hint,)


def _conforms(value: Any, hint: Any, name: str) -> bool:
    """Whether a TOML value fits ``hint`` (and kvlab's ranges for counts and numbers)."""
    for arm in _arms(hint):
        origin = typing.get_origin(arm)
        if arm is bool:
            ok = type(value) is bool
        elif arm is int:
            ok = type(value) is int and (0 if name in ZERO_ALLOWED else 1) <= value <= MAX_COUNT
        elif arm is float:
            ok = type(value) in (int, float) and math.isfinite(value) and value >= 0
        elif arm in (str, Path):
            ok = isinstance(value, str) and bool(value.strip())
        elif origin in (list, tuple):
            args = typing.get_args(arm)
            item = args[0] if args else Any
            ok = isinstance(value, list) and bool(value) and all(_conforms(v, item, name) for v in value)
        elif arm is dict or origin is dict:
            ok = isinstance(value, dict) and all(type(v) in (str, int, float, bool) for v in value.values())
        else:
            ok = True
        if ok:
            return True
    return False


def _describe(hint: Any, name: str) -> str:
    parts = []
    for arm in _arms(hint):
        origin = typing.get_origin(arm)
        if arm is bool:
            parts.append("true or false")
        elif arm is int:
            parts.append(f"an integer from {0 if name in ZERO_ALLOWED else 1} to {MAX_COUNT:,}")
        elif arm is float:
            parts.append("a finite number >= 0")
        elif arm in (str, Path):
            parts.append("a non-empty string")
        elif origin in (list, tuple):
            args = typing.get_args(arm)
            inner = _describe(args[0], name) if args else "values"
            parts.append(f"a non-empty list, each {inner}")
        elif arm is dict or origin is dict:
            parts.append("a table of plain values")
    return " or ".join(dict.fromkeys(parts)) or "a value of the right type"


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
