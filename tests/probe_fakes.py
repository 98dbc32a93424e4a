"""Small fake OpenAI-compatible servers for ``tests/test_probe.py``: each plants one caching behaviour
``kvlab probe`` must tell apart. Standard library only (``http.server`` in a thread on 127.0.0.1).

A prompt (the chat's contents joined) counts one token per 4 characters. The fake caches prompt prefixes
in blocks of 64 characters, keyed by the tenant (the Bearer key) or, in ``shared`` mode, by nothing; a
request takes 10 ms plus 0.3 ms per character not cached, and claims the cached characters / 4 as
``usage.prompt_tokens_details.cached_tokens``. Its answer is four words and their log-probabilities, a
function of the prompt only (a hash), except in ``wrong`` mode, where a prompt seen before (a warm hit)
gets another last word and shifted log-probabilities: a planted wrong cache. Prompts past 2,048 tokens
are refused with a 400, as vLLM does.

* ``tenant``: a correct per-tenant cache (clean);
* ``shared``: one cache for every tenant (an isolation finding);
* ``wrong``: per-tenant, but a warm repeat is answered wrong (a correctness finding).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BLOCK, CONTEXT = 64, 2048
ANSWER_WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]


class FakeServer:
    """A fake server in a thread: ``url``, ``requests`` (how many came), ``stop()``."""

    def __init__(self, mode: str, per_char: float = 3e-4) -> None:
        self.mode, self.per_char = mode, per_char
        self.seen: set[tuple[str, str]] = set()
        self.requests = 0
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, tenant: str, text: str) -> tuple[int, dict]:
        """(status, body) for one prompt; sleeps the time the uncached part would take."""
        if len(text) // 4 > CONTEXT:
            return 400, {
                "error": {"message": f"prompt longer than {CONTEXT} tokens", "type": "invalid_request_error"}
            }
        ns = "" if self.mode == "shared" else tenant
        with self.lock:
            hit = max(
                (k for k in range(BLOCK, len(text) + 1, BLOCK) if (ns, text[:k]) in self.seen), default=0
            )
            warm = (ns, text) in self.seen
            self.seen.update((ns, text[:k]) for k in range(BLOCK, len(text) + 1, BLOCK))
            self.seen.add((ns, text))
        time.sleep(0.01 + self.per_char * (len(text) - hit))
        digest = hashlib.sha256(text.encode()).digest()
        tokens = [ANSWER_WORDS[b % len(ANSWER_WORDS)] for b in digest[:4]]
        logprobs = [-b / 255 for b in digest[4:8]]
        if warm and self.mode == "wrong":
            tokens[-1] = "WRONG"
            logprobs = [x - 0.05 for x in logprobs]
        return 200, _chat_reply(tokens, logprobs, len(text) // 4, hit // 4)


def _chat_reply(tokens: list[str], logprobs: list[float], prompt: int, cached: int) -> dict:
    content = [
        {"token": f" {t}", "logprob": lp, "top_logprobs": []} for t, lp in zip(tokens, logprobs, strict=True)
    ]
    return {
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(c["token"] for c in content)},
                "logprobs": {"content": content},
                "finish_reason": "length",
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": len(tokens),
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }


def _handler(fake: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, status: int, doc: dict) -> None:
            raw = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            fake.requests += 1
            if self.path != "/v1/models":
                return self._send(404, {"error": {"message": "not found"}})
            self._send(
                200, {"object": "list", "data": [{"id": "fake", "object": "model", "max_model_len": CONTEXT}]}
            )

        def do_POST(self) -> None:
            fake.requests += 1
            doc = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path != "/v1/chat/completions":
                return self._send(404, {"error": {"message": "not found"}})
            tenant = self.headers.get("Authorization", "")
            text = "\n".join(m["content"] for m in doc["messages"])
            self._send(*fake.answer(tenant, text))

    return Handler
