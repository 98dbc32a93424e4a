"""Benchmark: decode throughput of ``kvlab serve --capture compile`` against eager (``--capture off``) and
llama.cpp's ``llama-server``, side by side in one run, ONE thread each, on this CPU (issue 46).

Every server serves SmolLM2-135M-Instruct in float32 (kvlab: its safetensors folder of the bundled model;
llama-server: the same weights converted to an F32 GGUF by ``scripts/build_llama_server.sh``) on
127.0.0.1 with OMP_NUM_THREADS=1 (``llama-server -t 1 -tb 1``). Each round measures three things, each
on every server before the next thing begins (a pair's two measurements seconds apart), in an order rotated
round by round, each measurement right after a short reply of the same server (``WARM_TOKENS``, discarded:
the machine's caches then hold that server's weights, as when it serves alone, not the server's before);
round 0 is a warm-up (torch.compile compiles on the first requests) and is discarded:

1. **Prefill**: one conversation with a ~500-token prompt (a passage of the book), ``max_tokens`` 1:
   time to first token.
2. **Decode, 1 conversation**: a short prompt whose greedy reply is long, ``max_tokens`` N (llama-server
   is asked to ``ignore_eos``; kvlab has no such switch, so the tokens each reply has are counted), sent
   to the servers there and back (A B C C B A: a drift of the machine's speed within the phase falls on
   each server alike). Decode rate = (tokens - 1) / (time of the last streamed token - time of the
   first), a server's two replies pooled (their tokens - 1 summed over their spans summed).
3. **Decode, 4 conversations at once**: four such prompts sent together: the sum of their rates, and
   the aggregate (all tokens - 1) / (last token of any - first token of any).

Prompts differ from round to round from their first tokens (no server reuses a cached prefix), and are
the same for every server within a round. Per setting: the median over rounds, and the PAIRED ratio per
round (kvlab-compile / kvlab-off, llama-server / kvlab-compile) with a 95% t-interval on the log
ratios (only from >= 5 rounds). The weight-bandwidth floor: the fastest this machine's one thread read
a 1 GiB float32 tensor, before and after the rounds (torch's sum, one stream; and ``read_streams.c``,
several interleaved streams prefetching ahead, which reads faster), best of 5 each, and floor ms/token =
weight bytes / that bandwidth, beside each server's ms/token at 1 conversation.

Run: python benchmarks/serve_decode.py [--rounds 7] [--max-tokens 64]
         [--llama-server PATH --gguf PATH] [--before COMMIT] [--no-write] [--name serve_decode]
     (writes benchmarks/results/<name>.md, a row of its own, e.g. ``--max-tokens 512 --name
     serve_decode_512`` for long replies; ``--before``: a fourth server, ``--capture compile`` at that
     commit, paired with ``compile`` round by round: a change measured against the commit before it)
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import NoReturn

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the servers inherit it; this process reads with 1 thread
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # compiling must not take the other core

import openai  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import RESULTS, Refusal, c_function, run_main, write_results  # noqa: E402
from serve import LOGS, free_port, passages, stop  # noqa: E402

MODEL = "smollm2-135m"
ROOT = Path(__file__).resolve().parents[1]
ESSAY = (
    "Write a long, detailed essay about the history of bridges, with many examples from different countries."
)


@dataclass
class Server:
    key: str  # off, compile, before (compile at --before), llama
    label: str  # the baseline, named in full
    port: int
    extra: dict = field(default_factory=dict)  # extra request fields
    proc: subprocess.Popen | None = None

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0, timeout=900
        )


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line and exit 2 (run_main), not argparse's usage block
        raise Refusal(message)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="measured rounds after the warm-up (>= 5 to write)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens asked per reply")
    ap.add_argument("--prefill-tokens", type=int, default=500, help="about this many prompt tokens (prefill)")
    ap.add_argument("--llama-server", type=Path, help="a llama-server binary (scripts/build_llama_server.sh)")
    ap.add_argument("--gguf", type=Path, help="the F32 GGUF of the same weights, for --llama-server")
    ap.add_argument("--no-write", action="store_true", help="print the tables, write no results file")
    ap.add_argument("--name", default="serve_decode", help="the results file: benchmarks/results/<name>.md")
    ap.add_argument(
        "--kvlab-commit", default="HEAD", help="serve kvlab from a clean copy of this commit's src/"
    )
    ap.add_argument("--working-tree", action="store_true", help="serve kvlab from the working tree instead")
    ap.add_argument(
        "--before",
        help="also serve --capture compile from a clean copy of this commit's src/ (server `before`): "
        "the change against the commit before it, paired in the same rounds",
    )
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise Refusal(f"--rounds must be >= 1, got {args.rounds}")
    if not args.no_write and args.rounds < 5:
        raise Refusal(f"a results file needs --rounds >= 5 (got {args.rounds}); a smoke run takes --no-write")
    if not re.fullmatch(r"serve_decode[a-z0-9_]*", args.name):
        raise Refusal(
            f"--name must be serve_decode followed by [a-z0-9_] (a results file's name), got {args.name!r}"
        )
    if args.max_tokens < 2:
        raise Refusal(f"--max-tokens must be >= 2 (a decode rate needs two tokens), got {args.max_tokens}")
    if not 64 <= args.prefill_tokens <= 900:
        raise Refusal(
            f"--prefill-tokens must be in [64, 900] (within one 1,024-token window), got {args.prefill_tokens}"
        )
    if (args.llama_server is None) != (args.gguf is None):
        raise Refusal("--llama-server and --gguf go together (or neither: no llama-server column)")
    if args.llama_server is not None and not os.access(args.llama_server, os.X_OK):
        raise Refusal(f"--llama-server {args.llama_server} is not an executable file")
    if args.gguf is not None and not args.gguf.is_file():
        raise Refusal(f"--gguf {args.gguf} is not a file")
    if args.working_tree and args.kvlab_commit != "HEAD":
        raise Refusal("--working-tree and --kvlab-commit exclude each other")
    for opt, rev in (("--kvlab-commit", args.kvlab_commit), ("--before", args.before)):
        probe = ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"]
        if rev is not None and subprocess.run(probe, capture_output=True).returncode != 0:
            raise Refusal(f"{opt} {rev!r} is not a commit of this repository")
    return args


# --- servers ---------------------------------------------------------------------------------------------


def start(
    cmd: list[str], port: int, log: Path, minutes: float = 30, path: str | None = None
) -> subprocess.Popen:
    """``cmd`` started (output to ``log``), once it answers ``/v1/models``: ``kvlab serve --capture compile``
    compiles (and autotunes) its step before it listens, which on one thread can take many minutes.
    ``path``: a ``src/`` put first on its PYTHONPATH (kvlab from a commit's clean copy)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=5)
    deadline = time.monotonic() + minutes * 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{Path(cmd[0]).name} {' '.join(cmd[1:4])} exited: {log.read_text()[-1500:]}")
        try:
            client.models.list()
            return proc
        except openai.OpenAIError:
            time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{Path(cmd[0]).name} {' '.join(cmd[1:4])} did not start in {minutes} minutes")


def torch_kernel() -> str:
    import torch

    blas = next(
        (
            ln.split("=", 1)[1].strip(",")
            for ln in torch.__config__.show().split()
            if ln.startswith("BLAS_INFO=")
        ),
        "?",
    )
    return f"PyTorch {torch.__version__} (BLAS {blas})"


def start_kvlab(capture: str, key: str | None = None, path: str | None = None, commit: str = "") -> Server:
    """``kvlab serve --capture capture`` as server ``key`` (default: the capture), from ``path`` (a commit's
    clean ``src/``, named ``commit``) or from the snapshot every kvlab server runs."""
    port = free_port()
    how = {
        "off": "eager: each conversation's own rolling cache in one batched forward",
        "compile": "torch.compile(fullgraph=True) inductor C++ step, weights frozen; a graph per width of 1, 2"
        " and 4 ring rows, each step the narrowest holding its conversations, over the slots they wrote",
    }[capture]
    label = (
        f"kvlab serve --capture {capture} ({how}; {torch_kernel()}, fp32, 1 thread, window 1024 + 4 sinks)"
    ) + (f"; kvlab at commit {commit} (`--before`)" if commit else "")
    cmd = [sys.executable, "-m", "kvlab", "serve", "--port", str(port), "--device", "cpu", "--max-batch", "4"]
    server = Server(key or capture, label, port)
    t0 = time.perf_counter()
    log = LOGS / f"serve-decode-{server.key}.log"
    server.proc = start([*cmd, "--capture", capture], port, log, path=path)
    server.label += f"; ready {time.perf_counter() - t0:.0f} s after launch"
    return server


def log_value(log: Path, key: str) -> str:
    """What follows ``key`` on the first line of ``log`` that has it ('?' where none does)."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if key in ln]
    return lines[0].split(key, 1)[1].strip(" =:") if lines else "?"


# llama-server's weights read into its own memory (`-lm none`), as kvlab's compiled step holds its frozen
# copy, not memory-mapped from the page cache (its default): mapped, it decoded ~0.8x as fast here on
# 2026-12-02 (one thread, alone, 6 alternated rounds of 64-token replies by its own timings), so llama-server
# is measured at its faster setting
LLAMA_LOAD = ("-lm", "none")


def start_llama(binary: Path, gguf: Path) -> Server:
    def launch(name: str, *extra: str) -> tuple[subprocess.Popen, int, Path]:
        port = free_port()
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-tb", "1",
               "-c", "4096", "-np", "4", "-cram", "0", "--no-webui", *LLAMA_LOAD, *extra]  # fmt: skip
        return start(cmd, port, LOGS / f"serve-decode-{name}.log"), port, LOGS / f"serve-decode-{name}.log"

    probe, _, log = launch("llama-probe", "-lv", "5")  # trace logging (what it runs on), then stopped
    stop(probe)
    info, fa, kv = log_value(log, "system_info:"), log_value(log, "flash_attn "), log_value(log, "K (")
    fa += " (FLASH_ATTN_EXT in its graph: on)" if "FLASH_ATTN_EXT" in log.read_text(errors="replace") else ""
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    build = " ".join((version.stdout + version.stderr).split()[:6])
    server = Server("llama", "", 0, {"ignore_eos": True, "cache_prompt": False})
    server.proc, server.port, _ = launch("llama")  # default logging: none per token
    server.label = (
        f"llama.cpp llama-server ({build}; ggml CPU backend, F32 GGUF `{gguf.name}`, -t 1 -tb 1, "
        f"-c 4096 -np 4 (1,024 per slot), -lm none (the weights read into its own memory), flash_attn {fa}, KV cache {kv.split(':')[0].strip(' )')} (its "
        f"default), continuous batching; {info})"
    )
    return server


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def kvlab_snapshot(work: Path, rev: str) -> tuple[str, str]:
    """``rev``'s ``src/`` copied into ``work`` (``git archive``), for the kvlab servers' PYTHONPATH, so what
    they run is the commit the results name, not the working tree (which others may be editing); returns
    that commit and the copy's ``src/``."""
    commit = git("rev-parse", "--short", rev)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "src"], capture_output=True, check=True
    )
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(work)], input=archive.stdout, check=True)
    return commit, str(work / "src")


# --- requests --------------------------------------------------------------------------------------------


def stream(server: Server, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy reply: when it was sent, its first and last content chunk, its token counts."""
    times: list[float] = []
    usage = None
    sent = time.perf_counter()
    chunks = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=server.extra or None,
    )  # fmt: skip
    for ch in chunks:
        if ch.choices and ch.choices[0].delta.content:
            times.append(time.perf_counter())
        if getattr(ch, "usage", None):
            usage = ch.usage
    if not times:
        raise RuntimeError(f"{server.key}: a reply without content")
    tokens = usage.completion_tokens if usage else len(times)
    prompt = usage.prompt_tokens if usage else 0
    return {
        "sent": sent,
        "first": times[0],
        "last": times[-1],
        "tokens": tokens,
        "chunks": len(times),
        "prompt": prompt,
    }


def rate(r: dict) -> float:
    return (r["tokens"] - 1) / max(r["last"] - r["first"], 1e-9)


def essay(tag: str) -> list[dict]:
    return [
        {"role": "system", "content": f"Session {tag}. You are a helpful assistant."},
        {"role": "user", "content": ESSAY},
    ]


def together(server: Server, prompts: list[list[dict]], max_tokens: int) -> list[dict]:
    out: list[dict | None] = [None] * len(prompts)
    gate = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        gate.wait()
        out[i] = stream(server, prompts[i], max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(r is None for r in out):
        raise RuntimeError(f"{server.key}: a conversation of 4 failed (see its log in benchmarks/out)")
    return [r for r in out if r is not None]


def prefill(server: Server, r: int, passage: str) -> dict:
    """Time to first token of a ~500-token prompt (``max_tokens`` 1)."""
    pre = [
        {"role": "system", "content": f"Session {r:02d}9. You are a helpful assistant."},
        {"role": "user", "content": passage + "\n\nRetell this passage in your own words."},
    ]
    p = stream(server, pre, 1)
    return {"ttft_ms": (p["first"] - p["sent"]) * 1000, "prefill_prompt": p["prompt"]}


def decode_one(replies: list[dict]) -> dict:
    """One conversation's decode rate over its replies of a round, pooled: (tokens - 1 summed) / (their
    spans summed)."""
    spans = sum(x["last"] - x["first"] for x in replies)
    return {
        "d1": sum(x["tokens"] - 1 for x in replies) / max(spans, 1e-9),
        "d1_tokens": min(x["tokens"] for x in replies), "d1_chunks": min(x["chunks"] for x in replies),
        "d1_prompt": replies[0]["prompt"], "d1_rates": [rate(x) for x in replies],
    }  # fmt: skip


def decode_four(server: Server, r: int, max_tokens: int) -> dict:
    """Four conversations sent together: the sum of their rates and the aggregate rate."""
    four = together(server, [essay(f"{r:02d}{c}") for c in range(1, 5)], max_tokens)
    total = sum(x["tokens"] for x in four)
    span = max(x["last"] for x in four) - min(x["first"] for x in four)
    return {
        "d4_sum": sum(rate(x) for x in four), "d4_agg": (total - 1) / span,
        "d4_tokens": [x["tokens"] for x in four],
    }  # fmt: skip


# --- the machine's floor -----------------------------------------------------------------------------------


def read_bandwidth(reps: int = 5) -> dict[str, float]:
    """Bytes per second one thread reads a 1 GiB float32 tensor at (best of ``reps``): ``"sum"``, torch
    summing it (one sequential stream); ``"streams"``, the C reader ``read_streams.c`` over the same bytes
    as several interleaved streams with software prefetch, at its best of a few stream counts and prefetch
    distances (absent without a C compiler). A one-stream sum is not the most one thread can read: the
    floor takes the faster."""
    import torch

    torch.set_num_threads(1)
    x = torch.ones(2**28)
    x.sum()
    out = {"sum": x.numel() * 4 / _best(lambda: x.sum(), reps)}
    reader = _stream_reader()
    if reader is not None:
        for streams, ahead in [(1, 0), (4, 1024), (8, 1024), (16, 1024)]:
            t = _best(lambda s=streams, a=ahead: reader(x.data_ptr(), x.numel(), s, a), reps)
            read = x.numel() // streams // 64 * 64 * streams * 4  # the bytes it reads (whole 256-byte steps)
            if read / t > out.get("streams", 0.0):
                out.update(streams=read / t, n_streams=streams, ahead=ahead)
    return out


def _best(f, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def _stream_reader():
    """``read_streams.c``, built and loaded (None: no compiler, or it failed)."""
    import ctypes

    args = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_long]
    return c_function(HERE / "read_streams.c", "read_streams", args, ctypes.c_float)


def weight_bytes(folder: Path) -> int:
    """Bytes of the model's parameters (each stored tensor once: the tied embedding is the lm_head)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
            t = f.get_slice(name)
            total += math.prod(t.get_shape()) * {"F32": 4, "F16": 2, "BF16": 2}[t.get_dtype()]
    return total


# --- statistics --------------------------------------------------------------------------------------------


def paired(num: Sequence[float], den: Sequence[float]) -> dict:
    """Per-round ratios num/den: geometric mean with a 95% t-interval on the logs (>= 5 rounds), median."""
    from scipy import stats

    ratios = [a / b for a, b in zip(num, den, strict=True)]
    logs = [math.log(x) for x in ratios]
    mean = statistics.fmean(logs)
    out = {
        "ratios": ratios,
        "geo": math.exp(mean),
        "median": statistics.median(ratios),
        "lo": None,
        "hi": None,
    }
    if len(logs) >= 5:
        half = float(stats.t.ppf(0.975, len(logs) - 1)) * statistics.stdev(logs) / math.sqrt(len(logs))
        out["lo"], out["hi"] = math.exp(mean - half), math.exp(mean + half)
    return out


def fmt_ratio(p: dict) -> str:
    return f"{p['geo']:.2f}x"


def fmt_interval(p: dict) -> str:
    return f"[{p['lo']:.2f}, {p['hi']:.2f}]" if p["lo"] is not None else "— (fewer than 5 rounds)"


# --- the run ----------------------------------------------------------------------------------------------


WARM_TOKENS = 16  # each measurement's warm-up reply: the machine's caches hold this server's weights, not the last one's


def warm(server: Server, tag: str) -> None:
    """A short reply, discarded, right before a measurement on ``server``: a server measured right after
    another (whose weights fill the caches) would otherwise be measured in a state it is never in when it
    serves alone. Its prompt differs from the measured ones from its first word (no prefix to reuse)."""
    stream(
        server,
        [{"role": "system", "content": f"Warm-up {tag}."}, {"role": "user", "content": ESSAY}],
        WARM_TOKENS,
    )


def one_round(servers: list[Server], r: int, passage: str, max_tokens: int) -> dict[str, dict]:
    """One round in three phases, each going through every server before the next begins (a pair's two
    measurements seconds apart, not a server's whole round), each measurement right after a warm-up
    reply of its own server: prefill in ``servers``' order; one conversation's decode there and back
    (A B C C B A: a drift of the machine's speed within the phase falls on every server alike), each
    server's two replies pooled; four conversations in order."""
    got: dict[str, dict] = {}
    for s in servers:
        warm(s, f"{r:02d}p")
        got[s.key] = prefill(s, r, passage)
    replies: dict[str, list[dict]] = {s.key: [] for s in servers}
    for i, s in enumerate([*servers, *reversed(servers)]):
        warm(s, f"{r:02d}{i}")
        replies[s.key].append(stream(s, essay(f"{r:02d}0{i}"), max_tokens))
    for s in servers:
        warm(s, f"{r:02d}f")
        got[s.key] |= decode_one(replies[s.key]) | decode_four(s, r, max_tokens)
    return got


def run_rounds(
    servers: list[Server], rounds: int, max_tokens: int, texts: list[str]
) -> list[dict[str, dict]]:
    """Round 0 (warm-up, discarded) then ``rounds`` rounds, the servers' order rotated each round."""
    rows: list[dict[str, dict]] = []
    for r in range(rounds + 1):
        order = servers[r % len(servers) :] + servers[: r % len(servers)]
        got = one_round(order, r, texts[r], max_tokens)
        print(f"round {r}{' (warm-up)' if r == 0 else ''}: " + ", ".join(
            f"{k} {v['d1']:.1f}/{v['d4_sum']:.1f} tok/s, TTFT {v['ttft_ms']:.0f} ms" for k, v in got.items()
        ), flush=True)  # fmt: skip
        if r:
            rows.append(got)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the servers too (finally)
    from kvlab.model.loading import bundled_model_dir

    folder = bundled_model_dir()
    LOGS.mkdir(exist_ok=True)
    texts = passages(args.rounds + 1, args.prefill_tokens - 40, skip=60)
    bw_before = read_bandwidth()
    servers: list[Server] = []
    work = Path(tempfile.mkdtemp(prefix="kvlab-serve-decode-"))
    try:
        args.commit, path = (
            (git("rev-parse", "--short", "HEAD"), None)
            if args.working_tree
            else kvlab_snapshot(work / "now", args.kvlab_commit)
        )
        servers.append(start_kvlab("off", path=path))
        servers.append(start_kvlab("compile", path=path))
        if args.before is not None:
            before, old = kvlab_snapshot(work / "before", args.before)
            servers.append(start_kvlab("compile", "before", old, before))
        if args.llama_server is not None:
            servers.append(start_llama(args.llama_server, args.gguf))
        t0, load = time.perf_counter(), os.getloadavg()[0]
        rows = run_rounds(servers, args.rounds, args.max_tokens, texts)
        minutes = (time.perf_counter() - t0) / 60
        args.load = (load, os.getloadavg()[0])
    finally:
        stop(*[s.proc for s in servers if s.proc is not None])
        shutil.rmtree(work, ignore_errors=True)
    bw_after = read_bandwidth()
    floor = {"bytes": weight_bytes(folder), "before": bw_before, "after": bw_after}
    floor["bw"] = max(b.get(k, 0.0) for b in (bw_before, bw_after) for k in ("sum", "streams"))
    body, summary = report(args, servers, rows, floor, minutes)
    if args.no_write:
        print(body)
        return
    # the command the file shows: build outputs as DEST/<name>, no machine path
    sys.argv[1:] = [f"DEST/{Path(a).name}" if Path(a).is_absolute() else a for a in sys.argv[1:]]
    path = RESULTS / f"{args.name}.md"
    path.write_text(summary)  # write_results carries a file's summary block over to the head: this one
    write_results(
        args.name,
        "Serving decode: kvlab serve --capture compile vs eager vs llama-server, 1 thread",
        body,
    )


# --- the report -------------------------------------------------------------------------------------------


def col(rows: list[dict[str, dict]], key: str, field_: str) -> list[float]:
    return [r[key][field_] for r in rows]


def floor_reads(floor: dict) -> str:
    """How each read of the floor's GiB went, before and after the rounds."""
    b, a = floor["before"], floor["after"]
    text = f"torch summing it, one stream: {b['sum'] / 1e9:.2f} GB/s before the rounds, {a['sum'] / 1e9:.2f} after"
    if "streams" in b and "streams" in a:
        text += (
            f"; `benchmarks/read_streams.c`, the same bytes as interleaved streams prefetching ahead (best of 1, 4, "
            f"8 and 16 streams): {b['streams'] / 1e9:.2f} GB/s before ({b['n_streams']} streams, {b['ahead']} bytes "
            f"ahead), {a['streams'] / 1e9:.2f} after ({a['n_streams']}, {a['ahead']}); best of 5 each"
        )
    else:
        text += "; best of 5 each; no C compiler here for the many-stream reader"
    return text


def setting_table(rows: list[dict[str, dict]], keys: list[str], floor: dict) -> list[str]:
    floor_ms = floor["bytes"] / floor["bw"] * 1000
    out = [
        "| server | decode 1 conv tok/s | ms/token | floor ms/token | floor / measured | decode 4 conv: sum of "
        "rates tok/s | 4 conv aggregate tok/s | prefill TTFT ms | prefill tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in keys:
        d1 = statistics.median(col(rows, k, "d1"))
        ttft = statistics.median(col(rows, k, "ttft_ms"))
        prompt = rows[0][k]["prefill_prompt"]
        out.append(
            f"| {k} | {d1:.1f} | {1000 / d1:.1f} | {floor_ms:.1f} | {floor_ms * d1 / 1000:.0%} | "
            f"{statistics.median(col(rows, k, 'd4_sum')):.1f} | {statistics.median(col(rows, k, 'd4_agg')):.1f} | "
            f"{ttft:.0f} | {prompt / ttft * 1000:.0f} |"
        )
    return out


PAIRS = [
    ("compile", "before", "kvlab-compile / kvlab-compile at --before"),
    ("compile", "off", "kvlab-compile / kvlab-off"),
    ("llama", "compile", "llama-server / kvlab-compile"),
    ("llama", "off", "llama-server / kvlab-off"),
]
MEASURES = [
    ("d1", "decode rate, 1 conversation", False),
    ("d4_sum", "decode, 4 conversations: sum of rates", False),
    ("d4_agg", "decode, 4 conversations: aggregate", False),
    ("ttft_ms", "prefill speed (TTFT of B / TTFT of A)", True),
]


def ratio_table(rows: list[dict[str, dict]], keys: list[str]) -> tuple[list[str], dict[tuple, dict]]:
    out = [
        "| ratio | measure | geometric mean | 95% interval | median | per round |",
        "|---|---|---|---|---|---|",
    ]
    got: dict[tuple, dict] = {}
    for a, b, name in PAIRS:
        if a not in keys or b not in keys:
            continue
        for field_, what, inverse in MEASURES:
            num, den = col(rows, a, field_), col(rows, b, field_)
            p = paired(den, num) if inverse else paired(num, den)
            got[(a, b, field_)] = p
            per = ", ".join(f"{x:.2f}" for x in p["ratios"])
            out.append(
                f"| {name} | {what} | {fmt_ratio(p)} | {fmt_interval(p)} | {p['median']:.2f} | {per} |"
            )
    return out, got


def raw_table(rows: list[dict[str, dict]], keys: list[str]) -> list[str]:
    out = [
        "| round | server | decode 1 tok/s (fewest tokens, chunks; each reply's rate) | 4 conv sum tok/s | 4 conv aggregate tok/s "
        "| 4 conv tokens | TTFT ms (prompt tokens) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(rows, 1):
        for k in keys:
            v = row[k]
            out.append(
                f"| {i} | {k} | {v['d1']:.2f} ({v['d1_tokens']}, {v['d1_chunks']}; "
                f"{', '.join(f'{x:.2f}' for x in v.get('d1_rates', []))}) | {v['d4_sum']:.2f} | "
                f"{v['d4_agg']:.2f} | {'/'.join(map(str, v['d4_tokens']))} | {v['ttft_ms']:.0f} ({v['prefill_prompt']}) |"
            )
    return out


def status(commit: str, otherwise: str = "current") -> str:
    """'code changed since' where HEAD's src/ is not the measured commit's (e.g. ``--kvlab-commit`` older)."""
    same = (
        subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", commit, "HEAD", "--", "src"]).returncode
        == 0
    )
    return otherwise if same else "code changed since"


def shown(pair: dict) -> str:
    """Whether the paired interval of llama-server / kvlab shows kvlab ahead, behind, or neither."""
    if pair["lo"] is None:
        return ""
    if pair["hi"] < 1.0:
        return ": clear of 1, kvlab ahead"
    return ": clear of 1, llama-server ahead" if pair["lo"] > 1.0 else ": holds 1, so not shown"


def summary_block(got: dict[tuple, dict], rounds: int, commit: str, max_tokens: int = 64) -> str:
    """One row (BENCHMARKS.md has a size cap): with llama-server, kvlab's decode rate as a multiple of
    its (the issue's goal); without, kvlab-compile's as a multiple of eager's. Replies other than the
    default 64 tokens are named in the claim."""
    date = datetime.now().strftime("%Y-%m-%d")
    what = "1 thread" if max_tokens == 64 else f"{max_tokens}-token replies"
    if ("llama", "compile", "d1") in got:
        pair = got[("llama", "compile", "d1")]  # llama-server / kvlab, paired: its interval is the row's too
        c, e = 1 / pair["geo"], 1 / got[("llama", "off", "d1")]["geo"]
        four = got[("llama", "compile", "d4_sum")]
        c4 = 1 / four["geo"]
        row = (
            f"| speed | Serve decode vs llama-server, {what} | **{c:.2f}x** at 1 conv (llama / kvlab "
            f"{pair['geo']:.2f}x {fmt_interval(pair)}{shown(pair)}; {c4:.2f}x at 4, llama / kvlab {four['geo']:.2f}x "
            f"{fmt_interval(four)}), "
            f"eager {e:.2f}x | llama-server, F32 | CPU 2 cores | "
            f"{date} | {commit} | "
            f"{status(commit, 'current' if shown(pair).endswith('kvlab ahead') else 'bar not met')} |"
        )
    else:
        c = got[("compile", "off", "d1")]["geo"]
        row = (
            f"| speed | kvlab serve --capture compile decode (1 conversation, {what}) | **{c:.2f}x** eager's "
            f"rate ({rounds} rounds) | --capture off, fp32 | CPU 2 cores | {date} | {commit} | {status(commit)} |"
        )
    head = "| theme | claim | figure | versus | machine | date | commit | status |\n|---|---|---|---|---|---|---|---|"
    return f"<!-- summary -->\n{head}\n{row}\n<!-- /summary -->\n"


def kvlab_source(args: argparse.Namespace) -> str:
    if not args.working_tree:
        head = git("rev-parse", "--short", "HEAD")
        newer = "" if status(args.commit) == "current" else f"; HEAD ({head}) has a different src/ since"
        return f"a clean copy of commit {args.commit}'s src/ (`git archive`, `--kvlab-commit`), not the working tree{newer}"
    dirty = git("status", "--porcelain", "src")
    return f"the working tree at commit {args.commit}" + (
        ", with uncommitted changes in src/" if dirty else ""
    )


def goal_line(got: dict[tuple, dict]) -> str:
    """The issue's goal in words: kvlab's decode rate as a multiple of llama-server's."""
    if ("llama", "compile", "d1") not in got:
        return ""
    c1, c4 = got[("llama", "compile", "d1")]["geo"], got[("llama", "compile", "d4_sum")]["geo"]
    e1, e4 = got[("llama", "off", "d1")]["geo"], got[("llama", "off", "d4_sum")]["geo"]
    return (
        f"**Goal (decode >= 1.0x llama-server): kvlab serve decodes at {1 / c1:.2f}x llama-server's rate with "
        f"--capture compile and {1 / e1:.2f}x eager at 1 conversation; {1 / c4:.2f}x and {1 / e4:.2f}x at 4 "
        "(sums of rates).**\n"
    )


def report(args, servers: list[Server], rows, floor: dict, minutes: float) -> tuple[str, str]:
    keys = [s.key for s in servers]
    ratios, got = ratio_table(rows, keys)
    n1 = col(rows, "compile", "d1_tokens")
    floor_ms = floor["bytes"] / floor["bw"] * 1000
    llama = "" if "llama" in keys else (
        "\n**No llama-server column**: the run had no `--llama-server`/`--gguf` "
        "(build them with `scripts/build_llama_server.sh`).\n"
    )  # fmt: skip
    prompt_tokens = [str(rows[0][k]["d1_prompt"]) for k in keys]
    body = "\n".join([
        f"{args.rounds} measured rounds after one warm-up round (discarded); in each, prefill, then one conversation's "
        "decode (two replies per server, there and back: A B C C B A), then four conversations', each on every server "
        f"before the next, each measurement right after a {WARM_TOKENS}-token reply of its own server (discarded); the "
        "servers' order rotates each round. "
        f"Every server: SmolLM2-135M-Instruct, float32, ONE thread, greedy, `max_tokens` {args.max_tokens}; "
        f"decode prompts of {'/'.join(prompt_tokens)} tokens (per server, the chat template's count), prefill prompts of "
        f"{rows[0][keys[0]]['prefill_prompt']} tokens. Wall time of the rounds: {minutes:.1f} min.",
        llama,
        "Servers (named in full):",
        "",
        *[f"- `{s.key}`: {s.label}" for s in servers],
        "",
        "### Per setting (median over rounds)",
        "",
        *setting_table(rows, keys, floor),
        "",
        f"Weight-bandwidth floor: {floor['bytes'] / 1e6:.1f} MB of fp32 weights read once per decode step, at "
        f"{floor['bw'] / 1e9:.2f} GB/s, the fastest one thread read 1 GiB of float32 here ({floor_reads(floor)}) = "
        f"**{floor_ms:.1f} ms/token** at 1 conversation (the same bytes serve all 4 rows of a step, so 4 "
        f"conversations' floor is {4000 / floor_ms:.0f} tok/s). 'floor / measured' is the share of a "
        "step the weight read alone explains; the rest is compute, attention over the cache, and overhead.",
        "",
        "### Paired ratios (per round; > 1: the first server is faster)",
        "",
        *ratios,
        "",
        goal_line(got),
        "### Notes",
        "",
        f"- Load average (1 minute) {args.load[0]:.2f} as the rounds began and {args.load[1]:.2f} as they ended, "
        "on 2 cores (each server runs one thread; the client is this process). Every ratio is paired within a "
        "round, its two measurements taken in the same phase of it.",
        f"- kvlab has no `ignore_eos`: its replies have the tokens counted in the raw rows (kvlab-compile "
        f"at 1 conversation: {min(n1)}-{max(n1)} of {args.max_tokens}); llama-server was asked to `ignore_eos` "
        "and to skip its prompt cache (`cache_prompt: false`, `-cram 0`).",
        "- Decode rate = (tokens - 1) / (last streamed token - first), client side, per conversation; the "
        "4-conversation aggregate = (all tokens - 1) / (last token of any - first token of any).",
        "- Prefill: time to first token of a ~500-token prompt (`max_tokens` 1); 'prefill tok/s' = its prompt "
        "tokens / TTFT.",
        f"- kvlab code: {kvlab_source(args)}.",
        "- Logs of every server: `benchmarks/out/serve-decode-*.log`. In the command, DEST is the folder given "
        "to `scripts/build_llama_server.sh DEST` (llama-server and the F32 GGUF it converted).",
        "",
        "### Raw rows",
        "",
        *raw_table(rows, keys),
    ])  # fmt: skip
    return body, summary_block(got, args.rounds, args.commit, args.max_tokens)


if __name__ == "__main__":
    run_main(main)
