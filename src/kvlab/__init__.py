"""kvlab: see, measure and exploit what a language model's KV cache holds.

The core objects: :func:`load_model` gives a :class:`ModelHandle`; its ``prefill`` returns a
:class:`KVSnapshot` (an immutable picture of the cache); :mod:`kvlab.rope` rotates cached keys
exactly; :func:`save_snapshot` / :func:`load_snapshot` store snapshots safely.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab._lazy import lazy_exports

# Public names -> the module that defines them. Imported on first use (PEP 562), so ``kvlab --help``
# and ``import kvlab.errors`` do not pay for torch and transformers.
_EXPORTS = {
    "BadInputError": "kvlab.errors",
    "IncompatibleCacheError": "kvlab.errors",
    "KvlabError": "kvlab.errors",
    "ModelNotFoundError": "kvlab.errors",
    "SnapshotFileError": "kvlab.errors",
    "UnsupportedModelError": "kvlab.errors",
    "KVSnapshot": "kvlab.cache",
    "concat": "kvlab.cache",
    "load_snapshot": "kvlab.cache",
    "save_snapshot": "kvlab.cache",
    "ModelHandle": "kvlab.model",
    "load_model": "kvlab.model",
    "as_handle": "kvlab.model",
    "RopeSpec": "kvlab.rope",
    "apply_rope": "kvlab.rope",
    "remove_rope": "kvlab.rope",
    "shift_keys": "kvlab.rope",
    "data": "kvlab.data",
}

if TYPE_CHECKING:
    from kvlab import data
    from kvlab.cache import KVSnapshot, concat, load_snapshot, save_snapshot
    from kvlab.errors import (
        BadInputError,
        IncompatibleCacheError,
        KvlabError,
        ModelNotFoundError,
        SnapshotFileError,
        UnsupportedModelError,
    )
    from kvlab.model import ModelHandle, load_model
    from kvlab.rope import RopeSpec, apply_rope, remove_rope, shift_keys


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__version__ = "0.1.0"

__all__ = [
    "BadInputError",
    "IncompatibleCacheError",
    "KVSnapshot",
    "KvlabError",
    "ModelHandle",
    "ModelNotFoundError",
    "RopeSpec",
    "SnapshotFileError",
    "UnsupportedModelError",
    "apply_rope",
    "as_handle",
    "concat",
    "data",
    "load_model",
    "load_snapshot",
    "remove_rope",
    "save_snapshot",
    "shift_keys",
]
