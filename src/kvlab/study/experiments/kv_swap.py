"""K/V swap factorial and sink-only swaps: which of K and V makes a moved cache loop?

For text samples of prose ``x`` (cache over ``x[:-1]``, then ``x[-1]`` is fed and the model continues):

* roll by n: reference = re-prefill of ``x[n:]``. Keys from {original slots n.. at their original
  positions, the same keys re-rotated to 0.., the reference} x values from {original, reference}.
* truncate by n: reference = prefill of ``x[:-n]``; the original cache's first slots mixed with it
  (a control: by causality they hold the same K/V).
* cross-text: keys of window x with values of another window y, and the reverse.
* sink-only: the naive rolled cache (original keys re-rotated to 0.., original values; slot 0 was
  never a sink) with only the sink slot's K, V or both taken from the reference; and the reference
  with its sink's K, V or both replaced by the naive cache's slot 0.

Per condition: KL(reference || condition) of the first next-token distribution, teacher-forced
NLL of the reference's greedy continuation, and the condition's own greedy continuation:
distinct-2, longest repeated n-gram, tokens agreeing with the reference.
"""

from __future__ import annotations

import numpy as np
import torch

from kvlab.cache.snapshot import KVSnapshot, batchable_groups, stack_rows
from kvlab.data import python_docs, token_samples
from kvlab.errors import BadInputError
from kvlab.metrics import bootstrap_ci, distinct_n, kl_divergence, longest_repeated_ngram, nll
from kvlab.metrics.stats import MIN_SAMPLES
from kvlab.metrics.text import agreement_length
from kvlab.ops.transfer import hybrid_kv, reposition, swap_slots
from kvlab.study.experiments._sampling import seeded_text
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Table
from kvlab.study.report.format import each, format_interval, format_number, iv, num, side_of_zero
from kvlab.study.report.plots import subplots

METRICS = ("first_token_kl", "ref_nll", "distinct_2", "longest_repeat", "agreement")


def _evaluate_many(
    model,
    pasts: dict[str, KVSnapshot],
    feed: int,
    ref_cont: list[int],
    ref_first: torch.Tensor,
    gen_tokens: int,
) -> dict[str, dict]:
    """Per condition: teacher-forced metrics against the reference continuation, then a free greedy one.

    Conditions whose caches share length and slot positions run as the rows of one batch (one pass
    over the weights per step for all of them).
    """
    res: dict[str, dict] = {}
    target = torch.tensor(ref_cont, device="cpu")  # nll moves targets to the logits
    for names in batchable_groups(pasts):
        batch = stack_rows([pasts[n] for n in names])
        out = model.forward([[feed, *ref_cont[:-1]]] * len(names), batch)
        logits = out.logits if out.logits.ndim == 3 else out.logits[None]  # [B, T_new, vocab]
        after_feed = out.snapshot.slice(0, batch.seq_len + 1)  # the caches after ``feed`` alone (causal)
        own_rows = model.generate_rows(after_feed, logits[:, 0], gen_tokens)
        for b, name in enumerate(names):
            own, first = own_rows[b], logits[b, 0]
            res[name] = {
                "first_token_kl": float(kl_divergence(ref_first, first)),
                "ref_nll": float(nll(logits[b], target).mean()),
                "distinct_2": distinct_n(own, 2),
                "longest_repeat": float(longest_repeated_ngram(own)),
                "agreement": float(agreement_length(own, ref_cont)),
                "tokens": own,
                "first_logits": first,
            }
    return {name: res[name] for name in pasts}


def _window_conditions(model, x: list[int], y: list[int], n: int, gen_tokens: int) -> dict[str, dict]:
    orig = model.prefill(x[:-1], all_logits=False).snapshot
    tail = orig.slice(n)  # original slots n.. at positions n..
    shifted = reposition(tail, 0)
    ref = model.prefill(x[n:-1], all_logits=False).snapshot
    ref_out = model.forward([x[-1]], ref)
    ref_cont = model.generate(ref_out.snapshot, ref_out.logits[-1], gen_tokens, stop_at_eos=False).token_ids
    roll: dict[str, KVSnapshot] = {"roll: reference (re-prefill)": ref}
    for k_name, k_snap in (("K orig@n..", tail), ("K orig shifted", shifted), ("K ref", ref)):
        for v_name, v_snap in (("V orig", tail), ("V ref", ref)):
            if k_snap is ref and v_snap is ref:
                continue
            roll[f"roll: {k_name} + {v_name}"] = hybrid_kv(k_snap, v_snap)
    naive = hybrid_kv(shifted, tail)
    for which in ("k", "v", "kv"):
        roll[f"sink: naive + ref sink {which.upper()}"] = swap_slots(naive, ref, [0], which=which)
        roll[f"sink: ref - own sink {which.upper()}"] = swap_slots(ref, naive, [0], which=which)
    res = _evaluate_many(model, roll, x[-1], ref_cont, ref_out.logits[-1], gen_tokens)
    # truncate: reference is a fresh prefill of the shorter text; the original's first slots are the same by causality.
    cut = len(x) - 1 - n
    tref = model.prefill(x[:cut], all_logits=False).snapshot
    t_out = model.forward([x[cut]], tref)
    t_cont = model.generate(t_out.snapshot, t_out.logits[-1], gen_tokens, stop_at_eos=False).token_ids
    prefix = orig.slice(0, cut)
    trunc = {
        "truncate: K orig + V orig": prefix,
        "truncate: K orig + V ref": hybrid_kv(prefix, tref),
        "truncate: K ref + V orig": hybrid_kv(tref, prefix),
    }
    res.update(_evaluate_many(model, trunc, x[cut], t_cont, t_out.logits[-1], gen_tokens))
    # cross-text: K from x, V from y (same length, same positions), and the reverse; reference: x's own cache.
    other = model.prefill(y[: len(x) - 1], all_logits=False).snapshot
    x_out = model.forward([x[-1]], orig)
    x_cont = model.generate(x_out.snapshot, x_out.logits[-1], gen_tokens, stop_at_eos=False).token_ids
    y_first = model.forward([x[-1]], other).logits[-1]
    cross = {
        "cross: K x + V y": hybrid_kv(orig, other),
        "cross: K y + V x": hybrid_kv(other, orig),
        "cross: y's own cache": other,
    }
    for name, r in _evaluate_many(model, cross, x[-1], x_cont, x_out.logits[-1], gen_tokens).items():
        r["first_token_kl_vs_y"] = float(kl_divergence(y_first, r["first_logits"]))
        res[name] = r
    return res


def run(
    ctx: ExperimentContext,
    *,
    windows: int | None = None,
    length: int | None = None,
    roll: int = 5,
    gen_tokens: int | None = None,
) -> ExperimentResult:
    result = EXPERIMENT.result(__doc__)
    n_win = ctx.count("windows", windows, quick=2, default=6, full=12)
    length = ctx.count("length", length, quick=40, default=64, full=128)
    gen_tokens = ctx.count("gen_tokens", gen_tokens, quick=8, default=16, full=32)
    if not 1 <= roll < length - 8:
        raise BadInputError(
            f"roll must lie in [1, {length - 9}] for text samples of {length} tokens, got {roll}"
        )
    handle = ctx.handle()
    text = seeded_text(python_docs(), ctx.seed)
    ids = handle.encode(text.text[: (n_win + 1) * length * 8])
    wins = token_samples(ids, length, n_win + 1, seed=ctx.seed)
    per: list[dict[str, dict]] = []
    with ctx.progress.task("kv swap: text samples", total=n_win) as advance:
        for w in range(n_win):
            per.append(_window_conditions(handle, wins[w], wins[w + 1], roll, gen_tokens))
            advance(1)
    names = list(per[0])
    arr = {m: np.array([[p[c][m] for c in names] for p in per]) for m in METRICS}  # [windows, conditions]
    stats = {m: [bootstrap_ci(arr[m][:, j], seed=ctx.seed) for j in range(len(names))] for m in METRICS}
    cross_kl_y = {
        c: float(np.mean([p[c]["first_token_kl_vs_y"] for p in per])) for c in names if c.startswith("cross")
    }
    result.tables.extend(_tables(handle, names, stats, per, cross_kl_y, n_win, length, roll, gen_tokens))
    result.summary["sink_alone_minus_both"] = sink_paired(arr["first_token_kl"], names, ctx.seed)
    result.summary.update(
        {
            "windows": n_win,
            "length": length,
            "roll": roll,
            "gen_tokens": gen_tokens,
            "conditions": names,
            **{m: {c: stats[m][j].to_json() for j, c in enumerate(names)} for m in METRICS},
            "cross_first_token_kl_vs_y": cross_kl_y,
        }
    )
    result.arrays.update({m: arr[m] for m in METRICS})
    result.arrays["condition_names"] = np.array(names)
    result.arrays["generated_tokens"] = np.array(
        [[p[c]["tokens"] + [-1] * (gen_tokens - len(p[c]["tokens"])) for c in names] for p in per]
    )
    ctx.figure(
        "kv_swap",
        _figure(names, stats, handle.name, n_win),
        "First-token KL, reference NLL and distinct-2 per K/V condition, "
        "bootstrap 95% intervals over text samples.",
        into=result.figures,
    )
    result.data_sources.append(f"{text.source}: {n_win + 1} text samples of {length} tokens")
    return result


#: the sink-only swaps: the re-prefilled sink's K, V or both put into the naive rolled cache
SINK = "sink: naive + ref sink "


def sink_paired(kl: np.ndarray, names: list[str], seed: int) -> dict[str, dict] | None:
    """Per text sample, the first-token KL with only the sink's K (V) swapped in minus with both swapped in
    (``kl``: ``[samples, conditions]``): mean with a 95% bootstrap interval (JSON), None without those
    conditions."""
    if not all(f"{SINK}{x}" in names for x in ("KV", "K", "V")):
        return None
    both = kl[:, names.index(f"{SINK}KV")]
    return {x: bootstrap_ci(kl[:, names.index(SINK + x)] - both, seed=seed).to_json() for x in ("K", "V")}


def _sink_verdict(paired: dict | None) -> str:
    """What the paired differences say about the sink's K and V: together only when each alone leaves the
    KL higher than both (each interval wholly above 0)."""
    if not paired:
        return "this result has no paired differences to tell whether the sink's K and V act together."
    diffs = ", ".join(f"{x} alone − both {format_interval(paired[x], signed=True)}" for x in ("K", "V"))
    sides = [side_of_zero(paired[x]) for x in ("K", "V")]
    if any(x not in ("above 0", "below 0", "contains 0") for x in sides):
        return f"with so few text samples there is no paired interval ({diffs}): this run cannot tell."
    if all(x == "above 0" for x in sides):
        return f"each alone leaves the KL higher than both together ({diffs}, paired): they act together."
    return f"the paired differences ({diffs}) do not show that the sink's K and V need each other."


def _tables(
    handle, names, stats, per, cross_kl_y, n_win: int, length: int, roll: int, gen_tokens: int
) -> list:
    """Every condition with intervals, the cross-text comparison, and one window's continuations."""
    tables = []
    rows = []
    for j, c in enumerate(names):
        rows.append([c] + [stats[m][j].text(".3g") for m in METRICS])
    tables.append(
        Table(
            "K/V swap conditions",
            Table.header(
                "condition | first-token KL vs ref (nats) | NLL of ref continuation | distinct-2 | "
                "longest repeated n-gram | tokens agreeing with ref"
            ),
            rows,
            caption=f"Mean [95% bootstrap CI] over {n_win} text samples of {length} tokens; roll/truncate by {roll}; "
            f"{gen_tokens} greedy tokens. 'naive' = original keys re-rotated to 0.. with original values "
            "(slot 0 never was a sink). Cross-text reference: sample x's own cache.",
        )
    )
    tables.append(
        Table(
            "Cross-text: first-token KL against each text's own cache",
            ["condition", "KL vs x's cache", "KL vs y's cache"],
            [[c, stats["first_token_kl"][names.index(c)].value, cross_kl_y[c]] for c in cross_kl_y],
            caption="Which cache does a K/V hybrid behave like? Mean over text samples.",
        )
    )
    tables.append(
        Table(
            "Example continuations (text sample 0)",
            ["condition", "greedy continuation"],
            [[c, handle.decode(per[0][c]["tokens"])] for c in names],
            caption="One text sample, for reading; the statistics above are over all of them.",
        )
    )
    return tables


def _figure(names, stats, name, n):
    fig, axes = subplots(1, 3, figsize=(15, 0.32 * len(names) + 2), sharey=True)
    y = np.arange(len(names))
    for ax, m, xlab in zip(
        axes,
        ("first_token_kl", "ref_nll", "distinct_2"),
        (
            "first-token KL vs reference (nats)",
            "NLL of reference continuation (nats/token)",
            "distinct-2 of own continuation",
        ),
        strict=True,
    ):
        v = np.array([s.value for s in stats[m]])
        err = np.array([[s.value - s.low for s in stats[m]], [s.high - s.value for s in stats[m]]])
        label = (
            "mean, 95% bootstrap interval" if n >= MIN_SAMPLES else f"mean (no interval: n < {MIN_SAMPLES})"
        )
        ax.barh(y, v, xerr=np.nan_to_num(err), capsize=2, color="#4c72b0", label=label)
        ax.set_xlabel(xlab)
        ax.grid(alpha=0.3, axis="x")
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_yticks(y)
    axes[0].set_yticklabels(names, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(f"{name}: K/V swap conditions over {n} text samples")
    return fig


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    kl = s.get("first_token_kl") or {}
    pick = [k for k in kl if k.startswith(("roll: K orig", "roll: K ref", "sink: naive + ref sink"))]
    both, k_only, v_only = (num(kl, f"{SINK}{x}") for x in ("KV", "K", "V"))
    text = (
        f"After a {s.get('roll', '?')}-token roll, swapping in the re-prefilled sink's K and V together brings the "
        f"first-token KL to {format_number(both)} nats, K alone to {format_number(k_only)} and V alone to "
        f"{format_number(v_only)}: " + _sink_verdict(s.get("sink_alone_minus_both"))
    )
    rows = [(f"first-token KL (nats), {k}", iv(kl, k)) for k in pick]
    rows += each(s, "sink_alone_minus_both", "first-token KL, sink {} alone minus both (paired)", signed=True)
    return text, rows


EXPERIMENT = Experiment(
    seed_changes="where in the Python docs the text samples are cut",
    describe=describe,
    name="kv_swap",
    title="K/V swap factorial and sink-only swaps",
    run=run,
    order=72,
    description="All K/V source combinations for roll, truncate and cross-text, plus swapping "
    "only the sink's K or V: which one makes a moved cache degenerate.",
)
