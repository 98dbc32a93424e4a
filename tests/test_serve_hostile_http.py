"""``kvlab serve`` against hostile HTTP (issue 27): bodies that must be a 4xx before anything is queued,
clients that leave a non-streaming request, and the admin key that closes ``/`` and ``/metrics``.

A real server subprocess (as in ``tests/test_serve.py``), driven with raw HTTP and raw sockets.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

from tests.test_serve import ADMIN, KEY_A, KEY_B, MODEL, Server

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
# greedy SmolLM2 goes on counting far beyond 300 tokens: a request that never ends by itself
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the default body limit (1 MiB): the 100,000-deep body fits in it. One key may use the whole
    # batch and queue (a dropped batch of four prompts below); the per-key shares are tests/test_serve_tenants.py's
    s = Server(
        tmp_path_factory.mktemp("hostile"),
        *("--max-batch", "2", "--max-queue", "4", "--max-tokens", "300"),
        *("--max-batch-per-key", "2", "--max-open-per-key", "6"),
    )
    yield s
    s.stop()


def _raw_json(path: str, tail: bytes) -> tuple[str, bytes]:
    """A body spelled by hand (what ``json.dumps`` cannot write): the model, then ``tail``."""
    head = {CHAT: b'"messages": [{"role": "user", "content": "hi"}]', TEXT: b'"prompt": "hi"'}[path]
    return path, b'{"model": "' + MODEL.encode() + b'", ' + head + b", " + tail + b"}"


def _doc(path: str, **fields) -> tuple[str, bytes]:
    base = {"model": MODEL, "max_tokens": 2, **({"messages": HI} if path == CHAT else {"prompt": "hi"})}
    return path, json.dumps({**base, **fields}).encode()


DEEP = 100_000
# (name, (path, body), status): the ten bodies first (each once a 500), then their relatives
HOSTILE = [
    ("100k-deep arrays", (CHAT, b'{"messages": ' + b"[" * DEEP + b"]" * DEEP + b"}"), 400),
    ("100k-deep objects", (CHAT, b'{"m": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}"), 400),
    ("100k-deep prompt", (TEXT, b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}"), 400),
    ("5,000-digit max_tokens", _raw_json(CHAT, b'"max_tokens": ' + b"9" * 5000), 400),
    ("5,000-digit seed", _raw_json(CHAT, b'"seed": ' + b"9" * 5000), 400),
    ("5,000-digit token id", (TEXT, b'{"model": "x", "prompt": [1, ' + b"7" * 5000 + b"]}"), 400),
    ("seed 2^64", _doc(CHAT, seed=2**64), 422),
    ("seed 2^64 (completions)", _doc(TEXT, seed=2**64), 422),
    ("lone surrogate in a prompt", _doc(TEXT, prompt="a \ud800 b"), 400),
    ("lone surrogate in a batch", _doc(TEXT, prompt=["fine", "\udfff"]), 400),
    # the same families
    ("33 levels (one over)", _raw_json(CHAT, b'"metadata": ' + b"[" * 32 + b"]" * 32), 400),
    ("seed -2^63 - 1", _doc(CHAT, seed=-(2**63) - 1), 422),
    ("seed 10^30", _doc(TEXT, seed=10**30), 422),
    ("4,000-digit max_tokens", _doc(CHAT, max_tokens=10**4000), 400),
    ("4,000-digit token id", _doc(TEXT, prompt=[1, 10**4000]), 400),
    ("4,000-digit n", _doc(CHAT, n=10**4000), 400),
    ("huge max_completion_tokens", _doc(CHAT, max_completion_tokens=10**30), 400),
    ("lone surrogate in chat", _doc(CHAT, messages=[{"role": "user", "content": "x\ud800"}]), 400),
    (
        "lone surrogate in a part",
        _doc(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]),
        400,
    ),  # fmt: skip
    ("lone surrogate in a key", _doc(CHAT, **{"\ud800": 1}), 400),
    ("lone surrogate in the model", _doc(CHAT, model="m\ud800"), 400),
    ("lone surrogate in a stop", _doc(TEXT, stop=["\ud83d"]), 400),
    ("lone surrogate in cache_salt", _doc(CHAT, cache_salt="\udead"), 400),
    ("lone surrogate in metadata", _doc(CHAT, metadata={"k": "\ud800"}), 400),
    ("temperature NaN", _raw_json(CHAT, b'"temperature": NaN'), 400),
    ("top_p Infinity", _raw_json(CHAT, b'"top_p": Infinity'), 400),
    ("temperature 1e999", _raw_json(TEXT, b'"temperature": 1e999'), 400),
    ("top_p -1e400", _raw_json(CHAT, b'"top_p": -1e400'), 400),
    ("presence_penalty -Infinity", _raw_json(CHAT, b'"presence_penalty": -Infinity'), 400),
    ("frequency_penalty NaN", _raw_json(TEXT, b'"frequency_penalty": NaN'), 400),
    ("NaN in logit_bias", _raw_json(CHAT, b'"logit_bias": {"1": NaN}'), 400),
    ("NaN in metadata", _raw_json(CHAT, b'"metadata": {"x": [NaN]}'), 400),
    ("max_tokens -1", _doc(CHAT, max_tokens=-1), 422),
    ("max_tokens 1.5", _doc(CHAT, max_tokens=1.5), 422),
    ("top_logprobs -1", _doc(CHAT, logprobs=True, top_logprobs=-1), 422),
    ("logprobs 10^20", _doc(TEXT, logprobs=10**20), 422),
    ("n -1", _doc(CHAT, n=-1), 422),
    ("temperature -0.1", _doc(CHAT, temperature=-0.1), 422),
    ("a message a number", _doc(CHAT, messages=[5]), 422),
    ("a message a list", _doc(CHAT, messages=[[]]), 422),
    ("no content", _doc(CHAT, messages=[{"role": "user"}]), 422),
    (
        "a part's text a number",
        _doc(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        422,
    ),  # fmt: skip
    (
        "an image part",
        _doc(
            CHAT, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        ),
        422,
    ),  # fmt: skip
    ("a role a list", _doc(CHAT, messages=[{"role": ["user"], "content": "x"}]), 422),
    ("stop a number", _doc(CHAT, stop=[1]), 422),
    ("stop an object", _doc(CHAT, stop={"a": 1}), 422),
    ("10,000 stops", _doc(CHAT, stop=["x"] * 10_000), 400),
    ("a 10,000-character stop", _doc(TEXT, stop="x" * 10_000), 400),
    ("logit_bias a string", _doc(CHAT, logit_bias="x"), 400),
    ("logit_bias a list", _doc(CHAT, logit_bias=[1, 2]), 400),
    ("logit_bias a huge id", _doc(TEXT, logit_bias={"999999999999": 100}), 400),
    ("stream_options a string", _doc(CHAT, stream_options="yes"), 422),
    ("cache_salt 10,000 characters", _doc(CHAT, cache_salt="s" * 10_000), 422),
    ("100 prompts (over the queue)", _doc(TEXT, prompt=["hi"] * 100), 400),
    ("a mixed batch", _doc(TEXT, prompt=[[1, 2], "a"]), 422),
    ("100,000 token ids", _doc(TEXT, prompt=[5] * 100_000), 400),
    ("an empty body", (CHAT, b""), 400),
    ("null", (CHAT, b"null"), 400),
    ("a JSON string", (TEXT, b'"hello"'), 400),
]


def _post(server: Server, path: str, body: bytes, key: str | None = KEY_A) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    status, hdrs, data = server.request("POST", path, body, headers)
    return status, hdrs, json.loads(data) if data else {}


def _health(server: Server) -> dict:
    return json.loads(server.get("/health")[2])


def test_hostile_bodies_get_a_4xx_json_error_before_anything_is_computed(server):
    prefills = server.metric("kvlab_prefills_total")
    for name, (path, body), want in HOSTILE:
        status, headers, data = _post(server, path, body)
        assert status == want, (name, status, data)
        assert headers["content-type"] == "application/json", name
        error = data["error"]
        assert error["message"] and error["type"] == "invalid_request_error", (name, error)
        assert "Traceback" not in error["message"] and len(error["message"]) < 600, (name, error)
    # nothing was queued or prefilled, and the server still serves (and logged no server error)
    assert server.metric("kvlab_prefills_total") == prefills
    assert server.metric('kvlab_requests_total{endpoint="chat",status="500"}') == 0
    assert _post(server, *_doc(CHAT))[0] == 200
    assert "unexpected error" not in server.log.read_text()


def test_values_at_the_edge_are_served(server):
    # a temperature too small to divide by samples as greedy; seeds at torch's limits; 32 levels deep
    edge = [
        _doc(CHAT, temperature=1e-310, seed=2**64 - 1),
        _doc(TEXT, temperature=0.7, seed=-(2**63)),
        _raw_json(CHAT, b'"metadata": ' + b"[" * 31 + b"]" * 31),
        _doc(CHAT, messages=[{"role": "user", "content": "an emoji \U0001f600, escaped as a pair"}]),
        _doc(TEXT, stop=["s" * 256]),
    ]
    for path, body in edge:
        status, _, data = _post(server, path, body)
        assert status == 200, (body[:120], data)
    greedy = _post(server, *_doc(CHAT, temperature=0, max_tokens=6))[2]
    tiny = _post(server, *_doc(CHAT, temperature=1e-300, seed=7, max_tokens=6))[2]
    assert tiny["kvlab"]["completion_ids"] == greedy["kvlab"]["completion_ids"]


def test_a_body_that_takes_seconds_to_tokenize_does_not_stall_the_server(server):
    import threading

    # 30,000 messages in 1 MiB: about 2 s of chat template and tokenizer, then a 400 (180,000 tokens)
    path, body = _doc(CHAT, messages=[{"role": "user", "content": "a"}] * 30_000)
    assert len(body) < 1 << 20
    got: list[int] = []
    sender = threading.Thread(target=lambda: got.append(_post(server, path, body)[0]))
    sender.start()
    slowest = 0.0
    while sender.is_alive():
        t0 = time.monotonic()
        assert server.get("/health")[0] == 200
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.05)
    sender.join()
    assert got == [400]
    assert slowest < 0.6, slowest  # encoding runs beside the event loop (0.2 s measured; 2 s on it)


def _send_and_leave(server: Server, doc: dict, wait_decoding: int, timeout: float = 60) -> float:
    """POST ``doc`` on a raw socket, wait until ``wait_decoding`` requests decode, close the socket; the
    time it was closed."""
    body = json.dumps(doc).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    head = (
        f"POST {TEXT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    deadline = time.monotonic() + timeout
    while _health(server)["decoding"] < wait_decoding:
        assert time.monotonic() < deadline, _health(server)
        time.sleep(0.05)
    time.sleep(1.5)  # the client: gone after 1.5 s
    sock.close()
    return time.monotonic()


def _idle_after(server: Server, left: float) -> float:
    while True:
        h = _health(server)
        if h["decoding"] == 0 and h["queue"] == 0:
            return time.monotonic() - left
        assert time.monotonic() - left < 30, h
        time.sleep(0.05)


def test_a_dropped_non_streaming_request_stops_decoding_within_a_second(server):
    generated = server.metric("kvlab_generated_tokens_total")
    doc = {"model": MODEL, "prompt": COUNTING, "max_tokens": 300, "temperature": 0}
    left = _send_and_leave(server, doc, 1)
    took = _idle_after(server, left)
    assert took < 1.0, took
    after = server.metric("kvlab_generated_tokens_total")
    assert 0 < after - generated < 250  # stopped, far from its 300 tokens
    time.sleep(1.0)
    assert server.metric("kvlab_generated_tokens_total") == after  # and stays stopped
    assert server.metric('kvlab_requests_total{endpoint="completions",status="499"}') >= 1


def test_a_dropped_batch_cancels_its_queued_prompts_unprefilled(server):
    prefills = server.metric("kvlab_prefills_total")
    # four prompts in one request: two decode (--max-batch 2), two wait in the queue
    doc = {"model": MODEL, "prompt": [COUNTING + f" {i}" for i in range(4)], "max_tokens": 300}
    assert _health(server)["queue"] == 0
    left = _send_and_leave(server, {**doc, "temperature": 0}, 2)
    assert _health(server)["queue"] <= 2
    took = _idle_after(server, left)
    assert took < 1.0, took
    assert server.metric("kvlab_prefills_total") - prefills == 2  # the queued two were never prefilled
    assert _post(server, *_doc(CHAT))[0] == 200


# -- the admin key ---------------------------------------------------------------------------------------------
def _basic(user: str, password: str) -> str:
    import base64

    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.parametrize("path", ["/", "/metrics"])
def test_the_admin_pages_need_the_admin_key(server, path):
    refused = {
        "no key": {},
        "a wrong key": {"Authorization": "Bearer not-the-admin-key"},
        "a tenant's key": {"Authorization": f"Bearer {KEY_A}"},
        "the other tenant's key": {"Authorization": f"Bearer {KEY_B}"},
        "the key with another scheme": {"Authorization": f"Token {ADMIN}"},
        "the key as a Basic user": {"Authorization": _basic(ADMIN, "")},
        "a broken Basic": {"Authorization": "Basic !!!"},
        "a prefix of the key": {"Authorization": f"Bearer {ADMIN[:-1]}"},
    }
    for why, headers in refused.items():
        status, hdrs, data = server.request("GET", path, headers=headers)
        assert status == 401, (why, status)
        assert hdrs["content-type"] == "application/json", why
        assert json.loads(data)["error"]["code"] == "invalid_admin_key", why
        assert hdrs["www-authenticate"].startswith("Basic "), why
        assert b"kvlab_" not in data and b"session" not in data, why
    for headers in ({"Authorization": f"Bearer {ADMIN}"}, {"Authorization": _basic("admin", ADMIN)}):
        status, _, data = server.request("GET", path, headers=headers)
        assert status == 200 and (
            b"kvlab_ttft_seconds" in data if path == "/metrics" else b"Sessions" in data
        )


def test_health_stays_open_and_tells_no_tenants_activity(server):
    _post(server, *_doc(CHAT))
    status, _, data = server.get("/health")
    assert status == 200
    doc = json.loads(data)
    assert {"queue", "decoding", "device"} <= set(doc)  # counts and where the model runs
    assert "session" not in data.decode() and "tokens" not in data.decode()


@pytest.mark.process
def test_without_any_key_the_admin_pages_stay_open_and_an_admin_key_alone_closes_them(tmp_path):
    s = Server(tmp_path, keys=(), admin=None)
    try:
        assert s.get("/")[0] == 200 and s.get("/metrics")[0] == 200
        assert _post(s, *_doc(CHAT), key=None)[0] == 200  # no key needed for the API either
    finally:
        s.stop()
    s = Server(tmp_path, keys=(), admin=ADMIN)
    try:
        assert s.get("/")[0] == 401 and s.get("/metrics")[0] == 401
        assert s.get("/", ADMIN)[0] == 200 and s.get("/metrics", ADMIN)[0] == 200
        assert _post(s, *_doc(CHAT), key=None)[0] == 200  # the API stays open
    finally:
        s.stop()
    s = Server(tmp_path, admin=None)  # API keys and no admin key: nobody sees the admin pages
    try:
        for key in (None, KEY_A, KEY_B):
            status, _, data = s.get("/metrics", key)
            assert status == 401 and b"--admin-key" in data
    finally:
        s.stop()


def test_bad_admin_keys_fail_in_one_line_and_a_good_one_is_never_logged(server):
    import os
    import subprocess
    import sys

    def run(*args, **env):
        return subprocess.run(
            [sys.executable, "-m", "kvlab", "serve", "--port", "1", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        )

    for args, env, words in (
        ([], {"KVLAB_ADMIN_KEY": "short"}, "at least 8 characters"),
        (["--api-key", KEY_A, "--admin-key", KEY_A], {}, "must differ"),
        # headers arrive as Latin-1, keys compare as UTF-8: a non-ASCII key could never match (issue 48)
        (
            ["--api-key", KEY_A, "--api-key", "clé-secrète-42"],
            {},
            "API key 2 of 2 has '\\xe9', not printable ASCII",
        ),
        ([], {"KVLAB_API_KEYS": "tenant-key-\u00a0-1"}, "API key 1 of 1 has a space"),
        ([], {"KVLAB_ADMIN_KEY": "admin\u2013key-1234"}, "the admin key has '\\u2013'"),
    ):
        done = run(*args, **env)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and words in lines[0], (args, done.stderr[-800:])
        assert "secrète" not in done.stderr and "tenant-key" not in done.stderr  # keys are never echoed
    assert ADMIN not in server.log.read_text()


def test_an_unexpected_error_is_one_json_500_and_one_log_record(caplog):
    """The catch-all (no route fails on purpose: an ASGI app that raises stands in for a bug)."""
    import asyncio

    from kvlab.serve.app import _Errors

    async def broken(scope, receive, send):
        raise RuntimeError("a bug")

    app = _Errors(broken)
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def many():
        for _ in range(50):
            await app({"type": "http", "method": "POST", "path": CHAT, "headers": []}, receive, send)

    with caplog.at_level(logging.ERROR, logger="kvlab.serve"):
        asyncio.run(many())
    starts = [m for m in sent if m["type"] == "http.response.start"]
    bodies = [json.loads(m["body"]) for m in sent if m["type"] == "http.response.body"]
    assert len(starts) == 50 and {m["status"] for m in starts} == {500}
    assert all(b["error"]["type"] == "server_error" for b in bodies)
    records = [r for r in caplog.records if r.name == "kvlab.serve"]
    assert len(records) == 1 and records[0].exc_info is not None, records
    assert "RuntimeError" in records[0].getMessage()
    # a minute later the same failure is logged again, with the count of those it did not log
    app.last = {k: v - 61 for k, v in app.last.items()}
    with caplog.at_level(logging.ERROR, logger="kvlab.serve"):
        asyncio.run(many())
    records = [r for r in caplog.records if r.name == "kvlab.serve"]
    assert len(records) == 2 and "49 more like it" in records[1].getMessage()
