"""Which cache policies ``kvlab serve`` runs: read and checked without torch, so ``kvlab serve --cache``
refuses one it cannot run before anything loads. Each layout says whether the server runs it
(:meth:`~kvlab.policy.layouts.Layout.serve_check`)."""

from __future__ import annotations

from kvlab.policy.spec import CachePolicy, parse


def serve_policy(spec: str) -> CachePolicy:
    """``spec`` parsed (:func:`kvlab.policy.spec.parse`) and checked by its layout to be one the server runs
    (today a sinks + window layout, or a scored one keeping its budget while decoding); anything else is one
    :class:`~kvlab.errors.BadInputError` line."""
    policy = parse(spec)
    policy.layout.serve_check(policy, spec)
    return policy
