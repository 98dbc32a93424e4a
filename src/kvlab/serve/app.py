"""The OpenAI-compatible HTTP side of ``kvlab serve`` (FastAPI): routes, keys, limits, errors, streaming.

Every request is validated here before the engine sees it; every failure is an OpenAI-style JSON
error (``{"error": {"message", "type", "param", "code"}}``) with its status — never a traceback,
never a dead worker. See ``docs/serving.md`` for the request flow and the security model.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvlab.errors import KvlabError
from kvlab.loop import Sampling
from kvlab.serve.engine import (
    Engine,
    QueueFullError,
    ShuttingDownError,
    check_request_fits,
)
from kvlab.serve.engine import (
    Request as EngineRequest,
)
from kvlab.serve.metrics import Metrics
from kvlab.serve.status import status_page

log = logging.getLogger("kvlab.serve")


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 32768
    max_tokens: int = 2048
    default_max_tokens: int = 256
    retry_after_s: int = 1


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, type_: str = "invalid_request_error", param=None, code=None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


# -- request bodies (unknown fields are ignored, as OpenAI-compatible servers do) ----------------------
class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, max_length=256)


class _Part(BaseModel):
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_Part]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Common):
    messages: list[_Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionBody(_Common):
    prompt: str
    max_tokens: int | None = Field(default=None, ge=0)  # 0 with echo: score the prompt, generate nothing
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


def _error(exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(exc.code)} if exc.status == 429 and isinstance(exc.code, int) else None
    body = {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}
    return JSONResponse(body, status_code=exc.status, headers=headers)


def create_app(
    engine: Engine, *, model_id: str, api_keys: tuple[str, ...] = (), limits: Limits = Limits()
) -> FastAPI:
    """The ASGI app around ``engine`` (which must already be running)."""
    metrics: Metrics = engine.metrics or Metrics()
    engine.metrics = metrics
    app = FastAPI(title="kvlab serve", docs_url=None, redoc_url=None, openapi_url=None)
    keys = tuple(k.encode() for k in api_keys)
    started = time.time()

    def tenant(request: Request) -> str:
        """The caller's tenant salt (an API key's digest), after checking its key in constant time."""
        if not keys:
            return ""
        auth = request.headers.get("authorization", "")
        given = auth[7:].encode() if auth[:7].lower() == "bearer " else b""
        ok = False
        for k in keys:  # compare against every key: the time taken does not say which key matched
            ok |= hmac.compare_digest(given, k)
        if not ok:
            raise ApiError(
                401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key"
            )
        return hashlib.sha256(b"kvlab-tenant|" + given).hexdigest()[:32]

    async def body_of(request: Request, cls: type[_Common]) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise ApiError(413, f"request body over {limits.max_body_bytes} bytes", code="request_too_large")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limits.max_body_bytes:
                raise ApiError(
                    413, f"request body over {limits.max_body_bytes} bytes", code="request_too_large"
                )
        try:
            doc = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(doc, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        try:
            body = cls.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ApiError(422, f"{where}: {first['msg']}", param=where, code="invalid_value") from None
        if body.model != model_id:
            raise ApiError(
                404,
                f"the model {body.model!r} does not exist; this server serves {model_id!r}",
                param="model",
                code="model_not_found",
            )
        if body.n != 1:
            raise ApiError(400, "only n=1 is supported", param="n", code="unsupported_value")
        return body

    def prepare(body: Any, salt: str, ids: list[int], pinned: int, emit) -> EngineRequest:
        if len(ids) > limits.max_prompt_tokens:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens; this server accepts at most {limits.max_prompt_tokens}",
                param="messages",
                code="context_length_exceeded",
            )
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_new = limits.default_max_tokens if asked is None else asked
        echo = isinstance(body, CompletionBody) and body.echo
        if max_new == 0 and not echo:
            raise ApiError(
                400,
                "max_tokens=0 is only for scoring a prompt (with echo)",
                param="max_tokens",
                code="invalid_value",
            )
        if echo and body.stream:
            raise ApiError(400, "echo is not supported with stream", param="echo", code="unsupported_value")
        if isinstance(body, ChatBody):
            if body.top_logprobs is not None and not body.logprobs:
                raise ApiError(
                    400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value"
                )
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            logprobs = body.logprobs
        if max_new > limits.max_tokens:
            raise ApiError(
                400, f"max_tokens is at most {limits.max_tokens}", param="max_tokens", code="invalid_value"
            )
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "stop: up to 4 non-empty strings", param="stop", code="invalid_value")
        check_request_fits(ids, pinned, engine.settings)
        salt = salt + ("|" + body.cache_salt if body.cache_salt else "")
        return EngineRequest(
            ids=ids,
            max_new_tokens=max_new,
            sampling=Sampling(temperature=body.temperature, top_p=body.top_p, seed=body.seed or 0),
            emit=emit,
            salt=salt,
            pinned=pinned,
            stop_ids=frozenset(engine.handle.eos_ids()),
            stop_strings=stops,
            logprobs=logprobs,
            score_prompt=echo and logprobs is not None,
        )

    async def serve(request: Request, kind: str) -> Response:
        endpoint = "chat" if kind == "chat" else "completions"
        try:
            salt = tenant(request)
            body = await body_of(request, ChatBody if kind == "chat" else CompletionBody)
            ids, pinned = _encode(engine, body, kind)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()
            req = prepare(
                body, salt, ids, pinned, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
            )
            engine.submit(req)
        except ApiError as exc:
            metrics.requests.labels(endpoint, str(exc.status)).inc()
            return _error(exc)
        except QueueFullError as exc:
            metrics.requests.labels(endpoint, "429").inc()
            return _error(ApiError(429, str(exc), type_="rate_limit_error", code=limits.retry_after_s))
        except ShuttingDownError as exc:
            metrics.requests.labels(endpoint, "503").inc()
            return _error(ApiError(503, str(exc), type_="server_error", code="unavailable"))
        except KvlabError as exc:
            metrics.requests.labels(endpoint, "400").inc()
            return _error(ApiError(400, str(exc)))
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        meta = {"id": rid, "created": int(time.time()), "model": model_id, "prompt_tokens": len(ids)}
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            metrics.requests.labels(endpoint, "200").inc()
            return StreamingResponse(
                _sse(events, req, kind, meta, include_usage, engine.handle.tokenizer),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            text, finish, info = await _collect(events, req)
        except ApiError as exc:
            metrics.requests.labels(endpoint, str(exc.status)).inc()
            return _error(exc)
        metrics.requests.labels(endpoint, "200").inc()
        if kind == "text" and body.echo:
            meta["echo"] = (body.prompt, ids)
        return JSONResponse(_final(kind, meta, text, finish, info, engine.handle.tokenizer))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serve(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "text")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            tenant(request)
        except ApiError as exc:
            return _error(exc)
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": model_id, "object": "model", "created": int(started), "owned_by": "kvlab"}],
            }
        )

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "model": model_id,
                "queue": engine.queue_depth(),
                "decoding": engine.active(),
                "device": engine.device_info(),
                "uptime_s": round(time.time() - started, 1),
            }
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def status() -> HTMLResponse:
        return HTMLResponse(status_page(model_id, engine.status(), engine.store_stats()))

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(ApiError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def bad_method(request: Request, exc: Exception) -> Response:
        return _error(
            ApiError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error")
        return _error(ApiError(500, "internal error (logged on the server)", type_="server_error"))

    return app


def _encode(engine: Engine, body: Any, kind: str) -> tuple[list[int], int]:
    """Token ids of the request and how many leading tokens (the system prompt) are pinned."""
    tok = engine.handle.tokenizer
    if kind == "text":
        if not body.prompt.strip():
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
        return engine.handle.encode(body.prompt), 0
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
    ]
    if messages[-1]["role"] == "assistant":
        raise ApiError(
            400, "the last message must not be the assistant's", param="messages", code="invalid_value"
        )
    if not any(m["content"].strip() for m in messages):
        raise ApiError(400, "every message is empty", param="messages", code="invalid_value")
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
    return ids, pinned


def _template(tok: Any, messages: list[dict]) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return [int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def _engine_error(exc: Exception) -> ApiError:
    if isinstance(exc, ShuttingDownError):
        return ApiError(503, str(exc), type_="server_error", code="unavailable")
    if isinstance(exc, KvlabError):
        return ApiError(400, str(exc))
    return ApiError(500, "internal error (logged on the server)", type_="server_error")


async def _collect(events: asyncio.Queue, req: EngineRequest) -> tuple[str, str, dict]:
    parts: list[str] = []
    try:
        while True:
            ev = await events.get()
            if ev[0] == "token":
                parts.append(ev[2])
            elif ev[0] == "done":
                return ev[3], ev[1], ev[2]
            elif ev[0] == "error":
                raise _engine_error(ev[1])
    finally:
        req.cancelled.set()  # a no-op once done; stops the work if the client went away


def _usage(meta: dict, info: dict) -> dict:
    done = info.get("completion_tokens", 0)
    return {
        "prompt_tokens": meta["prompt_tokens"],
        "completion_tokens": done,
        "total_tokens": meta["prompt_tokens"] + done,
        "prompt_tokens_details": {"cached_tokens": info.get("cached_tokens", 0)},
    }


def _token_text(tok: Any, token_id: int) -> str:
    return tok.decode([token_id])


def _chat_logprobs(tok: Any, entries: list | None) -> dict | None:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if entries is None:
        return None

    def one(token_id: int, lp: float) -> dict:
        text = _token_text(tok, token_id)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {
        "content": [
            {**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in alts]} for t, lp, alts in entries
        ],
        "refusal": None,
    }


def _text_logprobs(tok: Any, entries: list, offset: int = 0) -> dict:
    """Legacy completions ``logprobs``: parallel lists (``None`` where a token was not scored)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in entries:
        text = _token_text(tok, token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(None if entry is None else entry[1])
        out["top_logprobs"].append(
            None if entry is None else {_token_text(tok, a): alp for a, alp in entry[2]}
        )
    return out


def _public(info: dict) -> dict:
    return {k: v for k, v in info.items() if not k.startswith("_")}


def _final(kind: str, meta: dict, text: str, finish: str, info: dict, tok: Any) -> dict:
    head = {"id": meta["id"], "created": meta["created"], "model": meta["model"]}
    generated = info.get("_logprobs")
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "logprobs": _chat_logprobs(tok, generated),
        }
        return {
            **head,
            "object": "chat.completion",
            "choices": [choice],
            "usage": _usage(meta, info),
            "kvlab": _public(info),
        }
    logprobs = None
    if "echo" in meta:
        prompt, ids = meta["echo"]
        text = prompt + text
        if generated is not None:
            scored = info.get("_prompt_logprobs") or [None] * len(ids)
            logprobs = _text_logprobs(tok, [*zip(ids, scored, strict=True), *((e[0], e) for e in generated)])
    elif generated is not None:
        logprobs = _text_logprobs(tok, [(e[0], e) for e in generated])
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
    return {
        **head,
        "object": "text_completion",
        "choices": [choice],
        "usage": _usage(meta, info),
        "kvlab": _public(info),
    }


async def _sse(
    events: asyncio.Queue, req: EngineRequest, kind: str, meta: dict, include_usage: bool, tok: Any
) -> AsyncIterator[str]:
    head = {"id": meta["id"], "created": meta["created"], "model": meta["model"]}
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(delta: dict | str, finish: str | None = None, entries: list | None = None, **extra: Any) -> str:
        if req.logprobs is None or entries is None:
            lp = None
        else:
            lp = (
                _chat_logprobs(tok, entries)
                if kind == "chat"
                else _text_logprobs(tok, [(e[0], e) for e in entries])
            )
        if kind == "chat":
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": lp}
        return "data: " + json.dumps({**head, "object": obj, "choices": [choice], **extra}) + "\n\n"

    try:
        while True:
            ev = await events.get()
            if ev[0] == "start" and kind == "chat":
                yield chunk({"role": "assistant", "content": ""})
            elif ev[0] == "token":
                yield chunk({"content": ev[2]} if kind == "chat" else ev[2], entries=ev[3])
            elif ev[0] == "done":
                yield chunk({} if kind == "chat" else "", ev[1], kvlab=_public(ev[2]))
                if include_usage:
                    yield (
                        "data: "
                        + json.dumps({**head, "object": obj, "choices": [], "usage": _usage(meta, ev[2])})
                        + "\n\n"
                    )
                yield "data: [DONE]\n\n"
                return
            elif ev[0] == "error":
                err = _engine_error(ev[1])
                yield (
                    "data: "
                    + json.dumps({"error": {"message": err.message, "type": err.type, "code": err.code}})
                    + "\n\n"
                )
                return
    finally:
        req.cancelled.set()  # the client disconnected (or we are done): the engine drops the row
