"""Benchmark: ``kvlab serve`` against ``transformers serve`` on the same model folder, side by side in one run.

1. **Time to first token per turn.** One conversation, each turn sent with the whole history (as
   clients do), the assistant turns being each server's own replies; the user turns are the
   UltraChat conversations' (``../shared/data``; a built-in list where absent). Turns alternate
   between the two servers, so both see the same machine load. kvlab continues its session and
   computes only the new turn; ``transformers serve`` prefills the whole history every turn.
2. **Throughput with concurrent conversations.** Generated tokens per second of wall time for one
   conversation alone and for 4 at once (kvlab decodes them in one batched forward per step),
   against ``transformers serve`` (no continuous batching: its CPU path) with the same 4.

Run: python3 benchmarks/serve.py [--turns 14] [--max-tokens 32]   (writes benchmarks/results/serve.md)
"""

from __future__ import annotations

import argparse
import os
import re
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


def start(cmd: list[str], port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=5)
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


def turn(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str, int]:
    """Stream one reply: (time to first content in ms, the reply, tokens generated)."""
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=14)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--window", type=int, default=1024)
    args = ap.parse_args()
    from kvlab.model.loading import bundled_model_dir

    folder = str(bundled_model_dir())
    turns, source = user_turns(args.turns + 12)
    logs = Path(__file__).resolve().parent / "out"
    logs.mkdir(exist_ok=True)
    kp, tp = free_port(), free_port()
    kvlab = start(
        [
            sys.executable,
            "-m",
            "kvlab",
            "serve",
            "--port",
            str(kp),
            "--window",
            str(args.window),
            "--max-batch",
            "4",
        ],
        kp,
        logs / "serve-kvlab.log",
    )
    tf = start(
        [
            str(Path(sys.executable).parent / "transformers"),
            "serve",
            folder,
            "--port",
            str(tp),
            "--host",
            "127.0.0.1",
            "--dtype",
            "float32",
        ],
        tp,
        logs / "serve-transformers.log",
    )
    kc = openai.OpenAI(base_url=f"http://127.0.0.1:{kp}/v1", api_key="x", max_retries=0, timeout=600)
    tc = openai.OpenAI(base_url=f"http://127.0.0.1:{tp}/v1", api_key="x", max_retries=0, timeout=600)
    try:
        turn(kc, "smollm2-135m", [{"role": "user", "content": "warm up"}], 4)
        turn(tc, folder, [{"role": "user", "content": "warm up"}], 4)
        # 1. TTFT per turn, alternating servers turn by turn
        km: list[dict] = []
        tm: list[dict] = []
        lines = [
            "| turn | history (messages) | kvlab TTFT ms | transformers serve TTFT ms | ratio |",
            "|---|---|---|---|---|",
        ]
        k_late, t_late = [], []
        for i, text in enumerate(turns[: args.turns], 1):
            km.append({"role": "user", "content": text})
            tm.append({"role": "user", "content": text})
            k_ttft, k_reply, _ = turn(kc, "smollm2-135m", km, args.max_tokens)
            t_ttft, t_reply, _ = turn(tc, folder, tm, args.max_tokens)
            km.append({"role": "assistant", "content": k_reply or "."})
            tm.append({"role": "assistant", "content": t_reply or "."})
            lines.append(f"| {i} | {len(km) - 1} | {k_ttft:.0f} | {t_ttft:.0f} | {t_ttft / k_ttft:.1f}x |")
            if i >= 10:
                k_late.append(k_ttft)
                t_late.append(t_ttft)
        tok = kvlab_tokens(km)
        k_med, t_med = statistics.median(k_late), statistics.median(t_late)
        # 2. throughput: 1 conversation vs 4 at once
        extra = turns[args.turns : args.turns + 12]
        four = [extra[j::4][:3] for j in range(4)]
        k1 = throughput(kc, "smollm2-135m", [four[0]], 64)
        k4 = throughput(kc, "smollm2-135m", [[f"{t} (again)" for t in c] for c in four], 64)
        t4 = throughput(tc, folder, four, 64)
    finally:
        for p in (kvlab, tf):
            p.terminate()
            p.wait(30)
    body = f"""Model: SmolLM2-135M-Instruct fp32, the same folder for both (`{Path(folder).name}`). kvlab serve:
window {args.window} + 4 sinks, batch up to 4, memory store. transformers serve: defaults (no continuous
batching). Replies greedy, at most {args.max_tokens} tokens; user turns: {source}. By the last turn the
history is {tok} tokens.

### Time to first token, turn by turn (whole history sent each turn)

{chr(10).join(lines)}

**Median TTFT at turns ≥ 10: kvlab {k_med:.0f} ms, transformers serve {t_med:.0f} ms: {t_med / k_med:.1f}x lower.**

### Generated tokens per second (3-turn conversations, up to 64 tokens per reply)

| setting | tokens/s | vs kvlab alone |
|---|---|---|
| kvlab, 1 conversation | {k1:.1f} | 1.00x |
| kvlab, 4 conversations at once | {k4:.1f} | {k4 / k1:.2f}x |
| transformers serve, 4 conversations at once | {t4:.1f} | {t4 / k1:.2f}x |

kvlab at 4 conversations: {k4 / t4:.2f}x transformers serve's rate. Logs of both servers: `benchmarks/out/serve-*.log`.
"""
    write_results("serve", "Serving: kvlab serve vs transformers serve", body)


def kvlab_tokens(messages: list[dict]) -> int:
    from kvlab import load_model

    ids = load_model("smollm2-135m").tokenizer.apply_chat_template(messages, tokenize=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


if __name__ == "__main__":
    main()
