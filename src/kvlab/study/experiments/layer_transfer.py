"""Which layers carry the fact? Retention when the fact turn's cache is transferred only in some layers.

Receiver: cache(P + neutral turn), where the neutral turn has exactly the fact turn's length (the
fact's words replaced by unrelated text). Donor: cache(P + fact turn). ``transfer_layers`` puts the
donor's K/V into the chosen layers; all other layers keep the neutral turn's K/V at those slots.
Conditions: none, all, thirds (early / middle / late) and sliding windows of ``width`` layers; the
per-layer curve plots each window's retention at its centre layer. Scored like context_retention.
"""

from __future__ import annotations

import numpy as np

from kvlab.errors import BadInputError
from kvlab.metrics import bootstrap_ci, bootstrap_curve, wilson_ci
from kvlab.ops.transfer import transfer_layers
from kvlab.study.experiments._retention_facts import FACTS, build_episodes, score_answers
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult
from kvlab.study.report.format import each, format_number, iv, num, says
from kvlab.study.report.plots import style, subplots


def layer_conditions(num_layers: int, width: int, stride: int) -> list[tuple[str, tuple[int, ...]]]:
    """(label, layers) for none, all, thirds and sliding windows of ``width`` layers every ``stride``."""
    if not 1 <= width <= num_layers or stride < 1:
        raise BadInputError(
            f"window width must lie in [1, {num_layers}] and stride >= 1 (got {width}, {stride})"
        )
    t = num_layers / 3
    thirds = [(round(i * t), round((i + 1) * t)) for i in range(3)]
    conds = [("none", ()), ("all", tuple(range(num_layers)))]
    conds += [
        (f"{name} {a}-{b - 1}", tuple(range(a, b)))
        for name, (a, b) in zip(("early", "middle", "late"), thirds, strict=True)
    ]
    conds += [
        (f"window {s}-{s + width - 1}", tuple(range(s, s + width)))
        for s in range(0, num_layers - width + 1, stride)
    ]
    return conds


def run(
    ctx: ExperimentContext, *, facts: int | None = None, width: int | None = None, stride: int | None = None
) -> ExperimentResult:
    result = EXPERIMENT.result(__doc__)
    model = ctx.handle()
    L = model.facts.num_layers
    width = ctx.count("width", width, quick=max(1, L // 3), default=max(1, L // 6))
    stride = ctx.count("stride", stride, quick=max(1, L // 3), default=max(1, L // 10), full=1)
    episodes = build_episodes(model, ctx.count("facts", facts, quick=6, default=len(FACTS)), seed=ctx.seed)
    conds = layer_conditions(L, width, stride)
    exact = np.zeros((len(episodes), len(conds)))
    nll = np.zeros_like(exact)
    with ctx.progress.task("layer transfer: facts", total=len(episodes)) as advance:
        for i, ep in enumerate(episodes):
            donor = model.prefill(ep.preamble + ep.fact, all_logits=False).snapshot
            neutral = model.prefill(ep.preamble + ep.neutral_fact, all_logits=False).snapshot
            unique = list(dict.fromkeys(layers for _, layers in conds))  # a window equal to a third runs once
            pasts = [transfer_layers(neutral, donor, layers) if layers else neutral for layers in unique]
            done = {
                layers: (s.exact, s.nll)
                for layers, s in zip(unique, score_answers(model, pasts, ep), strict=True)
            }  # every condition has the same length and positions: one batched forward per fact
            for j, (_, layers) in enumerate(conds):
                exact[i, j], nll[i, j] = done[layers]
            advance(1)
    acc = [wilson_ci(exact[:, j]) for j in range(len(conds))]
    mnll = [bootstrap_ci(nll[:, j], seed=ctx.seed) for j in range(len(conds))]
    result.table(
        "Retention by transferred layers",
        ["layers", "accuracy", "95% CI", "answer NLL (nats)", "95% CI"],
        [
            [lab, a.value, a.bracket(".2f"), m.value, m.bracket(".2f")]
            for (lab, _), a, m in zip(conds, acc, mnll, strict=True)
        ],
        caption=f"{len(episodes)} facts; other layers hold a same-length neutral turn's K/V. Windows of {width} layers "
        f"every {stride}.",
    )
    win = [j for j, (lab, _) in enumerate(conds) if lab.startswith("window")]
    centres = np.array([np.mean(conds[j][1]) for j in win])
    result.summary.update(
        {
            "facts": len(episodes),
            "num_layers": L,
            "window_width": width,
            "window_stride": stride,
            "accuracy": {lab: a.to_json() for (lab, _), a in zip(conds, acc, strict=True)},
            "answer_nll_nats": {lab: m.to_json() for (lab, _), m in zip(conds, mnll, strict=True)},
            **_best_window(nll, conds, win, ctx.seed),
        }
    )
    result.arrays.update(
        {
            "exact": exact,
            "answer_nll": nll,
            "condition_labels": np.array([c[0] for c in conds]),
            "window_centres": centres,
            "condition_layers": np.array([[int(i in c[1]) for i in range(L)] for c in conds]),
        }
    )
    if win:
        ctx.figure(
            "per_layer",
            _figure(exact[:, win], nll[:, win], centres, exact, nll, conds, width, model.name, ctx.seed),
            f"Retention when only a window of {width} layers carries the fact turn's "
            "K/V, by window centre; bands are 95% intervals (Wilson for accuracy, bootstrap for NLL; "
            "none from fewer than 5 facts).",
            into=result.figures,
        )
    result.data_sources.append(
        f"{len(episodes)} fact/question pairs written for kvlab; the model's chat template"
    )
    return result


def _best_window(nll: np.ndarray, conds: list, win: list[int], seed: int) -> dict:
    """The window with the lowest mean answer NLL, and its paired per-fact NLL difference to no layers and
    to every layer (95% bootstrap over facts)."""
    if not win:
        return {"best_window": None}
    labels, best = [c[0] for c in conds], win[int(np.argmin(nll[:, win].mean(0)))]
    out: dict = {"best_window": labels[best]}
    for other in ("none", "all"):
        diff = nll[:, best] - nll[:, labels.index(other)]
        out[f"best_window_minus_{other}_nll"] = bootstrap_ci(diff, seed=seed).to_json()
    return out


def _figure(ex, nl, centres, exact_all, nll_all, conds, width, name, seed):
    fig, axes = subplots(1, 2, figsize=(12, 4))
    for ax, data, full, ylab in (
        (axes[0], ex, exact_all, "accuracy"),
        (axes[1], nl, nll_all, "answer NLL (nats)"),
    ):
        if data is ex:  # accuracy is a proportion: a Wilson band per window
            ivs = [wilson_ci(data[:, k]) for k in range(data.shape[1])]
            mean, lo, hi = (np.array([getattr(i, a) for i in ivs]) for a in ("value", "low", "high"))
        else:
            mean, lo, hi = bootstrap_curve(data, seed=seed)
        ax.plot(centres, mean, marker="o", ms=3, label=f"window of {width} layers transferred")
        ax.fill_between(centres, lo, hi, alpha=0.25, label="95% band")
        for lab, ls in (("none", ":"), ("all", "--")):
            j = [c[0] for c in conds].index(lab)
            ax.axhline(full[:, j].mean(), ls=ls, color="k", lw=1, label=f"{lab} layers")
        style(ax, "window centre (layer)", ylab, legend=8)
    axes[0].set_ylim(-0.02, 1.02)
    axes[0].set_title("Fact retention by layer window")
    axes[1].set_title("Answer NLL by layer window")
    fig.suptitle(f"{name}: which layers carry the fact")
    return fig


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    best = s.get("best_window")
    layers = str(best).replace("window ", "")
    to_none = s.get("best_window_minus_none_nll")
    verdict = (
        says(
            to_none,
            "carry the fact",
            "do worse than no layers",
            "do not carry the fact more than no layers do",
            "give the lowest answer NLL (too few facts for a paired interval)",
        )
        if to_none
        else "give the lowest answer NLL"
    )
    text = (
        f"Of the layer ranges tried, layers {layers} {verdict}: transferring only them gives answer NLL "
        f"{format_number(num(s, f'answer_nll_nats.{best}'))} nats against {format_number(num(s, 'answer_nll_nats.all'))} "
        f"with every layer and {format_number(num(s, 'answer_nll_nats.none'))} with none"
        + (
            f" (minus none, paired per fact: {iv(s, 'best_window_minus_none_nll', signed=True)})."
            if to_none
            else "."
        )
    )
    rows = each(s, "answer_nll_nats", "answer NLL (nats), {}")
    rows += [
        (
            f"answer NLL, best window minus {k} (paired per fact)",
            iv(s, f"best_window_minus_{k}_nll", signed=True),
        )
        for k in ("none", "all")
        if s.get(f"best_window_minus_{k}_nll")
    ]
    return text, rows


EXPERIMENT = Experiment(
    seed_changes="which facts are asked (quick profile: 6 drawn by the seed); with every fact the same for each seed",
    describe=describe,
    name="layer_transfer",
    title="Which layers carry the fact",
    run=run,
    order=71,
    description="Fact retention when the fact's cache is transferred only for early, middle, "
    "late or sliding windows of layers.",
)
