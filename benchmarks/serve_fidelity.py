"""Fidelity through the server: a conversation 3x longer than the window, scored by ``kvlab serve``.

For each UltraChat conversation (user turns from ``../shared/data``; built-in questions where absent):

1. **Reference replies** come from the full-context model: each turn, greedy, on the whole history.
2. **Through the server**: turn after turn, the history with the reference reply is sent to
   ``/v1/completions`` with ``echo=true, logprobs=0, max_tokens=0`` (scoring, as lm-eval-harness does).
   Each request continues the conversation's session, so the server computes only the new turn, and
   past the window the conversation rolls (sinks + pinned system prompt + window): the log-probabilities
   it returns for the reply tokens are those of its rolled cache.
3. **Sliding-window re-computation** (``kvlab.streaming.stream_nll(..., "recompute")``): each reply token
   predicted from a fresh prefill of the ``window`` tokens before it; and **full context**.

Reported: mean NLL of the reply tokens that sit past the window (nats/token) for each, and the server's
ratio to re-computation with a bootstrap interval over replies (bar: within 2%). Raw per-token arrays:
``benchmarks/out/serve_fidelity.npz``.

Run: python3 benchmarks/serve_fidelity.py [--window 256] [--conversations 6]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
import openai
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402
from serve import FALLBACK_TURNS, LOGS, free_port, start, stop  # noqa: E402

MODEL = "smollm2-135m"


def conversations(limit: int) -> tuple[list[list[str]], str]:
    from kvlab.data import shared_conversations

    convs = shared_conversations()
    if not convs:
        return [FALLBACK_TURNS * 3], "built-in questions (../shared/data absent)"
    out = []
    for c in convs[:limit]:
        turns = [
            m.group(1).strip()[:600] for m in re.finditer(r"(?ms)^User: (.*?)(?=^Assistant:|\Z)", c["full"])
        ]
        if turns:
            out.append(turns)
    return out, "UltraChat user turns from ../shared/data"


def reference_conversation(handle, turns: list[str], min_tokens: int, reply_tokens: int) -> list[dict]:
    """User turns (cycled) with the full-context model's greedy replies, until the history passes ``min_tokens``."""
    tok = handle.tokenizer
    messages: list[dict] = []
    i = 0
    while True:
        messages.append({"role": "user", "content": turns[i % len(turns)]})
        i += 1
        ids = handle.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        with torch.no_grad():
            out = handle.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=reply_tokens,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
        reply = tok.decode(out[0, len(ids) :], skip_special_tokens=True).strip() or "."
        messages.append({"role": "assistant", "content": reply})
        if len(ids) + reply_tokens > min_tokens:
            return messages


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--times", type=float, default=3.5, help="history length as a multiple of the window")
    ap.add_argument("--reply-tokens", type=int, default=48)
    args = ap.parse_args()
    from kvlab import load_model
    from kvlab.streaming import stream_nll

    handle = load_model(MODEL)
    tok = handle.tokenizer
    convs, source = conversations(args.conversations)
    LOGS.mkdir(exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "-m", "kvlab", "serve", "--port", str(port), "--window", str(args.window)]
    cmd += ["--sinks", str(args.sinks), "--max-tokens", "64"]
    server = start(cmd, port, LOGS / "serve-fidelity.log")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
    per_reply: list[tuple[float, float, float, int]] = []  # (server, recompute, full) NLL sums, tokens
    raw: dict[str, list[np.ndarray]] = {"server": [], "recompute": [], "full": []}
    lines = [
        "| conversation | tokens | replies past the window | server | re-computed | full context |",
        "|---|---|---|---|---|---|",
    ]
    rolls = 0
    try:
        for c, turns in enumerate(convs):
            messages = reference_conversation(handle, turns, int(args.times * args.window), args.reply_tokens)
            full_ids = handle.encode(tok.apply_chat_template(messages, tokenize=False))
            server_lp = np.full(len(full_ids), np.nan)
            spans = []
            for k in range(2, len(messages) + 1, 2):
                text = tok.apply_chat_template(messages[:k], tokenize=False)
                head = handle.encode(
                    tok.apply_chat_template(messages[: k - 1], add_generation_prompt=True, tokenize=False)
                )
                r = client.completions.create(
                    model=MODEL,
                    prompt=text,
                    max_tokens=0,
                    echo=True,
                    logprobs=0,
                    extra_body={"cache_salt": f"c{c}"},
                )
                lps = r.choices[0].logprobs.token_logprobs
                ids = handle.encode(text)
                if ids != full_ids[: len(ids)] or len(lps) != len(ids):
                    raise RuntimeError("the turn's tokens are not a prefix of the conversation's")
                rolls += r.model_extra["kvlab"]["rolls"]
                end = len(ids) - 1 if tok.decode(ids[-1:]) == "\n" else len(ids)
                spans.append((len(head), end))
                for t in range(len(head), end):
                    server_lp[t] = lps[t]
            past = [(a, b) for a, b in spans if a >= args.window + args.sinks]
            targets = np.array([t for a, b in past for t in range(a, b)], dtype=np.int64)
            rec = stream_nll(handle, full_ids, "recompute", window=args.window, recompute_targets=targets).nll
            full = stream_nll(handle, full_ids, "full", window=args.window).nll  # targets 1..N-1
            rec_at = dict(zip(targets.tolist(), rec, strict=True))
            srv_t, rec_t, full_t = (
                -server_lp[targets],
                np.array([rec_at[t] for t in targets]),
                full[targets - 1],
            )
            raw["server"].append(srv_t)
            raw["recompute"].append(rec_t)
            raw["full"].append(full_t)
            for a, b in past:
                sel = (targets >= a) & (targets < b)
                per_reply.append((srv_t[sel].sum(), rec_t[sel].sum(), full_t[sel].sum(), int(sel.sum())))
            lines.append(
                f"| {c + 1} | {len(full_ids)} | {len(past)} | {srv_t.mean():.3f} | {rec_t.mean():.3f} | {full_t.mean():.3f} |"
            )
    finally:
        stop(server)
    arr = np.array(per_reply)
    ratio = arr[:, 0].sum() / arr[:, 1].sum()
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(arr), size=(2000, len(arr)))
    boot = arr[idx, 0].sum(1) / arr[idx, 1].sum(1)
    lo, hi = np.quantile(boot, [0.025, 0.975])
    tokens = int(arr[:, 3].sum())
    means = arr[:, :3].sum(0) / tokens
    np.savez(
        LOGS / "serve_fidelity.npz",
        per_reply=arr,
        **{k: np.concatenate(v) for k, v in raw.items()},
    )
    verdict = "met" if ratio <= 1.02 else "NOT met"
    body = f"""kvlab serve (bundled SmolLM2 fp32, window {args.window} + {args.sinks} sinks, the default system prompt pinned)
scores {len(convs)} conversations of {source}, each grown to more than {args.times:g}x the window with the
full-context model's own greedy replies (at most {args.reply_tokens} tokens each). Each turn is one
`/v1/completions` request with `echo=true, logprobs=0, max_tokens=0` that continues the conversation's
session: the server computed only the new turn and rolled {rolls} times in all. NLL in nats per reply
token, over the {tokens} reply tokens ({len(arr)} replies) that sit past the first window.

{chr(10).join(lines)}
| **all** | | {len(arr)} | **{means[0]:.3f}** | **{means[1]:.3f}** | **{means[2]:.3f}** |

**Server / sliding-window re-computation: {ratio:.4f} (95% bootstrap over replies: [{lo:.4f}, {hi:.4f}]); the bar
(at most 2% worse, ≤ 1.02) is {verdict}.** The server's cache holds the sinks, the pinned system prompt and
the window; re-computation sees the {args.window} tokens before each target.
Full context: {means[2]:.3f}. Raw per-token NLL: `benchmarks/out/serve_fidelity.npz`.
"""
    write_results(
        "serve_fidelity", "Serving fidelity: conversations 3x the window, scored through the server", body
    )


if __name__ == "__main__":
    main()
