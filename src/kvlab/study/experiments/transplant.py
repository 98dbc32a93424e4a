"""Transplanting caches between models and a learned linear map between them ("C2C-lite").

Pair: the bundled model and its fine-tuned derivative (``kvlab transfer finetune-derivative``):
same tokenizer and cache geometry, different weights. Where that derivative is not built (it takes
~7 minutes; ``--full`` builds it), the second model is the quantized derivative instead: the base with
its decoder weights rounded to 4 bits (:func:`kvlab.model.derivative.quantized_derivative`, seconds,
in memory), so a fresh clone still measures a real transplant. For windows of text (context, then a
continuation fed by teacher forcing) each model runs on its own cache and on the other model's
cache (transplanted), and on the other model's cache passed through a ridge map fitted on separate
training windows (per layer and KV head, de-rotated keys and values). Reported: top-1 agreement
and KL with the receiver's own-cache predictions, NLL of the true continuation, greedy generation
quality, and the map's held-out explained variance per layer (vs using the donor's cache as is).
A second ridge map between two random-weight models of *different* geometry shows the mechanics
when no transplant is possible; with random weights its numbers carry no linguistic meaning.

Across real geometries and tokenizers (``target_model="gemma3-270m"``, opt-in, default in --full
when installed): both models read the same Python-docs passages, their tokens are paired where
character end offsets coincide (:mod:`kvlab.model.align`), and ridge maps are fitted in both
directions from de-rotated keys / values of the sharer's depth-matched layer (and of every layer,
a grid), with held-out explained variance per receiver layer and a shuffled-slot control. Gemma-3
de-rotation uses its per-layer-type RoPE (local 1e4 / global 1e6).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvlab.data import python_docs, shared_book, token_samples
from kvlab.metrics import bootstrap_ci, distinct_n, kl_divergence, longest_repeated_ngram, nll
from kvlab.metrics.text import agreement_length
from kvlab.model.derivative import (
    DEFAULT_STEPS,
    QUANT_BITS,
    QUANT_GROUP,
    build_command,
    default_training_text,
    derivative_info,
    finetune_derivative,
    load_derivative,
    quantized_derivative,
)
from kvlab.model.loading import GEMMA_ALIASES, GEMMA_INSTALL, GEMMA_NAME, gemma_installed
from kvlab.ops.crossmodel import apply_cache_map, cache_map_grid, fit_cache_map, layer_ropes, transplant
from kvlab.study.experiments._sampling import seeded_text
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Table
from kvlab.study.report.format import dig, format_interval, format_number, iv, num, says
from kvlab.study.report.plots import style, subplots

if TYPE_CHECKING:
    from kvlab.cache.snapshot import KVSnapshot
    from kvlab.model.handle import ModelHandle

CONDS = ("own cache", "transplanted", "ridge-mapped")


def _texts(n: int, length: int, model, seed: int, trained_on_book: bool) -> list[tuple[str, list[list[int]]]]:
    """Python-docs windows, and Shakespeare windows where ../shared/data has the book."""
    out = []
    docs = seeded_text(python_docs(), seed)
    out.append(
        (docs.source, token_samples(model.encode(docs.text[: 2 * n * length * 10]), length, 2 * n, seed=seed))
    )
    book = shared_book("shakespeare")
    book = seeded_text(book, seed) if book is not None else None
    if book is not None:
        ids = model.encode(book.text[len(book.text) // 2 : len(book.text) // 2 + 2 * n * length * 10])
        label = f"{book.source} (the derivative's training text)" if trained_on_book else book.source
        out.append((label, token_samples(ids, length, 2 * n, seed=seed)))
    return out


class _Prefills:
    """Snapshots of (model, token ids), computed once: both transplant directions read the same samples."""

    def __init__(self) -> None:
        self._memo: dict = {}

    def __call__(self, model, ids: list[int]):
        key = (id(model), tuple(ids))
        if key not in self._memo:
            self._memo[key] = model.prefill(ids).snapshot
        return self._memo[key]


def _continue(
    receiver: ModelHandle, past: KVSnapshot, f: list[int], gen: int
) -> tuple[torch.Tensor, list[int]]:
    """``receiver``'s logits over the true continuation ``f`` from ``past``, and its greedy ``gen`` tokens after."""
    out = receiver.extend(past, f)
    return out.logits[:-1], receiver.generate(out.snapshot, out.logits[-1], gen, stop_at_eos=False).token_ids


def _pair_metrics(
    receiver, donor, test: list[list[int]], cont: int, gen: int, cmap, prefill=None
) -> dict[str, np.ndarray]:
    """Per window and condition: top-1 agreement / KL with own cache, NLL of the truth, generation stats."""
    prefill = prefill or _Prefills()
    m = {k: np.zeros((len(test), len(CONDS))) for k in ("top1", "kl", "nll", "distinct_2", "repeat", "agree")}
    for i, w in enumerate(test):
        c, f = w[:-cont], w[-cont:]
        own = prefill(receiver, c)
        d_snap = prefill(donor, c)
        pasts = (own, transplant(d_snap, donor, receiver), apply_cache_map(cmap, d_snap, receiver))
        runs = [_continue(receiver, past, f, gen) for past in pasts]
        own_logits, own_gen = runs[0]
        for j, (logits, g) in enumerate(runs):
            m["top1"][i, j] = float((logits.argmax(-1) == own_logits.argmax(-1)).double().mean())
            m["kl"][i, j] = float(kl_divergence(own_logits, logits).mean())
            m["nll"][i, j] = float(nll(logits, torch.tensor(f[1:], device=logits.device)).mean())
            m["distinct_2"][i, j] = distinct_n(g, 2)
            m["repeat"][i, j] = longest_repeated_ngram(g)
            m["agree"][i, j] = agreement_length(g, own_gen)
    return m


def run(
    ctx: ExperimentContext,
    *,
    windows: int | None = None,
    length: int | None = None,
    alpha: float = 1e-2,
    target_model: str | None = None,
    cross_texts: int | None = None,
) -> ExperimentResult:
    result = EXPERIMENT.result(__doc__)
    base = ctx.handle()
    _random_geometry_map(ctx, result, base, alpha)
    target = target_model if target_model else ctx.pick(quick=None, default=None, full=GEMMA_NAME)
    _cross_geometry_section(ctx, result, base, target, alpha, cross_texts)
    _derivative_section(ctx, result, base, windows, length, alpha)
    result.data_sources.append(
        "Python documentation text samples; Shakespeare text samples when ../shared/data is present"
    )
    return result


def _derivative_section(
    ctx: ExperimentContext, result: ExperimentResult, base, windows, length, alpha
) -> None:
    n = ctx.count("windows", windows, quick=2, default=6, full=24)
    length = ctx.count("length", length, quick=40, default=80, full=128)
    cont, gen = ctx.pick(quick=8, default=16), ctx.pick(quick=6, default=16, full=32)
    deriv, about = _second_model(ctx, result, base)
    first = 0
    rows: list[list[Any]] = []
    ev_rows: list[list[Any]] = []
    trained_on_book = result.summary["derivative"]["kind"] == "fine-tuned"
    with ctx.progress.task("transplant: texts", total=2) as advance:
        for source, wins in _texts(n, length, base, ctx.seed, trained_on_book):
            prefill = _Prefills()  # per text: both directions reuse each model's snapshots
            tag = "docs" if source.startswith("Python") else "train-text" if trained_on_book else "book"
            for rname, receiver, donor in (("derivative", deriv, base), ("base", base, deriv)):
                _derivative_direction(
                    ctx,
                    result,
                    rows,
                    ev_rows,
                    source,
                    tag,
                    rname,
                    receiver,
                    donor,
                    wins[:n],
                    wins[n:],
                    prefill,
                    cont,
                    gen,
                    alpha,
                )
            advance(1)
    result.tables[first:first] = _derivative_tables(rows, ev_rows, n, length, cont, gen, alpha, about)


def _second_model(ctx: ExperimentContext, result: ExperimentResult, base):
    """The derivative the transplant pairs with ``base`` and a sentence saying what it is: the fine-tuned
    one when built (or built by --full), else the quantized one; fills ``summary["derivative"]``."""
    info = _derivative(ctx, result, base)
    if info is None:
        with ctx.progress.task(f"transplant: rounding the derivative's weights to {QUANT_BITS} bits"):
            deriv = quantized_derivative(base)
        result.summary["derivative"] = {
            "name": deriv.name,
            "kind": "quantized",
            "bits": QUANT_BITS,
            "group_size": QUANT_GROUP,
        }
        return deriv, (
            f"Derivative: the base with every decoder weight rounded to {QUANT_BITS}-bit symmetric codes, "
            f"one scale per {QUANT_GROUP} weights (embeddings and norms kept); the own-cache NLL rows show "
            "how far that moves the model."
        )
    deriv = load_derivative(dtype=str(base.dtype).replace("torch.", ""))
    if info.base_fingerprint != base.fingerprint:
        result.notes.append(
            "The derivative was fine-tuned from a different base model than the one loaded now."
        )
    result.summary["derivative"] = {
        "name": info.name,
        "kind": "fine-tuned",
        "steps": info.steps,
        "seq_len": info.seq_len,
        "batch": info.batch,
        "learning_rate": info.learning_rate,
        "text": info.text_source,
        "build_seconds": info.seconds,
        "loss_first": info.loss_first,
        "loss_last": info.loss_last,
    }
    return deriv, (
        f"Derivative: {info.steps} AdamW steps on {info.batch} x {info.seq_len}-token samples of "
        f"{info.text_source}, loss {info.loss_first:.2f} -> {info.loss_last:.2f}."
    )


def _derivative_tables(
    rows, ev_rows, n: int, length: int, cont: int, gen: int, alpha: float, about: str
) -> list[Table]:
    """The transplant table and the ridge maps' explained variance."""
    return [
        Table(
            "Transplant between the base model and its derivative",
            Table.header(
                "text | receiver | cache | top-1 agreement with own cache | KL(own || cache) | "
                "NLL of true text | distinct-2 | longest repeat | "
                "tokens agreeing with own generation | NLL minus own cache (paired)"
            ),
            rows,
            caption=f"Mean [95% bootstrap CI] over {n} test text samples of {length} tokens: context, then {cont} true tokens "
            f"teacher-forced, then {gen} greedy tokens. Ridge maps fitted on {n} other text samples (alpha {alpha}). "
            "NLL minus own cache: per text sample, this cache's NLL of the true text minus the receiver's own "
            "cache's on the same sample (95% bootstrap; none from fewer than 5 samples). " + about,
        ),
        Table(
            "C2C-lite: held-out explained variance (mean over layers and heads)",
            ["text", "map", "EV keys (ridge)", "EV keys (as is)", "EV values (ridge)", "EV values (as is)"],
            ev_rows,
            caption="De-rotated keys. 'As is' uses the donor's cache unchanged, the transplant.",
        ),
    ]


def _derivative(ctx: ExperimentContext, result: ExperimentResult, base):
    """The fine-tuned derivative's build info: built here under --full, else None (and a note) when absent."""
    info = derivative_info()
    if info is None and ctx.profile == "full":
        source = default_training_text()
        with ctx.progress.task("transplant: fine-tuning the derivative", total=DEFAULT_STEPS) as advance:
            info = finetune_derivative(
                base, source.text, text_source=source.source, progress=lambda step, loss: advance(1)
            )
        result.notes.append(
            f"The derivative was built by this --full run ({info.steps} steps, {info.seconds:.0f} s)."
        )
    if info is None:
        result.notes.append(
            f"The fine-tuned derivative is not built (200 training steps: about 7-8 minutes on one CPU "
            f"thread), so the transplant paired the base with its {QUANT_BITS}-bit-weight derivative instead: "
            "a relative that differs by rounding, not by training. For the fine-tuned pair build it with: "
            f"{build_command()} (or run with --full, which builds it)"
        )
        return None
    return info


def _derivative_direction(
    ctx, result, rows, ev_rows, source, tag, rname, receiver, donor, train, test, prefill, cont, gen, alpha
) -> None:
    """One direction (receiver <- donor) on one text: the ridge map, the pair metrics, their rows and arrays."""
    cmap = fit_cache_map(
        [prefill(donor, w) for w in train],
        [prefill(receiver, w) for w in train],
        [prefill(donor, w) for w in test[:2]],
        [prefill(receiver, w) for w in test[:2]],
        alpha=alpha,
    )
    if cmap.ev_k_identity is None or cmap.ev_v_identity is None:
        raise ValueError("a derivative shares its base's geometry: its cache map has identity EVs")
    met = _pair_metrics(receiver, donor, test, cont, gen, cmap, prefill)
    own = CONDS.index("own cache")
    for j, cond in enumerate(CONDS):
        ci = {k: bootstrap_ci(v[:, j], seed=ctx.seed) for k, v in met.items()}
        # the same test text sample under this cache and under the receiver's own: a paired difference
        to_own = bootstrap_ci(met["nll"][:, j] - met["nll"][:, own], seed=ctx.seed) if j != own else None
        rows.append(
            [source, f"{rname} receives", cond]
            + [ci[k].text(".3g") for k in met]
            + [format_interval(to_own, signed=True) if to_own else "–"]
        )
        result.summary[f"{tag}/{rname}/{cond}"] = {k: ci[k].to_json() for k in met} | (
            {"nll_minus_own": to_own.to_json()} if to_own else {}
        )
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
        ctx.figure(
            f"ridge_ev_{tag}",
            _ev_figure(cmap, f"base -> derivative, {source}"),
            f"Held-out explained variance per layer of the ridge map base -> "
            f"derivative ({tag}), vs using the base cache as is.",
            into=result.figures,
        )


def _cross_texts(n: int, seed: int, chars: int = 1400) -> list[str]:
    """``n`` Python-docs passages of ``chars`` characters (~300 tokens: inside Gemma-3's 512-token window)."""
    text = python_docs().text
    rng = np.random.default_rng(seed + 7)
    slots = len(text) // chars
    picks = sorted(rng.choice(slots, size=min(n, slots), replace=False).tolist())
    return [text[i * chars : (i + 1) * chars] for i in picks]


def _cross_geometry_section(
    ctx: ExperimentContext, result: ExperimentResult, base, target: str | None, alpha: float, n_texts
) -> None:
    """C2C-lite between the bundled model and a model of another geometry and tokenizer (Gemma-3-270M)."""
    if target is None:
        if gemma_installed():
            result.notes.append(
                "C2C-lite across geometries (bundled model <-> Gemma-3-270M) is opt-in (it adds ~3-4 minutes): "
                f"run kvlab transfer transplant --target-model {GEMMA_NAME}, or --full."
            )
        else:
            result.tables.append(_not_applicable_table())
        result.summary["cross_model"] = None
        return
    if target.lower() in GEMMA_ALIASES and not gemma_installed():
        result.tables.append(_not_applicable_table())
        result.summary["cross_model"] = None
        return
    from kvlab.model.align import aligned_snapshots

    other = ctx.load_model(target, dtype=base.dtype)  # on the study's device
    n_train = ctx.count("n_texts", n_texts, quick=4, default=8, full=16)
    n_test = max(2, n_train // 3)
    texts = _cross_texts(n_train + n_test, ctx.seed)
    pairs = []
    with ctx.progress.task("transplant: span-aligned prefills", total=len(texts)) as advance:
        for t in texts:
            pairs.append(aligned_snapshots(base, other, t, skip_first=1))
            advance(1)
    a_snaps, b_snaps, aligns = [p[0] for p in pairs], [p[1] for p in pairs], [p[2] for p in pairs]
    ropes = {base.name: layer_ropes(base), other.name: layer_ropes(other)}
    summary: dict = {
        "target": other.name,
        "texts_train": n_train,
        "texts_test": n_test,
        "slots_train": sum(len(a) for a in aligns[:n_train]),
        "slots_test": sum(len(a) for a in aligns[n_train:]),
        "coverage": {
            base.name: sum(len(a) for a in aligns) / sum(len(a.src_ids) for a in aligns),
            other.name: sum(len(a) for a in aligns) / sum(len(a.dst_ids) for a in aligns),
        },
    }
    gen = np.random.default_rng(ctx.seed)
    for src, dst, xs, ys in ((base, other, a_snaps, b_snaps), (other, base, b_snaps, a_snaps)):
        _cross_direction(ctx, result, summary, src, dst, xs, ys, ropes, n_train, n_test, alpha, gen, base)
    result.summary["cross_model"] = summary
    result.data_sources.append(
        f"C2C-lite across geometries: {n_train + n_test} Python documentation passages"
    )


def _cross_direction(
    ctx, result, summary, src, dst, xs, ys, ropes, n_train, n_test, alpha, gen, base
) -> None:
    """One direction of C2C-lite: the ridge map, its all-pairs grid and the shuffled-slot control."""
    sr, dr = ropes[src.name], ropes[dst.name]
    split = (xs[:n_train], ys[:n_train], xs[n_train:], ys[n_train:])
    cmap = fit_cache_map(*split, alpha=alpha, src_ropes=sr, dst_ropes=dr)
    grid_k, grid_v = cache_map_grid(*split, alpha=alpha, src_ropes=sr, dst_ropes=dr)
    # control: the same fit with the receiver's slots shuffled within each text (alignment destroyed)
    shuffled = [y.select(gen.permutation(y.seq_len).tolist()) for y in ys]
    ctrl = fit_cache_map(
        xs[:n_train],
        shuffled[:n_train],
        xs[n_train:],
        shuffled[n_train:],
        alpha=alpha,
        src_ropes=sr,
        dst_ropes=dr,
    )
    kinds = _layer_kinds(dst)
    rows = [
        [
            li,
            kinds[li],
            sl,
            float(cmap.ev_k[li].mean()),
            float(cmap.ev_v[li].mean()),
            f"{grid_k[:, li].max():.3f} (L{int(grid_k[:, li].argmax())})",
            f"{grid_v[:, li].max():.3f} (L{int(grid_v[:, li].argmax())})",
            float(ctrl.ev_k[li].mean()),
            float(ctrl.ev_v[li].mean()),
        ]
        for li, sl in enumerate(cmap.src_layer)
    ]
    label = f"{src.name} -> {dst.name}"
    tag = "to_target" if src is base else "from_target"
    result.tables.append(_cross_table(rows, label, alpha, summary, n_train, n_test))
    result.arrays.update(
        {
            f"cross_{tag}_ev_k": cmap.ev_k,
            f"cross_{tag}_ev_v": cmap.ev_v,
            f"cross_{tag}_grid_ev_k": grid_k,
            f"cross_{tag}_grid_ev_v": grid_v,
            f"cross_{tag}_shuffled_ev_k": ctrl.ev_k,
            f"cross_{tag}_shuffled_ev_v": ctrl.ev_v,
        }
    )
    summary[tag] = {
        "map": label,
        "ev_k_mean": float(cmap.ev_k.mean()),
        "ev_v_mean": float(cmap.ev_v.mean()),
        "grid_best_ev_k_mean": float(grid_k.max(0).mean()),
        "grid_best_ev_v_mean": float(grid_v.max(0).mean()),
        "shuffled_ev_k_mean": float(ctrl.ev_k.mean()),
        "shuffled_ev_v_mean": float(ctrl.ev_v.mean()),
    }
    ctx.figure(
        f"cross_{tag}",
        _cross_figure(cmap, ctrl, grid_k, grid_v, label),
        f"C2C-lite {label}: held-out explained variance per receiver layer (depth-matched sharer layer, "
        "and shuffled-slot control), and for every (sharer, receiver) layer pair.",
        into=result.figures,
    )


def _cross_table(rows: list, label: str, alpha: float, summary: dict, n_train: int, n_test: int) -> Table:
    """Held-out explained variance per receiver layer, for one direction."""
    return Table(
        f"C2C-lite across geometries: {label}",
        Table.header(
            "receiver layer | type | sharer layer (same depth) | EV keys | EV values | "
            "best EV keys, any sharer layer | best EV values, any sharer layer | "
            "EV keys, shuffled slots | EV values, shuffled slots"
        ),
        rows,
        caption=f"Held-out explained variance (R^2, mean over receiver KV heads) of a ridge map (alpha {alpha}) "
        f"from all sharer heads' de-rotated keys / values to each receiver head. Fitted on "
        f"{summary['slots_train']} span-aligned token slots of {n_train} Python-docs passages, tested on "
        f"{summary['slots_test']} slots of {n_test} others. 'Shuffled slots' refits with the receiver's "
        "slots permuted within each text: what a map gets without the alignment.",
    )


def _layer_kinds(handle) -> list[str]:
    from kvlab.rope.layers import sliding_windows

    return [f"sliding ({w})" if w is not None else "full" for w in sliding_windows(handle.config)]


def _not_applicable_table() -> Table:
    return Table(
        f"C2C-lite across geometries: not applicable: Gemma-3-270M not installed ({GEMMA_INSTALL})",
        ["status"],
        [
            [
                f"not applicable: Gemma-3-270M not installed ({GEMMA_INSTALL}); then run "
                f"kvlab transfer transplant --target-model {GEMMA_NAME}"
            ]
        ],
        caption="The cross-geometry, cross-tokenizer map needs a second real model; only the random-weight "
        "mechanics table above ran.",
    )


def _cross_figure(cmap, ctrl, grid_k, grid_v, title: str):
    fig, axes = subplots(1, 3, figsize=(15, 4))
    layers = np.arange(cmap.ev_k.shape[0])
    ax = axes[0]
    for ev, c_ev, name, color in (
        (cmap.ev_k, ctrl.ev_k, "keys (de-rotated)", "#4c72b0"),
        (cmap.ev_v, ctrl.ev_v, "values", "#dd8452"),
    ):
        ax.plot(layers, ev.mean(1), color=color, marker="o", ms=3, label=f"{name}: aligned")
        ax.plot(layers, c_ev.mean(1), color=color, ls="--", label=f"{name}: shuffled slots")
    ax.set_ylim(min(-0.05, float(np.nanmin(ctrl.ev_k.mean(1)))), 1.0)
    style(ax, "receiver layer", "held-out explained variance")
    ax.set_title(title, fontsize=9)
    for ax, grid, name in ((axes[1], grid_k, "keys"), (axes[2], grid_v, "values")):
        im = ax.imshow(
            grid, aspect="auto", origin="lower", vmin=0, vmax=max(0.01, float(grid.max())), cmap="viridis"
        )
        ax.set_xlabel("receiver layer")
        ax.set_ylabel("sharer layer")
        ax.set_title(f"{name}: EV for every layer pair", fontsize=9)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return fig


def _random_geometry_map(ctx: ExperimentContext, result: ExperimentResult, base, alpha: float) -> None:
    """Ridge map between two random-weight models of the base family with different geometry (mechanics only)."""
    from kvlab.model.random import tiny_random_model

    a = tiny_random_model(base.config, seed=ctx.seed, layers=4, head_dim=16, kv_heads=2)
    b = tiny_random_model(base.config, seed=ctx.seed + 1, layers=3, head_dim=32, kv_heads=3)
    gen = torch.Generator().manual_seed(ctx.seed)
    ids = torch.randint(0, int(a.config.vocab_size), (8, 48), generator=gen, device="cpu").tolist()
    sa, sb = [a.prefill(w).snapshot for w in ids], [b.prefill(w).snapshot for w in ids]
    cmap = fit_cache_map(sa[:6], sb[:6], sa[6:], sb[6:], alpha=alpha)
    result.table(
        "C2C-lite mechanics: random-weight models of different geometry",
        ["receiver layer", "sharer layer", "EV keys (mean over heads)", "EV values (mean over heads)"],
        [
            [i, s, float(cmap.ev_k[i].mean()), float(cmap.ev_v[i].mean())]
            for i, s in enumerate(cmap.src_layer)
        ],
        caption="Sharer: 4 layers x 2 KV heads x 16 dims; receiver: 3 layers x 3 heads x 32 dims; random token ids. "
        "Shows the map runs across geometries; random weights make the values meaningless as findings.",
    )
    result.arrays.update({"random_geometry_ev_k": cmap.ev_k, "random_geometry_ev_v": cmap.ev_v})
    result.summary["random_geometry_ev"] = {"k": float(cmap.ev_k.mean()), "v": float(cmap.ev_v.mean())}


def _ev_figure(cmap, title: str):
    fig, ax = subplots(figsize=(8, 4))
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
    ax.set_ylim(
        min(0.0, float(np.nanmin(cmap.ev_k_identity.mean(1))) if cmap.ev_k_identity is not None else 0.0),
        1.02,
    )
    style(ax, "layer", "held-out explained variance", f"C2C-lite: {title}")
    return fig


#: what a paired NLL difference (transplanted minus own cache) says: below 0, above 0, across 0, none
TRANSPLANT_SAYS = (
    "the transplant predicts the text better",
    "the transplant predicts the text worse",
    "no difference seen",
    "too few text samples for an interval",
)


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    parts, rows = [], []
    deriv = s.get("derivative")
    if deriv:
        which = "its 4-bit-weight copy" if deriv.get("kind") == "quantized" else "its fine-tuned derivative"
        own, moved = "docs/base/own cache", "docs/base/transplanted"
        parts.append(
            f"Fed the cache of {which} on Python-docs text samples, the base model's next-token predictions agree "
            f"with its own-cache predictions at {format_number(num(s, f'{moved}.top1'))} (KL "
            f"{format_number(num(s, f'{moved}.kl'))}; NLL of the true text {format_number(num(s, f'{moved}.nll'))} "
            f"vs {format_number(num(s, f'{own}.nll'))} with its own cache"
            + (
                f"; transplanted minus own, paired per text sample: {iv(s, f'{moved}.nll_minus_own', signed=True)}, "
                f"{says(dig(s, f'{moved}.nll_minus_own'), *TRANSPLANT_SAYS)})"
                if dig(s, f"{moved}.nll_minus_own")
                else ")"
            )
        )
        rows += [
            (f"top-1 agreement, base fed the cache of {which}", iv(s, f"{moved}.top1")),
            (f"KL(own || transplanted), base fed the cache of {which}", iv(s, f"{moved}.kl")),
            ("top-1 agreement, derivative fed the base's cache", iv(s, "docs/derivative/transplanted.top1")),
        ]
    parts.append(
        f"a ridge map between two random models of different geometry explains {format_number(num(s, 'random_geometry_ev.k'))} "
        f"of K's variance and {format_number(num(s, 'random_geometry_ev.v'))} of V's on held-out text (a negative value: worse "
        "than predicting the mean, the control that a map learns nothing between unrelated models)"
    )
    if s.get("cross_model") is None:
        parts.append("no second model of another geometry was installed")
    rows += [
        ("explained variance of K, random geometry control", iv(s, "random_geometry_ev.k")),
        ("explained variance of V, random geometry control", iv(s, "random_geometry_ev.v")),
    ]
    text = "; ".join(parts) + "."
    return text[0].upper() + text[1:], rows


EXPERIMENT = Experiment(
    seed_changes="where in the texts the text samples are cut, and the cross-model passages",
    describe=describe,
    name="transplant",
    title="Cache transplant between models and C2C-lite",
    run=run,
    order=74,
    description="Use one model's cache in another of the same geometry (the bundled model and a "
    "fine-tuned or 4-bit-weight derivative), and learned ridge maps between caches.",
)
