"""Request framing of ``kvlab serve`` (issue 48 item 3): a request whose framing a proxy could read
differently (``Content-Length`` and ``Transfer-Encoding`` together, duplicate or malformed lengths, codings
other than ``chunked``, obs-fold, bare LF or CR, bad chunk sizes) gets a 400 and the connection closes:
the request smuggled after it is never parsed or answered (RFC 9112 section 6.1).

Three levels: :class:`~kvlab.serve.framing.RequestFraming` fed whole and byte by byte; uvicorn with kvlab's
protocol (:func:`~kvlab.serve.connections.protocol_class`) in this process, around an app that records
what it served; and a real ``kvlab serve`` subprocess (as in ``tests/test_serve.py``), over raw sockets.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from kvlab.serve.connections import ConnectionGuard, ConnectionLimits, GuardedServer, protocol_class
from kvlab.serve.framing import MAX_CHUNK_BYTES, RequestFraming
from tests.test_serve import Server

SMUGGLED = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"  # answered 200 by kvlab serve, were it ever parsed


def _post(*headers: bytes, body: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    return (
        b"POST /v1/completions "
        + version
        + b"\r\nHost: x\r\n"
        + b"".join(h + b"\r\n" for h in headers)
        + b"\r\n"
        + body
    )


CHUNKED = b"Transfer-Encoding: chunked"
# (name, the request's bytes): each is refused, and SMUGGLED rides after it on the same connection
HOSTILE = [
    ("CL then TE", _post(b"Content-Length: 5", CHUNKED, body=b"0\r\n\r\n")),
    ("TE then CL", _post(CHUNKED, b"Content-Length: 5", body=b"0\r\n\r\n")),
    ("two Content-Lengths differing", _post(b"Content-Length: 0", b"Content-Length: 5", body=b"hello")),
    ("two Content-Lengths equal", _post(b"Content-Length: 5", b"Content-Length: 5", body=b"hello")),
    ("Content-Length list", _post(b"Content-Length: 5, 5", body=b"hello")),
    ("Content-Length with a sign", _post(b"Content-Length: +5", body=b"hello")),
    ("Content-Length with a space inside", _post(b"Content-Length: 5 0", body=b"hello")),
    ("Content-Length not a number", _post(b"Content-Length: 5x", body=b"hello")),
    ("Content-Length of 19 digits", _post(b"Content-Length: " + b"9" * 19)),
    ("whitespace before the colon", _post(b"Content-Length : 5", body=b"hello")),
    ("TE: a second coding", _post(b"Transfer-Encoding: gzip, chunked", body=b"0\r\n\r\n")),
    ("TE: chunked then identity", _post(b"Transfer-Encoding: chunked, identity", body=b"0\r\n\r\n")),
    ("TE: xchunked", _post(b"Transfer-Encoding: xchunked", body=b"0\r\n\r\n")),
    ("TE twice", _post(CHUNKED, CHUNKED, body=b"0\r\n\r\n")),
    ("TE in obs-fold", _post(b"Transfer-Encoding:", b" chunked", body=b"0\r\n\r\n")),
    ("obs-fold in another header", _post(b"X-Note: a", b"\tb", b"Content-Length: 0")),
    ("TE in HTTP/1.0", _post(CHUNKED, body=b"0\r\n\r\n", version=b"HTTP/1.0")),
    ("chunk size 2^64", _post(CHUNKED, body=b"10000000000000000\r\nab\r\n0\r\n\r\n")),
    ("chunk size of 21 digits, zero-padded", _post(CHUNKED, body=b"0" * 20 + b"1\r\na\r\n0\r\n\r\n")),
    ("chunk size over the limit", _post(CHUNKED, body=b"%x\r\nab\r\n0\r\n\r\n" % (MAX_CHUNK_BYTES + 1))),
    ("chunk size not hex", _post(CHUNKED, body=b"zz\r\nab\r\n0\r\n\r\n")),
    ("chunk size negative", _post(CHUNKED, body=b"-2\r\nab\r\n0\r\n\r\n")),
    ("chunk size 0x-prefixed", _post(CHUNKED, body=b"0x2\r\nab\r\n0\r\n\r\n")),
    ("chunk size empty", _post(CHUNKED, body=b"\r\nab\r\n0\r\n\r\n")),
    ("chunk extension of 2,000 bytes", _post(CHUNKED, body=b"2;a=" + b"b" * 2000 + b"\r\nab\r\n0\r\n\r\n")),
    ("chunk extension malformed", _post(CHUNKED, body=b"2;=\r\nab\r\n0\r\n\r\n")),
    ("chunk data too long for its size", _post(CHUNKED, body=b"2\r\nabc\r\n0\r\n\r\n")),
    ("bare LF in a chunk-size line", _post(CHUNKED, body=b"2\nab\r\n0\r\n\r\n")),
    ("bare LF in the trailers", _post(CHUNKED, body=b"0\r\nX-T: 1\n\r\n")),
    ("bare LF ending a header", b"POST /v1/completions HTTP/1.1\r\nHost: x\nContent-Length: 0\r\n\r\n"),
    ("bare LF ending the request line", b"GET /health HTTP/1.1\nHost: x\r\n\r\n"),
    ("bare LF everywhere", b"GET /health HTTP/1.1\nHost: x\n\n"),
    ("bare CR in a header", b"GET /health HTTP/1.1\r\nHost: x\rX-A: 1\r\n\r\n"),
    ("empty line before the request line", b"\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n"),
]
# framings that must pass untouched (each followed by SMUGGLED, which is then a plain pipelined request)
FINE = [
    ("Content-Length", _post(b"Content-Length: 5", body=b"hello")),
    ("Content-Length with spaces around it", _post(b"Content-Length:   5\t", body=b"hello")),
    ("chunked", _post(CHUNKED, body=b"5\r\nhello\r\n0\r\n\r\n")),
    (
        "chunked, upper-case coding and hex",
        _post(b"Transfer-Encoding: CHUNKED", body=b"A\r\n0123456789\r\n0\r\n\r\n"),
    ),
    ("chunked with extensions", _post(CHUNKED, body=b'5;a=b;c="d e" ;f\r\nhello\r\n0;x=y\r\n\r\n')),
    ("chunked with trailers", _post(CHUNKED, body=b"5\r\nhello\r\n0\r\nX-T: 1\r\nX-U: 2\r\n\r\n")),
    ("no body", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"),
]


def _feed(data: bytes, step: int) -> tuple[bytes, str | None, RequestFraming]:
    framing, out, problem = RequestFraming(), b"", None
    for i in range(0, len(data), step):
        got, problem = framing.feed(data[i : i + step])
        out += got
    return out, problem, framing


@pytest.mark.parametrize("step", [10**9, 1, 7], ids=["whole", "byte by byte", "7 at a time"])
@pytest.mark.parametrize("name,data", HOSTILE, ids=[n for n, _ in HOSTILE])
def test_framing_refuses_and_hands_on_nothing_after(name, data, step):
    out, problem, _ = _feed(data + SMUGGLED, step)
    assert problem is not None, name
    assert data.startswith(out) and len(out) < len(data)  # what came before the fault, nothing after


@pytest.mark.parametrize("step", [10**9, 1, 7], ids=["whole", "byte by byte", "7 at a time"])
@pytest.mark.parametrize("name,data", FINE, ids=[n for n, _ in FINE])
def test_framing_hands_on_well_framed_requests_untouched(name, data, step):
    out, problem, framing = _feed(data + SMUGGLED + data, step)
    assert problem is None and out == data + SMUGGLED + data and framing.held == 0


def test_a_head_over_the_limit_is_refused_before_it_ends():
    framing = RequestFraming(max_head_bytes=1024)
    out, problem = framing.feed(b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 2000)
    assert out == b"" and problem is not None and "over 1024 bytes" in problem
    assert framing.feed(b"\r\n\r\n" + SMUGGLED) == (b"", problem)  # nothing after a refusal, ever


# -- over sockets ------------------------------------------------------------------------------------------
def _exchange(port: int, data: bytes, wait: float = 8.0) -> tuple[bytes, bool, float]:
    """Send ``data`` at once; everything the server sends back, whether it then closed (EOF), and when."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        started = time.monotonic()
        s.sendall(data)
        got, closed = b"", False
        s.settimeout(wait)
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    closed = True
                    break
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return got, closed, time.monotonic() - started


def _statuses(reply: bytes) -> list[bytes]:
    return [part.split(b"\r\n", 1)[0] for part in reply.split(b"HTTP/1.1 ")[1:]]


class _Recorder:
    """An ASGI app that answers every request 200 with its path, and records the paths it served."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                break
        if message["type"] == "http.disconnect":
            return
        self.paths.append(scope["path"])
        out = f"{scope['path']} {len(body)}".encode()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(out))]}
        )
        await send({"type": "http.response.body", "body": out})


@pytest.fixture(scope="module")
def guarded():
    """uvicorn with kvlab's protocol on a free port, in a thread of this process: (port, recorder)."""
    app = _Recorder()
    guard = ConnectionGuard(ConnectionLimits(header_timeout=20, body_timeout=20, idle_timeout=20))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=protocol_class(guard), log_config=None, log_level="warning"
    )
    server = GuardedServer(config, guard)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield port, app
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.parametrize("name,data", HOSTILE, ids=[n for n, _ in HOSTILE])
def test_uvicorn_with_kvlabs_protocol_answers_400_closes_and_never_serves_what_follows(guarded, name, data):
    port, app = guarded
    before = len(app.paths)
    reply, closed, took = _exchange(port, data + SMUGGLED)
    assert _statuses(reply) == [b"400 Bad Request"] and b'"code": "bad_framing"' in reply, reply[:300]
    assert closed and took < 3.0, (closed, took)
    time.sleep(0.05)
    assert "/health" not in app.paths[before:], app.paths[before:]


@pytest.mark.parametrize("name,data", FINE, ids=[n for n, _ in FINE])
def test_uvicorn_with_kvlabs_protocol_serves_well_framed_pipelined_requests(guarded, name, data):
    port, app = guarded
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data + SMUGGLED)
        reply = b""
        while reply.count(b"HTTP/1.1 200") < 2 or not reply.endswith(b"/health 0"):
            chunk = s.recv(65536)
            assert chunk, reply
            reply += chunk
    assert _statuses(reply) == [b"200 OK", b"200 OK"]


def test_a_bad_request_pipelined_after_a_good_one_is_refused_after_its_reply(guarded):
    port, app = guarded
    good = _post(b"Content-Length: 2", body=b"hi")
    reply, closed, _ = _exchange(port, good + HOSTILE[0][1] + SMUGGLED)
    assert _statuses(reply) == [b"200 OK", b"400 Bad Request"] and closed, reply[:400]


# -- kvlab serve itself ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("framing"))
    yield s
    s.stop()


def test_kvlab_serve_answers_400_closes_and_never_serves_what_follows(server):
    slow = {}
    for name, data in HOSTILE:
        reply, closed, took = _exchange(server.port, data + SMUGGLED)
        assert _statuses(reply) == [b"400 Bad Request"] and closed, (name, reply[:300])
        if took >= 3.0:
            slow[name] = round(took, 2)
    assert not slow, slow  # the 2^64 chunk size got no reply within 8 s
    reply, closed, _ = _exchange(server.port, SMUGGLED.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
    assert _statuses(reply) == [b"200 OK"]  # the server is fine, and /health answers when asked properly
    log = server.log.read_text()
    assert "refusing a request with 400" in log and "Traceback" not in log
