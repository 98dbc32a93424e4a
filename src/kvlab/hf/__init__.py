"""Adapter to transformers' cache API. Nothing outside ``kvlab.hf`` touches ``DynamicCache`` or its layers."""

from kvlab.hf.cache import (
    cache_argument,
    check_fits_sliding_windows,
    hf_cache_layers,
    hf_cache_length,
    new_hf_cache,
    sliding_windows,
    snapshot_from_hf,
    to_hf_cache,
)

__all__ = [
    "cache_argument",
    "check_fits_sliding_windows",
    "hf_cache_layers",
    "hf_cache_length",
    "new_hf_cache",
    "sliding_windows",
    "snapshot_from_hf",
    "to_hf_cache",
]
