"""A cheap ``kvlab serve`` for fault tests: a tiny random-weight SmolLM2-family model saved as a local model
folder (``--model PATH``) with a character-level tokenizer built here (no download, not the bundled model), and
helpers to ask it, stream from it and verify its store.

Replies are greedy, so a reply is a function of the prompt's tokens and the cache it was computed from: a
server that served a wrong cache gives other tokens and other log-probabilities than a server that
computed everything (:class:`Reference`). The model is random but deterministic (seeded).
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.conftest import config_path

#: The tokens' special strings: the chat template's two, the end of text and the unknown character (never
#: in a prompt: the prompts are ASCII)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LOGPROB_TOL = 2e-3  # as tests/test_serve.py: two fp32 forwards that sum in another order
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
]


def build_tiny_model(folder: Path) -> Path:
    """A 2-layer SmolLM2-family model with random weights (seed 0) and a character-level tokenizer (one
    token a printable ASCII character or newline, ChatML template, ``<|im_end|>`` ends a reply), saved where
    ``kvlab serve --model`` loads it. Every token decodes to text that encodes back to it, so a reply sent
    back in the history continues its session, as with a real model."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    from kvlab.model.random import tiny_random_model

    hf_logging.disable_progress_bar()

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {c: i for i, c in enumerate(chars + list(SPECIALS))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        unk_token="<unk>",
        bos_token="<|im_start|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    handle = tiny_random_model(config_path("smollm2"), vocab=len(fast), layers=2, head_dim=16)
    cfg = handle.model.config
    cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id = (
        fast.eos_token_id,
        fast.bos_token_id,
        fast.pad_token_id,
    )
    folder.mkdir(parents=True, exist_ok=True)
    handle.model.save_pretrained(folder, safe_serialization=True)
    fast.save_pretrained(folder)
    return folder


def text(seed: int, words: int) -> str:
    """A deterministic text of ``words`` words (about 6 tokens a word: one token a character)."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def body(model: str, content: str, n: int, **kw) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": n,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        **kw,
    }


def post(port: int, doc: dict, key: str, timeout: float = 120) -> tuple[int, dict]:
    """POST a chat request: (status, JSON reply); raises OSError when the connection fails."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(doc).encode(), headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def reply_tokens(doc: dict) -> tuple[list[int], list[float]]:
    """A reply's generated token ids and each one's log-probability."""
    info = doc["kvlab"]
    logprobs = [e["logprob"] for e in doc["choices"][0]["logprobs"]["content"]]
    return info["completion_ids"], logprobs


class Reference:
    """What a server that reuses nothing replies: every request gets its own ``cache_salt``, so it meets
    no session and no stored block (each reply's ``cached_tokens`` is checked to be 0). Memoised."""

    def __init__(self, port: int, model: str, key: str) -> None:
        self.port, self.model, self.key = port, model, key
        self.replies: dict[tuple[str, int], dict] = {}

    def __call__(self, content: str, n: int) -> dict:
        if (content, n) not in self.replies:
            status, doc = post(self.port, body(self.model, content, n, cache_salt=uuid.uuid4().hex), self.key)
            assert status == 200, (status, doc)
            assert doc["kvlab"]["cached_tokens"] == 0, doc["kvlab"]
            self.replies[(content, n)] = doc
        return self.replies[(content, n)]

    def check(self, content: str, n: int, doc: dict) -> None:
        """``doc`` (a reply to ``content``) is the reference's, token for token, log-probabilities within
        :data:`LOGPROB_TOL`: no wrong cache was served."""
        want_ids, want_lp = reply_tokens(self(content, n))
        got_ids, got_lp = reply_tokens(doc)
        assert got_ids == want_ids, (content[:60], doc["kvlab"], got_ids, want_ids)
        worst = max((abs(a - b) for a, b in zip(got_lp, want_lp, strict=True)), default=0.0)
        assert worst <= LOGPROB_TOL, (content[:60], doc["kvlab"], worst)


class Stream:
    """One streamed chat request, read on the caller's thread (:meth:`read`) with a socket timeout, so a
    server that neither sends nor closes fails the test instead of hanging it."""

    def __init__(self, port: int, doc: dict, key: str, timeout: float = 60) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        self.conn.request("POST", "/v1/chat/completions", body=json.dumps(doc).encode(), headers=headers)
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, (self.resp.status, self.resp.read()[:500])
        self.tokens: list[tuple[list[int], float]] = []  # each token's bytes and log-probability, in order
        self.done, self.error, self.ended = False, None, None
        self.info: dict | None = None

    def read(self) -> None:
        """Read to the end: ``done`` ([DONE] came), ``error`` (an error event, the exception that ended the
        read, or an EOF before [DONE]: a stream cut), ``ended`` (when, monotonic)."""
        try:
            while line := self.resp.readline():
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    self.done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.error = event["error"]
                    continue
                for choice in event.get("choices") or ():
                    entries = (choice.get("logprobs") or {}).get("content") or ()
                    self.tokens += [(e["bytes"], e["logprob"]) for e in entries]
                self.info = event.get("kvlab", self.info)
            if not self.done and self.error is None:
                self.error = "EOF before [DONE]"  # the connection closed mid-stream
        except (OSError, http.client.HTTPException) as exc:  # the server went away mid-stream
            self.error = repr(exc)
        finally:
            self.ended = time.monotonic()
            self.conn.close()


def verify(store: str, *extra: str) -> tuple[int, dict]:
    """``kvlab store verify --store STORE --json [extra]``: (exit code, report)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvlab", "store", "verify", "--store", store, "--json", *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def wait_for(what: str, check, seconds: float = 60.0) -> None:
    """Poll ``check()`` until true; fail naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {seconds:.0f} s"
        time.sleep(0.05)
