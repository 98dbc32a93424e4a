"""Which cache policies ``kvlab serve`` runs: read and checked without torch, so ``kvlab serve --cache``
refuses one it cannot run before anything loads."""

from __future__ import annotations

from kvlab.compress.spec import CachePolicy, ScoredLayout, SinksWindowLayout, parse
from kvlab.errors import BadInputError

#: what ``kvlab serve --cache`` runs, in words (for the one-line refusal of any other layout)
SERVE_CACHES = (
    "kvlab serve runs sinks + window caches, in full precision or over a codec "
    "(sinks=N,window=N[,chunk=N][,codec=C[,tail=N]], e.g. sinks=4,window=2048,codec=kivi4), and scored "
    "eviction that keeps its budget while decoding (POLICY,budget=N|keep=F,every=N[,layers=pyramid][,codec=C], "
    "e.g. h2o,budget=1024,every=64)"
)


def serve_policy(spec: str) -> CachePolicy:
    """``spec`` parsed (:func:`kvlab.compress.spec.parse`) and checked to be one the server runs: a sinks +
    window layout, with or without a codec, or a scored layout that keeps its budget while decoding
    (``every=``; uniform over the heads: a per-head cache cannot join a batched decode step). Anything else
    is one :class:`BadInputError` line."""
    policy = parse(spec)
    lay = policy.layout
    if isinstance(lay, SinksWindowLayout):
        return policy
    if isinstance(lay, ScoredLayout):
        if not lay.every:
            raise BadInputError(
                f"--cache '{spec}': a conversation grows without end, so a scored layout must keep its budget "
                f"while decoding: add every=N (e.g. {spec},every=64)"
            )
        if lay.heads != "uniform":
            raise BadInputError(
                f"--cache '{spec}': per-head budgets (heads={lay.heads}) cannot join a batched decode step; "
                "use per-layer budgets (layers=pyramid) or uniform ones"
            )
        return policy
    raise BadInputError(f"--cache '{spec}' keeps {policy.describe()}; {SERVE_CACHES}")
