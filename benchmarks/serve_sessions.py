"""1,000 sessions through ``kvlab serve`` (issue 48 item 7): resident memory every 100 sessions, on 127.0.0.1.

Each session is a conversation of a few turns (a system prompt shared by all, a user turn of its own, then
short follow-ups, each sent with the whole history and ``max_tokens`` small, greedy), from a few client
threads at once. The server keeps at most ``--max-sessions`` idle conversations (least recently used
dropped), so 1,000 sessions pass that bound 15 times over. Sampled when each 100th session ends: the
server's resident memory (``VmRSS``), and from ``/metrics`` the idle sessions, what their caches hold and
what the store's memory tier holds. At the end the first sessions are continued once more: their sessions
were dropped long before, so each turn is computed again (from the store's head where it still holds it).

Pass: every request 200, the idle sessions never above ``--max-sessions``, and resident memory never above
1.1 x (its value before the first session + the most the bounded structures held). Reported beside it: the
growth per 100 sessions from the ``--warmup``-th on, and whether it plateaus (the last three under 1%).

Run: python3 benchmarks/serve_sessions.py [--sessions 1000] [--model tiny|smollm2-135m|FOLDER]
(``tiny``: a 2-layer random-weight model saved to a temporary folder, ``tests/tiny_serve.py``; the
bundled SmolLM2 costs ~0.3 s a request on this machine. Writes benchmarks/results/serve_sessions.md)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Refusal, run_main, write_results  # noqa: E402
from serve import LOGS, free_port, start, stop  # noqa: E402

ADMIN_KEY = "sessions-admin-key"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
TOPICS = ["rivers", "copper", "falcons", "lanterns", "granite", "comets", "harbors", "meadows", "quartz"]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metrics(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    text = conn.getresponse().read().decode()
    conn.close()
    names = ("kvlab_idle_sessions", "kvlab_idle_session_bytes", "kvlab_store_memory_bytes")
    return {
        n: sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(n + " "))
        for n in names
    }


def ask(port: int, model: str, messages: list[dict], max_tokens: int) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    doc = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    conn.request("POST", "/v1/chat/completions", json.dumps(doc), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    status, data = resp.status, resp.read()
    conn.close()
    return status, json.loads(data) if data else {}


class Run:
    """The sessions, handed out to the client threads in order; what each turn got, by source."""

    def __init__(self, args: argparse.Namespace, port: int, model: str) -> None:
        self.args, self.port, self.model = args, port, model
        self.lock = threading.Lock()
        self.next = 0
        self.done = 0
        self.statuses: dict[int, int] = {}
        self.sources: dict[tuple[int, str], int] = {}  # (turn, source) -> count
        self.histories: dict[int, list[dict]] = {}
        self.failed: list[str] = []

    def session(self, i: int) -> None:
        topic = TOPICS[i % len(TOPICS)]
        messages = [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"Session {i}. Tell me one fact about {topic} number {i * 7 % 1000}.",
            },
        ]
        for turn in range(self.args.turns):
            if turn:
                messages.append({"role": "user", "content": f"And another fact, number {turn + 1}?"})
            status, doc = ask(self.port, self.model, messages, self.args.max_tokens)
            with self.lock:
                self.statuses[status] = self.statuses.get(status, 0) + 1
            if status != 200:
                self.failed.append(f"session {i} turn {turn + 1}: {status} {str(doc)[:200]}")
                return
            key = (turn + 1, doc["kvlab"]["source"])
            with self.lock:
                self.sources[key] = self.sources.get(key, 0) + 1
            messages.append({"role": "assistant", "content": doc["choices"][0]["message"]["content"] or "."})
        if i < 20:
            self.histories[i] = messages

    def client(self) -> None:
        while True:
            with self.lock:
                i, self.next = self.next, self.next + 1
            if i >= self.args.sessions:
                return
            self.session(i)
            with self.lock:
                self.done += 1


def sample_every_100(run: Run, pid: int, samples: list[dict], threads: list[threading.Thread]) -> None:
    mark = 0
    t0 = time.monotonic()
    while any(t.is_alive() for t in threads) or run.done >= mark + 100:
        if run.done >= mark + 100 or (mark == 0 and not samples):
            m = metrics(run.port)
            samples.append(
                {
                    "sessions": run.done,
                    "minutes": (time.monotonic() - t0) / 60,
                    "rss": rss_mb(pid),
                    "idle": m["kvlab_idle_sessions"],
                    "bounded": (m["kvlab_idle_session_bytes"] + m["kvlab_store_memory_bytes"]) / 2**20,
                }
            )
            mark = run.done - run.done % 100
        time.sleep(0.2)


def revisit(run: Run) -> dict[str, int]:
    """One more turn of each of the first 20 sessions, long since dropped from the idle pool: by source."""
    got: dict[str, int] = {}
    for _, history in sorted(run.histories.items()):
        messages = [*history, {"role": "user", "content": "One last fact?"}]
        status, doc = ask(run.port, run.model, messages, run.args.max_tokens)
        source = doc["kvlab"]["source"] if status == 200 else f"status {status}"
        got[source] = got.get(source, 0) + 1
    return got


def memory(args: argparse.Namespace, samples: list[dict]) -> tuple[bool, bool, str]:
    """Whether resident memory stayed within what the bounds allow and whether it plateaued, and the lines
    that say so. The bounds' bytes are nominal (a session's cache is allocated for its whole window, and its
    pages become resident as they are written), so resident memory may approach them slowly."""
    start, peak = samples[0]["rss"], max(s["rss"] for s in samples)
    limit = 1.1 * (start + max(s["bounded"] for s in samples))
    per_100 = [
        (b["rss"] - a["rss"]) * 100 / max(1, b["sessions"] - a["sessions"])
        for a, b in zip(samples, samples[1:], strict=False)
        if a["sessions"] >= args.warmup
    ]
    last = per_100[-3:]
    flat = len(last) == 3 and all(d < 0.01 * peak for d in last)
    text = f"""- Resident memory: {start:.0f} MB before the first session, highest **{peak:.0f} MB**; the bound
  1.1 x (that start + the most the bounded structures held) is {limit:.0f} MB: {"within" if peak <= limit else "**over**"}.
- Growth per 100 sessions from session {args.warmup} on (MB): {", ".join(f"{d:.1f}" for d in per_100)};
  the last three each under 1% of resident memory: **{"yes, it plateaus" if flat else "no, not yet"}**."""
    return peak <= limit, flat, text


def report(args, model: str, samples: list[dict], run: Run, again: dict, load: tuple, took: float) -> str:
    max_idle = max(s["idle"] for s in samples)
    within, _, mem = memory(args, samples)
    ok = not run.failed and set(run.statuses) == {200} and max_idle <= args.max_sessions and within
    rows = [
        "| sessions | minutes | resident MB | +MB since the last row | idle sessions | bounded MB |",
        "|---|---|---|---|---|---|",
    ]
    prev = None
    for s in samples:
        delta = "" if prev is None else f"{s['rss'] - prev:+.1f}"
        rows.append(
            f"| {s['sessions']} | {s['minutes']:.1f} | {s['rss']:.1f} | {delta} | {s['idle']:.0f} | {s['bounded']:.1f} |"
        )
        prev = s["rss"]
    sources = ", ".join(f"turn {t} {src}: {n}" for (t, src), n in sorted(run.sources.items()))
    failures = f"{len(run.failed)}{(': ' + '; '.join(run.failed[:3])) if run.failed else ''}"
    return f"""
`kvlab serve --model {model} --max-sessions {args.max_sessions} --store-memory-mb {args.store_memory_mb}`
(default window 1024 + 4 sinks, batch 4, queue 16, memory store; `OMP_NUM_THREADS={os.environ.get("OMP_NUM_THREADS")}`)
on 127.0.0.1; {args.sessions} sessions of {args.turns} turns (a shared system prompt, a user turn of its own,
short follow-ups; the whole history sent each turn, greedy, `max_tokens` {args.max_tokens}) from
{args.clients} client threads. Load average at the start {load[0]:.1f}, at the end {load[1]:.1f} (2 cores
shared with other jobs); {took / 60:.1f} minutes.

{chr(10).join(rows)}

*Bounded*: what the idle sessions' caches and the store's memory tier hold (`/metrics`: the bytes of their
tensors, allocated in full), both capped by design (`--max-sessions`, `--store-memory-mb`).

- Requests by status: {run.statuses}; failures: {failures}.
- Where each turn's prompt came from: {sources}.
- Idle sessions: at most **{max_idle:.0f}** (the bound: {args.max_sessions}). Beyond it the least recently used
  idle session is dropped (not an error): the first 20 sessions, continued once more at the end, were
  served from: {again} (`store`: the head reloaded from the store, the rest computed; `none`: all computed).
{mem}

**Verdict: {"pass" if ok else "FAIL"}** (every request 200, idle sessions within their bound, resident memory
within the bound). Server log: `benchmarks/out/serve-sessions.log`.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-sessions", type=int, default=64)
    # small, so that the store's memory tier is full within the warm-up: later growth is not by design
    ap.add_argument("--store-memory-mb", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=300, help="sessions before the growth is measured")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--out", default="serve_sessions")
    args = ap.parse_args()
    if args.sessions < args.warmup + 200 or args.turns < 1 or args.max_tokens < 1 or args.clients < 1:
        raise Refusal("need --sessions >= --warmup + 200, and --turns, --max-tokens, --clients >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":
            sys.path.insert(0, str(ROOT))
            from tests.tiny_serve import build_tiny_model

            model = str(build_tiny_model(Path(tmp) / "tiny-model"))
        measure(args, model)


def measure(args: argparse.Namespace, model: str) -> None:
    # the server on one thread (as the tests run it): on this shared 2-core machine two OpenMP threads wait
    # for each other whenever another job holds a core (requests 10x slower in a first run)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    port = free_port()
    LOGS.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "kvlab", "serve", "--model", model, "--port", str(port)]
    cmd += ["--max-sessions", str(args.max_sessions), "--store-memory-mb", str(args.store_memory_mb)]
    cmd += ["--admin-key", ADMIN_KEY]
    load0 = os.getloadavg()[0]
    server = start(cmd, port, LOGS / "serve-sessions.log")
    try:
        run = Run(args, port, model)
        threads = [threading.Thread(target=run.client) for _ in range(args.clients)]
        samples: list[dict] = []
        t0 = time.monotonic()
        for t in threads:
            t.start()
        sample_every_100(run, server.pid, samples, threads)
        took = time.monotonic() - t0
        again = revisit(run)
        alive = server.poll() is None
    finally:
        stop(server)
    label = "tiny random model" if args.model == "tiny" else model
    body = report(args, label, samples, run, again, (load0, os.getloadavg()[0]), took)
    if not alive:
        body += "\n**The server was not alive at the end.**\n"
    write_results(args.out, f"Reliability: {args.sessions:,} sessions through kvlab serve ({label})", body)


if __name__ == "__main__":
    run_main(main)
