"""Benchmark: what a full Redis costs ``kvlab serve`` per request, in CPU-seconds of the server process.

Issue 48: with ``maxmemory`` reached under ``noeviction`` every store put is refused with OOM; a put of 4
blocks cost 9.27 s (8.84 s of it redis-py formatting its error over the 2.4 MB value), on the engine
thread, for every request while Redis stayed full. The fix writes Redis behind the engine (a bounded
queue, one writer thread), never through a pipeline (whose error quotes the value), and trips the tier's
circuit breaker on every Redis error.

One server (the bundled SmolLM2, ``--store redis://...`` on a private redis-server) serves rounds of
requests, each a new conversation (a unique ~300-token prompt, so each one looks up and puts ~5 blocks),
in two states alternated round by round (the order flips every round): *healthy* (no ``maxmemory``) and
*full* (``maxmemory 1``, ``noeviction``: every write is OOM). Per round and state: the server process's
CPU-seconds (user + system, every thread: ``/proc/PID/stat``) per request, the wall time per request,
and the OOM replies Redis sent (``INFO errorstats``). Before a healthy round the script waits out the
tier's back-off and sends one untimed request, so the breaker a full round left open is closed again.

The servers run with ``OMP_NUM_THREADS=1``: on a shared machine, idle OpenMP threads spinning for work
would add CPU-seconds that have nothing to do with the store.

``--before-src DIR`` also runs a second server from another source tree (``PYTHONPATH=DIR/src``, e.g. a
``git archive`` of the code before the fix) on its own Redis, alternated with the first in the same run.

Run: python benchmarks/serve_redis_full.py [--rounds 6] [--requests 3] [--before-src DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Refusal, run_main, write_results  # noqa: E402
from serve import LOGS, client_for, free_port, start, start_redis, stop  # noqa: E402

MODEL = "smollm2-135m"
BACKOFF_S = 5.0  # the Redis tier's default back-off (KVLAB_REDIS_BACKOFF_S), left as users get it
WORDS = [
    "river",
    "stone",
    "lamp",
    "orchard",
    "violet",
    "copper",
    "harbor",
    "meadow",
    "signal",
    "canvas",
    "thunder",
    "pepper",
]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid``, all its threads (``/proc/PID/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompt(n: int) -> str:
    """A unique ~300-token prompt: no stored prefix beyond the chat template's first tokens."""
    words = " ".join(WORDS[(n * 7 + i * (n % 5 + 1)) % len(WORDS)] for i in range(240))
    return f"Request {n}: {words}. Summarise this in one word."


class Side:
    """One kvlab server on its own redis-server."""

    def __init__(self, name: str, src: Path | None, workdir: Path) -> None:
        import redis

        self.name = name
        self.redis_port = free_port()
        self.redis_proc = start_redis(self.redis_port, workdir)
        self.redis = redis.Redis(port=self.redis_port)
        self.redis.config_set("maxmemory-policy", "noeviction")
        port = free_port()
        env_before = os.environ.get("PYTHONPATH")
        if src is not None:
            os.environ["PYTHONPATH"] = str(src / "src")
        try:
            cmd = [sys.executable, "-m", "kvlab", "serve", "--port", str(port)]
            cmd += ["--store", f"redis://127.0.0.1:{self.redis_port}/0"]
            self.proc = start(cmd, port, LOGS / f"serve-redis-full-{name}.log")
        finally:
            if env_before is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = env_before
        self.client = client_for(port)
        self.asked = 0

    def ask(self) -> None:
        self.asked += 1
        r = self.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt(self.asked)}],
            max_tokens=8,
            temperature=0,
        )
        assert r.choices[0].message.content is not None

    def ooms(self) -> int:
        stats = self.redis.info("errorstats")
        return int(stats.get("errorstat_OOM", {}).get("count", 0))

    def round(self, state: str, requests: int) -> dict:
        """``requests`` timed requests in ``state``: CPU and wall seconds per request, OOM replies."""
        self.redis.config_set("maxmemory", "1" if state == "full" else "0")
        if state == "healthy":
            time.sleep(BACKOFF_S + 0.5)  # a breaker a full round opened has passed its back-off
            self.ask()  # untimed: its put probes Redis and closes the breaker
        time.sleep(1.0)  # the writer thread done with what came before
        ooms, cpu, wall = self.ooms(), cpu_seconds(self.proc.pid), time.perf_counter()
        for _ in range(requests):
            self.ask()
        wall = time.perf_counter() - wall
        time.sleep(1.0)  # the writer thread's share of these requests is theirs
        cpu = cpu_seconds(self.proc.pid) - cpu
        return {"cpu": cpu / requests, "wall": wall / requests, "ooms": self.ooms() - ooms}

    def close(self) -> None:
        stop(self.proc, self.redis_proc)


def table(name: str, rounds: list[dict]) -> str:
    lines = [
        f"**{name}**",
        "",
        "| round | healthy CPU s/req | full CPU s/req | full / healthy | healthy wall s/req | full wall s/req "
        "| OOM replies (full) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds):
        h, f = r["healthy"], r["full"]
        lines.append(
            f"| {i + 1} ({r['order']}) | {h['cpu']:.3f} | {f['cpu']:.3f} | {f['cpu'] / h['cpu']:.2f} "
            f"| {h['wall']:.2f} | {f['wall']:.2f} | {f['ooms']} |"
        )
    ratios = [r["full"]["cpu"] / r["healthy"]["cpu"] for r in rounds]
    med = lambda k, s: statistics.median(r[s][k] for r in rounds)  # noqa: E731
    lines += [
        "",
        f"Median over {len(rounds)} rounds: healthy {med('cpu', 'healthy'):.3f} CPU-s per request, full "
        f"{med('cpu', 'full'):.3f}; full / healthy {statistics.median(ratios):.2f} "
        f"(rounds {min(ratios):.2f} to {max(ratios):.2f}). Wall per request: healthy "
        f"{med('wall', 'healthy'):.2f} s, full {med('wall', 'full'):.2f} s.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=3, help="timed requests per round and state")
    ap.add_argument("--before-src", type=Path, help="also run a server from this source tree (its src/)")
    args = ap.parse_args()
    if args.rounds < 5 or args.requests < 1:
        raise Refusal("need --rounds >= 5 (a median and range over fewer means little) and --requests >= 1")
    if args.before_src is not None and not (args.before_src / "src" / "kvlab").is_dir():
        raise Refusal(f"--before-src {args.before_src} has no src/kvlab")
    try:
        subprocess.run(["redis-server", "--version"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        raise Refusal("redis-server is not installed") from None
    LOGS.mkdir(exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = "1"  # the servers' (see the docstring)
    import kvlab

    workdir = Path(tempfile.mkdtemp(prefix="kvlab-redis-full-"))
    sides = [Side("after", None, workdir)]
    if args.before_src is not None:
        sides.append(Side("before", args.before_src, workdir))
    results: dict[str, list[dict]] = {s.name: [] for s in sides}
    try:
        for side in sides:
            side.ask()  # warm up (model, store, breaker closed)
        for i in range(args.rounds):
            order = ("healthy", "full") if i % 2 == 0 else ("full", "healthy")
            for side in sides if i % 2 == 0 else sides[::-1]:
                row = {"order": " then ".join(order)}
                for state in order:
                    row[state] = side.round(state, args.requests)
                    print(side.name, i + 1, state, row[state], flush=True)
                results[side.name].append(row)
    finally:
        for side in sides:
            side.close()
    sources = {"after": str(Path(kvlab.__file__).resolve().parents[1])}
    if args.before_src is not None:
        sources["before"] = str(args.before_src / "src")
    body = [
        "A new ~300-token conversation per request (8 tokens generated), so each request looks up and puts "
        f"~5 blocks; {args.requests} timed requests per round and state; server CPU = user + system of the "
        "`kvlab serve` process (every thread, the Redis writer's included, read 1 s after the last reply). "
        "*full*: `maxmemory 1`, `noeviction` (every write is OOM). Tier back-off: the default 5 s. "
        "Servers with `OMP_NUM_THREADS=1`.",
        "",
    ]
    for name, rounds in results.items():
        body += [table(f"{name} (kvlab from {sources[name]})", rounds), ""]
    write_results(
        "serve_redis_full", "kvlab serve: server CPU per request, healthy vs full Redis", "\n".join(body)
    )


if __name__ == "__main__":
    run_main(main)
