"""Transplanting caches between models (R10) and a learned linear map between them ("C2C-lite", B6).

Pair: the bundled model and its fine-tuned derivative (``kvlab transfer finetune-derivative``):
same tokenizer and cache geometry, different weights. For windows of text (context, then a
continuation fed by teacher forcing) each model runs on its own cache and on the other model's
cache (transplanted), and on the other model's cache passed through a ridge map fitted on separate
training windows (per layer and KV head, de-rotated keys and values). Reported: top-1 agreement
and KL with the receiver's own-cache predictions, NLL of the true continuation, greedy generation
quality, and the map's held-out explained variance per layer (vs using the donor's cache as is).
A second ridge map between two random-weight models of *different* geometry shows the mechanics
when no transplant is possible; with random weights its numbers carry no linguistic meaning.
"""

from __future__ import annotations

import numpy as np
import torch

from kvlab.data import python_docs, shared_book, token_windows
from kvlab.experiments.base import Experiment, ExperimentContext, ExperimentResult, Table
from kvlab.metrics import bootstrap_ci, distinct_n, kl_divergence, longest_repeated_ngram, nll
from kvlab.metrics.text import agreement_length
from kvlab.model.derivative import build_command, derivative_info, load_derivative
from kvlab.ops.crossmodel import apply_cache_map, fit_cache_map, transplant

CONDS = ("own cache", "transplanted", "ridge-mapped")


def _texts(n: int, length: int, model, seed: int) -> list[tuple[str, list[list[int]]]]:
    out = []
    docs = python_docs()
    out.append(
        (docs.source, token_windows(model.encode(docs.text[: 2 * n * length * 10]), length, 2 * n, seed=seed))
    )
    book = shared_book("shakespeare")
    if book is not None:
        ids = model.encode(book.text[len(book.text) // 2 : len(book.text) // 2 + 2 * n * length * 10])
        out.append(
            (f"{book.source} (the derivative's training text)", token_windows(ids, length, 2 * n, seed=seed))
        )
    return out


def _pair_metrics(receiver, donor, test: list[list[int]], cont: int, gen: int, cmap) -> dict[str, np.ndarray]:
    """Per window and condition: top-1 agreement / KL with own cache, NLL of the truth, generation stats."""
    m = {k: np.zeros((len(test), len(CONDS))) for k in ("top1", "kl", "nll", "distinct_2", "repeat", "agree")}
    for i, w in enumerate(test):
        c, f = w[:-cont], w[-cont:]
        own = receiver.prefill(c).snapshot
        d_snap = donor.prefill(c).snapshot
        pasts = (own, transplant(d_snap, donor, receiver), apply_cache_map(cmap, d_snap, receiver))
        own_logits, own_gen = None, None
        for j, past in enumerate(pasts):
            out = receiver.extend(past, f)
            logits = out.logits[:-1]
            g = receiver.generate(out.snapshot, out.logits[-1], gen, stop_at_eos=False).token_ids
            if j == 0:
                own_logits, own_gen = logits, g
            m["top1"][i, j] = float((logits.argmax(-1) == own_logits.argmax(-1)).double().mean())
            m["kl"][i, j] = float(kl_divergence(own_logits, logits).mean())
            m["nll"][i, j] = float(nll(logits, torch.tensor(f[1:])).mean())
            m["distinct_2"][i, j] = distinct_n(g, 2)
            m["repeat"][i, j] = longest_repeated_ngram(g)
            m["agree"][i, j] = agreement_length(g, own_gen)
    return m


def run(
    ctx: ExperimentContext, *, windows: int | None = None, length: int | None = None, alpha: float = 1e-2
) -> ExperimentResult:
    result = ExperimentResult(
        name="transplant",
        title="Cache transplant between models and C2C-lite",
        description=__doc__.strip().split("\n")[0],
    )
    base = ctx.model()
    n = windows or ctx.pick(quick=3, default=6, full=24)
    length = length or ctx.pick(quick=40, default=80, full=128)
    cont, gen = ctx.pick(quick=8, default=16), ctx.pick(quick=6, default=16, full=32)
    _random_geometry_map(ctx, result, base, alpha)
    info = derivative_info()
    if info is None:
        result.notes.append(
            f"The fine-tuned derivative is not built (about 200 training steps: roughly 5-20 minutes "
            f"on 2 CPU cores), so only the random-weight map ran. Build it with: {build_command()}"
        )
        result.summary["derivative"] = None
        return result
    deriv = load_derivative(dtype=str(base.dtype).replace("torch.", ""))
    if info.base_fingerprint != base.fingerprint:
        result.notes.append(
            "The derivative was fine-tuned from a different base model than the one loaded now."
        )
    result.summary["derivative"] = {
        "name": info.name,
        "steps": info.steps,
        "text": info.text_source,
        "loss_first": info.loss_first,
        "loss_last": info.loss_last,
    }
    rows, ev_rows = [], []
    with ctx.progress.task("transplant: texts", total=2) as advance:
        for source, wins in _texts(n, length, base, ctx.seed):
            train, test = wins[:n], wins[n:]
            tag = "docs" if source.startswith("Python") else "train-text"
            for rname, receiver, donor in (("derivative", deriv, base), ("base", base, deriv)):
                cmap = fit_cache_map(
                    [donor.prefill(w).snapshot for w in train],
                    [receiver.prefill(w).snapshot for w in train],
                    [donor.prefill(w).snapshot for w in test[:2]],
                    [receiver.prefill(w).snapshot for w in test[:2]],
                    alpha=alpha,
                )
                met = _pair_metrics(receiver, donor, test, cont, gen, cmap)
                for j, cond in enumerate(CONDS):
                    ci = {k: bootstrap_ci(v[:, j], seed=ctx.seed) for k, v in met.items()}
                    rows.append(
                        [source, f"{rname} receives", cond]
                        + [f"{ci[k].value:.3g} [{ci[k].low:.3g}, {ci[k].high:.3g}]" for k in met]
                    )
                    result.summary[f"{tag}/{rname}/{cond}"] = {k: ci[k].to_json() for k in met}
                for k, v in met.items():
                    result.arrays[f"{tag}_{rname}_{k}"] = v
                result.arrays.update(
                    {
                        f"{tag}_{rname}_ev_k": cmap.ev_k,
                        f"{tag}_{rname}_ev_v": cmap.ev_v,
                        f"{tag}_{rname}_ev_k_identity": cmap.ev_k_identity,
                        f"{tag}_{rname}_ev_v_identity": cmap.ev_v_identity,
                    }
                )
                ev_rows.append(
                    [
                        source,
                        f"{'base' if rname == 'derivative' else 'derivative'} -> {rname}",
                        float(cmap.ev_k.mean()),
                        float(cmap.ev_k_identity.mean()),
                        float(cmap.ev_v.mean()),
                        float(cmap.ev_v_identity.mean()),
                    ]
                )
                if rname == "derivative":
                    result.figures.append(
                        ctx.figure(
                            f"ridge_ev_{tag}",
                            _ev_figure(cmap, f"base -> derivative, {source}"),
                            f"Held-out explained variance per layer of the ridge map base -> "
                            f"derivative ({tag}), vs using the base cache as is.",
                        )
                    )
            advance(1)
    result.tables.insert(
        0,
        Table(
            "Transplant between the base model and its derivative",
            [
                "text",
                "receiver",
                "cache",
                "top-1 agreement with own cache",
                "KL(own || cache)",
                "NLL of true text",
                "distinct-2",
                "longest repeat",
                "tokens agreeing with own generation",
            ],
            rows,
            caption=f"Mean [95% bootstrap CI] over {n} test windows of {length} tokens: context, then {cont} true tokens "
            f"teacher-forced, then {gen} greedy tokens. Ridge maps fitted on {n} other windows (alpha {alpha}).",
        ),
    )
    result.tables.insert(
        1,
        Table(
            "C2C-lite: held-out explained variance (mean over layers and heads)",
            ["text", "map", "EV keys (ridge)", "EV keys (as is)", "EV values (ridge)", "EV values (as is)"],
            ev_rows,
            caption="De-rotated keys. 'As is' uses the donor's cache unchanged, the transplant.",
        ),
    )
    result.data_sources.append(
        "Python documentation windows; Shakespeare windows when ../shared/data is present"
    )
    return result


def _random_geometry_map(ctx: ExperimentContext, result: ExperimentResult, base, alpha: float) -> None:
    """Ridge map between two random-weight models of the base family with different geometry (mechanics only)."""
    from kvlab.model.random import tiny_random_model

    a = tiny_random_model(base.config, seed=ctx.seed, layers=4, head_dim=16, kv_heads=2)
    b = tiny_random_model(base.config, seed=ctx.seed + 1, layers=3, head_dim=32, kv_heads=3)
    gen = torch.Generator().manual_seed(ctx.seed)
    ids = torch.randint(0, int(a.config.vocab_size), (8, 48), generator=gen).tolist()
    sa, sb = [a.prefill(w).snapshot for w in ids], [b.prefill(w).snapshot for w in ids]
    cmap = fit_cache_map(sa[:6], sb[:6], sa[6:], sb[6:], alpha=alpha)
    result.tables.append(
        Table(
            "C2C-lite mechanics: random-weight models of different geometry",
            ["receiver layer", "sharer layer", "EV keys (mean over heads)", "EV values (mean over heads)"],
            [
                [i, s, float(cmap.ev_k[i].mean()), float(cmap.ev_v[i].mean())]
                for i, s in enumerate(cmap.src_layer)
            ],
            caption="Sharer: 4 layers x 2 KV heads x 16 dims; receiver: 3 layers x 3 heads x 32 dims; random token ids. "
            "Shows the map runs across geometries; random weights make the values meaningless as findings.",
        )
    )
    result.arrays.update({"random_geometry_ev_k": cmap.ev_k, "random_geometry_ev_v": cmap.ev_v})
    result.summary["random_geometry_ev"] = {"k": float(cmap.ev_k.mean()), "v": float(cmap.ev_v.mean())}


def _ev_figure(cmap, title: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    layers = np.arange(cmap.ev_k.shape[0])
    for ev, ident, name, color in (
        (cmap.ev_k, cmap.ev_k_identity, "keys (de-rotated)", "#4c72b0"),
        (cmap.ev_v, cmap.ev_v_identity, "values", "#dd8452"),
    ):
        ax.plot(layers, ev.mean(1), color=color, marker="o", ms=3, label=f"{name}: ridge map")
        ax.fill_between(
            layers, ev.min(1), ev.max(1), color=color, alpha=0.2, label=f"{name}: min-max over heads"
        )
        if ident is not None:
            ax.plot(layers, ident.mean(1), color=color, ls="--", label=f"{name}: donor cache as is")
    ax.set_xlabel("layer")
    ax.set_ylabel("held-out explained variance")
    ax.set_ylim(
        min(0.0, float(np.nanmin(cmap.ev_k_identity.mean(1))) if cmap.ev_k_identity is not None else 0.0),
        1.02,
    )
    ax.set_title(f"C2C-lite: {title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


EXPERIMENT = Experiment(
    name="transplant",
    title="Cache transplant between models and C2C-lite",
    run=run,
    order=74,
    description="Use one model's cache in another of the same geometry (the bundled model and a "
    "fine-tuned derivative), and learned ridge maps between caches.",
)
