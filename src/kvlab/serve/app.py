"""The OpenAI-compatible HTTP side of ``kvlab serve`` (FastAPI): routes, keys, limits, errors, streaming.

Every request is validated here before the engine sees it; every failure is an OpenAI-style JSON
error (``{"error": {"message", "type", "param", "code"}}``) with its status — never a traceback,
never a dead worker. See ``docs/serving.md`` for the request flow and the security model.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import math
import random
import re
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from kvlab.errors import KvlabError
from kvlab.loop import Sampling
from kvlab.serve.engine import (
    Engine,
    EngineSettings,
    ShuttingDownError,
    check_request_fits,
)
from kvlab.serve.engine import (
    Request as EngineRequest,
)
from kvlab.serve.keys import check_keys
from kvlab.serve.metrics import Metrics
from kvlab.serve.relay import Relay
from kvlab.serve.status import status_page
from kvlab.serve.tenants import KeyLimitError, QueueFullError, WorkTooLargeError, tenant_label

log = logging.getLogger("kvlab.serve")


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 32768
    max_tokens: int = 2048
    default_max_tokens: int = 256
    retry_after_s: int = 1
    # log-probabilities one request may ask for: scored tokens x (1 + alternatives); lm-eval's requests
    # (echo, logprobs=1, max_tokens=1, 2,047-token contexts) fit 16 prompts to a request
    max_logprob_entries: int = 65536
    max_response_bytes: int = 8 << 20  # a reply's JSON (or a stream's events, all together)


# torch.Generator.manual_seed takes [-2**63, 2**64 - 1] (negative seeds are mapped onto the rest)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# a temperature below this samples as greedy (as vLLM does): dividing the logits by 1e-310 gives inf - inf
GREEDY_BELOW = 1e-5
MAX_DEPTH = 32  # nesting levels in a body; an OpenAI request needs 5 (messages, parts)
MAX_STOP_CHARS = 256  # per stop string: each is matched against the reply's tail at every token


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param=None,
        code=None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers  # sent with the error (Retry-After, WWW-Authenticate)


# -- request bodies ------------------------------------------------------------------------------------
# Every field of a body is either read (a field of these models), harmless (_METADATA: labels that change
# nothing kvlab computes), accepted only at its neutral value (_NEUTRAL), or refused with a 400 that names
# it (unknown fields too): a client asking for tools, a response format or penalties gets an error, never
# a plain reply that silently ignored what it asked for.
class _Extension(BaseModel):
    """The body's ``kvlab`` field: what this server adds to the OpenAI API."""

    model_config = ConfigDict(extra="forbid")
    # score this response against the exact full cache (kvlab.serve.fidelity); null: the server's sampling
    fidelity: StrictBool | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, max_length=256)
    kvlab: _Extension | None = None


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_Part]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Common):
    messages: list[_Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionBody(_Common):
    # a text, several texts, token ids, or several lists of token ids (one choice per prompt)
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0 with echo: score the prompt, generate nothing
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


def _none_or(*neutral: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == n and type(v) is type(n) for n in neutral)


_TOOLS = "tool calling is not supported"
# field -> (is this value neutral?, what kvlab lacks); null is always neutral
_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (_none_or([]), _TOOLS),
    "tool_choice": (_none_or("none"), _TOOLS),
    "parallel_tool_calls": (_none_or(), _TOOLS),
    "functions": (_none_or([]), _TOOLS),
    "function_call": (_none_or("none"), _TOOLS),
    "response_format": (_none_or({"type": "text"}), "only plain text replies ({'type': 'text'})"),
    "presence_penalty": (_none_or(0, 0.0), "penalties are not supported (only 0)"),
    "frequency_penalty": (_none_or(0, 0.0), "penalties are not supported (only 0)"),
    "logit_bias": (_none_or({}), "logit_bias is not supported (only {})"),
    "best_of": (_none_or(1), "only best_of=1"),
    "suffix": (_none_or(""), "suffix (insertion) is not supported"),
    "modalities": (_none_or(["text"]), "only text output"),
    "audio": (_none_or(), "only text output"),
    "prediction": (_none_or(), "predicted outputs are not supported"),
    "reasoning_effort": (_none_or(), "this model does not reason"),
    "verbosity": (_none_or(), "verbosity is not supported"),
    "web_search_options": (_none_or(), "web search is not supported"),
    "moderation": (_none_or(), "moderation is not supported"),
    "store": (_none_or(False), "completions are not stored (only store=false)"),
    "service_tier": (_none_or("auto", "default"), "one service tier (auto)"),
}
# labels for the caller's own bookkeeping: accepted, and they change nothing kvlab computes
_METADATA = frozenset(
    {
        "user",
        "metadata",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
    }
)
_ONLY = {"best_of": "text", "suffix": "text"}  # fields of one endpoint only
# fields of a message that are accepted at their neutral value (an assistant message sent back as received)
_MESSAGE_NEUTRAL = {
    "tool_calls": (_none_or([]), _TOOLS),
    "function_call": (_none_or(), _TOOLS),
    "refusal": (_none_or(), "refusals are not supported"),
    "annotations": (_none_or([]), "annotations are not supported"),
    "audio": (_none_or(), "only text"),
    "name": (_none_or(), "named participants are not supported"),
}
_STREAM_OPTIONS = {"include_usage", "include_obfuscation"}


def _unsupported(doc: dict, cls: type[_Common], kind: str) -> dict:
    """``doc`` without its neutral and metadata fields; a 400 naming every unsupported or unknown one."""
    known = set(cls.model_fields)
    problems: list[tuple[str, str]] = []
    kept: dict[str, Any] = {}
    for key, value in doc.items():
        if key in known:
            kept[key] = value
        elif key in _METADATA:
            continue
        elif key in _NEUTRAL and _ONLY.get(key, kind) == kind:
            neutral, why = _NEUTRAL[key]
            if not neutral(value):
                shown = f"={json.dumps(value)[:40]}" if isinstance(value, int | float | str) else ""
                problems.append((key, f"{key}{shown}: {why}"))
        else:
            problems.append((key, f"{key}: unknown field"))
    if isinstance(doc.get("messages"), list):
        for i, m in enumerate(doc["messages"]):
            if not isinstance(m, dict):
                continue
            for key in [k for k in m if k not in ("role", "content")]:
                where = f"messages[{i}].{key}"
                neutral, why = _MESSAGE_NEUTRAL.get(key, (_none_or(), "unknown field"))
                if not neutral(m[key]):
                    problems.append((where, f"{where}: {why}"))
        if not problems:
            kept["messages"] = [
                {k: v for k, v in m.items() if k in ("role", "content")} if isinstance(m, dict) else m
                for m in doc["messages"]
            ]
    options = doc.get("stream_options")
    if isinstance(options, dict):
        for key in [k for k in options if k not in _STREAM_OPTIONS]:
            problems.append((f"stream_options.{key}", f"stream_options.{key}: unknown option"))
    if problems:
        raise ApiError(
            400,
            "unsupported by this server: " + "; ".join(why for _, why in problems),
            param=problems[0][0],
            code="unsupported_parameter",
        )
    return kept


def _invalid(message: str, param: str, code: str = "invalid_value") -> ApiError:
    """A 400 that names the field at fault."""
    return ApiError(400, message, param=param, code=code)


def _error(exc: ApiError) -> Response:
    body = {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}
    # ASCII JSON: a message that quotes the request can never fail to encode
    return Response(
        json.dumps(body), status_code=exc.status, headers=exc.headers, media_type="application/json"
    )


_SURROGATE = re.compile("[\ud800-\udfff]")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:24]} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def parse_body(raw: bytes) -> dict:
    """The request's JSON object, or a 400 before anything else reads it: not JSON (or NaN, Infinity, a
    number beyond a float's range, an integer over Python's 4,300 digits), nested deeper than
    ``MAX_DEPTH``, a string (or key) with a lone surrogate (not text: no tokenizer or UTF-8 encoder
    takes it), or not an object."""
    try:
        doc = json.loads(raw, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:  # the C parser refuses at about 1,000 levels
        raise ApiError(400, f"the body nests deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a too-long integer, the two above
        why = str(exc)
        if "integer string conversion" in why:
            why = "an integer has more digits than this server reads (4300)"
        raise ApiError(400, f"the body is not valid JSON: {why[:200]}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:  # iterative: a deep document must not recurse here either
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the body nests deeper than {MAX_DEPTH} levels", code="invalid_json")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, v in items:
            if type(key) is str and _SURROGATE.search(key):
                raise ApiError(400, "a key of the body is not valid Unicode text", code="invalid_json")
            if type(v) is str and _SURROGATE.search(v):
                why = "the body holds a lone surrogate (\\ud800-\\udfff without its pair): not text"
                raise ApiError(400, why, code="invalid_text")
            if type(v) is dict or type(v) is list:
                stack.append((v, depth + 1))
    return doc


def create_app(
    engine: Engine,
    *,
    model_id: str,
    api_keys: tuple[str, ...] = (),
    admin_key: str | None = None,
    limits: Limits = Limits(),
) -> FastAPI:
    """The ASGI app around ``engine`` (which must already be running).

    ``admin_key`` opens the status page and ``/metrics``; a server with API keys or an admin key closes
    them to everybody else (tenants' keys included); one with neither leaves them open (local use)."""
    check_keys(api_keys, admin_key)
    metrics: Metrics = engine.metrics or Metrics()
    engine.metrics = metrics
    metrics.cache_policy(engine.policy)
    app = FastAPI(title="kvlab serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Errors)
    keys = tuple(k.encode() for k in api_keys)
    server = _Server(engine, metrics, model_id, keys, admin_key.encode() if admin_key else None, limits)
    _add_api_routes(app, server)
    _add_admin_routes(app, server)
    return app


@dataclass
class _Server:
    """What the routes share: the engine, the metrics, the keys (as bytes), the limits and the start time."""

    engine: Engine
    metrics: Metrics
    model_id: str
    keys: tuple[bytes, ...]
    admin: bytes | None
    limits: Limits
    started: float = field(default_factory=time.time)
    _relay: Relay | None = field(default=None, repr=False)

    def relay(self) -> Relay:
        """The running loop's :class:`~kvlab.serve.relay.Relay` (made on the first request)."""
        loop = asyncio.get_running_loop()
        if self._relay is None or self._relay.loop is not loop:
            self._relay = Relay(loop)
        return self._relay

    def tenant(self, request: Request) -> _Caller:
        """The caller's tenant (its key's salt and label), after checking its key in constant time."""
        if not self.keys:
            return _Caller("", "-")
        auth = request.headers.get("authorization", "")
        given = auth[7:].encode() if auth[:7].lower() == "bearer " else b""
        ok = False
        for k in self.keys:  # compare against every key: the time taken does not say which key matched
            ok |= hmac.compare_digest(given, k)
        if not ok:
            raise ApiError(
                401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key"
            )
        return _Caller(
            hashlib.sha256(b"kvlab-tenant|" + given).hexdigest()[:32], tenant_label(given.decode())
        )

    def check_admin(self, request: Request) -> None:
        """A 401 (that asks a browser for the key) unless the caller may see every tenant's activity: it
        sent the admin key (``Bearer KEY``, or Basic with the key as password), or the server has no keys."""
        if not self.keys and self.admin is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        secret = given.strip().encode("latin-1")
        if scheme.lower() == "basic":
            try:
                secret = base64.b64decode(secret, validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                secret = b""
        elif scheme.lower() != "bearer":
            secret = b""
        if self.admin is not None and hmac.compare_digest(secret, self.admin):
            return
        why = "send Authorization: Bearer ADMIN_KEY" if self.admin else "start the server with --admin-key"
        realm = {"WWW-Authenticate": 'Basic realm="kvlab serve admin", charset="UTF-8"'}
        raise ApiError(401, f"this page needs the admin key ({why})", code="invalid_admin_key", headers=realm)

    async def body_of(self, request: Request, cls: type[_Common]) -> Any:
        limit = self.limits.max_body_bytes
        too_large = ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        parts = []
        size = 0
        async for chunk in request.stream():  # ClientDisconnect when the client leaves mid-body
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                raise too_large
        doc = _unsupported(parse_body(b"".join(parts)), cls, "chat" if cls is ChatBody else "text")
        try:
            body = cls.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ApiError(422, f"{where}: {first['msg']}", param=where, code="invalid_value") from None
        if body.model != self.model_id:
            raise ApiError(
                404,
                f"the model {body.model!r} does not exist; this server serves {self.model_id!r}",
                param="model",
                code="model_not_found",
            )
        if body.n != 1:
            raise _invalid("only n=1 is supported", "n", "unsupported_value")
        return body

    async def serve(self, request: Request, kind: str) -> Response:
        """A completion request's reply, its status counted (its tenant's too, once its key is checked)."""
        who = ""
        try:
            caller = self.tenant(request)
            who = caller.label
            reply = await self.reply(request, kind, caller)
        except ClientDisconnect:  # gone while sending its body: nobody reads a reply
            reply = Response(status_code=499)
        except ApiError as exc:
            reply = _error(exc)
        self.metrics.request("chat" if kind == "chat" else "completions", reply.status_code, who)
        return reply

    async def reply(self, request: Request, kind: str, caller: _Caller) -> Response:
        engine, limits = self.engine, self.limits
        body = await self.body_of(request, ChatBody if kind == "chat" else CompletionBody)
        try:
            # templating and tokenizing a 1 MiB body takes 1-2 s: off the event loop, which keeps answering
            if kind == "chat":
                prompts = await run_in_threadpool(_encode_chat, engine, body)
            else:
                prompts = await run_in_threadpool(
                    _encode_prompts, engine, body, _most_prompts(engine.settings)
                )
            if len(prompts) > 1 and body.stream:
                message = "stream is supported with one prompt only; send the prompts one per request"
                raise _invalid(message, "stream", "unsupported_value")
            queues: list[asyncio.Queue] = [asyncio.Queue() for _ in prompts]
            emits = [self.relay().emitter(q) for q in queues]
            reqs = [_prepare(engine, limits, body, caller, p, e) for p, e in zip(prompts, emits, strict=True)]
            _check_logprob_budget(
                reqs, limits.max_logprob_entries, "top_logprobs" if kind == "chat" else "logprobs"
            )
            fid = _submit(engine, body, caller, reqs)
        except KvlabError as exc:
            raise _engine_error(exc, limits.retry_after_s) from None
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        head = {"id": rid, "created": int(time.time()), "model": self.model_id}
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            tok = engine.handle.tokenizer
            return StreamingResponse(
                _sse(queues[0], reqs[0], kind, head, include_usage, tok, limits.max_response_bytes),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        collect = await _replies_or_leave(request, queues, reqs)
        if collect is None:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        echo = kind == "text" and body.echo
        doc = _final(kind, head, prompts, collect.result(), echo, engine.handle.tokenizer)
        doc = await _scored(engine, fid, doc)
        return _bounded_json(doc, limits.max_response_bytes)


def _add_api_routes(app: FastAPI, server: _Server) -> None:
    """``POST /v1/chat/completions`` and ``POST /v1/completions``; ``GET /v1/models`` (a tenant's key);
    ``GET /v1/fidelity/{id}``: a scored response's fidelity for the key that asked it: 200 with the score (or
    why none was computed), 202 while it is being scored; 404 for an unknown or expired id and for another
    key's (whose existence it does not reveal); ``GET /health`` (open)."""

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await server.serve(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.serve(request, "text")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        server.tenant(request)
        created = int(server.started)
        model = {"id": server.model_id, "object": "model", "created": created, "owned_by": "kvlab"}
        return JSONResponse({"object": "list", "data": [model]})

    @app.get("/health")
    async def health() -> Response:
        engine = server.engine
        return JSONResponse(
            {
                "status": "ok",
                "model": server.model_id,
                "queue": engine.queue_depth(),
                "decoding": engine.active(),
                "device": engine.device_info(),
                "uptime_s": round(time.time() - server.started, 1),
            }
        )

    @app.get("/v1/fidelity/{fid}")
    async def fidelity(fid: str, request: Request) -> Response:
        caller = server.tenant(request)
        known, result = server.engine.fidelity.read(fid, caller.salt)
        if not known:
            message = f"no fidelity record {fid[:80]!r} for this key (unknown, expired, or another key's)"
            raise ApiError(404, message, param="id", code="fidelity_not_found")
        head = {"id": fid, "object": "kvlab.fidelity"}
        if result is None:
            return JSONResponse({**head, "status": "pending"}, status_code=202, headers={"Retry-After": "1"})
        status = "skipped" if "skipped" in result else "done"
        return JSONResponse({**head, "status": status, "fidelity": result})


def _add_admin_routes(app: FastAPI, server: _Server) -> None:
    """``GET /metrics`` (Prometheus) and ``GET /`` (the status page), for the admin key only; then the error
    handlers: an :class:`ApiError` a route raises, 404 and 405 as OpenAI-style JSON errors."""

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        server.check_admin(request)
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def status(request: Request) -> Response:
        server.check_admin(request)
        engine = server.engine
        return HTMLResponse(status_page(server.model_id, engine.status(), engine.store_stats()))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error(exc)

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(ApiError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def bad_method(request: Request, exc: Exception) -> Response:
        return _error(
            ApiError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
        )


@dataclass(frozen=True)
class _Caller:
    """Who sent a request: its tenant's cache salt and its label (scheduling and metrics)."""

    salt: str  # an API key's digest ("" without keys: one tenant); a request's cache_salt extends it
    label: str  # kvlab.serve.tenants.tenant_label of the key ("-" without keys)


def _prepare(
    engine: Engine, limits: Limits, body: Any, caller: _Caller, prompt: _Prompt, emit: Callable[[tuple], None]
) -> EngineRequest:
    """The engine's request for one prompt of ``body`` (checked against ``limits``; nothing is computed)."""
    ids, pinned = prompt.ids, prompt.pinned
    if len(ids) > limits.max_prompt_tokens:
        message = (
            f"{prompt.name} has {len(ids)} tokens; this server accepts at most {limits.max_prompt_tokens}"
        )
        raise _invalid(message, prompt.param, "context_length_exceeded")
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_new = limits.default_max_tokens if asked is None else asked
    echo = isinstance(body, CompletionBody) and body.echo
    if max_new == 0 and not echo:
        raise _invalid("max_tokens=0 is only for scoring a prompt (with echo)", "max_tokens")
    if echo and body.stream:
        raise _invalid("echo is not supported with stream", "echo", "unsupported_value")
    if isinstance(body, ChatBody):
        if body.top_logprobs is not None and not body.logprobs:
            raise _invalid("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    if max_new > limits.max_tokens:
        raise _invalid(f"max_tokens is at most {limits.max_tokens}", "max_tokens")
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stops) > 4 or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise _invalid(f"stop: up to 4 non-empty strings of at most {MAX_STOP_CHARS} characters", "stop")
    try:
        check_request_fits(ids, pinned, engine.settings, max_new, engine.handle.max_positions)
    except KvlabError as exc:
        raise ApiError(400, str(exc), param=prompt.param) from None
    salt = caller.salt + ("|" + body.cache_salt if body.cache_salt else "")
    temperature = body.temperature if body.temperature >= GREEDY_BELOW else 0.0
    return EngineRequest(
        ids=ids,
        max_new_tokens=max_new,
        sampling=Sampling(temperature=temperature, top_p=body.top_p, seed=body.seed or 0),
        emit=emit,
        salt=salt,
        pinned=pinned,
        stop_ids=frozenset(engine.handle.eos_ids()),
        stop_strings=stops,
        logprobs=logprobs,
        logprob_stop=isinstance(body, CompletionBody),
        score_prompt=echo and logprobs is not None,
        tenant=caller.label,
    )


def _submit(engine: Engine, body: Any, caller: _Caller, reqs: list[EngineRequest]) -> str | None:
    """Queue ``reqs`` (:meth:`Engine.submit_many`), scored for fidelity (``kvlab.fidelity`` in the body, else
    sampled at ``--fidelity-sample``) or not: its record's id on the engine's board (set on its one request),
    or None. Only a request of one prompt that generates is scored; asking otherwise is a 400."""
    asked = body.kvlab.fidelity if body.kvlab is not None else None
    one = len(reqs) == 1 and reqs[0].max_new_tokens > 0
    if asked and not one:
        message = "kvlab.fidelity scores one generated response: send one prompt with max_tokens >= 1"
        raise _invalid(message, "kvlab.fidelity", "unsupported_value")
    chosen = asked if asked is not None else one and random.random() < engine.settings.fidelity_sample
    fid = reqs[0].fidelity = engine.fidelity.open(caller.salt) if chosen else None
    try:
        engine.submit_many(reqs)
    except KvlabError:
        if fid is not None:
            engine.fidelity.discard(fid)
        raise
    return fid


async def _scored(engine: Engine, fid: str | None, doc: dict) -> dict:
    """``doc`` with ``usage.fidelity`` when its response is scored and the score is ready within
    ``--fidelity-wait`` (else its ``kvlab.fidelity_url`` gives it later)."""
    if fid is not None:
        result = await engine.fidelity.wait(fid, engine.settings.fidelity_wait_s)
        if result is not None:
            doc["usage"]["fidelity"] = result
    return doc


def _most_prompts(settings: EngineSettings) -> tuple[int, str]:
    """How many prompts one request may hold, and the option that says so: the queue's size, or a key's
    share of open requests when that is smaller."""
    most, why = max(1, settings.max_queue), "--max-queue"
    if settings.max_open_per_key is not None and settings.max_open_per_key < most:
        most, why = settings.max_open_per_key, "--max-open-per-key"
    return most, why


def _check_logprob_budget(reqs: list[EngineRequest], limit: int, param: str) -> None:
    """A 400 naming the limit when the request asks for more than ``limit`` log-probabilities: scored
    tokens (prompt tokens echoed, tokens generated with logprobs) x (1 + alternatives), over its prompts.
    Checked before anything is queued, so nothing is computed for it."""
    asked = sum(
        ((len(r.ids) if r.score_prompt else 0) + r.max_new_tokens) * (1 + r.logprobs)
        for r in reqs
        if r.logprobs is not None
    )
    if asked > limit:
        raise ApiError(
            400,
            f"this request asks for {asked} log-probabilities (scored tokens x (1 + alternatives): prompt "
            f"tokens echoed and tokens generated, over its prompts); this server returns at most {limit} "
            "per request (--max-logprob-entries): ask for fewer alternatives, tokens or prompts",
            param=param,
            code="logprobs_limit_exceeded",
        )


def _bounded_json(doc: dict, limit: int) -> JSONResponse:
    """``doc`` as a JSON response, or a 400 naming the limit when it holds more than ``limit`` bytes."""
    reply = JSONResponse(doc)
    if len(reply.body) > limit:
        raise ApiError(
            400,
            f"the reply holds {len(reply.body)} bytes; this server sends at most {limit} "
            "(--max-response-bytes): ask for fewer prompts, alternatives or tokens",
            code="response_too_large",
        )
    return reply


class _Errors:
    """ASGI middleware: an exception a route lets through is a JSON 500, logged here once (Starlette's
    own handler re-raises it, and uvicorn would log the traceback a second time). The same failure
    (exception type and line) is logged with its traceback at most once a minute, then counted."""

    every_s = 60.0

    def __init__(self, app: Any) -> None:
        self.app = app
        self.last: dict[str, float] = {}
        self.quiet: dict[str, int] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            self.log(exc, f"{scope.get('method')} {scope.get('path')}")
            if not started:
                error = ApiError(500, "internal error (logged on the server)", type_="server_error")
                await _error(error)(scope, receive, send)

    def log(self, exc: Exception, where: str) -> None:
        frames = traceback.extract_tb(exc.__traceback__)
        at = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        kind = f"{type(exc).__name__} at {at}"
        now = time.monotonic()
        if now - self.last.get(kind, -math.inf) < self.every_s:
            self.quiet[kind] = self.quiet.get(kind, 0) + 1
            return
        self.last[kind] = now
        more = self.quiet.pop(kind, 0)
        also = f" ({more} more like it since it was last logged)" if more else ""
        log.error("unexpected error in %s: %s%s", where, kind, also, exc_info=exc)


@dataclass(frozen=True)
class _Prompt:
    """One prompt of a request: its token ids, how many lead tokens are pinned, its text (for ``echo``)."""

    ids: list[int]
    pinned: int
    text: str
    name: str  # how errors name it: "the prompt", "prompt[2]"
    param: str


def _encode_prompts(engine: Engine, body: CompletionBody, most: tuple[int, str]) -> list[_Prompt]:
    """The prompts of a completion: a text, a list of texts, token ids or a list of token-id lists
    (at most ``most[0]`` of them, counted before any is encoded; ``most[1]`` names the option).

    Token ids are used as given (checked against the vocabulary); texts are encoded as
    ``ModelHandle.encode`` does (no special tokens added)."""
    given = body.prompt
    several = isinstance(given, list) and bool(given) and not isinstance(given[0], int)
    items: list[Any] = list(given) if several else [given]
    if len(items) > most[0]:
        message = f"{len(items)} prompts in one request; this server queues at most {most[0]} ({most[1]})"
        raise _invalid(message, "prompt")
    vocab = int(engine.handle.config.vocab_size)
    prompts = []
    for i, item in enumerate(items):
        name, param = (f"prompt[{i}]", f"prompt[{i}]") if several else ("the prompt", "prompt")
        if not (item.strip() if isinstance(item, str) else item):
            raise _invalid(f"{name} is empty", param)
        if isinstance(item, str):
            prompts.append(_Prompt(engine.handle.encode(item), 0, item, name, param))
            continue
        bad = [t for t in item if not 0 <= t < vocab]
        if bad:
            shown = ", ".join(str(t) if abs(t) < 10**12 else f"{str(t)[:12]}..." for t in bad[:5])
            raise _invalid(f"{name} has token ids outside the vocabulary [0, {vocab}): [{shown}]", param)
        prompts.append(_Prompt(list(item), 0, engine.handle.decode(item), name, param))
    return prompts


def _encode_chat(engine: Engine, body: ChatBody) -> list[_Prompt]:
    """The conversation's token ids and how many leading tokens (the system prompt) are pinned."""
    tok = engine.handle.tokenizer
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
    ]
    if messages[-1]["role"] == "assistant":
        raise _invalid("the last message must not be the assistant's", "messages")
    if not any(m["content"].strip() for m in messages):
        raise _invalid("every message is empty", "messages")
    try:
        ids = _template(tok, messages)
        # pinned: the tokens shared with the same system prompt and any other first user turn
        lead = 0
        while lead < len(messages) and messages[lead]["role"] == "system":
            lead += 1
        other = _template(tok, messages[:lead] + [{"role": "user", "content": "\u2063kvlab"}])
    except Exception as exc:  # jinja errors from the model's chat template (e.g. role order)
        raise ApiError(
            400, f"the model's chat template refused these messages: {exc}", param="messages"
        ) from None
    pinned = 0
    for a, b in zip(ids, other, strict=False):
        if a != b:
            break
        pinned += 1
    return [_Prompt(ids, pinned, "", "the conversation", "messages")]


def _template(tok: Any, messages: list[dict]) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return [int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def _engine_error(exc: Exception, retry_after: int = 1) -> ApiError:
    if isinstance(exc, ShuttingDownError):
        return ApiError(503, str(exc), type_="server_error", code="unavailable")
    if isinstance(exc, QueueFullError):  # the queue, or the key's share of it (KeyLimitError)
        code = "per_key_limit" if isinstance(exc, KeyLimitError) else "queue_full"
        headers = {"Retry-After": str(retry_after)}
        return ApiError(429, str(exc), type_="rate_limit_error", code=code, headers=headers)
    if isinstance(exc, WorkTooLargeError):
        return ApiError(400, str(exc), code="request_too_large")
    if isinstance(exc, KvlabError):
        return ApiError(400, str(exc))
    return ApiError(500, "internal error (logged on the server)", type_="server_error")


async def _disconnected(request: Request) -> None:
    """Return once the client has gone. Called after the body is read, so the next ASGI message is the
    disconnect (Starlette's StreamingResponse watches for it the same way)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.1)  # nothing else should come; never spin on it


async def _replies_or_leave(
    request: Request, queues: list[asyncio.Queue], reqs: list[EngineRequest]
) -> asyncio.Future | None:
    """Wait for every prompt's reply (the finished future: its result, or the error it raises), or for the
    client to leave (None): then every prompt is cancelled (one decoding leaves the batch before the next
    step; one still queued is dropped unprefilled)."""
    tasks = [asyncio.ensure_future(_collect(q)) for q in queues]

    async def every() -> list[tuple[str, str, dict]]:  # the first failure fails the request
        return list(await asyncio.gather(*tasks))

    collect = asyncio.ensure_future(every())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        left = not collect.done()  # the client left (or this handler is being cancelled)
        if left:
            collect.cancel()
        for t in tasks:
            t.cancel()  # a no-op once done
        for r in reqs:
            r.cancelled.set()
    return None if left else collect


async def _collect(events: asyncio.Queue) -> tuple[str, str, dict]:
    """One prompt's (text, finish reason, info) from its events; its error as an :class:`ApiError`."""
    while True:
        ev = await events.get()
        if ev[0] == "done":
            return ev[3], ev[1], ev[2]
        if ev[0] == "error":
            raise _engine_error(ev[1])


def _usage(prompt_tokens: int, infos: list[dict]) -> dict:
    done = sum(info.get("completion_tokens", 0) for info in infos)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": done,
        "total_tokens": prompt_tokens + done,
        "prompt_tokens_details": {"cached_tokens": sum(info.get("cached_tokens", 0) for info in infos)},
    }


def _chat_logprobs(tok: Any, entries: list | None) -> dict | None:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if entries is None:
        return None

    def one(token_id: int, lp: float) -> dict:
        text = tok.decode([token_id])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {
        "content": [
            {**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in alts]} for t, lp, alts in entries
        ],
        "refusal": None,
    }


def _text_logprobs(tok: Any, generated: list, prompt: Iterable[tuple[int, Any]] = ()) -> dict:
    """Legacy completions ``logprobs``: parallel lists over the ``prompt``'s (token id, entry) pairs (an
    echoed prompt; the entry ``None`` where a token was not scored), then the ``generated`` entries."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token_id, entry in [*prompt, *((e[0], e) for e in generated)]:
        text = tok.decode([token_id])
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(None if entry is None else entry[1])
        out["top_logprobs"].append(None if entry is None else {tok.decode([a]): alp for a, alp in entry[2]})
    return out


def _public(info: dict) -> dict:
    return {k: v for k, v in info.items() if not k.startswith("_")}


def _final(
    kind: str, head: dict, prompts: list[_Prompt], done: list[tuple[str, str, dict]], echo: bool, tok: Any
) -> dict:
    """The reply of a request answered whole: each prompt's (text, finish reason, info) as a chat or text
    completion (with ``echo``: its prompt's text and log-probabilities first)."""
    infos = [info for _, _, info in done]
    usage = _usage(sum(len(p.ids) for p in prompts), infos)
    if kind == "chat":
        ((text, finish, info),) = done
        logprobs = _chat_logprobs(tok, info.get("_logprobs"))
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}
        return {
            **head,
            "object": "chat.completion",
            "choices": [choice],
            "usage": usage,
            "kvlab": _public(info),
        }
    choices = []
    for i, (prompt, (text, finish, info)) in enumerate(zip(prompts, done, strict=True)):
        generated, text_logprobs = info.get("_logprobs"), None
        if generated is not None:
            scored = info.get("_prompt_logprobs") or [None] * len(prompt.ids)
            text_logprobs = _text_logprobs(
                tok, generated, zip(prompt.ids, scored, strict=True) if echo else ()
            )
        text = prompt.text + text if echo else text
        choice = {"index": i, "text": text, "finish_reason": finish, "logprobs": text_logprobs}
        if len(done) > 1:
            choice["kvlab"] = _public(info)
        choices.append(choice)
    if len(done) == 1:
        kvlab = _public(infos[0])
    else:  # each choice carries its own; the response sums them
        summed = ("cached_tokens", "computed_tokens", "completion_tokens", "rolls")
        kvlab = {"prompts": len(done), **{k: sum(info.get(k, 0) for info in infos) for k in summed}}
    return {**head, "object": "text_completion", "choices": choices, "usage": usage, "kvlab": kvlab}


def _data(doc: dict) -> str:
    """One server-sent event."""
    return "data: " + json.dumps(doc) + "\n\n"


async def _sse(
    events: asyncio.Queue,
    req: EngineRequest,
    kind: str,
    head: dict,
    include_usage: bool,
    tok: Any,
    max_bytes: int = Limits.max_response_bytes,
) -> AsyncIterator[str]:
    """The reply as server-sent events; a stream that would pass ``max_bytes`` in all ends with an error
    event naming the limit instead (and its request is cancelled)."""
    sent = 0
    try:
        async for event in _sse_events(events, req, kind, head, include_usage, tok):
            sent += len(event.encode())
            if sent > max_bytes:
                message = (
                    f"the reply passed {max_bytes} bytes, the most this server sends (--max-response-bytes); "
                    "stopped: ask for fewer alternatives or tokens"
                )
                yield _data(
                    {
                        "error": {
                            "message": message,
                            "type": "invalid_request_error",
                            "code": "response_too_large",
                        }
                    }
                )
                return
            yield event
    finally:
        req.cancelled.set()  # the client left, or the reply ended: the engine drops the row of a stream cut short


async def _sse_events(
    events: asyncio.Queue, req: EngineRequest, kind: str, head: dict, include_usage: bool, tok: Any
) -> AsyncIterator[str]:
    chat = kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: dict | str, finish: str | None = None, entries: list | None = None, **extra: Any) -> str:
        lp = None
        if req.logprobs is not None and entries is not None:
            lp = _chat_logprobs(tok, entries) if chat else _text_logprobs(tok, entries)
        choice = {"index": 0, "delta" if chat else "text": delta, "finish_reason": finish, "logprobs": lp}
        return _data({**head, "object": obj, "choices": [choice], **extra})

    while True:
        ev = await events.get()
        if ev[0] == "start" and chat:
            yield chunk({"role": "assistant", "content": ""})
        elif ev[0] == "token":
            yield chunk({"content": ev[2]} if chat else ev[2], entries=ev[3])
        elif ev[0] == "done":
            yield chunk({} if chat else "", ev[1], kvlab=_public(ev[2]))
            if include_usage:
                usage = _usage(len(req.ids), [ev[2]])
                yield _data({**head, "object": obj, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
            return
        elif ev[0] == "error":
            err = _engine_error(ev[1])
            yield _data({"error": {"message": err.message, "type": err.type, "code": err.code}})
            return
