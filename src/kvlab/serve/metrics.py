"""The server's Prometheus metrics (``GET /metrics``), one registry per app so tests can run several.

Counters and histograms are updated as things happen; the gauges (queue, requests being served, idle
sessions) are read from the engine when ``/metrics`` is scraped, so a scrape shows the state at that
moment (an idle server reads 0 requests being served).

The ``kvlab_tenant_*`` series are labelled by tenant: a short hash of its API key
(:func:`kvlab.serve.tenants.tenant_label`, never the key itself; ``-`` on a server without keys), so
one series per key. The totals are everybody's traffic: a server with keys serves ``/metrics`` only
for the admin key. ``kvlab_requests_total`` counts a request whose client left before its reply as
status 499.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_KL = (1e-6, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)  # nats
_SHARE = (0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0)

if TYPE_CHECKING:
    from kvlab.policy.spec import CachePolicy


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        counter, gauge = functools.partial(Counter, registry=r), functools.partial(Gauge, registry=r)
        histogram = functools.partial(Histogram, registry=r)
        self.ttft = histogram("kvlab_ttft_seconds", "Time from request to first token", buckets=_LATENCY)
        self.tpot = histogram(
            "kvlab_token_latency_seconds", "Time between generated tokens", buckets=_LATENCY
        )
        self.prompt_tokens = counter(
            "kvlab_prompt_tokens",
            "Prompt tokens, by whether they were computed or reused",
            ["kind"],
        )
        self.prefills = counter("kvlab_prefills", "Prompts, by where their cache came from", ["source"])
        self.rolls = counter("kvlab_rolls", "Rolling-window evictions (a conversation outgrew the window)")
        self.store_blocks = counter("kvlab_store_hit_blocks", "Store blocks loaded, by tier", ["tier"])
        self.compressed_prefixes = counter(
            "kvlab_compressed_prefixes",
            "Shared system prompts started from compressed, by where the compressed prefix came from",
            ["source"],
        )
        self.requests = counter(
            "kvlab_requests", "HTTP requests by endpoint and status", ["endpoint", "status"]
        )
        self.generated = counter("kvlab_generated_tokens", "Tokens generated")
        self.tenant_requests = counter(
            "kvlab_tenant_requests",
            "HTTP completion requests by tenant (a hash of its API key) and status (429: refused for load)",
            ["tenant", "status"],
        )
        self.tenant_tokens = counter(
            "kvlab_tenant_tokens",
            "Tokens by tenant: prompt tokens computed or reused, tokens generated",
            ["tenant", "kind"],
        )
        self.queue = gauge("kvlab_queue_depth", "Requests waiting for a decode slot")
        self.active = gauge("kvlab_active_requests", "Requests being served (prefilling or decoding)")
        self.sessions = gauge("kvlab_idle_sessions", "Idle conversations kept for reuse")
        self.session_bytes = gauge("kvlab_idle_session_bytes", "Bytes the idle conversations' caches hold")
        self.store_memory_bytes = gauge("kvlab_store_memory_bytes", "K/V bytes the store's memory tier holds")
        self.fidelity_kl = histogram(
            "kvlab_fidelity_kl",
            "Scored responses' mean KL(full cache || served) per token, nats, by cache policy",
            ["policy"],
            buckets=_KL,
        )
        self.fidelity_top1 = histogram(
            "kvlab_fidelity_top1",
            "Scored responses' top-1 agreement with the full cache, by cache policy",
            ["policy"],
            buckets=_SHARE,
        )
        self.device_info = gauge(
            "kvlab_device_info", "Where the model runs (always 1)", ["device", "gpu", "dtype"]
        )
        self.policy: Gauge | None = None  # kvlab_cache_policy_info, once a policy is known (cache_policy)

    def prefilled(self, info: dict[str, Any], tenant: str = "") -> None:
        self.prompt_tokens.labels("reused").inc(info["cached_tokens"])
        self.prompt_tokens.labels("computed").inc(info["computed_tokens"])
        if tenant:
            self.tenant_tokens.labels(tenant, "reused").inc(info["cached_tokens"])
            self.tenant_tokens.labels(tenant, "computed").inc(info["computed_tokens"])
        self.prefills.labels(info["source"]).inc()
        if info["rolls"]:
            self.rolls.inc(info["rolls"])
        for tier, n in info.get("store_tiers", {}).items():
            self.store_blocks.labels(tier).inc(n)
        if "compressed_prefix" in info:
            self.compressed_prefixes.labels(info["compressed_prefix"]["source"]).inc()

    def token(self, seconds: float, *, first: bool, tenant: str = "") -> None:
        (self.ttft if first else self.tpot).observe(max(seconds, 0.0))
        self.generated.inc()
        if tenant:
            self.tenant_tokens.labels(tenant, "generated").inc()

    def request(self, endpoint: str, status: int | str, tenant: str = "") -> None:
        """One completion request's status (its tenant's too, once its key is known)."""
        self.requests.labels(endpoint, str(status)).inc()
        if tenant:
            self.tenant_requests.labels(tenant, str(status)).inc()

    def fidelity(self, result: dict[str, Any]) -> None:
        """A scored response's ``kl`` and ``top1`` (:mod:`kvlab.serve.fidelity`), under its ``policy``."""
        kl = result["kl"]
        self.fidelity_kl.labels(result["policy"]).observe(math.inf if kl is None else kl)
        self.fidelity_top1.labels(result["policy"]).observe(result["top1"])

    def cache_policy(self, policy: CachePolicy) -> None:
        """``kvlab_cache_policy_info{spec, layout, codec, exact} 1``: the policy every conversation's cache
        follows (once per registry; ``kvlab_idle_session_bytes`` says what those caches hold)."""
        if self.policy is not None:
            return
        self.policy = Gauge(
            "kvlab_cache_policy_info",
            "The cache policy every conversation follows (always 1)",
            ["spec", "layout", "codec", "exact"],
            registry=self.registry,
        )
        self.policy.labels(
            policy.spec, policy.layout.name, policy.codec_name or "", str(policy.exact).lower()
        ).set(1)

    def watch(self, engine: Any) -> None:
        """Read the gauges from ``engine`` (its ``queue_depth()``, ``active()``, ``idle_sessions()``) at
        each scrape, and record where its model runs."""
        self.queue.set_function(engine.queue_depth)
        self.active.set_function(engine.active)
        self.sessions.set_function(engine.idle_sessions)
        self.session_bytes.set_function(engine.session_bytes)
        self.store_memory_bytes.set_function(engine.store_memory_bytes)
        info = engine.device_info()
        self.device_info.labels(info["device"], info.get("gpu", ""), info["dtype"]).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
