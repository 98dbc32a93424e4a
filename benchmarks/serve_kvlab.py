"""Benchmark: ``kvlab serve``'s own figures from ``benchmarks/serve.py``, without ``transformers serve``.

For paired regression runs (old code against new, alternated on one machine): the same sections and
helpers as ``serve.py`` — time to first token per turn of one growing conversation, throughput with 1 and
4 concurrent conversations, a conversation that outgrows the context (book passages, the window rolls),
and two replicas on one Redis (a store hit against a miss) — kvlab's side only, so one run takes minutes,
not the better part of an hour. Which kvlab it measures is whatever ``python -m kvlab`` imports
(``PYTHONPATH``); the figures go to stdout as one JSON line (and to ``--out``).

Run: python3 benchmarks/serve_kvlab.py [--turns 14] [--max-tokens 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import (  # noqa: E402
    LOGS,
    client_for,
    conversation,
    free_port,
    kvlab_server,
    passages,
    replica_section,
    stop,
    throughput,
    turn,
    user_turns,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=14)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--long-passage", type=int, default=700)
    ap.add_argument("--replica-reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", default="turns,throughput,long,replica", help="sections, comma-separated")
    args = ap.parse_args()
    only = set(args.only.split(","))
    import kvlab

    turns, source = user_turns(args.turns + 12)
    LOGS.mkdir(exist_ok=True)
    port = free_port()
    t0 = time.time()
    server = kvlab_server(port, "kvlab-only", "--window", str(args.window))
    fig: dict = {"kvlab": str(Path(kvlab.__file__).resolve().parent), "turns_source": source}
    try:
        kc = client_for(port)
        turn(kc, "smollm2-135m", [{"role": "user", "content": "warm up"}], 2)
        if "turns" in only:
            rows = conversation(kc, "smollm2-135m", turns[: args.turns], args.max_tokens)
            fig["ttft_ms_per_turn"] = [round(r[0], 1) for r in rows]
            fig["ttft_ms_turns_10_on_median"] = statistics.median(r[0] for r in rows[9:])
        extra = turns[args.turns :]
        if "throughput" in only:
            fig["tokens_per_s_1_conversation"] = throughput(kc, "smollm2-135m", [extra[:3]], args.max_tokens)
            convs = [extra[i : i + 3] for i in range(0, 12, 3)]
            fig["tokens_per_s_4_conversations"] = throughput(kc, "smollm2-135m", convs, args.max_tokens)
        km: list[dict] = []
        long_ttft, rolls = [], 0
        for text in passages(16 if "long" in only else 0, args.long_passage, skip=3):
            km.append(
                {"role": "user", "content": text + "\n\nIn one sentence, what happens in this passage?"}
            )
            info: dict = {}
            ttft, reply, _ = turn(kc, "smollm2-135m", km, 24, info)
            km.append({"role": "assistant", "content": reply or "."})
            long_ttft.append(round(ttft, 1))
            rolls += int(info.get("rolls", 0))
        if long_ttft:
            fig["long_ttft_ms_per_turn"] = long_ttft
            fig["long_ttft_ms_median"] = statistics.median(long_ttft)
            fig["long_rolls"] = rolls
    finally:
        stop(server)
    if "replica" in only:
        rows = replica_section("", args.replica_reps)
        hits = [float(r.split("|")[3]) for r in rows[2:-1]]
        misses = [float(r.split("|")[5]) for r in rows[2:-1]]
        fig["replica_hit_ttft_ms_median"] = statistics.median(hits)
        fig["replica_miss_ttft_ms_median"] = statistics.median(misses)
        fig["replica_replies_equal"] = all("| yes |" in r for r in rows[2:-1])
    fig["wall_s"] = round(time.time() - t0, 1)
    line = json.dumps(fig)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
