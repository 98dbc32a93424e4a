"""Benchmark: what scoring fidelity per response costs the requests that are NOT scored (issue 49 item 2).

``kvlab serve --fidelity-sample F`` teacher-forces a sampled share of responses on the exact full cache, at low
priority: never in an iteration that computes a prompt, and at most ``fidelity_chunk`` (32) tokens between two
decode steps while any request is live. This measures the requests left unscored, under the same load, with
``--fidelity-sample 0`` and ``0.25`` side by side: requests per second over the whole load, and per unscored
request its latency (first byte to ``[DONE]``), time to first token and longest pause between two streamed
chunks (where a scoring pass would show).

Each run starts one server (``--model tiny``, the default: the tiny random-weight model with a
character-level tokenizer of ``tests/tiny_serve.py``, built into a scratch folder, so the run takes a few
minutes on a CPU; or a model spec such as ``smollm2-135m``; ``--cache h2o,budget=128,every=32``,
``--fidelity-wait 0``, ``--max-batch 4``) and runs ``--convs`` conversations at once, each ``--turns`` turns of
fixed questions, every reply streamed (``max_tokens`` 16, greedy) and sent back in the history. Runs alternate
the two settings (the order flips every round). The scored responses' own scores are read from their follow-up
URLs at the end of each run and summarised.

Run: python benchmarks/serve_fidelity_overhead.py [--rounds 3] [--convs 4] [--turns 8] [--model tiny|smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.tiny_serve
from _common import Refusal, run_main, write_results  # noqa: E402
from serve import LOGS, client_for, free_port, start, stop  # noqa: E402

SPEC = "h2o,budget=128,every=32"
SAMPLES = ("0", "0.25")
TINY = " (the random-weight model of tests/tiny_serve.py)"
QUESTIONS = [
    "Explain how a bicycle stays upright.",
    "What are the main causes of inflation?",
    "Summarize the plot of Hamlet in a few sentences.",
    "How do vaccines train the immune system?",
    "Give me three tips for writing clear documentation.",
    "Why is the sky blue?",
    "What does a compiler do?",
    "Describe the water cycle.",
]


def one_turn(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed reply: its text, latency, time to first token, longest gap between chunks, its kvlab."""
    t0 = time.perf_counter()
    last, gaps, first, parts, info = t0, [], None, [], {}
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    )
    for ch in stream:
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        if ch.choices and ch.choices[0].delta.content:
            first = first if first is not None else now - t0
            parts.append(ch.choices[0].delta.content)
        info.update((ch.model_extra or {}).get("kvlab") or {})
    end = time.perf_counter()
    return {
        "text": "".join(parts),
        "latency": end - t0,
        "ttft": first if first is not None else end - t0,
        "gap": max(gaps[1:], default=0.0),  # between chunks, the first (time to the role chunk) left out
        "url": info.get("fidelity_url"),
    }


def one_run(model: str, sample: str, convs: int, turns: int, max_tokens: int) -> dict:
    """One server at ``--fidelity-sample sample`` under ``convs`` concurrent conversations."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvlab", "serve", "--port", str(port), "--model", model, "--max-batch", "4"]
    cmd += ["--cache", SPEC, "--fidelity-sample", sample, "--fidelity-wait", "0"]
    proc: subprocess.Popen = start(cmd, port, LOGS / f"serve-fidelity-{sample}.log")
    try:
        client = client_for(port)
        rows: list[dict] = []

        def converse(c: int) -> None:
            messages: list[dict] = [{"role": "system", "content": "Be brief."}]
            for t in range(turns):
                messages.append({"role": "user", "content": QUESTIONS[(c * 3 + t) % len(QUESTIONS)]})
                row = one_turn(client, model, messages, max_tokens)
                rows.append(row)
                messages.append({"role": "assistant", "content": row["text"] or "."})

        threads = [threading.Thread(target=converse, args=(c,)) for c in range(convs)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        scores = [_follow(port, r["url"]) for r in rows if r["url"]]
    finally:
        stop(proc)
    return {"rows": rows, "wall": wall, "scores": scores}


def _follow(port: int, url: str) -> dict:
    """A scored response's fidelity, polled through its 202s (at most 300 s)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{url}", headers={"Authorization": "Bearer x"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            doc = json.loads(resp.read())
        if resp.status == 200:
            return doc["fidelity"]
        time.sleep(0.2)
    return {"skipped": "not scored within 300 s of the load's end"}


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(runs: dict[str, list[dict]], args: argparse.Namespace) -> str:
    lines = [
        f"Model `{args.model}`{TINY if args.model == 'tiny' else ''}, `--cache {SPEC}`, `--fidelity-wait 0`, "
        f"`--max-batch 4`; {args.convs} conversations at once, {args.turns} turns each, 16 tokens a reply "
        f"(greedy, streamed); {args.rounds} runs per setting, alternated (CPU, 2 cores shared with other "
        "work). Latency figures are over the UNSCORED requests only (pooled over the runs): p50 / p95 in ms.",
        "",
        "| --fidelity-sample | requests (scored) | requests/s: median (runs) | latency p50 / p95 | "
        "TTFT p50 / p95 | longest pause between chunks p50 / max |",
        "|---|---|---|---|---|---|",
    ]
    rates = {}
    for sample in SAMPLES:
        done = runs[sample]
        rows = [r for run in done for r in run["rows"]]
        plain = [r for r in rows if not r["url"]]
        each = sorted(len(run["rows"]) / run["wall"] for run in done)
        rates[sample] = statistics.median(each)
        lat = [r["latency"] for r in plain]
        ttft = [r["ttft"] for r in plain]
        gap = [r["gap"] for r in plain]
        lines.append(
            f"| {sample} | {len(rows)} ({len(rows) - len(plain)}) | {rates[sample]:.2f} "
            f"({each[0]:.2f} to {each[-1]:.2f}) | "
            f"{_ms(lat, 0.5):.0f} / {_ms(lat, 0.95):.0f} | {_ms(ttft, 0.5):.0f} / {_ms(ttft, 0.95):.0f} | "
            f"{_ms(gap, 0.5):.0f} / {1000 * max(gap):.0f} |"
        )
    ratio = rates[SAMPLES[1]] / rates[SAMPLES[0]]
    scores = [s for run in runs[SAMPLES[1]] for s in run["scores"]]
    kls = [s["kl"] for s in scores if s.get("kl") is not None]
    top1 = [s["top1"] for s in scores if "top1" in s]
    lines += [
        "",
        f"Requests/s at 0.25 against 0: **{ratio:.2f}x** (medians of {args.rounds} runs each).",
        "",
        f"The scored responses at 0.25: {len(scores)} ({len(kls)} with a score); mean KL per response "
        f"{statistics.mean(kls) if kls else float('nan'):.4f} nats (max {max(kls, default=float('nan')):.4f}), "
        f"mean top-1 agreement {statistics.mean(top1) if top1 else float('nan'):.3f}.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny (tests/tiny_serve.py) or a model spec")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--convs", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    args = parser.parse_args()
    if args.rounds < 1 or args.convs < 1 or args.turns < 1:
        raise Refusal("--rounds, --convs and --turns must be >= 1")
    LOGS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if model == "tiny":
            from tests.tiny_serve import build_tiny_model

            model = str(build_tiny_model(Path(scratch) / "tiny"))
        runs = run_all(model, args)
    write_results(
        "serve_fidelity_overhead",
        "Fidelity per response: the cost to unscored requests (`kvlab serve --fidelity-sample`)",
        report(runs, args),
    )


def run_all(model: str, args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every run, the two settings alternated (the order flips every round)."""
    runs: dict[str, list[dict]] = {s: [] for s in SAMPLES}
    for r in range(args.rounds):
        for sample in SAMPLES if r % 2 == 0 else SAMPLES[::-1]:
            run = one_run(model, sample, args.convs, args.turns, 16)
            runs[sample].append(run)
            print(
                f"round {r} sample {sample}: {len(run['rows'])} requests in {run['wall']:.1f} s", flush=True
            )
    return runs


if __name__ == "__main__":
    run_main(main)
