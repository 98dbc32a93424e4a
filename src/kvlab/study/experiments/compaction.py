"""Is a compacted conversation's cache like the full one's, and why? With lexical controls.

Each conversation is cached in full and compacted (a summary, then the last turns verbatim), plus
controls: the verbatim last turns only, the summary only, the compacted text's words shuffled, and
another conversation (unrelated). All go through the model's chat template. Two views: centroids
(mean K de-rotated with each cache's own positions, and mean V, per layer and KV head), raw and
centred on the other conversations' mean; and position-wise on the shared verbatim tail (the last
tokens, identical in full and compacted). The confound: the last turns are kept verbatim, so part of
any "compaction keeps the state" similarity is simply the same tokens; the controls measure how much.
"""

from __future__ import annotations

import json
import random
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvlab.cache.snapshot import KVSnapshot
from kvlab.data import shared_conversations
from kvlab.errors import BadInputError
from kvlab.metrics import bootstrap_ci
from kvlab.metrics.similarity import compare_caches, normalise_against_baseline
from kvlab.metrics.stats import MIN_SAMPLES, Interval
from kvlab.rope.ops import remove_rope_stacked
from kvlab.study.experiments import _conversations as built
from kvlab.study.experiments._conversations import RECENT_MARKER, chat_ids
from kvlab.study.experiments._rolling import reference
from kvlab.study.experiments._sampling import seeded_order
from kvlab.study.experiments.base import Experiment, ExperimentContext, ExperimentResult, Table
from kvlab.study.report.format import dig, format_interval, format_number, iv, num, side_of_zero
from kvlab.study.report.plots import colors, shade, style, subplots

CONDITIONS = ("compacted", "verbatim_tail_only", "summary_only", "shuffled_compacted", "unrelated")
LABELS = {
    "compacted": "compacted (summary + verbatim tail)",
    "verbatim_tail_only": "verbatim last turns only",
    "summary_only": "summary only",
    "shuffled_compacted": "compacted, words shuffled",
    "unrelated": "another conversation (unrelated)",
}
MIN_TAIL_TOKENS = 4
#: The least margin of compacted over unrelated (raw V centroid cosine) worth splitting into shares;
#: below it a share is a ratio of noise (3,000% of a -0.002 margin says nothing).
MIN_MARGIN = 0.01


def thread_centroid_v() -> dict[str, float]:
    """The thread's centroid V cosines (Qwen2.5-14B, 10 UltraChat conversations) from kvlab's shipped copy
    of its numbers; no result file carries them, the research brief does."""
    return dict(reference().brief.get("compaction_centroid_v", {}))


# -- building the conditions -----------------------------------------------------------------------
def parse_turns(text: str) -> list[dict[str, str]]:
    """``"User: ...\\n\\nAssistant: ..."`` -> chat messages; text before the first marker is a user turn."""
    parts = re.split(r"(?:^|\n\n)(User|Assistant): ", text)
    messages = []
    if parts[0].strip():
        messages.append({"role": "user", "content": parts[0].strip()})
    for role, content in zip(parts[1::2], parts[2::2], strict=True):
        if content.strip():
            messages.append({"role": role.lower(), "content": content.strip()})
    return messages


def conversation_messages(
    conv: dict[str, Any], unrelated: dict[str, Any], *, seed: int = 0
) -> dict[str, list[dict]]:
    """Chat messages of the full conversation and of every condition.

    The compacted text is its summary header (as the system message) and its recent turns (verbatim);
    "summary only" is that header alone, so compacted = summary only + verbatim tail, token for token.
    """
    for key in ("full", "compacted"):
        if not isinstance(conv.get(key), str) or not conv[key].strip():
            raise BadInputError(f"each conversation needs a non-empty '{key}' string")
    comp = conv["compacted"]
    if RECENT_MARKER in comp:
        header, recent = comp.split(RECENT_MARKER, 1)
        header, recent_turns = header.strip(), parse_turns(recent.strip())
    else:
        header, recent_turns = comp.strip(), []
    if not header:
        header = str(conv.get("summary", "")).strip()
    if not header:
        raise BadInputError("a compacted conversation has neither a summary header nor a 'summary' field")
    words = comp.split()
    random.Random(seed).shuffle(words)
    return {
        "full": parse_turns(conv["full"]),
        "compacted": [{"role": "system", "content": header}, *recent_turns],
        "verbatim_tail_only": recent_turns,
        "summary_only": [{"role": "system", "content": header}],
        "shuffled_compacted": [{"role": "user", "content": " ".join(words)}],
        "unrelated": parse_turns(unrelated["full"]),
    }


def common_suffix(a: list[int], b: list[int]) -> int:
    """How many trailing tokens two sequences share."""
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


# -- measuring ---------------------------------------------------------------------------------------
def cache_centroids(snap: KVSnapshot) -> np.ndarray:
    """``[2, layers, kv_heads, head_dim]`` float64: mean K (de-rotated with the cache's own positions) and mean V."""
    k = torch.stack([x[0] for x in snap.keys]).double()
    if snap.rope is not None:
        k = remove_rope_stacked(k, snap.positions, snap.rope)
    v = torch.stack([x[0] for x in snap.values]).double()
    return torch.stack((k.mean(dim=-2), v.mean(dim=-2))).numpy()


def centroid_cos(a: np.ndarray, b: np.ndarray, center: np.ndarray | None = None) -> np.ndarray:
    """Cosine over head_dim of ``[..., head_dim]`` centroids, optionally after subtracting ``center``."""
    if center is not None:
        a, b = a - center, b - center
    num = (a * b).sum(-1)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / den, np.nan)


def _tail_compare(
    full: KVSnapshot, cond: KVSnapshot, m: int, center: bool
) -> tuple[dict[str, np.ndarray], dict]:
    """Position-wise comparison of the last ``m`` slots of both caches: [L, H] means and curves along the tail."""
    idx_f = np.arange(full.seq_len - m, full.seq_len)
    idx_c = np.arange(cond.seq_len - m, cond.seq_len)
    cmp = compare_caches(full, cond, idx_f, idx_c, derotate="correct", center=center)
    out = {"cos_k": cmp.cos_k.mean(-1), "cos_v": cmp.cos_v.mean(-1)}
    curves = {"cos_v": cmp.cos_v.mean(axis=(0, 1)), "cos_k": cmp.cos_k.mean(axis=(0, 1))}
    if cmp.cos_k_derotated is not None:
        out["cos_kd"] = cmp.cos_k_derotated.mean(-1)
        curves["cos_kd"] = cmp.cos_k_derotated.mean(axis=(0, 1))
    return out, curves


def load_conversations(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise BadInputError(f"no conversations file at {path}")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadInputError(f"{path} is not a JSON file ({exc})") from None
    if not isinstance(doc, list) or not all(isinstance(c, dict) for c in doc):
        raise BadInputError(
            f"{path} must hold a JSON list of {{'full': ..., 'compacted': ..., 'summary': ...}} objects"
        )
    return doc


def run(
    ctx: ExperimentContext, *, conversations: str | Path | list[dict] | None = None, limit: int | None = None
) -> ExperimentResult:
    result = EXPERIMENT.result(__doc__)
    convs, source = _conversations(ctx, result, conversations, limit)
    handle = ctx.handle()
    N = len(convs)
    result.data_sources.append(f"{source}: {N} conversations, chat template of {handle.name}")
    ids = _token_ids(ctx, handle, convs)
    tokens = np.array([[len(ids[i][c]) for c in ("full", *CONDITIONS)] for i in range(N)])
    tail = np.array([common_suffix(ids[i]["full"], ids[i]["compacted"]) for i in range(N)])

    cent, pre, full_cent, full_pre, pos, curves = _measure(ctx, handle, ids, tail)
    # Centring: subtract the mean full-conversation centroid of the *other* conversations (not i, not its partner).
    mu = np.stack(
        [np.nanmean(full_cent[[j for j in range(N) if j not in (i, (i - 1) % N)]], axis=0) for i in range(N)]
    )  # [N, 2, L, H, D]
    sim = {
        "raw": centroid_cos(cent, full_cent[:, None]),  # [N, C, 2, L, H]
        "centred": centroid_cos(cent, full_cent[:, None], mu[:, None]),
        "pretail_raw": centroid_cos(pre, full_pre[:, None]),
        "pretail_centred": centroid_cos(pre, full_pre[:, None], mu[:, None]),
    }
    result.arrays.update(
        {
            "conditions": np.array(CONDITIONS),
            "tokens_full_and_conditions": tokens,
            "tail_tokens": tail,
            "centroids_full": full_cent,
            "centroids_full_pretail": full_pre,
            "centroids": cent,
            "centroids_pretail": pre,
            "centring_mean": mu,
            **{f"centroid_cos_{k}": v for k, v in sim.items()},
            **{f"tail_{k}": v for k, v in pos.items()},
            **{f"tail_curve_{k}": v for k, v in curves.items()},
        }
    )
    _report(ctx, result, handle.facts.name, convs, tokens, tail, sim, pos, curves)
    return result


def _conversations(
    ctx: ExperimentContext, result: ExperimentResult, conversations, limit
) -> tuple[list[dict], str]:
    """The conversations to compare and where they came from: those given, else the shared UltraChat set,
    else conversations the model makes from Python's documentation."""
    if conversations is None:
        convs = shared_conversations()
        if convs is None:
            return _built_conversations(ctx, result, limit)
        source = "UltraChat compaction set (../shared/data/ultrachat_compaction.json)"
    elif isinstance(conversations, list):
        convs, source = conversations, "conversations passed in"
    else:
        convs, source = load_conversations(conversations), f"conversations file {Path(conversations).name}"
    if limit is None:
        limit = ctx.pick(3, len(convs), len(convs))
    if len(convs) < 3 or limit < 3:
        raise BadInputError(
            f"need at least 3 conversations (one to compare, one unrelated, one to centre on), "
            f"got {min(len(convs), limit)}"
        )
    if limit < len(convs):  # the quick profile: the shortest conversations
        convs = sorted(convs, key=lambda c: len(c.get("full", "")))[:limit]
    return convs, source


def _built_conversations(ctx: ExperimentContext, result: ExperimentResult, limit: int | None):
    """Without the shared set: conversations the model makes from Python's documentation (cached)."""
    n = ctx.count("limit", limit, quick=3, default=10, full=20)
    if n < 3:
        raise BadInputError(
            f"need at least 3 conversations (one to compare, one unrelated, one to centre on), got {n}"
        )
    handle = ctx.handle()
    order = seeded_order(len(built.topics()), ctx.seed)
    with ctx.progress.task("compaction: making conversations (once per model)", total=n) as advance:
        convs = built.model_conversations(handle, n, order, advance)
    result.notes.append(
        f"No UltraChat set (../shared/data/ultrachat_compaction.json): the {n} conversations were made by "
        f"{handle.name} itself from Python's documentation, one topic each: two quoted passages with a question, "
        "then a request for an example, every reply the model's own (greedy); the compacted version is the "
        "model's summary of the first two exchanges, then the last exchange verbatim. They are kept in "
        f"{built.cache_path(handle)} and built again only for another model or format version. Every conversation "
        "asks the same questions about another topic, so 'unrelated' shares the full one's format (a stricter "
        "control than the UltraChat set's); the thread's conversations were longer and summarised by a stronger "
        "model, so its numbers are context, not a target."
    )
    return convs, built.source(handle)


def _token_ids(ctx: ExperimentContext, handle, convs: list[dict]) -> dict[int, dict[str, list[int]]]:
    """Chat-template token ids of every condition of every conversation, refused above the maximum."""
    N = len(convs)
    ids = {}
    for i, conv in enumerate(convs):
        msgs = conversation_messages(conv, convs[(i - 1) % N], seed=ctx.seed + i)
        ids[i] = {name: chat_ids(handle, m) for name, m in msgs.items()}
        for name, seq in ids[i].items():
            if len(seq) >= handle.max_positions:
                raise BadInputError(
                    f"conversation {i} ({name}) has {len(seq)} tokens, the handle's maximum is "
                    f"{handle.max_positions}"
                )
    return ids


def _measure(ctx: ExperimentContext, handle, ids: dict, tail: np.ndarray):
    """Centroids (whole cache and before the shared tail) and the tail's position-wise similarity."""
    N, C = len(ids), len(CONDITIONS)
    L, H = handle.facts.num_layers, handle.facts.num_kv_heads
    D = handle.facts.head_dim
    full_cent = np.full((N, 2, L, H, D), np.nan)
    full_pre = np.full((N, 2, L, H, D), np.nan)
    cent = np.full((N, C, 2, L, H, D), np.nan)
    pre = np.full((N, C, 2, L, H, D), np.nan)
    pos = {
        f"{m}{s}": np.full((N, C, L, H), np.nan)
        for m in ("cos_k", "cos_kd", "cos_v")
        for s in ("", "_centred")
    }
    max_tail = int(tail.max())
    curves = {m: np.full((N, C, max_tail), np.nan) for m in ("cos_v", "cos_kd", "cos_k")}

    def measure(i: int, full: KVSnapshot, c: int, snap: KVSnapshot | None, seq: list[int]) -> None:
        if snap is None:
            return
        cent[i, c] = cache_centroids(snap)
        m_c = common_suffix(ids[i]["full"], seq)
        if snap.seq_len - m_c >= 1 and full.seq_len - tail[i] >= 1:
            pre[i, c] = cache_centroids(snap.slice(0, snap.seq_len - m_c))
        m = min(int(tail[i]), snap.seq_len)
        if m >= MIN_TAIL_TOKENS:
            for center, suffix in ((False, ""), (True, "_centred")):
                means, crv = _tail_compare(full, snap, m, center)
                for k, v in means.items():
                    pos[f"{k}{suffix}"][i, c] = v
                if not center:
                    for k, v in crv.items():
                        curves[k][i, c, max_tail - m :] = v

    def prefill(seq: list[int]) -> KVSnapshot | None:
        return handle.prefill(seq, all_logits=False).snapshot if seq else None

    first_full: KVSnapshot | None = None
    prev_full: KVSnapshot | None = None
    u = CONDITIONS.index("unrelated")
    with ctx.progress.task("compaction: conversations", total=N) as advance:
        for i in range(N):
            full = handle.prefill(ids[i]["full"], all_logits=False).snapshot
            full_cent[i] = cache_centroids(full)
            if full.seq_len - tail[i] >= 1:
                full_pre[i] = cache_centroids(full.slice(0, full.seq_len - int(tail[i])))
            for c, name in enumerate(CONDITIONS):
                if (
                    name == "unrelated"
                ):  # the previous conversation's full cache (conversation 0's comes last)
                    if prev_full is not None:
                        measure(i, full, c, prev_full, ids[i]["unrelated"])
                    continue
                measure(i, full, c, prefill(ids[i][name]), ids[i][name])
            if i == 0:
                first_full = full
            prev_full = full
            advance(1)
        if first_full is not None:
            measure(0, first_full, u, prev_full, ids[0]["unrelated"])

    return cent, pre, full_cent, full_pre, pos, curves


def _per_conv(x: np.ndarray) -> np.ndarray:
    """Mean over the trailing [layers, heads] axes -> one number per conversation (and condition)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(x, axis=(-2, -1))


def _iv(x: np.ndarray | float) -> Interval | None:
    x = np.asarray(x, dtype=np.float64)
    return bootstrap_ci(x, seed=0) if np.isfinite(x).any() else None


def _s(iv) -> str:
    return "n/a" if iv is None else iv.text(".3f")


def _report(ctx, result, name, convs, tokens, tail, sim, pos, curves) -> None:
    """Tables, summary, the confound note and the figures."""
    N = len(convs)
    summary: dict[str, Any] = {"conversations": N, "conditions": list(CONDITIONS), "centroid": {}, "tail": {}}
    result.tables.append(_centroid_table(sim, summary))
    result.tables.append(_paired_centroid_table(sim, summary))
    result.tables.append(_tail_table(pos, tail, summary))
    share = tail / tokens[:, 1]
    result.tables.append(_conversation_table(tokens, tail, share, sim))
    _confound(result, summary, share)
    if N < 20:
        result.notes.append(
            f"Intervals are over {N} conversations only (fewer than the 20 the study asks for)."
        )
    result.figures.extend(_figures(ctx, name, sim, curves))


#: the centroid table's similarity columns (V and de-rotated K, raw and centred)
CENTROID_COLUMNS = ("v", "v_centred", "k_derotated", "k_derotated_centred")
#: where each column's numbers sit in the similarity arrays: (K 0 / V 1, raw or centred)
CENTROID_SOURCES = dict(
    zip(CENTROID_COLUMNS, ((1, "raw"), (1, "centred"), (0, "raw"), (0, "centred")), strict=True)
)


def _centroid_table(sim: dict, summary: dict) -> Table:
    """Centroid similarity per condition (raw, centred, vs unrelated); fills ``summary["centroid"]``."""
    u = CONDITIONS.index("unrelated")
    thread = thread_centroid_v()
    rows = []
    for c, cond in enumerate(CONDITIONS):
        v_raw, k_raw = _per_conv(sim["raw"][:, c, 1]), _per_conv(sim["raw"][:, c, 0])
        v_cen, k_cen = _per_conv(sim["centred"][:, c, 1]), _per_conv(sim["centred"][:, c, 0])
        v_norm = normalise_against_baseline(v_raw, _per_conv(sim["raw"][:, u, 1]))
        entry = {
            "v": _iv(v_raw),
            "k_derotated": _iv(k_raw),
            "v_centred": _iv(v_cen),
            "k_derotated_centred": _iv(k_cen),
            "v_vs_unrelated": _iv(v_norm) if cond != "unrelated" else None,
        }
        summary["centroid"][cond] = {k: (v.to_json() if v else None) for k, v in entry.items()}
        cells = [_s(entry[k]) for k in (*CENTROID_COLUMNS, "v_vs_unrelated")]
        rows.append([LABELS[cond], *cells, f"{thread[cond]:.2f}" if cond in thread else ""])
    c = CONDITIONS.index("compacted")
    pre = {
        k: _iv(_per_conv(sim[f"pretail_{kind}"][:, c, which]))
        for k, (which, kind) in CENTROID_SOURCES.items()
    }
    summary["centroid"]["compacted_summary_region"] = {
        k: (iv.to_json() if iv else None) for k, iv in pre.items()
    }
    cells = [_s(pre[k]) for k in CENTROID_COLUMNS]
    rows.append(["compacted without its verbatim tail vs the full history before it", *cells, "", ""])
    return Table(
        "Centroid similarity to the full conversation (mean over layers and KV heads; 95% CI over conversations)",
        Table.header(
            "condition | V | V centred | K de-rotated | K de-rotated centred | "
            "V vs unrelated (0 = unrelated, 1 = identical) | thread V (Qwen2.5-14B)"
        ),
        rows,
        caption="Centred: each centroid minus the mean full-conversation centroid of the other conversations. "
        "Thread numbers from the research brief (no interval).",
    )


def _paired_cell(d: Interval | None) -> str:
    """``+0.1 [+0.05, +0.2] (n = 10): above 0``, or the value and why there is no interval."""
    if d is None:
        return "n/a"
    return (
        f"{format_interval(d, signed=True)}: {side_of_zero(d.to_json())}"
        if d.has_interval
        else format_interval(d, signed=True)
    )


def _paired_centroid_table(sim: dict, summary: dict) -> Table:
    """The compacted cache minus each other condition, conversation by conversation (the same full
    conversation on both sides); fills ``summary["centroid_paired"]``."""
    c = CONDITIONS.index("compacted")
    rows, summary["centroid_paired"] = [], {}
    for o, cond in enumerate(CONDITIONS):
        if cond == "compacted":
            continue
        diffs = {
            k: _iv(_per_conv(sim[kind][:, c, which]) - _per_conv(sim[kind][:, o, which]))
            for k, (which, kind) in CENTROID_SOURCES.items()
        }
        summary["centroid_paired"][cond] = {k: (d.to_json() if d else None) for k, d in diffs.items()}
        cells = [_paired_cell(d) for d in diffs.values()]
        rows.append([f"compacted − {LABELS[cond]}", *cells])
    return Table(
        "Compacted minus each other condition, paired per conversation (centroid cosine to the full conversation)",
        ["difference", "V", "V centred", "K de-rotated", "K de-rotated centred"],
        rows,
        caption="Per conversation, the compacted cache's centroid cosine minus the other condition's (both "
        "against the same full conversation), mean with a 95% bootstrap interval over conversations and where "
        f"it lies; fewer than {MIN_SAMPLES} conversations: no interval.",
    )


#: the tail table's columns, after the condition
TAIL_COLUMNS = ("cos_v", "cos_kd", "cos_k", "cos_v_centred", "cos_kd_centred")


def _tail_table(pos: dict, tail: np.ndarray, summary: dict) -> Table:
    """Position-wise similarity on the shared verbatim tail; fills ``summary["tail"]``."""
    trows = []
    for c, cond in enumerate(CONDITIONS):
        ivs = {k: _iv(_per_conv(v[:, c])) for k, v in pos.items()}
        summary["tail"][cond] = {k: (v.to_json() if v else None) for k, v in ivs.items()}
        trows.append([LABELS[cond], *(_s(ivs[k]) for k in TAIL_COLUMNS)])
    return Table(
        "Position-wise on the shared verbatim tail (last tokens of each cache vs the full cache's last tokens)",
        Table.header(
            "condition | cos V | cos K de-rotated | cos K raw | cos V centred | cos K de-rotated centred"
        ),
        trows,
        caption=f"Tail: the tokens the full and compacted chats share at the end ({tail.mean():.0f} on average). "
        "Verbatim and compacted hold the same tokens there; summary only, shuffled and unrelated hold other "
        "tokens at those slots and serve as baselines.",
    )


def _conversation_table(tokens: np.ndarray, tail: np.ndarray, share: np.ndarray, sim: dict) -> Table:
    """Tokens and centroid V cosine of every conversation."""
    N = len(tokens)
    crow = []
    for i in range(N):
        crow.append(
            [i, int(tokens[i, 0]), int(tokens[i, 1]), int(tail[i]), f"{share[i]:.2f}"]
            + [f"{_per_conv(sim['raw'][i, c, 1]):.3f}" for c in range(len(CONDITIONS))]
        )
    return Table(
        "Per conversation: tokens and centroid V cosine to the full cache",
        ["#", "full tokens", "compacted tokens", "verbatim tail tokens", "tail share of compacted"]
        + [f"V: {c}" for c in CONDITIONS],
        crow,
    )


def _confound(result: ExperimentResult, summary: dict, share: np.ndarray) -> None:
    """How much of the compacted cache's margin the verbatim tail alone explains (summary and a note)."""
    cv = summary["centroid"]
    v_comp, v_tail, v_sum, v_unrel = (
        cv[k]["v"]["value"] for k in ("compacted", "verbatim_tail_only", "summary_only", "unrelated")
    )
    margin = v_comp - v_unrel
    split = margin >= MIN_MARGIN
    summary["confound"] = {
        "tail_share_of_compacted_mean": float(share.mean()),
        "compacted_margin_over_unrelated": float(margin),
        "verbatim_only_share_of_margin": float((v_tail - v_unrel) / margin) if split else None,
        "summary_only_share_of_margin": float((v_sum - v_unrel) / margin) if split else None,
    }
    result.summary.update(summary)
    result.notes.append(
        f"Confound: the last turns are kept verbatim and make up {share.mean():.0%} of the compacted tokens on "
        f"average. Centroid V cosine to the full cache: compacted {v_comp:.3f}, verbatim last turns alone "
        f"{v_tail:.3f}, summary alone {v_sum:.3f}, unrelated {v_unrel:.3f}"
        + (
            f"; the verbatim turns alone recover {summary['confound']['verbatim_only_share_of_margin']:.0%} of the "
            f"compacted's margin over unrelated, the summary alone "
            f"{summary['confound']['summary_only_share_of_margin']:.0%}."
            if split
            else f"; compacted is not above unrelated by {MIN_MARGIN} (margin {margin:+.3f}), so the margin is "
            "not split into shares (the centred cosines separate the conditions better)."
        )
    )


def _figures(ctx, name, sim, curves) -> list:
    """Centroid similarity, the tail slot by slot, and V centroids by layer."""
    cs = colors()
    return [
        _centroid_figure(ctx, name, sim, cs),
        _tail_figure(ctx, name, curves, cs),
        _layer_figure(ctx, name, sim, cs),
    ]


def _centroid_figure(ctx, name, sim, colors):
    fig, axes = subplots(1, 2, figsize=(12, 4.4), sharey=True)
    x = np.arange(len(CONDITIONS) + 1)
    labels = [LABELS[c] for c in CONDITIONS] + ["compacted minus tail vs full history"]
    comp = CONDITIONS.index("compacted")
    for ax, which, title in ((axes[0], 1, "V"), (axes[1], 0, "K (de-rotated)")):
        for j, (kind, off) in enumerate((("raw", -0.18), ("centred", 0.18))):
            vals = [_iv(_per_conv(sim[kind][:, c, which])) for c in range(len(CONDITIONS))]
            vals.append(_iv(_per_conv(sim[f"pretail_{kind}"][:, comp, which])))
            y = [v.value if v else np.nan for v in vals]
            err = [[v.value - v.low if v else 0 for v in vals], [v.high - v.value if v else 0 for v in vals]]
            ax.bar(x + off, y, width=0.36, yerr=err, capsize=3, color=colors[j], label=kind)
        if which == 1:
            for k, val in thread_centroid_v().items():
                ax.plot(
                    CONDITIONS.index(k),
                    val,
                    "k*",
                    ms=10,
                    label="thread (Qwen2.5-14B)" if k == "compacted" else None,
                )
        ax.axhline(0, color="k", lw=0.6)
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("centroid cosine to the full conversation")
        ax.set_title(f"{title} centroids")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle(f"{name}: compacted vs full conversation, with lexical controls (95% CI over conversations)")
    return ctx.figure(
        "centroid_similarity",
        fig,
        "Centroid cosine to the full conversation's cache per "
        "condition, raw and centred; stars: the thread's numbers.",
    )


def _tail_figure(ctx, name, curves, colors):
    fig, axes = subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, metric, title in ((axes[0], "cos_v", "V"), (axes[1], "cos_kd", "K de-rotated")):
        n_tail = curves[metric].shape[-1]
        back = np.arange(n_tail)[::-1]  # tokens before the end
        for c, cond in enumerate(CONDITIONS):
            data = curves[metric][:, c]
            keep = np.isfinite(data).sum(axis=0) >= 2
            if not keep.any():
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                shade(ax, back[keep], data[:, keep], colors[c % len(colors)], lw=1, label=LABELS[cond])
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xlim(max(n_tail - 1, 1), 0)  # the end of the conversation on the right
        ax.set_title(f"{title}, along the shared verbatim tail")
        style(ax, "tokens before the end of the conversation", "cosine to the full cache at the same slot")
    fig.suptitle(f"{name}: position-wise similarity on the last tokens (95% bands over conversations)")
    return ctx.figure(
        "tail_positionwise",
        fig,
        "Cosine to the full cache slot by slot over the shared tail; "
        "the verbatim tail with less context above it vs the controls.",
    )


def _layer_figure(ctx, name, sim, colors):
    fig, axes = subplots(1, 2, figsize=(12, 4.0), sharey=True)
    L = sim["raw"].shape[-2]
    depth = np.arange(L)
    for ax, kind in ((axes[0], "raw"), (axes[1], "centred")):
        for c, cond in enumerate(CONDITIONS):
            per_layer = np.nanmean(sim[kind][:, c, 1], axis=-1)  # [N, L]
            if not np.isfinite(per_layer).any():
                continue
            shade(ax, depth, per_layer, colors[c % len(colors)], label=LABELS[cond])
        style(ax, "layer", "V centroid cosine to the full conversation", f"per layer, {kind}")
    fig.suptitle(f"{name}: V centroid similarity by layer (95% bands over conversations)")
    return ctx.figure(
        "centroid_v_by_layer",
        fig,
        "V centroid cosine per layer for each condition, raw and centred on the other conversations' mean.",
    )


def describe(s: dict) -> tuple[str, list[tuple[str, str]]]:
    """Finding and headline numbers for the report, from this run's summary."""
    text = (
        f"Over {s.get('conversations', '?')} conversations, the compacted cache's centred V centroid is at cosine "
        f"{format_number(num(s, 'centroid.compacted.v_centred'))} to the full one, against "
        f"{format_number(num(s, 'centroid.verbatim_tail_only.v_centred'))} for the verbatim tail alone and "
        f"{format_number(num(s, 'centroid.unrelated.v_centred'))} for an unrelated conversation"
        + (
            f" (compacted minus the tail alone, paired per conversation: "
            f"{iv(s, 'centroid_paired.verbatim_tail_only.v_centred', signed=True)})."
            if dig(s, "centroid_paired.verbatim_tail_only.v_centred")
            else "."
        )
    )
    rows = [
        (f"centred V centroid cosine, {c.replace('_', ' ')}", iv(s, f"centroid.{c}.v_centred"))
        for c in ("compacted", "verbatim_tail_only", "summary_only", "unrelated")
    ]
    rows += [
        (
            f"centred V centroid cosine, compacted minus {cond} (paired)",
            iv(s, f"centroid_paired.{cond}.v_centred", signed=True),
        )
        for cond in ("verbatim_tail_only", "unrelated")
        if dig(s, f"centroid_paired.{cond}.v_centred")
    ]
    return text, rows


EXPERIMENT = Experiment(
    seed_changes="the lexical control's word shuffle; without the shared UltraChat set, also which Python documentation topics the model's own conversations are about (the UltraChat set is always all ten)",
    describe=describe,
    name="compaction",
    title="Compaction: full vs compacted caches, with lexical controls",
    run=run,
    order=70,
    description="Centroid and tail similarity of compacted vs full conversations, "
    "with lexical controls and centring.",
)
