"""kvlab: see, measure and exploit what a language model's KV cache holds.

The core objects: :func:`load_model` gives a :class:`ModelHandle`; its ``prefill`` returns a
:class:`KVSnapshot` (an immutable picture of the cache); :mod:`kvlab.rope` rotates cached keys
exactly; :func:`save_snapshot` / :func:`load_snapshot` store snapshots safely.
"""

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
    "concat",
    "data",
    "load_model",
    "load_snapshot",
    "remove_rope",
    "save_snapshot",
    "shift_keys",
]
