"""Cache policies: what a cache keeps and where.

:class:`SinksWindow` (attention sinks + a recent window) is the policy every roll, rolling cache and
protected window in kvlab is built on; score-based eviction policies (H2O, SnapKV, TOVA, knorm,
learned, random) live in :mod:`kvlab.compress.evict` and keep their sinks and window through it.
"""

from kvlab.policy.window import SinksWindow, roll_amount

__all__ = ["SinksWindow", "roll_amount"]
