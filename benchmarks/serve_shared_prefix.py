"""Benchmark: a shared document compressed once and reused through ``kvlab serve``, beside exact reuse and kvpress.

The workload is RULER's multi-key needle task with the document shared: each document
(:func:`kvlab.eval.tasks.make_trial` ``niah_multikey``, seeded, on the bundled SmolLM2-135M-Instruct) hides
four keys with a number each; it is sent as the system message of four conversations, one per key, whose
questions differ. Per cache policy one ``kvlab serve`` subprocess answers every question through the
``openai`` client (greedy, streamed), one document after another, so the first question of a document
computes its prefix and the three others reuse it:

* **exact**: ``sinks=4,window=W`` with W above every conversation (nothing rolls: the full cache), the
  document's blocks shared through the exact store;
* **compressed**: ``SCORE,keep=K,every=E[,prefix=kvzip]``: the document compressed once, alone, by the
  prefix score (:mod:`kvlab.serve.prefixes`), stored under the policy and seeded into every conversation
  that shares it; ``every`` is above every question + answer, so nothing else is evicted (kvpress's setting:
  the context compressed, the question and answer not).

Measured per policy: time to the first token (TTFT) of the first question of each document (a miss) and of
the others (hits); the K/V bytes each conversation's cache holds when it ends (the server's
``kvlab.cache_bytes``); accuracy (RULER's string match, Wilson intervals) and its paired difference to the
exact server on the same questions; and, on the same token ids, teacher-forced KL(P_full || P_policy) and
top-1 agreement over question + the exact answer: kvlab's side from the compressed prefix the server would
seed (:meth:`~kvlab.policy.layouts.Layout.compress_prefix`, equal to the served cache: tested in
``tests/test_serve_shared_prefix.py``), kvpress's ``KVzipPress`` from the anchor worker
(``benchmarks/anchors/``, kvpress 0.5.5 in its own venv) on the very ids the server saw.

Writes ``benchmarks/results/serve_shared_prefix.md``; raw rows in ``benchmarks/out/serve_shared_prefix/``.

    python3 benchmarks/serve_shared_prefix.py --docs 2 --no-kvpress          # smoke run
    python3 benchmarks/serve_shared_prefix.py --docs 12 --length 1024        # the result file's run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Refusal, run_main, write_results  # noqa: E402
from serve import LOGS, free_port, start, stop  # noqa: E402

MODEL = "smollm2-135m"
OUT = LOGS / "serve_shared_prefix"
NEEDLE = re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\.")
MAX_TOKENS = 24


def documents(handle: Any, n: int, length: int) -> list[dict]:
    """``n`` seeded multi-key documents, each with its four (question, answer) pairs."""
    from kvlab.eval.tasks import _ask_one, make_trial

    docs = []
    for seed in range(n):
        trial = make_trial("niah_multikey", handle, length, seed)
        pairs = NEEDLE.findall(trial.context)
        if len(pairs) != 4:
            raise RuntimeError(f"document {seed}: expected 4 needles, found {len(pairs)}")
        docs.append(
            {"seed": seed, "context": trial.context, "qa": [(_ask_one(k).strip(), v) for k, v in pairs]}
        )
    return docs


def messages(doc: dict, question: str) -> list[dict]:
    return [{"role": "system", "content": doc["context"]}, {"role": "user", "content": question}]


def ids_of(tok: Any, doc: dict, question: str) -> tuple[list[int], int]:
    """The ids the server builds for this conversation, and how many lead ones it pins (its rule:
    ``kvlab.serve.app._encode_chat``, the tokens shared with any other first user turn)."""

    def template(msgs: list[dict]) -> list[int]:
        out = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        return [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]

    ids = template(messages(doc, question))
    other = template(messages(doc, "\u2063kvlab"))
    pinned = next((i for i, (a, b) in enumerate(zip(ids, other, strict=False)) if a != b), len(ids))
    return ids, pinned


def ask(client: openai.OpenAI, base: str, msgs: list[dict]) -> dict:
    """One streamed greedy answer: TTFT, text and the server's ``kvlab`` field (with ``fidelity`` fetched from
    its follow-up URL when the response was scored)."""
    t0 = time.perf_counter()
    ttft, parts, info = None, [], {}
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content and ttft is None:
            ttft = (time.perf_counter() - t0) * 1000
        if ch.choices and ch.choices[0].delta.content:
            parts.append(ch.choices[0].delta.content)
        if (ch.model_extra or {}).get("kvlab"):
            info.update(ch.model_extra["kvlab"])
    row = {"ttft_ms": ttft if ttft is not None else (time.perf_counter() - t0) * 1000, "text": "".join(parts)}
    if info.get("fidelity_url"):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            get = urllib.request.Request(
                base + info["fidelity_url"].removeprefix("/v1"), headers={"Authorization": "Bearer x"}
            )
            with urllib.request.urlopen(get, timeout=60) as resp:
                body = json.loads(resp.read())
            if body.get("status") != "pending":
                row["fidelity"] = body.get("fidelity")
                break
            time.sleep(0.2)
    return {**row, "info": info}


def serve_policy(spec: str, docs: list[dict], window: int, fidelity: bool) -> list[dict]:
    """Every question of every document through one fresh ``kvlab serve`` with ``--cache spec``."""
    from kvlab.eval.score import score

    port = free_port()
    cmd = [sys.executable, "-m", "kvlab", "serve", "--port", str(port), "--cache", spec]
    cmd += ["--max-tokens", str(MAX_TOKENS), "--store", "memory"]
    if fidelity:
        cmd += ["--fidelity-sample", "1"]
    name = re.sub(r"[^A-Za-z0-9]+", "-", spec)
    server = start(cmd, port, OUT / f"serve-{name}.log")
    base = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=900)
    rows = []
    try:
        for doc in docs:
            for j, (question, answer) in enumerate(doc["qa"]):
                r = ask(client, base, messages(doc, question))
                info = r["info"]
                rows.append(
                    {
                        "spec": spec,
                        "doc": doc["seed"],
                        "question": j,
                        "hit": j > 0,
                        "ttft_ms": r["ttft_ms"],
                        "score": score(r["text"], [answer], "all"),
                        "text": r["text"],
                        "completion_ids": info.get("completion_ids"),
                        "cache_bytes": info.get("cache_bytes"),
                        "kept_tokens": info.get("kept_tokens"),
                        "source": info.get("source"),
                        "prefix_source": (info.get("compressed_prefix") or {}).get("source"),
                        "fidelity": r.get("fidelity"),
                    }
                )
    finally:
        stop(server)
    return rows


def offline_kl(handle: Any, spec: str, trials: list[dict]) -> dict[str, dict]:
    """KL(P_full || P_cache) and top-1 agreement per trial (``"doc/question"``) on question + the exact answer
    (teacher-forced; the anchor worker's float64 formula, :func:`kvlab.metrics.divergence.token_kl`). A served
    spec's cache is the compressed prefix the server seeds; any other spec's is the eval's offline application of
    its layout to the context (:meth:`~kvlab.policy.layouts.Layout.apply`), e.g. ``heads=global``."""
    from kvlab.metrics.divergence import token_kl, top1_agreement
    from kvlab.policy.evict import observe
    from kvlab.policy.spec import parse

    policy = parse(spec)
    out, contexts = {}, {}
    for t in trials:
        ctx, rest = t["context_ids"], t["question_ids"] + t["answer_ids"][:-1]
        if tuple(ctx) not in contexts:
            obs = observe(handle, ctx)
            shared = policy.layout.compresses_prefix(len(ctx))
            held = policy.layout.compress_prefix(handle, ctx) if shared else None
            applied = None if held is not None else policy.layout.apply(policy, obs, handle)[0]
            contexts[tuple(ctx)] = (obs.snapshot, held, applied)
        full, held, applied = contexts[tuple(ctx)]
        ref = handle.forward(rest, full, all_logits=True).logits.double()
        got = (
            _seeded_logits(handle, policy, held, len(ctx), rest)
            if held is not None
            else handle.forward(rest, applied, all_logits=True).logits.double()
        )
        out[f"{t['doc']}/{t['question']}"] = {
            "kld": float(token_kl(ref, got).mean()),
            "top1": float(top1_agreement(ref, got).float().mean()),
        }
    return out


def _seeded_logits(handle: Any, policy: Any, held: Any, seen: int, rest: list[int]) -> Any:
    """Logits of ``rest`` on a conversation's live cache started from the compressed prefix ``held``."""
    import torch

    from kvlab.policy.spec import cache_for

    cache = cache_for(policy.live(), handle)
    cache.seed_kept(held, seen)
    with torch.no_grad():
        got = handle.run(torch.tensor([rest]), cache, logits_to_keep=0).logits[0].double()
    cache.close()
    return got


def paired(a: dict, b: dict, seed: int, share: bool = False) -> tuple[dict | None, str]:
    """Mean of a - b over the trials both have, its interval (for scores in [0, 1], ``share``: Tango's paired
    score interval, not degenerate when pairs tie; else a bootstrap of the differences), and what it says."""
    from kvlab.metrics.stats import bootstrap_ci, paired_share_ci

    keys = sorted(set(a) & set(b))
    if len(keys) < 5:
        return None, f"n = {len(keys)}, no interval"
    if share:
        iv = paired_share_ci([a[k] for k in keys], [b[k] for k in keys]).to_json()
    else:
        iv = bootstrap_ci([a[k] - b[k] for k in keys], seed=seed).to_json()
    return iv, "lower" if iv["high"] < 0 else "higher" if iv["low"] > 0 else "no difference seen"


def fmt(iv: dict | None, digits: int = 2) -> str:
    if iv is None or iv.get("value") is None:
        return "—"
    mean = f"{iv['value']:.{digits}f}"
    if iv.get("low") is None:
        return f"{mean} (n = {iv.get('n', '?')}, no interval)"
    return f"{mean} [{iv['low']:.{digits}f}, {iv['high']:.{digits}f}]"


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=12, help="documents (4 questions each)")
    ap.add_argument("--length", type=int, default=1024, help="tokens per document + question")
    ap.add_argument("--keeps", default="0.5,0.25", help="fractions of the document kept (comma-separated)")
    ap.add_argument("--scores", default="h2o,snapkv", help="live scores whose own prefix compression is run")
    ap.add_argument("--no-kvpress", action="store_true", help="skip kvpress's KVzipPress")
    ap.add_argument("--no-fidelity", action="store_true", help="serve without --fidelity-sample 1")
    ap.add_argument(
        "--phase",
        default="all",
        choices=("all", "serve", "offline", "report"),
        help="run one phase from the raw files",
    )
    args = ap.parse_args()
    keeps = [float(k) for k in args.keeps.split(",") if k]
    if args.docs < 2 or not keeps or not all(0 < k < 1 for k in keeps):
        raise Refusal("need --docs >= 2 and --keeps fractions in (0, 1)")
    run(args, keeps)


def run(args: argparse.Namespace, keeps: list[float]) -> None:
    """The phases, each from the raw files of the ones before (``--phase``): serve, offline, report."""
    from kvlab import load_model

    OUT.mkdir(parents=True, exist_ok=True)
    handle = load_model(MODEL)
    docs = documents(handle, args.docs, args.length)
    window = 2 * args.length + 4 * MAX_TOKENS
    every = 4 * MAX_TOKENS + 64  # above any question + answer: nothing but the document is compressed
    exact = f"sinks=4,window={window}"
    specs = [exact]
    for keep in keeps:
        specs += [f"{s},keep={keep},every={every}" for s in args.scores.split(",") if s]
        specs.append(f"{args.scores.split(',')[0]},keep={keep},every={every},prefix=kvzip")
    offline = [*specs[1:], *(f"kvzip,keep={k},heads=global,sinks=4" for k in keeps)]
    if args.phase in ("all", "serve"):
        rows: list[dict] = []
        for spec in specs:
            print(f"serving {spec} ...", flush=True)
            rows += serve_policy(spec, docs, window, fidelity=spec != exact and not args.no_fidelity)
            (OUT / "rows.json").write_text(json.dumps(rows))
    rows = json.loads((OUT / "rows.json").read_text())
    trials = exact_trials(handle, docs, [r for r in rows if r["spec"] == exact])
    if args.phase in ("all", "offline"):
        (OUT / "trials.json").write_text(json.dumps(trials))
        kl = {}
        for spec in offline:
            print(f"offline {spec} ...", flush=True)
            kl[spec] = offline_kl(handle, spec, trials)
            (OUT / "kl.json").write_text(json.dumps(kl))
        press = [] if args.no_kvpress else kvpress_rows(handle, trials, keeps)
        (OUT / "kvpress.json").write_text(json.dumps(press))
    if args.phase not in ("all", "report"):
        return
    kl = json.loads((OUT / "kl.json").read_text())
    press = json.loads((OUT / "kvpress.json").read_text())
    report(args, specs, exact, rows, kl, press, trials, slot_bytes(handle))


def slot_bytes(handle: Any) -> int:
    """K/V bytes of one token in every layer (keys and values, the model's dtype)."""
    import torch

    from kvlab.hf.cache import head_dim_of

    cfg = handle.config
    size = torch.empty(0, dtype=handle.dtype).element_size()
    return int(cfg.num_hidden_layers) * int(cfg.num_key_value_heads) * head_dim_of(cfg) * 2 * size


def exact_trials(handle: Any, docs: list[dict], exact_rows: list[dict]) -> list[dict]:
    """The ids the exact server saw, split where it pins (the shared document), with its answer's ids."""
    by = {(r["doc"], r["question"]): r for r in exact_rows}
    out = []
    for doc in docs:
        for j, (question, answer) in enumerate(doc["qa"]):
            ids, pinned = ids_of(handle.tokenizer, doc, question)
            answer_ids = by[(doc["seed"], j)]["completion_ids"] or [handle.tokenizer.eos_token_id]
            out.append(
                {
                    "doc": doc["seed"],
                    "question": j,
                    "answers": [answer],
                    "context_ids": ids[:pinned],
                    "question_ids": ids[pinned:],
                    "answer_ids": list(answer_ids),
                }
            )
    return out


def kvpress_rows(handle: Any, trials: list[dict], keeps: list[float]) -> list[dict]:
    """kvpress's ``KVzipPress`` at ratio ``1 - keep`` on each trial's ids (the anchor worker, its own venv): per
    trial and ratio the greedy answer, scored like the server's, and KL / top-1 on question + the exact answer."""
    from anchors.run_anchors import ruler_rows
    from kvlab.eval.score import score
    from kvlab.model.loading import bundled_model_dir

    ratios = [round(1 - k, 6) for k in keeps]
    raw = ruler_rows(
        bundled_model_dir(),
        [(t["context_ids"], t["question_ids"], t["answer_ids"]) for t in trials],
        ratios,
        stop_ids=sorted(handle.eos_ids()),
        presses=("kvzip",),
        max_new_tokens=MAX_TOKENS,
        workdir=OUT / "kvpress",
    )
    out = []
    for r in raw:
        if not str(r.get("setup", "")).startswith("kvzip"):
            continue
        t = trials[int(r["trial"])]
        text = handle.tokenizer.decode(r["answer_ids"], skip_special_tokens=True)
        out.append(
            {
                "trial": f"{t['doc']}/{t['question']}",
                "ratio": round(float(r["setup"].split(":")[1]), 6),
                "score": score(text, t["answers"], "all"),
                "kld": r["kld"],
                "top1": r["top1"],
                "kept": sum(r.get("kept_per_layer") or [0]),
            }
        )
    return out


def report(
    args: argparse.Namespace,
    specs: list[str],
    exact: str,
    rows: list[dict],
    kl: dict[str, dict],
    press: list[dict],
    trials: list[dict],
    slot: int,
) -> None:
    from kvlab.eval.run import interval

    ex = {(r["doc"], r["question"]): r["score"] for r in rows if r["spec"] == exact}
    ex_held = median([r["kept_tokens"] * slot for r in rows if r["spec"] == exact])
    lines = [
        "| cache | accuracy | paired Δ to exact | TTFT miss / hit (ms, median) | K/V held per conversation: "
        "slots × bytes (median) | allocated (the server's `cache_bytes`) | prefix hits | served fidelity: KL, top-1 "
        "(mean) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, spec in enumerate(specs):
        rs = [r for r in rows if r["spec"] == spec]
        acc = interval([r["score"] for r in rs], seed=i, share=True)
        mine = {(r["doc"], r["question"]): r["score"] for r in rs}
        d, says = paired(mine, ex, seed=i, share=True) if spec != exact else (None, "—")
        miss = median([r["ttft_ms"] for r in rs if not r["hit"]])
        hit = median([r["ttft_ms"] for r in rs if r["hit"]])
        b = median([r["cache_bytes"] for r in rs])
        held = median([r["kept_tokens"] * slot for r in rs])
        hits = sum(
            1
            for r in rs
            if r["hit"] and (r["prefix_source"] or r["source"]) not in (None, "none", "computed")
        )
        fid = [r["fidelity"] for r in rs if r.get("fidelity")]
        fkl = statistics.fmean(f["kl"] for f in fid) if fid else math.nan
        ft1 = statistics.fmean(f["top1"] for f in fid) if fid else math.nan
        lines.append(
            f"| `{spec}` | {fmt(acc)} | {fmt(d)} {says if d else ''} | {miss:.0f} / {hit:.0f} | "
            f"{held / 2**20:.1f} MiB ({held / ex_held:.2f}x) | {b / 2**20:.1f} MiB | "
            f"{hits}/{sum(r['hit'] for r in rs)} | "
            + ("—" if not fid else f"{fkl:.3f}, {ft1:.3f} (n = {len(fid)})")
            + " |"
        )
    body = [
        f"{args.docs} documents of about {args.length} tokens (`niah_multikey`, seeds 0..{args.docs - 1}), "
        f"four questions each ({len(trials)} conversations per cache); answers greedy, at most {MAX_TOKENS} tokens. "
        "Each document is the system message, so the server pins it and shares it: the exact server through "
        "its block store, the compressed ones as one compressed prefix per document and policy. Accuracy: Wilson "
        "interval; paired Δ: Tango's paired score interval over the same questions. TTFT: the first question of a document (miss) "
        "and the three others (hits), streamed, on one server process at a time.",
        "",
        *lines,
        "",
        *same_ids_lines(kl, press, rows),
    ]
    write_results(
        "serve_shared_prefix",
        "A shared document compressed once and reused through kvlab serve",
        "\n".join(body),
    )


def same_ids_lines(kl: dict[str, dict], press: list[dict], rows: list[dict]) -> list[str]:
    """KL and top-1 on the same ids, teacher-forced on question + the exact answer: kvlab's caches (served
    compressed prefixes, and the eval's offline ones) beside kvpress's KVzipPress, each KVzip paired with
    kvpress's at the same ratio; accuracy where the cache answered (the server's, kvpress's greedy answers)."""
    from kvlab.eval.run import interval

    lines = [
        "Same token ids, teacher-forced on question + the exact server's answer: KL(P_full || P_cache) per token "
        "(mean over tokens, then over conversations) and top-1 agreement. kvlab's served rows start from the "
        "compressed prefix the server seeds; `heads=global` rows are the eval's offline eviction (top slots over "
        "every layer and KV head together, kvpress's KVzip allocation); kvpress's `KVzipPress` (ratio = 1 − keep, "
        "its defaults) compresses the same context ids in its own environment.",
        "",
        "| cache | accuracy | KL | top-1 | paired Δ KL to kvpress KVzip at the same ratio |",
        "|---|---|---|---|---|",
    ]
    by_press: dict[float, dict] = {}
    for r in press:
        by_press.setdefault(r["ratio"], {})[r["trial"]] = r
    for i, (spec, per) in enumerate(kl.items()):
        served = [r["score"] for r in rows if r["spec"] == spec]
        acc = fmt(interval(served, seed=i, share=True)) if served else "— (not served)"
        row = f"| `{spec}` | {acc} | {fmt(interval([v['kld'] for v in per.values()], seed=i), 4)} | "
        row += f"{fmt(interval([v['top1'] for v in per.values()], seed=i), 3)} | "
        keep = float(re.search(r"keep=([0-9.]+)", spec).group(1))
        other = by_press.get(round(1 - keep, 6))
        if "kvzip" in spec and other:
            d, says = paired(
                {k: v["kld"] for k, v in per.items()}, {k: v["kld"] for k, v in other.items()}, i
            )
            row += f"{fmt(d, 4)} {says}"
        lines.append(row + " |")
    for ratio, per in sorted(by_press.items()):
        acc = interval([v["score"] for v in per.values()], seed=7, share=True)
        lines.append(
            f"| kvpress `KVzipPress(compression_ratio={ratio:g})` | {fmt(acc)} | "
            f"{fmt(interval([v['kld'] for v in per.values()], seed=7), 4)} | "
            f"{fmt(interval([v['top1'] for v in per.values()], seed=7), 3)} | |"
        )
    return lines


if __name__ == "__main__":
    run_main(main)
