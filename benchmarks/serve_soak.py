"""Soak: ``kvlab serve`` under mixed load at its queue limit for 10 minutes, on 127.0.0.1 only.

Clients (more than ``max_batch + max_queue``, so the queue stays full and some requests get 429) loop
over a mix: conversations continued turn after turn (their sessions reused, long ones rolling),
single chats, completions, streams dropped after two chunks, two tenants, and malformed or
unauthorised requests. Counted: every status. Sampled: the server's resident memory every 5 s.

With ``--faults`` (the default; issue 27) the world is also hostile while the clients run:

- a tenant asks for ``temperature: 1e-310`` (which once failed every row of the batch);
- non-streaming requests of 300 tokens whose client leaves after 1.5 s (they must stop decoding);
- long prompts (~3,000 tokens) beside the others' streams (prefill is chunked between decode steps);
- the HTTP bodies that once gave a 500: 100,000-deep JSON, a 5,000-digit integer, ``seed`` 2^64, a
  lone surrogate;
- 60 idle and 20 slowloris connections held open, re-opened as the server closes them, while a
  probe times ``/health`` every 2 s;
- the store is a real ``redis-server`` that, in turn, is paused (SIGSTOP) for 5 s, full
  (``maxmemory`` with ``noeviction``) for 20 s, and has its keys turned into lists (WRONGTYPE).

Pass: no 5xx other than the deliberate 503 (none expected here), every bad request a 4xx JSON error,
``/health`` always answering within 2 s, and resident memory less what the bounded structures hold
(the idle sessions' caches, at most ``--max-sessions``, and the store's memory tier, at most
``--store-memory-mb``; both read from ``/metrics`` at each sample, since they fill slowly under faults)
growing by at most 10% after warm-up: the rise of a Theil-Sen line through every sample after warm-up,
over the whole span, relative to the line's start (:func:`memory_growth`). A leak raises the line; a
sample taken just before a trim of freed pages does not move it. The bar before 2026-12-02 (the highest
value against the first sample after warm-up, still reported) swung with where one sample fell between two
trims: the same code gave +13.5% and +6.8% on it. The medians of the first and last thirds are reported
beside, and the raw 5-s samples are written to ``benchmarks/results/raw/serve_soak_samples.csv``.

Run: python3 benchmarks/serve_soak.py [--minutes 10] [--warmup 2] [--no-faults]
(writes benchmarks/results/serve_soak.md)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, write_results  # noqa: E402
from serve import LOGS, free_port, passages, start, start_redis, stop  # noqa: E402

KEYS = ("soak-tenant-a-key", "soak-tenant-b-key")
ADMIN_KEY = "soak-admin-key"
MODEL = "smollm2-135m"
RAW = RESULTS / "raw"


def memory_growth(t: list[float], mb: list[float]) -> dict[str, float]:
    """Growth of a memory curve sampled at minutes ``t`` (at least 6 samples): a Theil-Sen line (the median
    of the pairwise slopes, with its 95% interval, in MB/min) and its rise over the whole span relative to
    its value at the start (``growth``); the medians of the first and last thirds beside it."""
    from statistics import median

    from scipy.stats import theilslopes

    if len(mb) < 6:
        raise SystemExit(f"serve_soak: {len(mb)} memory samples after warm-up; at least 6 are needed")
    third = len(mb) // 3
    slope, intercept, lo, hi = (float(x) for x in theilslopes(mb, t, alpha=0.95))
    start = intercept + slope * t[0]
    return {"early": median(mb[:third]), "late": median(mb[-third:]), "start": start,
            "growth": slope * (t[-1] - t[0]) / start, "slope": slope, "lo": lo, "hi": hi,
            "first": mb[0], "highest": max(mb), "peak_growth": max(mb) / mb[0] - 1}  # fmt: skip


def bounded_mb(port: int) -> float:
    """MB held by what the server bounds by design: idle sessions' caches and the store's memory tier."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    req.add_header("Authorization", f"Bearer {ADMIN_KEY}")
    text = urllib.request.urlopen(req, timeout=30).read().decode()
    names = ("kvlab_idle_session_bytes ", "kvlab_store_memory_bytes ")
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(names)) / 2**20


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

_HI = [{"role": "user", "content": "hi"}]
# the bodies that once gave a 500 (issue 27): each must now be a 4xx JSON error
HOSTILE_FAULTS = [
    (b'{"model": "' + MODEL.encode() + b'", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", KEYS[0]),
    (b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "x"}], "max_tokens": '
     + b"9" * 5000 + b"}", KEYS[0]),
    (json.dumps({"model": MODEL, "messages": _HI, "max_tokens": 2, "seed": 2**64}).encode(), KEYS[1]),
    (b'{"model": "' + MODEL.encode() + b'", "prompt": "a \\ud800 b", "max_tokens": 2}', KEYS[1]),
]  # fmt: skip


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


def fault_loop(port: int, deadline: float, tally: Tally, book: list[str], seed: int) -> None:
    """Requests that once hurt other tenants: a poisoned temperature, dropped non-streaming requests,
    long prompts, and the bodies that used to give a 500."""
    rng = random.Random(seed)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEYS[1], max_retries=0, timeout=300)
    long_prompt = " ".join(book[:16])  # about 3,000 tokens
    while time.monotonic() < deadline:
        roll = rng.random()
        kind = "?"
        try:
            if roll < 0.3:
                kind = "temperature 1e-310"
                c.chat.completions.create(model=MODEL, messages=_HI, max_tokens=8, temperature=1e-310)
                tally.add(kind, 200)
            elif roll < 0.55:
                kind = "dropped non-stream"
                try:
                    c.with_options(timeout=1.5).chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": "Write a very long story."}],
                        max_tokens=300,
                    )
                    tally.add(kind, 200)
                except openai.APITimeoutError:
                    tally.add(kind, "client left")
            elif roll < 0.7:
                kind = "long prompt"
                c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": long_prompt}], max_tokens=4
                )
                tally.add(kind, 200)
            else:
                kind = "hostile (was 500)"
                body, k = rng.choice(HOSTILE_FAULTS)
                path = "/v1/completions" if b'"prompt"' in body[:80] else "/v1/chat/completions"
                status, text = raw(port, body, k, path)
                ok_json = text.startswith("{") and "error" in json.loads(text)
                tally.add("hostile", status if ok_json else f"{status} (not a JSON error)", text)
        except openai.APIStatusError as e:
            tally.add(kind, e.status_code, str(e))
            if e.status_code == 429:
                time.sleep(rng.uniform(0.2, 1.0))
        except openai.APIConnectionError as e:
            tally.add(kind, "connection", str(e))
        time.sleep(rng.uniform(0.5, 2.0))


def connection_loop(port: int, deadline: float, tally: Tally, idle: int = 60, slow: int = 20) -> None:
    """Hold ``idle`` silent and ``slow`` trickling (one header byte a second) connections open,
    re-opening each one the server closes; count the closes. They come from another address than the
    clients' (127.0.0.2, as an attacker would): the per-client cap is then the attacker's alone."""
    conns: list[tuple[socket.socket, bool, int]] = []
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4000

    def opened(slow_one: bool) -> tuple[socket.socket, bool, int] | None:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2, source_address=("127.0.0.2", 0))
            s.setblocking(False)
            return (s, slow_one, 0)
        except OSError:
            return None

    while time.monotonic() < deadline:
        while len(conns) < idle + slow:
            c = opened(sum(1 for _, sl, _ in conns if sl) < slow)
            if c is None:
                break
            conns.append(c)
        kept = []
        for s, slow_one, sent in conns:
            try:
                if slow_one:
                    s.send(head[sent % len(head) : sent % len(head) + 1])
                    sent += 1
                if s.recv(4096) == b"":  # closed by the server
                    s.close()
                    tally.add("idle/slow connection", "closed by the server")
                    continue
            except BlockingIOError:
                pass
            except OSError:
                s.close()
                tally.add("idle/slow connection", "closed by the server")
                continue
            kept.append((s, slow_one, sent))
        conns = kept
        time.sleep(1)
    for s, _, _ in conns:
        s.close()


def health_probe(port: int, deadline: float, worst: list[float], tally: Tally) -> None:
    while time.monotonic() < deadline:
        t = time.perf_counter()
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).read()
            worst.append(time.perf_counter() - t)
        except Exception as e:  # a /health that does not answer is the failure this measures
            worst.append(float("inf"))
            tally.add("health", "no answer", str(e))
        time.sleep(2)


def redis_faults(redis_proc: subprocess.Popen, port: int, deadline: float, log: list[str]) -> None:
    """Every 40 s, one of: pause the Redis for 5 s; fill it (maxmemory, noeviction) for 20 s; turn
    its keys into lists (every later read of them: WRONGTYPE)."""
    import redis

    r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    turn = 0
    time.sleep(30)
    while time.monotonic() < deadline - 30:
        kind = ("pause", "full", "wrongtype")[turn % 3]
        turn += 1
        t = time.monotonic() - log_t0[0]
        if kind == "pause":
            os.kill(redis_proc.pid, signal.SIGSTOP)
            time.sleep(5)
            os.kill(redis_proc.pid, signal.SIGCONT)
        elif kind == "full":
            used = int(r.info("memory")["used_memory"])
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", str(used))
            time.sleep(20)
            r.config_set("maxmemory", "0")
        else:
            keys = list(r.scan_iter(count=500))[:200]
            for key in keys:
                r.delete(key)
                r.rpush(key, "not a block")
        log.append(f"{t / 60:.1f} min {kind}")
        time.sleep(40)


log_t0 = [0.0]


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
    ap.add_argument("--faults", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    if (args.minutes - args.warmup) * 60 < 30:  # memory_growth needs 6 samples, one every 5 s
        ap.error("--minutes must exceed --warmup by at least 0.5 (6 memory samples after warm-up)")
    LOGS.mkdir(exist_ok=True)
    book = passages(40, 180, skip=80)
    port = free_port()
    redis_proc = None
    store: list[str] = []
    if args.faults:
        redis_port = free_port()
        (LOGS / "soak-redis").mkdir(exist_ok=True)
        redis_proc = start_redis(redis_port, LOGS / "soak-redis")
        store = ["--store", f"redis://127.0.0.1:{redis_port}/0"]
    cmd = [
        sys.executable, "-m", "kvlab", "serve", "--port", str(port), "--window", str(args.window),
        "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
        "--max-sessions", str(args.max_sessions), "--store-memory-mb", str(args.store_memory_mb),
        "--api-key", KEYS[0], "--api-key", KEYS[1], "--admin-key", ADMIN_KEY, *store,
    ]  # fmt: skip
    server = start(cmd, port, LOGS / "serve-soak.log", key=KEYS[0])
    tally = Tally()
    samples: list[tuple[float, float]] = []
    held: list[
        float
    ] = []  # MB the bounded structures hold at each sample: idle sessions' caches + memory tier
    health: list[float] = []
    redis_log: list[str] = []
    t0 = time.monotonic()
    log_t0[0] = t0
    deadline = t0 + args.minutes * 60
    threads = [
        threading.Thread(target=client_loop, args=(i, port, deadline, tally, book, i), daemon=True)
        for i in range(args.clients)
    ]
    if args.faults:
        assert redis_proc is not None
        threads += [
            threading.Thread(target=fault_loop, args=(port, deadline, tally, book, 99), daemon=True),
            threading.Thread(target=connection_loop, args=(port, deadline, tally), daemon=True),
            threading.Thread(target=health_probe, args=(port, deadline, health, tally), daemon=True),
            threading.Thread(
                target=redis_faults, args=(redis_proc, redis_port, deadline, redis_log), daemon=True
            ),
        ]
    try:
        for t in threads:
            t.start()
        while time.monotonic() < deadline:
            samples.append(((time.monotonic() - t0) / 60, rss_mb(server.pid)))
            held.append(bounded_mb(port))
            time.sleep(5)
        for t in threads:
            t.join(timeout=330)
        alive = server.poll() is None
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
        req.add_header("Authorization", f"Bearer {ADMIN_KEY}")
        metrics = urllib.request.urlopen(req, timeout=30).read().decode()
    finally:
        stop(server)
        if redis_proc is not None:
            os.kill(redis_proc.pid, signal.SIGCONT)
            stop(redis_proc)
    log_mb = (LOGS / "serve-soak.log").stat().st_size / 2**20
    warm = [i for i, (t, _) in enumerate(samples) if t >= args.warmup]
    minutes = [samples[i][0] for i in warm]
    raw_mem = memory_growth(minutes, [samples[i][1] for i in warm])
    # what is not the session table or the store's memory tier (both bounded, both filling slowly)
    rest = memory_growth(minutes, [samples[i][1] - held[i] for i in warm])
    RAW.mkdir(exist_ok=True)
    (RAW / "serve_soak_samples.csv").write_text(
        "minute,resident_mb,bounded_mb\n"
        + "".join(f"{t:.3f},{m:.1f},{h:.1f}\n" for (t, m), h in zip(samples, held, strict=True))
    )
    held_curve = " · ".join(
        f"{t:.1f} min {h:.0f}"
        for (t, _), h in list(zip(samples, held, strict=True))[:: max(1, len(samples) // 12)]
    )
    total = sum(tally.counts.values())
    five = sum(n for k, n in tally.counts.items() if k.split(" -> ")[1][:1] == "5" and not k.endswith("503"))
    rolls = next(
        (line.split()[-1] for line in metrics.splitlines() if line.startswith("kvlab_rolls_total")), "?"
    )
    rows = "\n".join(f"| {k} | {n} |" for k, n in sorted(tally.counts.items()))
    curve = " · ".join(f"{t:.1f} min {m:.0f}" for t, m in samples[:: max(1, len(samples) // 12)])
    worst_health = max(health) if health else float("nan")
    health_ok = not health or worst_health <= 2.0
    verdict = (
        "pass" if five == 0 and not tally.bad and rest["growth"] <= 0.10 and alive and health_ok else "FAIL"
    )
    fault_lines = (
        f"""- Faults: Redis {", ".join(redis_log) or "none injected"}; `/health` probed {len(health)} times,
  slowest **{worst_health * 1000:.0f} ms** (bar: 2 s); server log {log_mb:.2f} MB.
"""
        if args.faults
        else ""
    )
    fault_desc = (
        "; with the faults of issue 27 (a Redis store paused, full and WRONGTYPE in turn; 1e-310 "
        "temperatures; 300-token requests abandoned after 1.5 s; ~3,000-token prompts; the bodies that "
        "once gave a 500; 60 idle and 20 slowloris connections from another address)"
        if args.faults
        else ""
    )
    body = f"""kvlab serve on 127.0.0.1 with the bundled SmolLM2 (window {args.window} + 4 sinks, batch {args.max_batch},
queue {args.max_queue}, {args.max_sessions} idle sessions kept, a {args.store_memory_mb} MiB memory store, two API
keys); {args.clients} client threads for
{args.minutes:g} minutes, each looping over: conversations continued turn after turn (30% of turns a
~180-token book passage, so they roll), single chats with seeded sampling, completions with a stop
string, streams dropped after two chunks, and malformed or unauthorised requests{fault_desc}.

| request -> status | count |
|---|---|
{rows}

- Requests: {total}; 5xx other than 503: **{five}**; unexpected outcomes: {len(tally.bad)}{"" if not tally.bad else " (" + "; ".join(tally.bad[:5]) + ")"}.
- Rolls counted by the server (`kvlab_rolls_total`): {rolls}. Server alive at the end: {alive}.
- Resident memory (MB) over time: {curve}.
- Held by the bounded structures (idle sessions' caches + the store's memory tier, from `/metrics`), MB: {held_curve}.
- After {args.warmup:g} min of warm-up ({len(minutes)} samples), resident less the bounded structures: a
  Theil-Sen line from {rest["start"]:.0f} MB rising {rest["slope"]:+.1f} MB/min (95% interval {rest["lo"]:+.1f} to
  {rest["hi"]:+.1f}): **growth {rest["growth"] * 100:+.1f}%** over the run (bar: 10%); medians of the first and last
  thirds {rest["early"]:.0f} -> {rest["late"]:.0f} MB. Resident memory itself: {raw_mem["growth"] * 100:+.1f}% on its line,
  medians {raw_mem["early"]:.0f} -> {raw_mem["late"]:.0f} MB.
- The bar before 2026-12-02 (highest value against the first sample after warm-up), for comparison:
  resident {raw_mem["first"]:.0f} / {raw_mem["highest"]:.0f} MB ({raw_mem["peak_growth"] * 100:+.1f}%), less the bounded
  structures {rest["first"]:.0f} / {rest["highest"]:.0f} MB ({rest["peak_growth"] * 100:+.1f}%).
  Raw samples: `benchmarks/results/raw/serve_soak_samples.csv`.
{fault_lines}
**Verdict: {verdict}.** Server log: `benchmarks/out/serve-soak.log`.
"""
    write_results("serve_soak", "Serving under load: 10 minutes at the queue limit", body)


if __name__ == "__main__":
    main()
