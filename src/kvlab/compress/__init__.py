"""Cache compression: quantizers with real bit-packed storage and eviction policies.

``kvlab.compress.quant`` turns a snapshot's K/V into packed codes (``quantize_snapshot``);
``kvlab.compress.evict`` keeps a budget of tokens chosen by a policy (``observe`` + ``evict``);
``kvlab.hf.compressed_cache.CompressedCache`` runs either inside ``model.generate``.

The names below are imported on first use (PEP 562), so reading a cache spec
(:mod:`kvlab.compress.spec`) does not import torch. ``kvlab.compress.evict`` is the eviction package
(its function is ``kvlab.compress.evict.evict``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab._lazy import lazy_exports

_EXPORTS = {
    "POLICIES": "kvlab.compress.evict",
    "LearnedPolicy": "kvlab.compress.evict",
    "Observation": "kvlab.compress.evict",
    "make_policy": "kvlab.compress.evict",
    "observe": "kvlab.compress.evict",
    "SUPPORTED_BITS": "kvlab.compress.catalogue",
    "KIVIQuantizer": "kvlab.compress.quant",
    "PerTokenQuantizer": "kvlab.compress.quant",
    "PreRopeQuantizer": "kvlab.compress.quant",
    "QuantizedSnapshot": "kvlab.compress.quant",
    "Quantizer": "kvlab.compress.quant",
    "RotatedQuantizer": "kvlab.compress.quant",
    "make_quantizer": "kvlab.compress.quant",
    "quantize_snapshot": "kvlab.compress.quant",
}

if TYPE_CHECKING:
    from kvlab.compress.catalogue import SUPPORTED_BITS
    from kvlab.compress.evict import POLICIES, LearnedPolicy, Observation, make_policy, observe
    from kvlab.compress.quant import (
        KIVIQuantizer,
        PerTokenQuantizer,
        PreRopeQuantizer,
        QuantizedSnapshot,
        Quantizer,
        RotatedQuantizer,
        make_quantizer,
        quantize_snapshot,
    )


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


__all__ = [
    "POLICIES",
    "SUPPORTED_BITS",
    "KIVIQuantizer",
    "LearnedPolicy",
    "Observation",
    "PerTokenQuantizer",
    "PreRopeQuantizer",
    "QuantizedSnapshot",
    "Quantizer",
    "RotatedQuantizer",
    "make_policy",
    "make_quantizer",
    "observe",
    "quantize_snapshot",
]
