"""kvlab's exceptions.

Every error a user can cause (bad input, missing model, corrupt file) raises a subclass of
:class:`KvlabError` with a one-line message that says what went wrong and what to do. The CLI
prints that line and exits with code 2; it never shows a traceback for these.
"""

from __future__ import annotations


class KvlabError(Exception):
    """Base class of every error kvlab raises on purpose."""

    exit_code = 2


class ModelNotFoundError(KvlabError):
    """A model spec names nothing that can be loaded offline."""


class BadInputError(KvlabError, ValueError):
    """An argument is out of range or malformed (empty text, roll larger than the context, ...)."""


class SnapshotFileError(KvlabError):
    """A snapshot file is missing, truncated, corrupt, or was written by an incompatible kvlab."""


class IncompatibleCacheError(KvlabError):
    """Two caches (or a cache and a model) do not belong together: other model, dtype, RoPE or geometry."""


class UnsupportedModelError(KvlabError):
    """The model's architecture or cache layout is outside what an operation can do exactly."""


def require(condition: bool, message: str, error: type[KvlabError] = BadInputError) -> None:
    """Raise ``error(message)`` unless ``condition`` holds (a check that survives ``python -O``)."""
    if not condition:
        raise error(message)
