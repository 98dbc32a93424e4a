"""Cache compression: quantizers with real bit-packed storage and eviction policies.

``kvlab.compress.quant`` turns a snapshot's K/V into packed codes (``quantize_snapshot``);
``kvlab.compress.evict`` keeps a budget of tokens chosen by a policy (``observe`` + ``evict``);
``kvlab.hf.compressed_cache.CompressedCache`` runs either inside ``model.generate``.
"""

from kvlab.compress.evict import (
    POLICIES,
    LearnedPolicy,
    Observation,
    evict,
    make_policy,
    observe,
)
from kvlab.compress.quant import (
    SUPPORTED_BITS,
    KIVIQuantizer,
    PerTokenQuantizer,
    PreRopeQuantizer,
    QuantizedSnapshot,
    Quantizer,
    RotatedQuantizer,
    make_quantizer,
    quantize_snapshot,
)

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
    "evict",
    "make_policy",
    "make_quantizer",
    "observe",
    "quantize_snapshot",
]
