"""Experiments: one module each, discovered by their ``EXPERIMENT`` attribute.

To add one, create ``kvlab/study/experiments/<name>.py`` with ``EXPERIMENT = Experiment(...)`` and add
its name and title to :data:`CATALOGUE`, which ``kvlab experiments`` and the checks of experiment names
read without importing the modules (they import torch and transformers); tests/test_cheap_paths.py
checks that the catalogue equals what the modules define.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvlab.errors import BadInputError
from kvlab.study.experiments.base import (
    Experiment,
    ExperimentContext,
    ExperimentResult,
    Figure,
    Progress,
    Table,
)

#: every experiment, by name (its module is ``kvlab.study.experiments.<name>``), in study order:
#: (title, whether a study runs it), as its ``EXPERIMENT`` says
CATALOGUE: dict[str, tuple[str, bool]] = {
    "inspect": ("Cache inspection (Phase 1)", True),
    "roll_sweep": ("Roll sweep and controls", True),
    "roll_long": ("Roll vs truncate on a long context", True),
    "rope_derotation": ("RoPE de-rotation and the RoPE predictor", True),
    "streaming_ppl": ("Streaming perplexity (attention sinks)", True),
    "suffix_caching": ("Suffix caching with attention sinks", True),
    "ruler": ("RULER-style accuracy vs compression ratio, and KL to the full cache", True),
    "positions": ("Positions after eviction: original, re-rotated contiguous, within the cache", True),
    "attention": ("Attention rows and next-token logits under a roll", True),
    "store_reuse": ("KV store: prefix reuse across tiers and non-prefix reuse", True),
    "transfer_equivalence": ("Cache injection equals a concatenated prefill", True),
    "compaction": ("Compaction: full vs compacted caches, with lexical controls", True),
    "context_retention": ("Context retention under cache transfer", True),
    "layer_transfer": ("Which layers carry the fact", True),
    "kv_swap": ("K/V swap factorial and sink-only swaps", True),
    "transplant": ("Cache transplant between models and C2C-lite", True),
    "caching_numerics": ("Numerics of caching vs recomputation", True),
    "compression": ("Cache compression: quantization and eviction", True),
    "findings": ("Findings: the thread's claims, checked", True),
}


def check_study_names(names: Sequence[str], known: Sequence[str] | None = None) -> None:
    """Refuse names that are not experiments a study runs (``kvlab study --only``): ``known``, else those
    of :data:`CATALOGUE` (no experiment module is imported)."""
    if known is None:
        known = [n for n, (_, in_study) in CATALOGUE.items() if in_study]
    missing = [n for n in names if n not in known]
    if missing:
        raise BadInputError(f"unknown experiment(s) {', '.join(missing)}; known: {', '.join(sorted(known))}")


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
    """One experiment, importing its module alone."""
    if name not in CATALOGUE:
        raise BadInputError(f"unknown experiment '{name}'; known: {', '.join(CATALOGUE)}")
    exp = importlib.import_module(f"{__name__}.{name}").EXPERIMENT
    assert isinstance(exp, Experiment) and exp.name == name, name
    return exp


def needed(ctx: ExperimentContext, name: str, **options: Any) -> tuple[dict[str, Any], str]:
    """The summary of experiment ``name`` that the one running in ``ctx`` declared in ``needs``, and
    where it came from.

    From this study's run when it ran earlier (the runner passes it in ``ctx.upstream``), else
    computed now in a ``computed/<name>`` sub-folder with the same model, profile and seed.
    Experiments never read each other's files.
    """
    if name in ctx.upstream:
        return ctx.upstream[name], f"from this study's {name} section"
    from kvlab.study.report.writer import to_jsonable

    out_dir = ctx.out_dir / "computed" / name
    sub = replace(ctx, out_dir=out_dir, options=dict(options), model_handle=ctx.handle(), upstream={})
    result = get_experiment(name).run(sub, **options)
    summary = to_jsonable(result.summary) if result.status == "ok" else {}
    return summary, f"computed here ({ctx.profile} profile)"


__all__ = [
    "CATALOGUE",
    "Experiment",
    "ExperimentContext",
    "ExperimentResult",
    "Figure",
    "Progress",
    "Table",
    "check_study_names",
    "get_experiment",
    "needed",
    "registry",
]
