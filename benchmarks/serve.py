"""Benchmark: ``kvlab serve`` against ``transformers serve`` on the same model folder, side by side in one run.

1. **Time to first token per turn.** One conversation, each turn sent with the whole history (as
   clients do), the assistant turns being each server's own replies; the user turns are the
   UltraChat conversations' (``../shared/data``; a built-in list where absent). Turns alternate
   between the two servers, so both see the same machine load. kvlab continues its session and
   computes only the new turn; ``transformers serve`` prefills the whole history every turn.
2. **Throughput with concurrent conversations.** Generated tokens per second of wall time for one
   conversation alone and for 4 at once (kvlab decodes them in one batched forward per step),
   against ``transformers serve`` with the same 4, without and with ``--continuous-batching``.
3. **A conversation that outgrows the context.** Book passages as user turns until the history is
   past the model's 8,192 positions: kvlab rolls its window; ``transformers serve`` re-prefills the
   whole history every turn and, past the maximum, fails (reported as it fails).
4. **Replicas.** Two kvlab servers on one Redis: a long prompt computed by server A, then sent to
   server B (a store hit), against a different prompt of the same length on B (a miss).

Run: python3 benchmarks/serve.py [--turns 14] [--max-tokens 32]   (writes benchmarks/results/serve.md)
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402

FALLBACK_TURNS = [
    "Explain how a bicycle stays upright.",
    "What are the main causes of inflation?",
    "Summarize the plot of Hamlet in a few sentences.",
    "How do vaccines train the immune system?",
    "Give me three tips for writing clear documentation.",
    "Why is the sky blue?",
]


def user_turns(limit: int) -> tuple[list[str], str]:
    from kvlab.data import shared_conversations

    convs = shared_conversations()
    if not convs:
        return (FALLBACK_TURNS * 4)[:limit], "built-in questions (../shared/data absent)"
    turns = []
    for c in convs:
        for m in re.finditer(r"(?ms)^User: (.*?)(?=^Assistant:|\Z)", c["full"]):
            turns.append(m.group(1).strip()[:500])
    return turns[:limit], f"UltraChat user turns from ../shared/data ({len(turns)} available)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, log: Path, key: str = "x") -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=5)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:3]} exited: {log.read_text()[-1500:]}")
        try:
            client.models.list()
            return proc
        except Exception:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[:3]} did not start")


def turn(
    client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int, info: dict | None = None
) -> tuple[float, str, int]:
    """Stream one reply: (time to first content in ms, the reply, tokens generated); kvlab's
    ``kvlab`` field of the last chunk goes into ``info`` where given."""
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], 0
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            ttft = ttft if ttft is not None else (time.perf_counter() - t0) * 1000
            parts.append(ch.choices[0].delta.content)
        if getattr(ch, "usage", None):
            usage = ch.usage.completion_tokens
        if info is not None and (ch.model_extra or {}).get("kvlab"):
            info.update(ch.model_extra["kvlab"])
    return (ttft if ttft is not None else (time.perf_counter() - t0) * 1000), "".join(parts), usage


def conversation(
    client, model, turns: list[str], max_tokens: int, out: list | None = None
) -> list[tuple[float, int, int]]:
    messages: list[dict] = []
    rows = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        ttft, reply, n = turn(client, model, messages, max_tokens)
        messages.append({"role": "assistant", "content": reply or "."})
        rows.append((ttft, n, len(messages)))
        if out is not None:
            out.append(n)
    return rows


def throughput(client, model, convs: list[list[str]], max_tokens: int) -> float:
    tokens: list[int] = []
    threads = [
        threading.Thread(target=conversation, args=(client, model, c, max_tokens, tokens)) for c in convs
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.perf_counter() - t0)


LOGS = Path(__file__).resolve().parent / "out"


def kvlab_server(port: int, name: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvlab", "serve", "--port", str(port), "--max-batch", "4", *extra]
    return start(cmd, port, LOGS / f"serve-{name}.log")


def transformers_server(folder: str, port: int, name: str, *extra: str) -> subprocess.Popen:
    binary = str(Path(sys.executable).parent / "transformers")
    cmd = [binary, "serve", folder, "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", *extra]
    return start(cmd, port, LOGS / f"serve-{name}.log")


def client_for(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=900)


def start_redis(port: int, workdir: Path) -> subprocess.Popen:
    """A private redis-server on ``port`` (127.0.0.1, no RDB/AOF files), once it accepts connections."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    for _ in range(150):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def passages(n: int, tokens: int, skip: int = 0) -> list[str]:
    """``n`` consecutive passages of about ``tokens`` SmolLM2 tokens from the long text."""
    from kvlab.data import default_long_text

    tok = tokenizer()
    ids = tok(default_long_text().text)["input_ids"]
    return [tok.decode(ids[(skip + i) * tokens : (skip + i + 1) * tokens]) for i in range(n)]


def ttft_section(
    kc, tc, folder: str, turns: list[str], max_tokens: int
) -> tuple[list[str], float, float, list]:
    km: list[dict] = []
    tm: list[dict] = []
    lines = [
        "| turn | history (messages) | kvlab TTFT ms | transformers serve TTFT ms | ratio |",
        "|---|---|---|---|---|",
    ]
    k_late, t_late = [], []
    for i, text in enumerate(turns, 1):
        km.append({"role": "user", "content": text})
        tm.append({"role": "user", "content": text})
        k_ttft, k_reply, _ = turn(kc, "smollm2-135m", km, max_tokens)
        t_ttft, t_reply, _ = turn(tc, folder, tm, max_tokens)
        km.append({"role": "assistant", "content": k_reply or "."})
        tm.append({"role": "assistant", "content": t_reply or "."})
        lines.append(f"| {i} | {len(km) - 1} | {k_ttft:.0f} | {t_ttft:.0f} | {t_ttft / k_ttft:.1f}x |")
        if i >= 10:
            k_late.append(k_ttft)
            t_late.append(t_ttft)
    return lines, statistics.median(k_late), statistics.median(t_late), km


def long_section(kc, tc, folder: str, max_turns: int, passage_tokens: int) -> tuple[list[str], int]:
    """Book passages as user turns until the history passes 8,192 tokens (one more turn after that)."""
    lines = [
        "| turn | history tokens | kvlab TTFT ms | kvlab rolls so far | transformers serve TTFT ms | ratio |",
        "|---|---|---|---|---|---|",
    ]
    km: list[dict] = []
    tm: list[dict] = []
    rolls, past, served = 0, 0, 0
    for i, text in enumerate(passages(max_turns, passage_tokens, skip=3), 1):
        content = text + "\n\nIn one sentence, what happens in this passage?"
        km.append({"role": "user", "content": content})
        info: dict = {}
        k_ttft, k_reply, _ = turn(kc, "smollm2-135m", km, 24, info)
        rolls += int(info.get("rolls", 0))
        km.append({"role": "assistant", "content": k_reply or "."})
        history = kvlab_tokens(km[:-1])
        if tm is not None:
            tm.append({"role": "user", "content": content})
            try:
                t_ttft, t_reply, _ = turn(tc, folder, tm, 24)
                tm.append({"role": "assistant", "content": t_reply or "."})
                t_cell, ratio = f"{t_ttft:.0f}", f"{t_ttft / k_ttft:.1f}x"
                served = history
            except Exception as exc:  # report how it fails, and stop asking it
                t_cell, ratio = f"failed: {type(exc).__name__}: {str(exc)[:120]}", "-"
                tm = None
        else:
            t_cell, ratio = "(not sent: it failed before)", "-"
        lines.append(f"| {i} | {history} | {k_ttft:.0f} | {rolls} | {t_cell} | {ratio} |")
        past = past + 1 if history > 8192 else past
        if past >= 2:
            break
    if tm is None:
        note = "transformers serve failed once the history passed what it serves (the failing turn is in the table)."
    elif served > 8192:
        note = (
            f"transformers serve did not refuse: it answered a {served}-token history, past the model's 8,192 "
            "positions, by re-prefilling it at positions the model was not trained on (no error, no warning to "
            "the client); kvlab's rolling cache re-bases its positions so they stay below the maximum."
        )
    else:
        note = "transformers serve answered every turn."
    return lines, rolls, note


def replica_section(folder: str, reps: int) -> list[str]:
    """Two kvlab servers on one Redis: a prefix computed by A is a hit on B."""
    import tempfile

    rport, pa, pb = free_port(), free_port(), free_port()
    work = tempfile.mkdtemp(prefix="kvlab-bench-redis-")
    redis = start_redis(rport, Path(work))
    url = f"redis://127.0.0.1:{rport}/0"
    a = kvlab_server(pa, "replica-a", "--store", url, "--window", "1024")
    b = kvlab_server(pb, "replica-b", "--store", url, "--window", "1024")
    ca, cb = client_for(pa), client_for(pb)
    rows = [
        "| prompt | A: miss TTFT ms | B: same prompt (store hit) TTFT ms | B: tiers | B: other prompt (miss) TTFT ms "
        "| miss / hit | replies equal | B's other prompt: tokens from the store |",
        "|---|---|---|---|---|---|---|---|",
    ]
    hits, misses = [], []
    try:
        turn(ca, "smollm2-135m", [{"role": "user", "content": "warm up"}], 2)
        turn(cb, "smollm2-135m", [{"role": "user", "content": "warm up"}], 2)
        texts = passages(2 * reps, 900, skip=40)
        for r in range(reps):
            q = "\n\nWho is speaking in this passage, and to whom?"
            same = [{"role": "user", "content": texts[2 * r] + q}]
            other = [{"role": "user", "content": texts[2 * r + 1] + q}]
            ia: dict = {}
            ib: dict = {}
            io: dict = {}
            a_ttft, _, _ = turn(ca, "smollm2-135m", same, 16, ia)
            hit, _, _ = turn(cb, "smollm2-135m", same, 16, ib)
            miss, _, _ = turn(cb, "smollm2-135m", other, 16, io)
            equal = ia.get("completion_ids") == ib.get("completion_ids")
            hits.append(hit)
            misses.append(miss)
            tiers = ", ".join(f"{k} {v}" for k, v in ib.get("store_tiers", {}).items())
            rows.append(
                f"| {r + 1} ({ib.get('cached_tokens')} of {ib.get('cached_tokens', 0) + ib.get('computed_tokens', 0)}"
                f" tokens from the store) | {a_ttft:.0f} | {hit:.0f} | {tiers} | {miss:.0f} | {miss / hit:.1f}x "
                f"| {'yes' if equal else 'NO'} | {io.get('cached_tokens')} |"
            )
    finally:
        stop(a, b, redis)
        shutil.rmtree(work, ignore_errors=True)
    rows.append(
        f"\n**Median: a prefix computed on A reaches B with a TTFT {statistics.median(misses) / statistics.median(hits):.1f}x "
        "lower than a miss on B.**"
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=14)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--long-passage", type=int, default=700, help="tokens per user turn in section 3")
    ap.add_argument("--replica-reps", type=int, default=3)
    args = ap.parse_args()
    from kvlab.model.loading import bundled_model_dir

    folder = str(bundled_model_dir())
    turns, source = user_turns(args.turns + 12)
    LOGS.mkdir(exist_ok=True)
    kp, tp = free_port(), free_port()
    kvlab = kvlab_server(kp, "kvlab", "--window", str(args.window))
    tf = transformers_server(folder, tp, "transformers")
    kc, tc = client_for(kp), client_for(tp)
    try:
        turn(kc, "smollm2-135m", [{"role": "user", "content": "warm up"}], 4)
        turn(tc, folder, [{"role": "user", "content": "warm up"}], 4)
        # 1. TTFT per turn, alternating servers turn by turn
        lines, k_med, t_med, km = ttft_section(kc, tc, folder, turns[: args.turns], args.max_tokens)
        tok = kvlab_tokens(km)
        # 2. throughput: 1 conversation vs 4 at once
        extra = turns[args.turns : args.turns + 12]
        four = [extra[j::4][:3] for j in range(4)]
        k1 = throughput(kc, "smollm2-135m", [four[0]], 64)
        k4 = throughput(kc, "smollm2-135m", [[f"{t} (again)" for t in c] for c in four], 64)
        t4 = throughput(tc, folder, four, 64)
        # 3. a conversation past the model's maximum position
        long_lines, long_rolls, long_note = long_section(kc, tc, folder, 16, args.long_passage)
    finally:
        stop(kvlab, tf)
    cp = free_port()
    cb = transformers_server(folder, cp, "transformers-cb", "--continuous-batching")
    try:
        cc = client_for(cp)
        turn(cc, folder, [{"role": "user", "content": "warm up"}], 4)
        t4cb = throughput(cc, folder, four, 64)
    finally:
        stop(cb)
    # 4. replicas on one Redis
    replica_rows = replica_section(folder, args.replica_reps)
    body = f"""Model: SmolLM2-135M-Instruct fp32, the same folder for both (`{Path(folder).name}`). kvlab serve:
window {args.window} + 4 sinks, batch up to 4, memory store. transformers serve: defaults (no continuous
batching) unless said. Replies greedy, at most {args.max_tokens} tokens; user turns: {source}. By the last
turn the history is {tok} tokens.

### Time to first token, turn by turn (whole history sent each turn)

{chr(10).join(lines)}

**Median TTFT at turns ≥ 10: kvlab {k_med:.0f} ms, transformers serve {t_med:.0f} ms: {t_med / k_med:.1f}x lower.**

### Generated tokens per second (3-turn conversations, up to 64 tokens per reply)

| setting | tokens/s | vs kvlab alone |
|---|---|---|
| kvlab, 1 conversation | {k1:.1f} | 1.00x |
| kvlab, 4 conversations at once | {k4:.1f} | {k4 / k1:.2f}x |
| transformers serve, 4 conversations at once | {t4:.1f} | {t4 / k1:.2f}x |
| transformers serve --continuous-batching, 4 conversations at once | {t4cb:.1f} | {t4cb / k1:.2f}x |

kvlab at 4 conversations: {k4 / t4:.2f}x transformers serve's rate, {k4 / t4cb:.2f}x its continuous-batching rate.

### A conversation past the model's 8,192 positions (book passages of ~{args.long_passage} tokens as user turns, replies ≤ 24 tokens)

{chr(10).join(long_lines)}

kvlab rolled its {args.window}-token window {long_rolls} times and computed only each new turn. {long_note}

### Replicas: two kvlab servers on one Redis (window 1024; prompts of ~900 tokens of the book)

{chr(10).join(replica_rows)}

Logs of every server: `benchmarks/out/serve-*.log`.
"""
    write_results("serve", "Serving: kvlab serve vs transformers serve", body)


@functools.cache
def tokenizer():
    from kvlab import load_model

    return load_model("smollm2-135m").tokenizer


def kvlab_tokens(messages: list[dict]) -> int:
    ids = tokenizer().apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


if __name__ == "__main__":
    main()
