"""Paths derived from names stay where they belong.

Any folder kvlab builds from a user-given name (a derivative model, a run folder) goes through
:func:`safe_name` and :func:`contained`, so a name like ``/abs/path`` or ``../..`` can never make kvlab
write, replace or delete anything outside its own folders.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvlab.errors import BadInputError

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def cache_dir() -> Path:
    """Where kvlab keeps converted models, fingerprints and built kernels: ``$KVLAB_CACHE_DIR`` or
    ``~/.cache/kvlab`` (``$XDG_CACHE_HOME/kvlab`` when that is set)."""
    root = os.environ.get("KVLAB_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvlab"
    )
    return Path(root)


def safe_name(name: str, *, what: str = "name") -> str:
    """``name`` if it is one plain path component (letters, digits, ``._-``; no separators, no ``..``)."""
    if not isinstance(name, str) or not _SAFE.match(name) or name in (".", "..") or ".." in name:
        raise BadInputError(
            f"{what} {name!r} must be a plain name (letters, digits, '.', '_', '-'; "
            "no '/', no '..', at most 128 characters)"
        )
    return name


def contained(root: Path, path: Path) -> Path:
    """``path`` resolved, if it lies strictly inside ``root`` (resolved); else a BadInputError."""
    root_r, path_r = Path(root).resolve(), Path(path).resolve()
    if path_r == root_r or root_r not in path_r.parents:
        raise BadInputError(f"{path} is outside {root}; kvlab only writes there")
    return path_r


def shared_data_dir() -> Path | None:
    """``$KVLAB_SHARED_DATA`` or ``../shared/data`` beside the checkout, if present (tests, benchmarks).

    ``KVLAB_SHARED_DATA=none`` turns the lookup off: the test suite sets it so a checkout with
    ``../shared`` beside it runs exactly what a fresh clone runs."""
    env = os.environ.get("KVLAB_SHARED_DATA")
    if env is not None and env.strip().lower() == "none":
        return None
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve()
    candidates += [p / "shared" / "data" for p in here.parents[1:5]]
    candidates.append(Path.cwd().parent / "shared" / "data")
    for c in candidates:
        if c.is_dir():
            return c
    return None
