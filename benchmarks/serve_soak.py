"""Soak: ``kvlab serve`` under mixed load at its queue limit for 10 minutes, on 127.0.0.1 only.

Clients (more than ``max_batch + max_queue``, so the queue stays full and some requests get 429) loop
over a mix: conversations continued turn after turn (their sessions reused, long ones rolling),
single chats, completions, streams dropped after two chunks, two tenants, and malformed or
unauthorised requests. Counted: every status. Sampled: the server's resident memory every 5 s.

Pass: no 5xx other than the deliberate 503 (none expected here), every bad request a 4xx JSON error,
and resident memory after warm-up growing by at most 10% (warm-up fills the session table and the
store's memory tier, bounded by ``--max-sessions`` and ``--store-memory-mb``).

Run: python3 benchmarks/serve_soak.py [--minutes 10] [--warmup 2]   (writes benchmarks/results/serve_soak.md)
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402
from serve import LOGS, free_port, passages, start, stop  # noqa: E402

KEYS = ("soak-tenant-a-key", "soak-tenant-b-key")
MODEL = "smollm2-135m"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.bad: list[str] = []

    def add(self, kind: str, status: int | str, note: str = "") -> None:
        with self.lock:
            self.counts[f"{kind} -> {status}"] += 1
            unexpected = (
                isinstance(status, int) and status >= 500 and status != 503
            ) or status == "connection"
            if kind == "hostile" and isinstance(status, int) and not 400 <= status < 500:
                unexpected = True
            if unexpected and len(self.bad) < 20:
                self.bad.append(f"{kind} -> {status} {note[:200]}")


def raw(port: int, body: bytes, key: str | None, path: str = "/v1/chat/completions") -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


HOSTILE = [
    (b"{not json", KEYS[0]),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), KEYS[0]),
    (
        json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}).encode(),
        KEYS[0],
    ),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}).encode(), None),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}).encode(), "wrong-key-123"),
    (
        json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}
        ).encode(),
        KEYS[1],
    ),
    (json.dumps({"model": MODEL, "messages": [], "max_tokens": 4}).encode(), KEYS[1]),
]


def client_loop(i: int, port: int, deadline: float, tally: Tally, book: list[str], seed: int) -> None:
    rng = random.Random(seed)
    key = KEYS[i % 2]
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=300)
    history: list[dict] = []
    while time.monotonic() < deadline:
        roll = rng.random()
        kind = "?"
        try:
            if roll < 0.45:  # continue this client's conversation (sometimes with a book passage: it rolls)
                kind = "conversation"
                if len(history) > 24:
                    history = []
                text = (
                    rng.choice(book)
                    if rng.random() < 0.3
                    else f"Tell me one fact about the number {rng.randint(1, 999)}."
                )
                history.append({"role": "user", "content": text})
                stream = c.chat.completions.create(
                    model=MODEL, messages=history, max_tokens=rng.randint(8, 40), temperature=0, stream=True
                )
                reply = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
                history.append({"role": "assistant", "content": reply or "."})
                tally.add(kind, 200)
            elif roll < 0.6:
                kind = "chat"
                c.chat.completions.create(
                    model=MODEL,
                    messages=[
                        {
                            "role": "user",
                            "content": f"Say a word that rhymes with {rng.choice(['cat', 'tree', 'moon'])}.",
                        }
                    ],
                    max_tokens=12,
                    temperature=0.7,
                    seed=rng.randint(0, 1000),
                )
                tally.add(kind, 200)
            elif roll < 0.7:
                kind = "completion"
                c.completions.create(
                    model=MODEL, prompt="The capital of France is", max_tokens=8, stop=["\n"]
                )
                tally.add(kind, 200)
            elif roll < 0.82:
                kind = "dropped stream"
                stream = c.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Write a long story about a lighthouse."}],
                    max_tokens=200,
                    stream=True,
                )
                for n, _ in enumerate(stream):
                    if n >= 2:
                        break
                stream.close()
                tally.add(kind, 200)
            else:
                kind = "hostile"
                body, k = rng.choice(HOSTILE)
                status, text = raw(port, body, k)
                ok_json = "error" in json.loads(text) if text.startswith("{") else False
                tally.add(kind, status if ok_json else f"{status} (not a JSON error)", text)
        except openai.APIStatusError as e:
            tally.add(kind, e.status_code, str(e))
            if kind == "conversation" and history and history[-1]["role"] == "user":
                history.pop()
            if e.status_code == 429:
                time.sleep(
                    rng.uniform(0.2, 1.0)
                )  # about what Retry-After asks, so the queue stays at its limit
        except openai.APIConnectionError as e:
            tally.add(kind, "connection", str(e))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--warmup", type=float, default=2, help="minutes before the memory baseline")
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--max-queue", type=int, default=4)
    ap.add_argument("--max-sessions", type=int, default=16)
    ap.add_argument("--store-memory-mb", type=int, default=256)
    args = ap.parse_args()
    LOGS.mkdir(exist_ok=True)
    book = passages(40, 180, skip=80)
    port = free_port()
    cmd = [
        sys.executable, "-m", "kvlab", "serve", "--port", str(port), "--window", str(args.window),
        "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
        "--max-sessions", str(args.max_sessions), "--store-memory-mb", str(args.store_memory_mb),
        "--api-key", KEYS[0], "--api-key", KEYS[1],
    ]  # fmt: skip
    server = start(cmd, port, LOGS / "serve-soak.log", key=KEYS[0])
    tally = Tally()
    samples: list[tuple[float, float]] = []
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    threads = [
        threading.Thread(target=client_loop, args=(i, port, deadline, tally, book, i), daemon=True)
        for i in range(args.clients)
    ]
    try:
        for t in threads:
            t.start()
        while time.monotonic() < deadline:
            samples.append(((time.monotonic() - t0) / 60, rss_mb(server.pid)))
            time.sleep(5)
        for t in threads:
            t.join(timeout=330)
        alive = server.poll() is None
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    finally:
        stop(server)
    after = [m for t, m in samples if t >= args.warmup]
    base = after[0]
    growth = (max(after) - base) / base
    total = sum(tally.counts.values())
    five = sum(n for k, n in tally.counts.items() if k.split(" -> ")[1][:1] == "5" and not k.endswith("503"))
    rolls = next(
        (line.split()[-1] for line in metrics.splitlines() if line.startswith("kvlab_rolls_total")), "?"
    )
    rows = "\n".join(f"| {k} | {n} |" for k, n in sorted(tally.counts.items()))
    curve = " · ".join(f"{t:.1f} min {m:.0f}" for t, m in samples[:: max(1, len(samples) // 12)])
    verdict = "pass" if five == 0 and not tally.bad and growth <= 0.10 and alive else "FAIL"
    body = f"""kvlab serve on 127.0.0.1 with the bundled SmolLM2 (window {args.window} + 4 sinks, batch {args.max_batch},
queue {args.max_queue}, {args.max_sessions} idle sessions kept, a {args.store_memory_mb} MiB memory store, two API
keys); {args.clients} client threads for
{args.minutes:g} minutes, each looping over: conversations continued turn after turn (30% of turns a
~180-token book passage, so they roll), single chats with seeded sampling, completions with a stop
string, streams dropped after two chunks, and malformed or unauthorised requests.

| request -> status | count |
|---|---|
{rows}

- Requests: {total}; 5xx other than 503: **{five}**; unexpected outcomes: {len(tally.bad)}{"" if not tally.bad else " (" + "; ".join(tally.bad[:5]) + ")"}.
- Rolls counted by the server (`kvlab_rolls_total`): {rolls}. Server alive at the end: {alive}.
- Resident memory (MB) over time: {curve}.
- After {args.warmup:g} min of warm-up: {base:.0f} MB; highest later {max(after):.0f} MB: **growth {growth * 100:+.1f}%** (bar: 10%).

**Verdict: {verdict}.** Server log: `benchmarks/out/serve-soak.log`.
"""
    write_results("serve_soak", "Serving under load: 10 minutes at the queue limit", body)


if __name__ == "__main__":
    main()
