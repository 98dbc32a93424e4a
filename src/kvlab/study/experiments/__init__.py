"""Experiments: one module each, discovered by their ``EXPERIMENT`` attribute.

To add one, create ``kvlab/study/experiments/<name>.py`` with ``EXPERIMENT = Experiment(...)``; ``kvlab
study`` and ``kvlab experiments`` pick it up without any other edit.
"""

from __future__ import annotations

import importlib
import pkgutil

from kvlab.errors import BadInputError
from kvlab.study.experiments.base import (
    Experiment,
    ExperimentContext,
    ExperimentResult,
    Figure,
    Progress,
    Table,
)


def registry() -> dict[str, Experiment]:
    """All experiments, by name, in study order."""
    found: list[Experiment] = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        exp = getattr(module, "EXPERIMENT", None)
        if isinstance(exp, Experiment):
            found.append(exp)
    found.sort(key=lambda e: (e.order, e.name))
    return {e.name: e for e in found}


def get_experiment(name: str) -> Experiment:
    reg = registry()
    if name not in reg:
        raise BadInputError(f"unknown experiment '{name}'; known: {', '.join(reg)}")
    return reg[name]


__all__ = [
    "Experiment",
    "ExperimentContext",
    "ExperimentResult",
    "Figure",
    "Progress",
    "Table",
    "get_experiment",
    "registry",
]
