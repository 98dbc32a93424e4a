"""An OpenAI-compatible server seen from outside: one request at a time, timed, its reply read into a
:class:`Reply` (the tokens, their log-probabilities, what ``usage`` claims). Standard library only
(``urllib``): the probe imports no torch, no transformers and no SDK.

Every request is greedy (``temperature: 0``) and asks for log-probabilities: on ``/chat/completions``
``logprobs: true, top_logprobs: 1``, on ``/completions`` ``logprobs: 1`` (a chat's messages joined into
one text there). A failed connection is a reply with status 0 and the error, never an exception: the
checks judge it.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Literal

from kvlab.errors import BadInputError, KvlabError

Api = Literal["chat", "completions"]
Message = dict[str, str]


@dataclass(frozen=True)
class Reply:
    """One request's outcome. ``status`` 0: no HTTP reply (refused, reset, timed out: ``error`` says)."""

    status: int
    seconds: float  # from sending the request to its last byte read
    text: str = ""
    tokens: tuple[str, ...] = ()
    logprobs: tuple[float, ...] = ()
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None when not reported
    finish: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def base_url(url: str) -> str:
    """The API root of ``url`` (``http://host:port`` or ``.../v1``: both give ``.../v1``), or a
    BadInputError naming what is wrong with it."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadInputError(f"URL {url!r} must be http(s)://HOST[:PORT][/v1]")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise BadInputError(f"URL {url!r} has a bad port") from None
    if parts.query or parts.fragment:
        raise BadInputError(f"URL {url!r} must have no query or fragment")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class Client:
    """Requests to one server's API root, as one of its tenants (an API key, or none)."""

    def __init__(self, base: str, api: Api = "chat", timeout: float = 120.0) -> None:
        self.base, self.api, self.timeout = base, api, timeout
        self.model = ""  # set by the caller (--model, or the first id /models lists)
        self.sent = 0  # requests sent, for the report

    def _call(self, method: str, path: str, key: str | None, doc: object) -> tuple[int, object, float, str]:
        """(status, parsed JSON body or None, seconds, error text); status 0 when no reply came."""
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = None if doc is None else json.dumps(doc).encode()
        req = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        self.sent += 1
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw, status, error = resp.read(), resp.status, ""
        except urllib.error.HTTPError as exc:
            raw, status = exc.read(), exc.code
            error = raw[:300].decode("utf-8", "replace")
        except (OSError, ValueError) as exc:
            return 0, None, time.perf_counter() - start, repr(exc)[:300]
        seconds = time.perf_counter() - start
        try:
            return status, json.loads(raw or b"null"), seconds, error
        except ValueError:
            return status, None, seconds, error or f"not JSON: {raw[:120]!r}"

    def models(self, key: str | None) -> list[dict[str, object]]:
        """The entries ``GET /models`` lists (their metadata may state a context length). No reply at all:
        a KvlabError (nothing to probe); a reply that lists nothing: a BadInputError (pass --model)."""
        status, doc, _, error = self._call("GET", "/models", key, None)
        if status == 0:
            raise KvlabError(f"cannot reach {self.base}: {error}")
        if status != 200 or not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
            raise BadInputError(f"GET {self.base}/models answered HTTP {status}: pass --model")
        return [e for e in doc["data"] if isinstance(e, dict) and isinstance(e.get("id"), str)]

    def chat(self, key: str | None, messages: list[Message], max_tokens: int) -> Reply:
        """One greedy request with log-probabilities; a completions API gets the messages as one text."""
        doc: dict[str, object] = {"model": self.model, "max_tokens": max_tokens, "temperature": 0}
        if self.api == "chat":
            doc |= {"messages": messages, "logprobs": True, "top_logprobs": 1}
        else:
            doc |= {"prompt": "\n\n".join(m["content"] for m in messages), "logprobs": 1}
        path = "/chat/completions" if self.api == "chat" else "/completions"
        status, body, seconds, error = self._call("POST", path, key, doc)
        if status != 200:
            return Reply(status, seconds, error=error or f"HTTP {status}")
        return _read_reply(body, seconds, self.api)

    def ask(self, key: str | None, prompt: str, max_tokens: int) -> Reply:
        return self.chat(key, [{"role": "user", "content": prompt}], max_tokens)


def _read_reply(body: object, seconds: float, api: Api) -> Reply:
    """A 200's body as a Reply; a body without a choice, or with fields of the wrong shape, is a reply
    with an error (the check that asked judges it)."""
    try:
        return _parse(body, seconds, api)
    except (AttributeError, TypeError, ValueError, IndexError, KeyError) as exc:
        return Reply(200, seconds, error=f"a 200 the probe cannot read: {exc!r}"[:300])


def _parse(body: Any, seconds: float, api: Api) -> Reply:
    """The reply's text, tokens, log-probabilities and usage (JSON: an exception on a wrong shape)."""
    if not body.get("choices"):
        return Reply(200, seconds, error="a 200 without choices")
    choice, usage = body["choices"][0], body.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if api == "chat":
        text = (choice.get("message") or {}).get("content") or ""
        entries = (choice.get("logprobs") or {}).get("content") or []
        tokens = tuple(str(e["token"]) for e in entries)
        logprobs = tuple(float(e["logprob"]) for e in entries)
    else:
        text = choice.get("text") or ""
        lp = choice.get("logprobs") or {}
        tokens = tuple(str(t) for t in lp.get("tokens") or [])
        logprobs = tuple(float(x) for x in lp.get("token_logprobs") or [] if x is not None)
    prompt = usage.get("prompt_tokens")
    return Reply(
        200,
        seconds,
        text=str(text),
        tokens=tokens,
        logprobs=logprobs,
        prompt_tokens=prompt if isinstance(prompt, int) else None,
        cached_tokens=cached if isinstance(cached, int) else None,
        finish=choice.get("finish_reason"),
    )
