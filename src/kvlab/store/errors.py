"""Errors of the KV store (all :class:`~kvlab.errors.KvlabError`, so the CLI prints one line)."""

from __future__ import annotations

from kvlab.errors import BadInputError, KvlabError


class StoreError(KvlabError):
    """The store cannot do what was asked (wrong path, unwritable tier, ...)."""


class StoreUnavailableError(StoreError):
    """A tier cannot be reached (Redis down, wrong host or port)."""


class StoreWriteError(StoreError):
    """A block could not be written (disk full, permission denied); blocks already stored are untouched."""


class BlockNotFoundError(StoreError, BadInputError):
    """No block with that hash is stored in any tier."""


class CorruptBlockError(StoreError):
    """A stored block failed its checksum or does not match the key it was read under."""


class UnsupportedBlockError(CorruptBlockError):
    """A stored block uses a format version or checksum this kvlab does not know: it is treated as a miss."""
