"""The correctness checks: a cache hit must answer as a miss does.

* :func:`cold_warm`: a prompt that no cache can hold (a fresh nonce first) asked twice; the second answer
  must repeat the first, token for token, log-probabilities within the tolerance.
* :func:`prefix_hits`: for several prefix lengths, a prompt answered from a cached prefix (another prompt
  with the same prefix asked first) against the same prompt asked cold. A cold answer must come before
  its prefix is cached anywhere, so it is asked first, by the second tenant: whether or not the server
  shares caches across tenants, that request met no cache. Needs two keys.
* :func:`context`: one conversation grown past the context limit: refused with a 4xx, or answered
  (truncated or rolled); a 5xx, a dropped connection or an empty answer is a finding.
"""

from __future__ import annotations

import random
import uuid

from kvlab.probe.client import Client, Message, Reply
from kvlab.probe.config import Log, ProbeConfig
from kvlab.probe.report import Section

WORDS = [
    "river",
    "stone",
    "lamp",
    "cedar",
    "orbit",
    "violet",
    "harbor",
    "copper",
    "meadow",
    "signal",
    "winter",
    "pepper",
    "canyon",
    "lantern",
    "fabric",
    "thunder",
    "mosaic",
    "falcon",
    "granite",
    "ember",
    "quartz",
    "saddle",
    "willow",
    "marble",
    "comet",
    "basalt",
    "garden",
    "mirror",
    "pocket",
    "ladder",
    "island",
    "candle",
    "rocket",
    "velvet",
]


def words(seed: int, n: int) -> str:
    """A deterministic text of ``n`` words."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def nonce() -> str:
    """A prefix no cache can hold: a fresh random id, first in the prompt."""
    return f"{uuid.uuid4().hex}: "


def question(k: int) -> str:
    """A short question that ends in a word ``k`` picks: prompts that differ in ``k`` differ at their end,
    where a model's next token looks first (a question asked again after an empty answer)."""
    return f"\nQuestion {k}: in a few words, which word comes after '{WORDS[k % len(WORDS)]}'?"


def compare(ref: Reply, got: Reply, tol: float) -> dict[str, object]:
    """How ``got`` agrees with ``ref``: same tokens (the texts when no tokens came), the largest
    log-probability difference, and ``match`` (both 200, same tokens, within ``tol``)."""
    if not (ref.ok and got.ok):
        return {"match": False, "why": f"HTTP {ref.status}/{got.status}", "max_dlogprob": None}
    same = ref.tokens == got.tokens if (ref.tokens or got.tokens) else ref.text == got.text
    worst = max((abs(a - b) for a, b in zip(ref.logprobs, got.logprobs, strict=False)), default=0.0)
    why = "" if same else f"tokens differ: {ref.text[:60]!r} vs {got.text[:60]!r}"
    if same and worst > tol:
        why = f"log-probabilities differ by {worst:.3g} > {tol:g}"
    return {"match": same and worst <= tol, "why": why, "max_dlogprob": round(worst, 6)}


def _pair_row(label: str, ref: Reply, got: Reply, tol: float) -> dict[str, object]:
    return {
        "prompt": label,
        **compare(ref, got, tol),
        "cold_cached": ref.cached_tokens,
        "warm_cached": got.cached_tokens,
        "prompt_tokens": got.prompt_tokens,
        "cold_s": round(ref.seconds, 4),
        "warm_s": round(got.seconds, 4),
        "cold_answer": ref.text[:80],
        "warm_answer": got.text[:80],
        "cold_logprobs": [round(x, 5) for x in ref.logprobs[:8]],
        "warm_logprobs": [round(x, 5) for x in got.logprobs[:8]],
    }


def _verdict_of(key: str, title: str, rows: list[dict[str, object]], what: str) -> Section:
    bad = [r for r in rows if not r["match"]]
    if bad:
        summary = f"{len(bad)} of {len(rows)} {what} answered differently: {bad[0]['why']}"
        return Section(key, title, "finding", summary, rows=rows)
    return Section(key, title, "ok", f"all {len(rows)} {what} answered as cold", rows=rows)


def cold_warm(client: Client, cfg: ProbeConfig, log: Log, prompts: int = 3) -> Section:
    """The same never-seen prompt asked twice by one tenant: the warm answer must repeat the cold one."""
    rows = []
    for i in range(prompts):
        log(f"correctness: cold vs warm {i + 1}/{prompts}")
        prompt = nonce() + words(100 + i, 60 + 40 * i) + question(i)
        cold = client.ask(cfg.tenant_a, prompt, cfg.max_tokens)
        warm = client.ask(cfg.tenant_a, prompt, cfg.max_tokens)
        rows.append(_pair_row(f"#{i} ({len(prompt)} chars)", cold, warm, cfg.tolerance))
    section = _verdict_of("cold_warm", "Cold vs warm", rows, "repeated prompts")
    section.stats = {"tolerance": cfg.tolerance, "max_tokens": cfg.max_tokens}
    return section


def prefix_hits(client: Client, cfg: ProbeConfig, log: Log) -> Section:
    """Prefixes of several lengths: tenant B asks P+s2 cold; tenant A asks P+s1 (caching P) then P+s2 (a
    prefix hit); A's P+s2 must answer as B's did."""
    title = "Prefix hits"
    if cfg.tenant_b is None:
        why = "needs a second --api-key: a prompt's cold answer must be asked before its prefix is cached"
        return Section("prefix_hits", title, "skipped", why)
    lengths = sorted({max(8, cfg.prefix_words // 8), max(8, cfg.prefix_words // 2), cfg.prefix_words})
    rows = []
    for i, n in enumerate(lengths):
        log(f"correctness: prefix hit {i + 1}/{len(lengths)} ({n} words)")
        prefix = nonce() + words(200 + i, n)
        ref = client.ask(cfg.tenant_b, prefix + question(2 * i + 1), cfg.max_tokens)
        prime = client.ask(cfg.tenant_a, prefix + question(2 * i), cfg.max_tokens)
        hit = client.ask(cfg.tenant_a, prefix + question(2 * i + 1), cfg.max_tokens)
        row = _pair_row(f"{n}-word prefix", ref, hit, cfg.tolerance)
        row["prime_cached"] = prime.cached_tokens
        if not prime.ok:
            row |= {"match": False, "why": f"the priming request failed: HTTP {prime.status}"}
        rows.append(row)
    section = _verdict_of("prefix_hits", title, rows, "prefix-hit prompts")
    section.stats = {"prefix_words": lengths, "tolerance": cfg.tolerance}
    return section


CONTEXT_KEYS = ("max_model_len", "context_length", "context_window", "max_context_length", "n_ctx")


def stated_context(entry: dict[str, object]) -> int | None:
    """A context length ``/models`` states for the model (vLLM, SGLang, llama.cpp, LM Studio spell it
    differently), else None."""
    for where in (entry, entry.get("meta"), entry.get("metadata")):
        if isinstance(where, dict):
            for key in (*CONTEXT_KEYS, "n_ctx_train"):
                if isinstance(where.get(key), int) and where[key] > 0:
                    return int(where[key])
    return None


def _context_row(turn: int, words_sent: int, reply: Reply) -> dict[str, object]:
    return {
        "turn": turn,
        "words_sent": words_sent,
        "status": reply.status,
        "prompt_tokens": reply.prompt_tokens,
        "cached_tokens": reply.cached_tokens,
        "finish": reply.finish,
        "seconds": round(reply.seconds, 3),
        "answer": reply.text[:80],
        "error": reply.error or "",
    }


#: an empty answer is asked again with another question this many times before it counts: a model may end a
#: reply at once (a random-weight one often does), and one empty reply says nothing about the server
EMPTY_RETRIES = 2


def context(client: Client, cfg: ProbeConfig, limit: int, log: Log, max_turns: int = 8) -> Section:
    """One conversation: a short first turn (its usage gives the tokens a word, over-estimated by the
    prompt's overhead), then about half of ``limit`` a turn, until two replies have counted more prompt
    tokens than ``limit`` (by the usage; else by the estimate), the server refuses, or ``max_turns``. A turn
    answered with an empty text is asked again with another question (:data:`EMPTY_RETRIES`)."""
    messages: list[Message] = []
    rows: list[dict[str, object]] = []
    per_word: float | None = None  # tokens a word, from the first reply's usage (1.5 until then)
    sent = past = 0
    for turn in range(max_turns):
        log(f"correctness: long conversation, turn {turn + 1} (limit {limit} tokens)")
        chunk = 32 if per_word is None else max(8, int(limit / 2 / per_word))  # turn 0 calibrates
        sent += chunk
        for ask in range(EMPTY_RETRIES + 1):  # an empty answer once is the model's: another question
            head = nonce() if turn == 0 else ""  # the first turn's retry also starts afresh
            text = head + words(300 + turn, chunk) + question(turn + 7 * ask)
            reply = client.chat(cfg.tenant_a, [*messages, {"role": "user", "content": text}], cfg.max_tokens)
            if not reply.ok or reply.text.strip():
                break
        messages.append({"role": "user", "content": text})
        rows.append(_context_row(turn, sent, reply))
        if not reply.ok or not reply.text.strip():
            break
        messages.append({"role": "assistant", "content": reply.text})
        if per_word is None and reply.prompt_tokens:
            per_word = max(0.3, reply.prompt_tokens / sent)
        past += (reply.prompt_tokens or sent * (per_word or 1.5)) > limit
        if past >= 2:
            break
    return _context_verdict(rows, limit, sent * (per_word or 1.5))


def _context_verdict(rows: list[dict[str, object]], limit: int, estimate: float) -> Section:
    """Refused (a 4xx), answered past the limit (the usage says: all counted, or truncated), or broken."""
    last, title = rows[-1], "Past the context limit"
    stats: dict[str, object] = {"limit_tokens": limit, "turns": len(rows)}
    status = int(str(last["status"]))
    if 400 <= status < 500 and len(rows) > 1:
        summary = f"refused with HTTP {status} at turn {last['turn']} (a clear refusal, not a wrong answer)"
        return Section("context", title, "ok", summary, stats | {"behaviour": "refuses"}, rows)
    if status != 200:  # a 5xx, no reply, or a 4xx for the short first turn
        summary = f"turn {last['turn']} failed: HTTP {status or 'none'} ({str(last['error'])[:120]})"
        return Section("context", title, "finding", summary, stats | {"behaviour": "fails"}, rows)
    if not str(last["answer"]).strip():
        tries = EMPTY_RETRIES + 1
        if (
            int(str(last["prompt_tokens"] or 0)) <= limit and len(rows) == 1
        ):  # not past the limit: the model's
            summary = f"the model answered the first turn with an empty text {tries} times: the limit was not tested"
            return Section("context", title, "skipped", summary, stats | {"behaviour": "empty"}, rows)
        summary = f"turn {last['turn']} answered with an empty text, {tries} questions in a row"
        return Section("context", title, "finding", summary, stats | {"behaviour": "empty"}, rows)
    counted = max(int(str(r["prompt_tokens"] or 0)) for r in rows)
    if estimate <= 1.5 * limit and counted <= limit:
        summary = f"not past the limit in {len(rows)} turns (about {round(estimate)} tokens sent)"
        return Section("context", title, "skipped", summary, stats, rows)
    if counted <= limit:
        behaviour = "truncates (the usage never counts more than the limit)"
    else:
        behaviour = "answers past the limit (rolls, or a limit larger than given)"
    summary = f"{behaviour}; every answer non-empty, no 5xx"
    return Section(
        "context",
        title,
        "ok",
        summary,
        stats | {"behaviour": behaviour, "estimated_tokens": round(estimate)},
        rows,
    )
