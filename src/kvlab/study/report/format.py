"""One way to write a number with its interval, used by every headline in the report."""

from __future__ import annotations

import math
from typing import Any


def format_number(x: float | None, digits: int = 3, signed: bool = False) -> str:
    """``x`` to ``digits`` significant digits (``signed``: with its sign, ``+0.5``); "–" for None/NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    sign = "+" if signed else ""
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:{sign},}"
    ax = abs(x)
    if ax != 0 and (ax < 1e-3 or ax >= 1e6):
        return f"{x:{sign}.{max(digits - 1, 1)}e}"
    if ax >= 1000:
        return f"{x:{sign},.0f}"
    return f"{x:{sign}.{digits}g}"


def format_range(values: list[float], digits: int = 3) -> str:
    """``a–b`` over several measurements, or one number when they agree."""
    lo, hi = min(values), max(values)
    return (
        format_number(lo, digits)
        if format_number(lo, digits) == format_number(hi, digits)
        else (f"{format_number(lo, digits)}–{format_number(hi, digits)}")
    )


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def format_interval(
    value: Any,
    low: float | None = None,
    high: float | None = None,
    digits: int = 3,
    n: int | None = None,
    signed: bool = False,
) -> str:
    """``0.998 [0.997, 0.999] (n = 20)`` from (value, low, high, n), an ``Interval`` or its JSON dict.

    No interval is written from fewer than :data:`~kvlab.metrics.stats.MIN_SAMPLES` samples or with a
    missing or non-finite bound: ``0.5 (n = 2, no interval)``, or the value alone when ``n`` is unknown
    (a plain number). ``signed`` writes every number with its sign (``+1.2 [+0.4, +2]``)."""
    from kvlab.metrics.stats import MIN_SAMPLES

    if isinstance(value, dict) and "value" in value:
        value, low, high, n = value["value"], value.get("low"), value.get("high"), value.get("n", n)
    elif hasattr(value, "value") and hasattr(value, "low"):
        value, low, high, n = value.value, value.low, value.high, value.n
    text = format_number(value, digits, signed)
    if not (_finite(low) and _finite(high)) or (n is not None and n < MIN_SAMPLES):
        return text if n is None else f"{text} (n = {n}, no interval)"
    bounds = f"{text} [{format_number(low, digits, signed)}, {format_number(high, digits, signed)}]"
    return bounds if n is None else f"{bounds} (n = {n})"


def side_of_zero(d: dict | None) -> str:
    """Where a paired difference's 95% interval (JSON) lies: "above 0", "below 0", "contains 0", or why there
    is none ("n = 2, no interval"; "no common samples")."""
    if d is None:
        return "no common samples"
    if not (_finite(d.get("low")) and _finite(d.get("high"))):
        return f"n = {d.get('n')}, no interval"
    return "above 0" if d["low"] > 0 else "below 0" if d["high"] < 0 else "contains 0"


def says(
    d: dict | None, below: str, above: str, contains: str = "no difference seen", few: str = "no interval"
) -> str:
    """What a paired difference's interval says, in the caller's words: ``below`` when it lies wholly below
    0, ``above`` when above, ``contains`` when across 0, ``few`` when there is none."""
    return {"below 0": below, "above 0": above, "contains 0": contains}.get(side_of_zero(d), few)


def dig(summary: dict, path: str) -> Any:
    """``dig(s, "rolls.1.k")`` → ``s["rolls"]["1"]["k"]`` (None where a key is missing)."""
    if isinstance(summary, dict) and path in summary:  # keys may themselves contain dots
        return summary[path]
    node: Any = summary
    for part in path.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, dict) and part.isdigit() and int(part) in node:
            node = node[int(part)]
        else:
            return None
    return node


def num(summary: dict, path: str) -> float | None:
    """The number at ``path`` (an interval's value, or a plain number); None if absent."""
    x = dig(summary, path)
    if isinstance(x, dict):
        x = x.get("value")
    elif hasattr(x, "value") and hasattr(x, "low"):
        x = x.value
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def each(summary: dict, key: str, label: str, signed: bool = False) -> list[tuple[str, str]]:
    """A headline row per entry of the mapping ``summary[key]``: ``label`` with the entry's name for ``{}``,
    and :func:`iv` of ``key.name``."""
    return [(label.format(k), iv(summary, f"{key}.{k}", signed=signed)) for k in (summary.get(key) or {})]


def iv(summary: dict, path: str, digits: int = 3, signed: bool = False) -> str:
    """The quantity at ``path`` written with its interval (or "–" when the run did not compute it)."""
    x = dig(summary, path)
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int | float | dict) or hasattr(x, "low"):
        return format_interval(x, digits=digits, signed=signed)
    return str(x)
