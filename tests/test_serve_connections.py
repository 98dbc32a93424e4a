"""Connection hygiene of ``kvlab serve`` (``kvlab/serve/connections.py``): real server subprocesses on
127.0.0.1 under ``ulimit -n 256``, driven by raw sockets (idle, trickling, stalled clients) and by plain
HTTP requests that must still get through. One server has long timeouts (its caps are what close
connections), the other short ones (head 2 s, body 2 s, idle 1 s) to keep the file quick.
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlab.serve.connections import (
    _BACKOFF_MAX,
    _BACKOFF_MIN,
    Acceptor,
    ConnectionGuard,
    ConnectionLimits,
    RateLimitFilter,
)

MODEL = "smollm2-135m"
KEY = "conn-test-key-123"
NOFILE = 256
HEAD_S, BODY_S, IDLE_S = 2.0, 2.0, 1.0
PER_CLIENT = 100
MAX_TOKENS = 400


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


class Server:
    """``kvlab serve`` in a subprocess whose open-file limit is ``NOFILE`` (as tests/test_serve.py's)."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.port = _free_port()
        self.log = tmp / f"serve-{self.port}.log"
        cmd = [sys.executable, "-m", "kvlab", "serve", "--port", str(self.port), "--window", "96"]
        cmd += ["--api-key", KEY, *args]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_limit_fds
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvlab serve exited: {self.log.read_text()[-2000:]}")
            try:
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"kvlab serve did not start: {self.log.read_text()[-2000:]}")

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 60):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        try:
            conn.request(method, path, body=json.dumps(body) if body else None, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def connect(self, source: str = "127.0.0.1") -> socket.socket:
        s = socket.socket()
        s.bind((source, 0))
        s.settimeout(10)
        s.connect(("127.0.0.1", self.port))
        return s

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two servers started side by side: ``capped`` (long timeouts: only the caps close connections) and
    ``timed`` (head 2 s, body 2 s, idle 1 s)."""
    tmp = tmp_path_factory.mktemp("serve-conn")
    capped = Server(tmp, "--max-connections-per-client", str(PER_CLIENT), "--idle-timeout", "60")
    timeouts = ("--header-timeout", str(HEAD_S), "--body-timeout", str(BODY_S), "--idle-timeout", str(IDLE_S))
    timed = Server(tmp, *timeouts, "--max-tokens", str(MAX_TOKENS))
    try:
        capped.wait_ready()
        timed.wait_ready()
        yield capped, timed
    finally:
        capped.stop()
        timed.stop()
    for s in (capped, timed):
        log = s.log.read_bytes()
        assert len(log) < 1 << 20 and b"Traceback" not in log, log[-3000:]


@pytest.fixture
def capped(servers):
    return servers[0]


@pytest.fixture
def server(servers):
    return servers[1]


def _closed_by_server(s: socket.socket, wait: float) -> tuple[bool, bytes, float]:
    """Wait up to ``wait`` s for the server to close ``s``: (closed, what it sent, seconds waited)."""
    t0 = time.monotonic()
    s.settimeout(wait)
    got = b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except TimeoutError:
        return False, got, time.monotonic() - t0
    except ConnectionResetError:
        pass
    return True, got, time.monotonic() - t0


def _is_closed(s: socket.socket) -> bool:
    """Whether the server has closed ``s`` (or written to it), without waiting."""
    timeout = s.gettimeout()
    s.setblocking(False)
    try:
        s.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    except OSError:
        pass
    finally:
        s.settimeout(timeout)
    return True


def _chat(n: int = 8, **kw) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story about a dragon who learns to count."}],
        "max_tokens": n,
        "temperature": 0,
        **kw,
    }


def test_300_idle_connections_under_ulimit_256_leave_health_and_chat_answering(capped):
    """The issue's case: 300 idle connections against a process allowed 256 files. The server keeps its
    descriptors under the limit by closing the oldest idle connections, and a new request still answers."""
    socks = []
    for i in range(300):  # three client addresses, 100 each (the per-client cap): the total cap rules
        socks.append(capped.connect(f"127.0.0.{2 + i // 100}"))
    assert capped.open_fds() < NOFILE
    t0 = time.monotonic()
    assert capped.request("GET", "/health", timeout=10)[0] == 200
    health_s = time.monotonic() - t0
    t0 = time.monotonic()
    status, data = capped.request("POST", "/v1/chat/completions", _chat(2), timeout=10)
    chat_s = time.monotonic() - t0
    assert status == 200, data
    assert health_s < 2 and chat_s < 2, (health_s, chat_s)
    # the oldest were closed at the cap: the server never held them all
    closed = sum(_is_closed(s) for s in socks[:100])
    assert closed == 100
    for s in socks:
        s.close()
    assert capped.open_fds() < NOFILE
    log = capped.log.read_bytes()
    assert b"(connection cap)" in log and b"accept() failed" not in log, log[-2000:]
    assert len(log) < 1 << 20


def test_per_client_cap_closes_the_clients_oldest_idle_connection(capped):
    socks = [capped.connect("127.0.0.9") for _ in range(PER_CLIENT + 5)]
    time.sleep(0.2)
    closed = [_is_closed(s) for s in socks]
    assert closed == [True] * 5 + [False] * PER_CLIENT  # the oldest five closed, the newest still open
    # a request from the same address still gets through (it closes the oldest idle one instead)
    s = capped.connect("127.0.0.9")
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    closed, got, _ = _closed_by_server(s, 5)
    assert closed and got.startswith(b"HTTP/1.1 200"), got[:200]
    for s in socks:
        s.close()


def test_slowloris_is_cut_at_the_header_timeout(server):
    s = server.connect()
    t0 = time.monotonic()
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 200
    for i in range(len(head)):
        try:
            s.sendall(head[i : i + 1])
        except OSError:
            break
        s.settimeout(0.1)
        try:
            if s.recv(4096, socket.MSG_PEEK) is not None:
                break
        except TimeoutError:
            continue
        except OSError:
            break
    closed, got, _ = _closed_by_server(s, 5)
    elapsed = time.monotonic() - t0
    assert closed and got.startswith(b"HTTP/1.1 408"), got[:200]
    assert HEAD_S - 0.2 < elapsed < HEAD_S + 1.5, elapsed
    s.close()


def test_stalled_body_is_cut_at_the_body_timeout(server):
    s = server.connect()
    t0 = time.monotonic()
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b'\r\nContent-Length: 200\r\n\r\n{"model": '
    )
    closed, got, _ = _closed_by_server(s, 5)
    elapsed = time.monotonic() - t0
    assert closed and got.startswith(b"HTTP/1.1 408"), got[:200]
    assert BODY_S - 0.2 < elapsed < BODY_S + 1.5, elapsed
    s.close()


def test_idle_connections_are_closed_after_the_idle_timeout(server):
    fresh = server.connect()  # sends nothing at all
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().read()
    conn.request("GET", "/health")  # keep-alive: the same connection serves a second request
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read()
    assert conn.sock is not None
    closed, got, waited = _closed_by_server(conn.sock, 5)
    assert closed and got == b"" and IDLE_S - 0.2 < waited < IDLE_S + 1.5, waited
    closed, got, _ = _closed_by_server(fresh, 5)
    assert closed and got == b""
    conn.close()
    fresh.close()


def test_requests_longer_than_the_idle_timeout_are_not_cut(server):
    """A non-streaming request waiting silently for the engine, and an SSE stream, each lasting several
    idle timeouts (and more than the header and body timeouts), complete."""
    t0 = time.monotonic()
    status, data = server.request("POST", "/v1/chat/completions", _chat(16), timeout=120)
    assert status == 200, data
    per_token = (time.monotonic() - t0) / 16
    n = min(MAX_TOKENS, max(16, int(4.0 / per_token)))  # about 4 s of decoding on this machine
    t0 = time.monotonic()
    status, data = server.request("POST", "/v1/chat/completions", _chat(n), timeout=120)
    plain_s = time.monotonic() - t0
    assert status == 200, data
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    t0 = time.monotonic()
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(_chat(n, stream=True)),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    body = resp.read()
    stream_s = time.monotonic() - t0
    conn.close()
    assert body.rstrip().endswith(b"data: [DONE]")
    assert min(plain_s, stream_s) > max(HEAD_S, BODY_S, 2 * IDLE_S), (n, plain_s, stream_s)


def test_bad_settings_are_one_line_and_exit_2(capsys, monkeypatch):
    """Checked before the model loads: a timeout out of range, a cap the open-file limit cannot hold."""
    from kvlab import cli
    from kvlab.serve import connections

    monkeypatch.setattr(connections, "fd_soft_limit", lambda: NOFILE)
    base = ["serve", "--port", str(_free_port())]
    for args, says in (
        (["--idle-timeout", "0"], "--idle-timeout"),
        (["--header-timeout", "-1"], "--header-timeout"),
        (["--max-connections-per-client", "0"], "--max-connections-per-client"),
        (["--max-connections", "1000"], f"ulimit -n {NOFILE}"),
    ):
        assert cli.main(base + args) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and says in err, err
    monkeypatch.setattr(connections, "fd_soft_limit", lambda: 64)  # too low for any connection
    assert cli.main(base) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "raise it to at least" in err, err


# -- in-process: the accept loop and the log's rate limit -----------------------------------------------
class _FullSocket:
    """A listening socket whose accept() fails as a process out of descriptors does."""

    def __init__(self) -> None:
        self.accepts = 0
        self._r, self._w = socket.socketpair()
        self._w.send(b"x")  # always readable, as a listening socket with a backlog is

    def fileno(self) -> int:
        return self._r.fileno()

    def accept(self):
        self.accepts += 1
        raise OSError(errno.EMFILE, "Too many open files")

    def close(self) -> None:
        self._r.close()
        self._w.close()


def test_accept_out_of_descriptors_backs_off_and_logs_once(caplog):
    async def run() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        sock = _FullSocket()
        acceptor = Acceptor(loop, sock, lambda: asyncio.Protocol(), ConnectionGuard(ConnectionLimits()))
        acceptor.start()
        await asyncio.sleep(1.0)
        backoff = acceptor._backoff
        acceptor.close()
        sock.close()
        return sock.accepts, backoff

    handler = logging.StreamHandler()
    handler.addFilter(RateLimitFilter())
    with caplog.at_level(logging.WARNING, logger="kvlab.serve.connections"):
        accepts, backoff = asyncio.run(run())
    # 50 ms doubling: accept() tried at 0, 0.05, 0.15, 0.35, 0.75 s; never a busy loop
    assert 3 <= accepts <= 6, accepts
    assert _BACKOFF_MIN < backoff <= _BACKOFF_MAX
    assert all("accept() failed" in r.getMessage() for r in caplog.records)
    kept = [r for r in caplog.records if handler.filter(r)]
    assert len(kept) == 1  # one line per kind per period


def test_rate_limit_filter_counts_what_it_suppressed():
    f = RateLimitFilter(period=0.2)
    rec = lambda: logging.LogRecord("x", logging.WARNING, __file__, 1, "boom %s", ("a",), None)  # noqa: E731
    assert f.filter(rec())
    assert not any(f.filter(rec()) for _ in range(999))
    info = logging.LogRecord("x", logging.INFO, __file__, 1, "boom %s", ("a",), None)
    assert f.filter(info)  # below WARNING: untouched
    time.sleep(0.25)
    r = rec()
    assert f.filter(r) and "999 more like this suppressed" in r.getMessage()


class _Conn:
    """What the guard needs of a connection: its address, when it began waiting, ``close_now``."""

    def __init__(self, guard: ConnectionGuard, host: str, t: float) -> None:
        self.guard, self.host, self.waiting_since, self.closed, self.farewell = guard, host, t, False, b""

    def close_now(self, farewell: bytes = b"") -> None:
        self.closed, self.farewell = True, farewell
        self.guard.closing(self)


def test_guard_closes_the_oldest_waiting_connection_and_refuses_only_when_all_are_busy():
    guard = ConnectionGuard(ConnectionLimits(max_connections=3, max_per_client=1))
    a, b, c = (_Conn(guard, h, t) for h, t in (("a", 1), ("b", 2), ("c", 3)))
    for conn in (a, b, c):
        assert guard.opened(conn)
    guard.set_waiting(b, True)
    guard.set_waiting(a, True)  # a began waiting after b: b is the oldest waiting
    d = _Conn(guard, "d", 4)
    assert guard.opened(d) and b.closed and not a.closed
    a2 = _Conn(guard, "a", 5)  # over a's own cap (1): a's waiting connection goes
    assert guard.opened(a2) and a.closed and guard.by_client["a"] == {a2: None}
    e = _Conn(guard, "e", 6)  # c, d, a2 are all busy: refused with a 503
    assert not guard.opened(e) and e.closed and e.farewell.startswith(b"HTTP/1.1 503")
    assert len(guard.live) == 3 and guard.counts == {"evicted": 2, "refused": 1}
