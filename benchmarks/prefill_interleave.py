"""Benchmark: a long prompt beside a decoding request, with prefill in pieces between decode steps and without.

Issue 27: a 10,801-token prompt delayed another tenant's tokens by 25 s, because the engine prefilled a
prompt in one go before the next decode step. The engine now spends at most ``prefill_chunk`` prompt
tokens per iteration, then runs a decode step. Measured here, in-process (the engine as ``kvlab serve``
runs it, without HTTP), on the bundled model, for ``prefill_chunk`` 256 and for "off" (a chunk larger
than the prompt, which is the old behaviour):

1. **Longest pause.** Request A decodes; after its third token, B's long prompt arrives. A's longest
   gap between two tokens while B is prefilled, and how many tokens A got meanwhile.
2. **First token behind a long prompt.** B's long prompt is being prefilled; A (a short prompt)
   arrives 0.3 s later. The time from A's arrival to its first token.

3. **A lone prompt.** The first ``--lone`` tokens of B alone (``--repeats`` runs of each, alternated):
   their prefill time fed ``prefill_alone`` tokens an iteration (few large forwards: each piece re-reads
   every weight) against ``prefill_chunk`` pieces, and the paired ratio.

Run: python3 benchmarks/prefill_interleave.py [--tokens 10801] [--chunk 256] [--alone 1024] [--lone 2048]
[--repeats 7]
(writes benchmarks/results/prefill_interleave.md)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402


def measure(
    handle, long_ids: list[int], short_ids: list[int], budgets: tuple[int, int], scenario: str
) -> dict:
    from kvlab.loop import Sampling
    from kvlab.serve.engine import Engine, EngineSettings, Request

    chunk, alone = budgets
    engine = Engine(
        handle, EngineSettings(window=1024, prefill_chunk=chunk, prefill_alone=alone, max_batch=4)
    )
    times: list[float] = []
    marks: dict[str, float] = {}
    a_done, b_done = threading.Event(), threading.Event()

    def b_emit(ev: tuple) -> None:
        if ev[0] == "start":
            marks["b_prefilled"] = time.perf_counter()
        if ev[0] in ("done", "error"):
            b_done.set()

    b = Request(ids=long_ids, max_new_tokens=1, sampling=Sampling(), emit=b_emit)

    def a_emit(ev: tuple) -> None:
        if ev[0] == "token":
            times.append(time.perf_counter())
            if scenario == "pause" and len(times) == 3:
                marks["b_sent"] = time.perf_counter()
                engine.submit(b)
        if ev[0] in ("done", "error"):
            a_done.set()

    a = Request(
        ids=short_ids, max_new_tokens=400 if scenario == "pause" else 4, sampling=Sampling(), emit=a_emit
    )
    try:
        if scenario == "pause":
            engine.submit(a)
            b_done.wait()
            a.cancelled.set()
            sent, ready = marks["b_sent"], marks["b_prefilled"]
            gaps = [
                t1 - t0 for t0, t1 in zip(times[:-1], times[1:], strict=True) if t1 >= sent and t0 <= ready
            ]
            return {
                "longest_pause_s": max(gaps),
                "a_tokens_during": sum(sent <= t <= ready for t in times),
                "b_prefill_s": ready - sent,
            }
        if scenario == "lone":
            sent = time.perf_counter()
            engine.submit(b)
            b_done.wait()
            return {"b_prefill_s": marks["b_prefilled"] - sent}
        engine.submit(b)
        time.sleep(0.3)
        sent = time.perf_counter()
        engine.submit(a)
        a_done.wait()
        b_done.wait()
        return {"first_token_s": times[0] - sent, "b_prefill_s": marks["b_prefilled"] - sent}
    finally:
        engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=10_801)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--alone", type=int, default=1024)
    ap.add_argument("--lone", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    import torch

    from kvlab import load_model
    from kvlab.data import default_long_text

    handle = load_model("smollm2-135m")
    long_ids = handle.encode(default_long_text().text)[: args.tokens]
    if len(long_ids) < args.tokens:
        raise SystemExit(f"the default text has only {len(long_ids)} tokens")
    short_ids = handle.encode("Count from 1 to 100: 1, 2, 3, 4,")
    off = 10**9
    columns = {"now": (args.chunk, args.alone), "pieces": (args.chunk, args.chunk), "off": (off, off)}
    rows = {}
    for scenario in ("pause", "first"):
        for name, budgets in columns.items():
            rows[(scenario, name)] = measure(handle, long_ids, short_ids, budgets, scenario)
            print(scenario, name, rows[(scenario, name)], flush=True)
    lone: dict[str, list[float]] = {"now": [], "pieces": []}
    for r in range(args.repeats):
        for name in ("now", "pieces") if r % 2 == 0 else ("pieces", "now"):
            run = measure(handle, long_ids[: args.lone], short_ids, columns[name], "lone")
            lone[name].append(run["b_prefill_s"])
            print("lone", name, run, flush=True)
    ratio = statistics.median(b / a for a, b in zip(lone["now"], lone["pieces"], strict=True))

    def cells(scenario: str, cell) -> str:
        return " | ".join(cell(rows[(scenario, name)]) for name in columns)

    n = f"{len(long_ids):,}"
    body = f"""The bundled SmolLM2 in-process (`kvlab.serve.engine.Engine`, window 1024, batch 4), torch with
{torch.get_num_threads()} threads; a {n}-token prompt (B) from the default long text beside a short
request (A), greedy. Columns: the engine's budgets (`prefill_chunk` {args.chunk} while a row decodes,
`prefill_alone` {args.alone} while none does); {args.chunk} in both cases (the engine before `prefill_alone`);
the prompt in one go (before chunked prefill).

| with B's {n}-token prompt | {args.chunk} / {args.alone} alone | {args.chunk} throughout | in one go |
|---|---|---|---|
| A's longest pause while B is prefilled | {cells("pause", lambda r: f"**{r['longest_pause_s']:.2f} s** ({r['a_tokens_during']} tokens during B's {r['b_prefill_s']:.1f} s prefill)")} |
| A's first token, A sent 0.3 s after B | {cells("first", lambda r: f"**{r['first_token_s']:.2f} s** (B prefilled at {r['b_prefill_s']:.1f} s)")} |
| B's first {args.lone:,} tokens alone: prefill, median of {args.repeats} | **{statistics.median(lone["now"]):.2f} s** | {statistics.median(lone["pieces"]):.2f} s ({ratio:.2f}x, paired median) | (forwards of the window's headroom: as the first column) |

B's prefill beside A is not compared: in pieces it shares the machine with A's decode steps. Raw rows of
the lone runs (seconds, in the order run): {args.chunk} / {args.alone} alone {[round(x, 2) for x in lone["now"]]};
{args.chunk} throughout {[round(x, 2) for x in lone["pieces"]]}.
"""
    write_results("prefill_interleave", "A long prompt beside a decoding request", body)


if __name__ == "__main__":
    main()
