"""What a cache spec may name — the eviction scores and the codecs — known without importing them.

The classes live in torch code (:data:`kvlab.policy.evict.POLICIES`,
:data:`kvlab.policy.quant.methods.QUANTIZERS`); reading a ``--cache`` spec needs only their names and
a few facts, so a mistyped spec is refused in a fraction of a second, before torch is imported. A new
score or codec is declared here too (a spec cannot name it otherwise); ``tests/test_cheap_paths.py``
checks that these tables equal the registries, facts included.
"""

from __future__ import annotations

from dataclasses import dataclass

#: bit widths the scalar codes support (:func:`kvlab.policy.quant.scalar.check_bits`)
SUPPORTED_BITS = (2, 3, 4, 8)

#: every eviction score by the name a spec uses, in registration order (built-ins, then ``methods/``)
SCORES = (
    "window",
    "streaming_llm",
    "h2o",
    "snapkv",
    "tova",
    "knorm",
    "random",
    "learned",
    "kvzip",
    "random_sinks",
)
#: scores that read an extra pass after the context (``Policy.probe_ids``: KVzip's reconstruction), which
#: runs offline only (``evict`` on an Observation, ``kvlab eval``): no live cache can run them yet
OFFLINE_SCORES = ("kvzip",)


@dataclass(frozen=True)
class CodecFacts:
    """What reading a spec needs of a codec: equal to what its class says (a test checks)."""

    #: a width that is part of the codec's name (``fp8``); None: the spec gives the bits (``kivi4``)
    fixed_bits: int | None = None
    #: newest slots kept in full precision when the spec says no ``tail=`` (the class's ``window``)
    tail: int = 0
    #: keys are coded in groups along tokens (``token_multiple() > 1``)
    along_tokens: bool = False
    #: codes read the slots' RoPE positions
    uses_positions: bool = False
    #: slots a rolling window encodes together (``rolling_block()``)
    block: int = 32


#: every codec by its ``kind``, in registration order (built-ins, then ``codecs/``)
CODECS = {
    "pertoken": CodecFacts(),
    "kivi": CodecFacts(tail=32, along_tokens=True),
    "prerope": CodecFacts(along_tokens=True, uses_positions=True),
    "rotation": CodecFacts(uses_positions=True),
    "fp8": CodecFacts(fixed_bits=8),
    "int4rows": CodecFacts(fixed_bits=4),
}
#: codec names that are another codec with an option (``rotation+qjl``: rotation with a sign sketch)
VARIANTS = {"rotation+qjl": "rotation"}


def codec_facts(name: str) -> CodecFacts:
    """The facts of a codec or of a variant of one (``rotation+qjl``)."""
    return CODECS[VARIANTS.get(name, name)]
