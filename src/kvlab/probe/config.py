"""What one probe run asks of a server: :class:`ProbeConfig`, checked whole when it is made (a
BadInputError naming the first bad value, before any request is sent)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvlab.errors import BadInputError, require
from kvlab.probe.client import Api, base_url

Log = Callable[[str], None]  # one progress line (the command prints it on stderr)


@dataclass(frozen=True)
class ProbeConfig:
    """A probe's settings. ``keys``: one API key (or none) per tenant, at most two; the isolation check and
    the prefix-hit references need two. ``context``: the server's context limit in tokens (None: what
    ``/models`` states, else 4,096). ``prefix_words``: the long shared prefix of the timing requests."""

    url: str
    keys: tuple[str, ...] = ()
    model: str | None = None
    api: Api = "chat"
    trials: int = 8
    tolerance: float = 2e-3
    alpha: float = 0.01
    prefix_words: int = 1024
    context: int | None = None
    max_tokens: int = 16
    timeout: float = 120.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", base_url(self.url))
        require(len(self.keys) <= 2, f"at most two --api-key (two tenants), got {len(self.keys)}")
        require(all(k.strip() for k in self.keys), "an --api-key is empty")
        require(len(set(self.keys)) == len(self.keys), "the two --api-key values are the same key")
        require(self.model is None or bool(self.model.strip()), "--model is empty")
        require(self.api in ("chat", "completions"), f"--api must be chat or completions, got {self.api!r}")
        require(
            5 <= self.trials <= 500, f"--trials must be 5..500 (a test needs 5 a side), got {self.trials}"
        )
        for name, value, top in (("--tolerance", self.tolerance, 10.0), ("--alpha", self.alpha, 0.5)):
            if not (math.isfinite(value) and 0 < value < top):
                raise BadInputError(f"{name} must be a number in (0, {top}), got {value}")
        require(
            16 <= self.prefix_words <= 100_000, f"--prefix-words must be 16..100000, got {self.prefix_words}"
        )
        require(
            self.context is None or 64 <= self.context <= 10_000_000,
            f"--context must be >= 64, got {self.context}",
        )
        require(1 <= self.max_tokens <= 1024, f"--max-tokens must be 1..1024, got {self.max_tokens}")
        require(
            math.isfinite(self.timeout) and self.timeout > 0, f"--timeout must be > 0, got {self.timeout}"
        )

    @property
    def tenant_a(self) -> str | None:
        return self.keys[0] if self.keys else None

    @property
    def tenant_b(self) -> str | None:
        """The second tenant's key, or None when there is only one."""
        return self.keys[1] if len(self.keys) == 2 else None
