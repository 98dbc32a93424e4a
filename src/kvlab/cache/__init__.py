"""kvlab's own cache types: the immutable :class:`KVSnapshot` and its file format."""

from kvlab.cache.io import load_snapshot, read_metadata, save_snapshot
from kvlab.cache.snapshot import KVSnapshot, batchable_groups, concat, stack_rows

__all__ = [
    "KVSnapshot",
    "batchable_groups",
    "concat",
    "stack_rows",
    "load_snapshot",
    "read_metadata",
    "save_snapshot",
]
