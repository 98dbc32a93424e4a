"""One probe run: the checks in order, against one server, into one report (:func:`run_probe`)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from kvlab.errors import BadInputError, require
from kvlab.probe import checks, timing
from kvlab.probe.client import Client
from kvlab.probe.config import Log, ProbeConfig
from kvlab.probe.report import Section, assemble

DEFAULT_CONTEXT = 4096


def _model_and_limit(client: Client, cfg: ProbeConfig) -> int:
    """Set the client's model (``--model``, else the first id ``/models`` lists) and return the context
    limit to probe past (``--context``, else what ``/models`` states for the model, else 4,096)."""
    entries: list[dict[str, object]] = []
    try:
        entries = client.models(cfg.tenant_a)
    except BadInputError:
        if cfg.model is None:
            raise
    client.model = cfg.model or (str(entries[0]["id"]) if entries else "")
    require(bool(client.model), f"{cfg.url}/models lists no model: pass --model")
    entry = next((e for e in entries if e["id"] == client.model), {})
    return cfg.context or checks.stated_context(entry) or DEFAULT_CONTEXT


def run_probe(cfg: ProbeConfig, log: Log) -> dict[str, object]:
    """Probe the server ``cfg`` names; the report (:func:`kvlab.probe.report.assemble`)."""
    started, t0 = datetime.now(UTC).isoformat(timespec="seconds"), time.perf_counter()
    client = Client(cfg.url, cfg.api, cfg.timeout)
    limit = _model_and_limit(client, cfg)
    sections: list[Section] = [
        checks.cold_warm(client, cfg, log),
        checks.prefix_hits(client, cfg, log),
        checks.context(client, cfg, limit, log),
    ]
    rows = timing.collect(client, cfg, log)
    sections += [timing.isolation(rows, cfg), timing.claims(rows, cfg)]
    settings = {
        "tenants": len(cfg.keys) or 1,
        "trials": cfg.trials,
        "tolerance": cfg.tolerance,
        "alpha": cfg.alpha,
        "prefix_words": cfg.prefix_words,
        "context_limit": limit,
        "max_tokens": cfg.max_tokens,
    }
    head = {
        "url": cfg.url,
        "model": client.model,
        "api": cfg.api,
        "started": started,
        "seconds": round(time.perf_counter() - t0, 2),
        "requests": client.sent,
        "settings": settings,
    }
    return assemble(head, sections)
