"""KV cache quantizers with real bit-packed storage (see docs/compression.md)."""

from kvlab.policy.quant.methods import (
    KIVIQuantizer,
    PerTokenQuantizer,
    PreRopeQuantizer,
    Quantizer,
    RotatedQuantizer,
    Segment,
    make_quantizer,
    split_plan,
)
from kvlab.policy.quant.pack import pack_bits, packed_nbytes, unpack_bits
from kvlab.policy.quant.scalar import SUPPORTED_BITS, QuantizedTensor, quantize
from kvlab.policy.quant.snapshot import LayerCode, QuantizedSnapshot, encode_layer, quantize_snapshot

__all__ = [
    "SUPPORTED_BITS",
    "KIVIQuantizer",
    "LayerCode",
    "PerTokenQuantizer",
    "PreRopeQuantizer",
    "QuantizedSnapshot",
    "QuantizedTensor",
    "Quantizer",
    "RotatedQuantizer",
    "Segment",
    "encode_layer",
    "make_quantizer",
    "pack_bits",
    "packed_nbytes",
    "quantize",
    "quantize_snapshot",
    "split_plan",
    "unpack_bits",
]
