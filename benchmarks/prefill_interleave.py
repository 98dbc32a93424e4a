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

Run: python3 benchmarks/prefill_interleave.py [--tokens 10801] [--chunk 256]
(writes benchmarks/results/prefill_interleave.md)
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402


def measure(handle, long_ids: list[int], short_ids: list[int], chunk: int, scenario: str) -> dict:
    from kvlab.loop import Sampling
    from kvlab.serve.engine import Engine, EngineSettings, Request

    engine = Engine(handle, EngineSettings(window=1024, prefill_chunk=chunk, max_batch=4))
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
    rows = {}
    for scenario in ("pause", "first"):
        for chunk in (args.chunk, off):
            rows[(scenario, chunk)] = measure(handle, long_ids, short_ids, chunk, scenario)
            print(scenario, chunk, rows[(scenario, chunk)], flush=True)
    p_on, p_off = rows[("pause", args.chunk)], rows[("pause", off)]
    f_on, f_off = rows[("first", args.chunk)], rows[("first", off)]
    body = f"""The bundled SmolLM2 in-process (`kvlab.serve.engine.Engine`, window 1024, batch 4), torch with
{torch.get_num_threads()} threads; a {len(long_ids):,}-token prompt (B) from the default long text beside a short
request (A), greedy.

| with B's {len(long_ids):,}-token prompt | prefill in pieces of {args.chunk} | in one go (before) |
|---|---|---|
| A's longest pause while B is prefilled | **{p_on["longest_pause_s"]:.2f} s** ({p_on["a_tokens_during"]} tokens during B's {p_on["b_prefill_s"]:.1f} s prefill) | {p_off["longest_pause_s"]:.2f} s ({p_off["a_tokens_during"]} tokens during {p_off["b_prefill_s"]:.1f} s) |
| A's first token, A sent 0.3 s after B | **{f_on["first_token_s"]:.2f} s** (B prefilled at {f_on["b_prefill_s"]:.1f} s) | {f_off["first_token_s"]:.2f} s (B prefilled at {f_off["b_prefill_s"]:.1f} s) |

B's own prefill time is not compared here: in pieces it shares the machine with A's decode steps.
"""
    write_results("prefill_interleave", "A long prompt beside a decoding request", body)


if __name__ == "__main__":
    main()
