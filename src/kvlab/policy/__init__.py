"""Cache policies: which slots stay (layouts, eviction scores, sinks + window) and how they are stored (codecs).

``kvlab.policy.spec`` reads a ``--cache`` spec into a ``CachePolicy`` (a layout x a codec) without torch
(``parse``), and ``cache_for(spec, model)`` builds the live cache it names, bound to the model;
``kvlab.policy.window`` is :class:`SinksWindow` (attention sinks + a recent window), the policy every roll,
rolling cache and protected window in kvlab is built on;

``kvlab.policy.quant`` turns a snapshot's K/V into packed codes (``quantize_snapshot``);
``kvlab.policy.evict`` keeps a budget of tokens chosen by a policy (``observe`` + ``evict``);
``kvlab.hf.compressed_cache.CompressedCache`` runs either inside ``model.generate``.

The names below are imported on first use (PEP 562), so reading a cache spec
(:mod:`kvlab.policy.spec`) does not import torch. ``kvlab.policy.evict`` is the eviction package
(its function is ``kvlab.policy.evict.evict``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab._lazy import lazy_exports

_EXPORTS = {
    "cache_for": "kvlab.policy.spec",
    "parse": "kvlab.policy.spec",
    "SinksWindow": "kvlab.policy.window",
    "roll_amount": "kvlab.policy.window",
    "POLICIES": "kvlab.policy.evict",
    "LearnedPolicy": "kvlab.policy.evict",
    "Observation": "kvlab.policy.evict",
    "make_policy": "kvlab.policy.evict",
    "observe": "kvlab.policy.evict",
    "SUPPORTED_BITS": "kvlab.policy.catalogue",
    "KIVIQuantizer": "kvlab.policy.quant",
    "PerTokenQuantizer": "kvlab.policy.quant",
    "PreRopeQuantizer": "kvlab.policy.quant",
    "QuantizedSnapshot": "kvlab.policy.quant",
    "Quantizer": "kvlab.policy.quant",
    "RotatedQuantizer": "kvlab.policy.quant",
    "make_quantizer": "kvlab.policy.quant",
    "quantize_snapshot": "kvlab.policy.quant",
}

if TYPE_CHECKING:
    from kvlab.policy.catalogue import SUPPORTED_BITS
    from kvlab.policy.evict import POLICIES, LearnedPolicy, Observation, make_policy, observe
    from kvlab.policy.quant import (
        KIVIQuantizer,
        PerTokenQuantizer,
        PreRopeQuantizer,
        QuantizedSnapshot,
        Quantizer,
        RotatedQuantizer,
        make_quantizer,
        quantize_snapshot,
    )
    from kvlab.policy.spec import cache_for, parse
    from kvlab.policy.window import SinksWindow, roll_amount


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


__all__ = [
    "cache_for",
    "parse",
    "SinksWindow",
    "roll_amount",
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
