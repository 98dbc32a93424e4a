"""Does a moved cache still carry a fact? Retention of chat-template facts under cache transfers.

Each episode is a conversation: preamble P (system prompt), a fact turn A ("my name is Lyra"), a
question B ("What is my name?" + "Your name is"). The answer is scored by teacher forcing (exact
greedy match and NLL) after the context is supplied in different ways:

* ``no context``: P + B only;  ``text``: one prefill of P + A + B;  ``injected cache``: cache(P + A) then B
  (the original Phase 2a set-up; must equal ``text``, the check the original run lacked);
* ``text, no preamble``: A + B; ``re-positioned, 0 / 4 sinks``: cache(P + A) with P dropped and A's
  slots shifted to position 0 (or kept behind P's first 4 tokens);
* ``other preamble``: A's slots from cache(P' + A), P' another system prompt, placed after P;
* ``cached alone``: A's slots from cache(A), placed after P (no recomputation, like CacheBlend at 0%).
"""

from __future__ import annotations

import numpy as np

from kvlab.metrics import bootstrap_ci, wilson_ci
from kvlab.ops.transfer import concat_caches, drop_prefix
from kvlab.study.experiments._retention_facts import FACTS, build_episodes, score_answers_grouped, score_text
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult
from kvlab.study.report.format import format_number, iv, num, says
from kvlab.study.report.plots import subplots

CONDITIONS = (
    ("no_context", "no context"),
    ("text", "text (P+A+B)"),
    ("injected", "injected cache(P+A)"),
    ("text_no_preamble", "text, no preamble (A+B)"),
    ("repos_0", "re-positioned, 0 sinks"),
    ("repos_4", "re-positioned, 4 sinks"),
    ("other_preamble", "A cached after other preamble"),
    ("cached_alone", "A cached alone"),
)


def run(ctx: ExperimentContext, *, facts: int | None = None, sinks: int = 4) -> ExperimentResult:
    result = EXPERIMENT.result(__doc__)
    handle = ctx.handle()
    n = ctx.count("facts", facts, quick=8, default=len(FACTS))
    episodes = build_episodes(handle, n, seed=ctx.seed)
    keys = [k for k, _ in CONDITIONS]
    exact, nll, inj_vs_text = _measure(ctx, handle, episodes, keys, sinks)
    labels = [lab.replace("4 sinks", f"{sinks} sinks") for _, lab in CONDITIONS]
    acc = {k: wilson_ci(exact[:, j]) for j, k in enumerate(keys)}
    mnll = {k: bootstrap_ci(nll[:, j], seed=ctx.seed) for j, k in enumerate(keys)}
    paired = bootstrap_ci(exact[:, keys.index("repos_4")] - exact[:, keys.index("repos_0")], seed=ctx.seed)
    paired_nll = bootstrap_ci(nll[:, keys.index("repos_4")] - nll[:, keys.index("repos_0")], seed=ctx.seed)
    result.summary.update(
        {
            "facts": len(episodes),
            "sinks": sinks,
            "accuracy": {k: acc[k].to_json() for k in keys},
            "answer_nll_nats": {k: mnll[k].to_json() for k in keys},
            "injected_vs_text_max_abs_logit_diff": float(inj_vs_text.max()),
            "injected_equals_text": bool(inj_vs_text.max() <= 1e-4 and (exact[:, 1] == exact[:, 2]).all()),
            "sinks_minus_no_sinks_accuracy": paired.to_json(),
            "sinks_minus_no_sinks_nll": paired_nll.to_json(),
        }
    )
    result.table(
        "Answer retention by condition",
        ["condition", "accuracy", "95% CI", "answer NLL (nats)", "95% CI"],
        [
            [lab, acc[k].value, acc[k].bracket(".2f"), mnll[k].value, mnll[k].bracket(".2f")]
            for k, lab in zip(keys, labels, strict=True)
        ],
        caption=f"{len(episodes)} fact/question pairs, chat template, answers scored by teacher forcing (exact = greedy "
        f"decoding emits the answer). Injected cache vs text: max |logit diff| {inj_vs_text.max():.2e}. "
        f"{sinks} sinks minus 0 sinks: accuracy {paired}, NLL {paired_nll} (paired bootstrap).",
    )
    result.arrays.update(
        {
            "exact": exact,
            "answer_nll": nll,
            "injected_vs_text_max_abs": inj_vs_text,
            "condition_keys": np.array(keys),
        }
    )
    ctx.figure(
        "retention",
        _figure(labels, acc, mnll, len(episodes), handle.name),
        "Answer accuracy (95% Wilson intervals) and NLL (95% bootstrap intervals) per condition, over "
        "facts; no bar where fewer than 5 facts ran.",
        into=result.figures,
    )
    result.notes.append(
        "The injected cache is the text condition computed in two steps: equal logits (within fp32 "
        "noise) are a correctness check, not evidence of 'transfer'."
    )
    result.data_sources.append(
        f"{len(episodes)} fact/question pairs written for kvlab; the model's chat template"
    )
    return result


def _measure(ctx: ExperimentContext, handle, episodes, keys: list[str], sinks: int):
    """Exact-answer flags and answer NLL per fact and condition, and injected-vs-text logit gaps."""
    exact = np.zeros((len(episodes), len(keys)))
    nll = np.zeros_like(exact)
    inj_vs_text = np.zeros(len(episodes))
    with ctx.progress.task("retention: facts", total=len(episodes)) as advance:
        for i, ep in enumerate(episodes):
            p_snap = handle.prefill(ep.preamble, all_logits=False).snapshot
            pa = handle.prefill(ep.preamble + ep.fact, all_logits=False).snapshot
            pasts = {
                "no_context": p_snap,
                "injected": pa,
                "text_no_preamble": None,
                "repos_0": drop_prefix(pa, len(ep.preamble), sinks=0),
                "repos_s": drop_prefix(pa, len(ep.preamble), sinks=sinks),
                "other_preamble": concat_caches(
                    p_snap,
                    handle.prefill(ep.other_preamble + ep.fact, all_logits=False).snapshot.slice(
                        len(ep.other_preamble)
                    ),
                ),
                "cached_alone": concat_caches(p_snap, handle.prefill(ep.fact, all_logits=False).snapshot),
            }
            scores = {
                "text": score_text(handle, ep.preamble + ep.fact, ep),
                "text_no_preamble": score_text(handle, ep.fact, ep),
            }
            cached = {k: past for k, past in pasts.items() if k not in scores}
            for k, sc in score_answers_grouped(handle, cached, ep).items():
                scores["repos_4" if k == "repos_s" else k] = sc
            inj_vs_text[i] = float((scores["injected"].logits - scores["text"].logits).abs().max())
            for j, k in enumerate(keys):
                exact[i, j], nll[i, j] = scores[k].exact, scores[k].nll
            advance(1)
    return exact, nll, inj_vs_text


def _figure(labels, acc, mnll, n, name):
    keys = list(acc)
    fig, axes = subplots(1, 2, figsize=(12, 4.2))
    x = np.arange(len(keys))
    for ax, stat, ylab in (
        (axes[0], acc, "accuracy (exact greedy answer)"),
        (axes[1], mnll, "answer NLL (nats)"),
    ):
        vals = np.array([stat[k].value for k in keys])
        err = np.nan_to_num(  # no interval (NaN bounds): no error bar
            [[stat[k].value - stat[k].low for k in keys], [stat[k].high - stat[k].value for k in keys]]
        )
        ax.bar(
            x,
            vals,
            yerr=err,
            capsize=3,
            color=["#999"] + ["#4c72b0"] * 3 + ["#dd8452"] * 2 + ["#55a868"] * 2,
            label="mean with its 95% interval",
        )
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(ylab)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    axes[0].set_ylim(0, 1.05)
    axes[0].set_title("Fact retention")
    axes[1].set_title("Answer negative log-likelihood")
    fig.suptitle(f"{name}: {n} facts, context supplied as text or as (moved) cache")
    return fig


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    same = s.get("injected_equals_text")  # per fact: the same logits (to 1e-4) and the same exact answer
    sinks_diff = s.get("sinks_minus_no_sinks_nll")
    text = (
        "An injected cache answers the invented facts "
        + ("as" if same else "not as")
        + " the text itself does, fact by fact "
        f"({format_number(num(s, 'accuracy.injected'))} vs {format_number(num(s, 'accuracy.text'))} accuracy; "
        f"no context: {format_number(num(s, 'accuracy.no_context'))}); re-positioned, the answer's NLL is "
        f"{format_number(num(s, 'answer_nll_nats.repos_0'))} nats without sinks and "
        f"{format_number(num(s, 'answer_nll_nats.repos_4'))} with {s.get('sinks', 4)}"
        + (
            f" (with minus without, paired per fact: {iv(s, 'sinks_minus_no_sinks_nll', signed=True)}, "
            f"{says(sinks_diff, 'the sinks lower it', 'the sinks raise it', few='too few facts for an interval')})."
            if sinks_diff
            else "."
        )
    )
    rows = [
        ("accuracy, text in context", iv(s, "accuracy.text")),
        ("accuracy, injected cache", iv(s, "accuracy.injected")),
        ("accuracy, no context", iv(s, "accuracy.no_context")),
        ("answer NLL (nats), re-positioned, no sinks", iv(s, "answer_nll_nats.repos_0")),
        ("answer NLL (nats), re-positioned, with sinks", iv(s, "answer_nll_nats.repos_4")),
        (
            "answer NLL, with sinks minus without (paired per fact)",
            iv(s, "sinks_minus_no_sinks_nll", signed=True),
        ),
    ]
    return text, rows


EXPERIMENT = Experiment(
    seed_changes="which facts are asked (quick profile: 8 drawn by the seed); with every fact (default profile) the facts are the same for each seed",
    describe=describe,
    name="context_retention",
    title="Context retention under cache transfer",
    run=run,
    order=70,
    description="Fact recall when a conversation's cache is injected, re-positioned (with/without "
    "sinks), or computed under another preamble.",
)
