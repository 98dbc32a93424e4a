"""Connection hygiene for ``kvlab serve``: timeouts, connection caps, an accept loop that cannot spin, quiet logs.

uvicorn alone closes an idle keep-alive connection (``timeout_keep_alive``) but gives a request head or
body as long as the client likes (a client trickling its headers one byte at a time holds its connection
forever), caps nothing, and on Python 3.11 asyncio's accept loop answers ``EMFILE`` by logging a traceback
per failed ``accept()`` up to ``backlog`` (2,048) times per event-loop pass. Here:

- :class:`GuardedH11Protocol` (uvicorn's h11 protocol plus a per-connection deadline): a connection that
  has sent nothing of its next request is *idle* (closed after ``idle_timeout``); once a request has
  begun its head must be complete within ``header_timeout`` (counted from the connection's opening for
  its first request, from the first byte for later ones; then a 408) and its body within
  ``body_timeout`` of the head (then a 408). A complete request (waiting for the engine, streaming) has
  no deadline.
- :class:`ConnectionGuard`: at most ``max_per_client`` connections per client address and
  ``max_connections`` in all. A connection over either cap closes the oldest connection that has not sent
  a complete request (idle or trickling) of that client, or of anyone; only when every such connection is
  busy with a request is the newcomer refused (a 503 with ``Retry-After``, written without parsing).
- :class:`Acceptor`: accepts while the connections' file descriptors stay within ``fd_budget`` (the cap
  plus room for connections being closed), pauses until one closes otherwise, and on ``EMFILE`` and its
  kin closes the oldest waiting connection and backs off (50 ms doubling to 1 s) instead of retrying.
- :func:`setup_logging`: one line per kind of warning or error per ``LOG_PERIOD`` seconds, then a count
  of those suppressed; event-loop errors about sockets are one line, never a traceback.

The total cap derives from ``RLIMIT_NOFILE`` (:func:`resolve_max_connections`): the soft limit less the files
already open, ``FD_RESERVE`` for the store's files, Redis, logs and model files, and ``CLOSING_SLACK``.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvlab.errors import BadInputError
from kvlab.serve.framing import DEFAULT_MAX_HEAD_BYTES, RequestFraming

log = logging.getLogger("kvlab.serve.connections")

FD_RESERVE = 64  # descriptors kept for everything but connections: store files, Redis, logs, model files
CLOSING_SLACK = 16  # connections closed (evicted) but whose descriptor the loop releases on its next pass
DEFAULT_MAX_CONNECTIONS = 1024
MIN_CONNECTIONS = 8
LOG_PERIOD = 10.0
_ACCEPT_BATCH = 32
_BACKOFF_MIN, _BACKOFF_MAX = 0.05, 1.0
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

_REFUSED = b"503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1"
_TIMEOUT = b"408 Request Timeout\r\ncontent-type: application/json"
_BAD_FRAMING = b"400 Bad Request\r\ncontent-type: application/json"


def _raw_response(head: bytes, message: str, code: str, kind: str = "server_error") -> bytes:
    """A whole response, written without the HTTP stack: ``head`` (status and headers) and a JSON error."""
    error = {"message": message, "type": kind, "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    return b"HTTP/1.1 %s\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (head, len(body), body)


# -- limits ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    idle_timeout: float = 5.0
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_per_client: int = 64

    @property
    def fd_budget(self) -> int:
        """Descriptors the connections may hold at once (open ones and those being closed)."""
        return self.max_connections + CLOSING_SLACK


def fd_soft_limit() -> int | None:
    """The process's ``RLIMIT_NOFILE`` soft limit, or None where there is none (or no ``resource``)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def open_fd_count() -> int:
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 0


def resolve_max_connections(requested: int | None) -> int:
    """``--max-connections``: the value given, or ``min(1024, what RLIMIT_NOFILE allows)``; a value the
    limit cannot hold (or a limit too low for ``MIN_CONNECTIONS``) is a one-line :class:`BadInputError`."""
    soft = fd_soft_limit()
    # the most connections the limit allows with the reserve kept (None: no limit)
    ceiling = None if soft is None else soft - open_fd_count() - FD_RESERVE - CLOSING_SLACK
    if soft is not None and ceiling is not None and ceiling < MIN_CONNECTIONS:
        raise BadInputError(
            f"the open-file limit (ulimit -n {soft}) leaves room for {max(ceiling, 0)} connections "
            f"({FD_RESERVE + CLOSING_SLACK} descriptors are kept for files); raise it to at least "
            f"{soft - ceiling + MIN_CONNECTIONS}"
        )
    if requested is None:
        return DEFAULT_MAX_CONNECTIONS if ceiling is None else min(DEFAULT_MAX_CONNECTIONS, ceiling)
    if ceiling is not None and requested > ceiling:
        raise BadInputError(
            f"--max-connections {requested} needs more file descriptors than the open-file limit "
            f"(ulimit -n {soft}) allows: at most {ceiling} here; raise the limit or lower the cap"
        )
    return requested


# -- logging --------------------------------------------------------------------------------------------
class RateLimitFilter(logging.Filter):
    """Lets one record per kind through per ``period`` seconds; the next one let through says how many
    were dropped meanwhile. A kind is the record's ``kind`` attribute (``extra={"kind": ...}``), else its
    logger, level and message template. Records below WARNING pass untouched."""

    def __init__(self, period: float = LOG_PERIOD, max_kinds: int = 1000) -> None:
        super().__init__()
        self.period, self.max_kinds = period, max_kinds
        self._seen: dict[tuple, list[float]] = {}  # kind -> [since, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        kind = getattr(record, "kind", None)
        key = (kind,) if kind is not None else (record.name, record.levelno, str(record.msg)[:200])
        now = time.monotonic()
        slot = self._seen.get(key)
        if slot is not None and now - slot[0] < self.period:
            slot[1] += 1
            return False
        if slot is None and len(self._seen) >= self.max_kinds:
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.period}
        suppressed = int(slot[1]) if slot is not None else 0
        self._seen[key] = [now, 0]
        if suppressed:
            record.msg = f"{record.msg} [{suppressed} more like this suppressed]"
        return True


def setup_logging(level: int = logging.INFO) -> None:
    """The server's logging: one format on stderr, and every handler of the root logger rate-limited
    (uvicorn's loggers propagate to it: pass ``log_config=None`` to ``uvicorn.Config``)."""
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RateLimitFilter) for f in handler.filters):
            handler.addFilter(RateLimitFilter())


def _loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's errors as one line each (a traceback only for what is not a socket's error)."""
    exc = context.get("exception")
    message = str(context.get("message") or "event loop error").split("\n")[0][:200]
    if isinstance(exc, OSError):
        log.warning(
            "event loop: %s: %s", message, exc, extra={"kind": f"loop:{type(exc).__name__}:{exc.errno}"}
        )
    else:
        name = type(exc).__name__ if exc is not None else "none"
        log.error("event loop: %s", message, exc_info=exc, extra={"kind": f"loop:{name}"})


# -- the connections' registry --------------------------------------------------------------------------
class ConnectionGuard:
    """Every live connection of one server, by client address, and those waiting for a complete request
    (idle, or still sending their head or body) in the order they began waiting."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.live: dict[GuardedH11Protocol, None] = {}
        self.waiting: dict[GuardedH11Protocol, None] = {}
        self.by_client: dict[str, dict[GuardedH11Protocol, None]] = {}
        self.open_fds = 0  # connections whose socket is not yet closed (live ones and those closing)
        self.pending = 0  # accepted sockets whose protocol is not made yet
        self.counts: dict[str, int] = {}
        self._acceptors: list[Acceptor] = []

    def fds_in_use(self) -> int:
        return self.open_fds + self.pending

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def opened(self, conn: GuardedH11Protocol) -> bool:
        """Admit a new connection (closing the oldest waiting one over a cap); False: refused, closed."""
        self.open_fds += 1
        host = conn.host
        mine = self.by_client.setdefault(host, {})
        if len(mine) >= self.limits.max_per_client:
            victim = min((c for c in mine if c in self.waiting), key=lambda c: c.waiting_since, default=None)
            if victim is None:
                self._refuse(conn, f"client {host} has {len(mine)} connections, all busy")
                return False
            self._evict(victim, "per-client cap")
        if len(self.live) >= self.limits.max_connections:
            victim = next(iter(self.waiting), None)
            if victim is None:
                self._refuse(conn, f"{len(self.live)} connections, all busy")
                return False
            self._evict(victim, "connection cap")
        self.live[conn] = None
        # looked up afresh: evicting the client's last connection dropped its entry
        self.by_client.setdefault(host, {})[conn] = None
        return True

    def set_waiting(self, conn: GuardedH11Protocol, waiting: bool) -> None:
        if not waiting:
            self.waiting.pop(conn, None)
        elif conn in self.live and conn not in self.waiting:
            self.waiting[conn] = None

    def closing(self, conn: GuardedH11Protocol) -> None:
        """The connection no longer counts against the caps (its descriptor does until :meth:`closed`)."""
        self.live.pop(conn, None)
        self.waiting.pop(conn, None)
        mine = self.by_client.get(conn.host)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.by_client[conn.host]

    def closed(self, conn: GuardedH11Protocol) -> None:
        self.closing(conn)
        self.open_fds -= 1
        self.released()

    def released(self) -> None:
        """A descriptor was released or an accepted socket got its protocol: paused acceptors may go on."""
        for acceptor in self._acceptors:
            acceptor.resume_if_paused()

    def shed_oldest(self, why: str) -> bool:
        victim = next(iter(self.waiting), None)
        if victim is not None:
            self._evict(victim, why)
        return victim is not None

    def _evict(self, victim: GuardedH11Protocol, why: str) -> None:
        self.count("evicted")
        log.warning(
            "closing the oldest connection without a complete request (%s)",
            why,
            extra={"kind": f"evict:{why}"},
        )
        victim.close_now()

    def _refuse(self, conn: GuardedH11Protocol, why: str) -> None:
        self.count("refused")
        log.warning("refusing a connection with 503: %s", why, extra={"kind": "refuse"})
        conn.close_now(_raw_response(_REFUSED, "too many connections; retry later", "too_many_connections"))


# -- the protocol ---------------------------------------------------------------------------------------
IDLE, HEAD, BODY, ACTIVE = "idle", "head", "body", "active"


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline per state (see the module's docstring).

    Use :func:`protocol_class` to bind it to a :class:`ConnectionGuard`."""

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.host = ""
        self.state = ""
        self.waiting_since = 0.0
        self._opened_at = 0.0
        self._requests = 0  # request heads received on this connection
        self._deadline: asyncio.TimerHandle | None = None
        self._closing = False
        self._cycle_seen: object = None
        # every byte passes the strict framing check before h11 parses it (kvlab.serve.framing)
        limit = self.config.h11_max_incomplete_event_size
        self._framing = RequestFraming(DEFAULT_MAX_HEAD_BYTES if limit is None else limit)

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.host = self.client[0] if self.client else ""
        self._opened_at = self.loop.time()
        if self.guard.opened(self):
            self._sync()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self._closing = True
        self.guard.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._closing or self._framing.problem is not None:
            return
        if self.state == IDLE and data:
            self._enter(HEAD)
        checked, problem = self._framing.feed(data)
        if checked:  # never b"": h11 takes that for the end of the stream
            super().data_received(checked)
        if problem is not None:
            self.guard.count("bad_framing")
            log.warning("refusing a request with 400: %s", problem, extra={"kind": "framing"})
            self._refuse_framing()
        self._sync()

    # uvicorn hooks
    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._unset_keepalive_if_required()  # the idle deadline below replaces uvicorn's keep-alive timer
        if self._framing.problem is not None:
            self._refuse_framing()
        self._sync()

    def _refuse_framing(self) -> None:
        """Answer a request whose framing broke a rule with a 400 and close the connection, once the
        request before it (whole, and being answered) has its reply: nothing after it is parsed."""
        cycle, problem = self.cycle, self._framing.problem
        if self._closing or self.transport is None or self.transport.is_closing() or problem is None:
            return
        if cycle is not None and not cycle.response_complete and self.conn.their_state is h11.DONE:
            return  # on_response_complete comes back here
        farewell = b""
        if cycle is None or cycle.response_complete or not cycle.response_started:
            farewell = _raw_response(
                _BAD_FRAMING, f"bad request framing: {problem}", "bad_framing", "invalid_request_error"
            )
            if cycle is not None:
                cycle.response_started = True  # nothing else may be written
        self.close_now(farewell)

    # state
    def close_now(self, farewell: bytes = b"") -> None:
        """Close without waiting (with ``farewell`` written first: a raw response)."""
        if self._closing:
            return
        self._closing = True
        self._cancel_deadline()
        self.guard.closing(self)
        if self.transport is None:
            return
        if farewell and not self.transport.is_closing():
            self.transport.write(farewell)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's sends become no-ops; its receive() says disconnect
            self.cycle.message_event.set()
        self.transport.close()

    def _sync(self) -> None:
        """Derive the state from h11's and the request cycle's (after every event that may change it)."""
        if self._closing or self.transport is None or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and cycle is not self._cycle_seen:
            self._cycle_seen = cycle
            self._requests += 1
        if cycle is not None and not cycle.response_complete:
            state = BODY if cycle.more_body else ACTIVE
        elif self.conn.their_state is h11.SEND_BODY:  # answered before its body ended (a 401, a 413)
            state = BODY
        elif self.conn.their_state is h11.IDLE:
            waiting = self.conn.trailing_data[0] or self._framing.held
            state = HEAD if self.state == HEAD or waiting else IDLE
        else:
            state = ACTIVE
        if state != self.state:
            self._enter(state)

    def _enter(self, state: str) -> None:
        previous, self.state = self.state, state
        now = self.loop.time()
        limits = self.guard.limits
        waiting = state in (IDLE, HEAD, BODY)
        if waiting and previous not in (IDLE, HEAD, BODY):
            self.waiting_since = now
        self.guard.set_waiting(self, waiting)
        if state == IDLE:
            self._arm(now + limits.idle_timeout)
        elif state == HEAD:
            # the first request's head counts from the connection's opening, a later one's from its first byte
            start = self._opened_at if self._requests == 0 else now
            self._arm(start + limits.header_timeout)
        elif state == BODY:
            self._arm(now + limits.body_timeout)
        else:
            self._cancel_deadline()

    def _arm(self, when: float) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_at(when, self._expired)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self._closing:
            return
        state, limits = self.state, self.guard.limits
        self.guard.count(f"{state}_timeout")
        if state == IDLE:
            self.close_now()  # an idle connection is closed silently, as keep-alive expects
        elif state in (HEAD, BODY):
            which, timeout = (
                ("header", limits.header_timeout) if state == HEAD else ("body", limits.body_timeout)
            )
            message = "closing a connection whose request %s took over %g s (%s timeout)"
            log.warning(message, state, timeout, which, extra={"kind": f"timeout:{state}"})
            # a late head follows a request answered whole (or none); a late body has its 408 unless answered
            cycle, farewell = self.cycle, b""
            if state == HEAD or (cycle is not None and not cycle.response_started):
                farewell = _raw_response(_TIMEOUT, f"the request {state} took too long", f"{which}_timeout")
                if cycle is not None:
                    cycle.response_started = True  # nothing else may be written
            self.close_now(farewell)


def protocol_class(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """A :class:`GuardedH11Protocol` bound to ``guard`` (for ``uvicorn.Config(http=...)``)."""
    return type("KvlabH11Protocol", (GuardedH11Protocol,), {"guard": guard})


# -- accepting --------------------------------------------------------------------------------------------
class Acceptor:
    """Accepts connections on one listening socket for ``factory`` while the guard's descriptors allow;
    on ``EMFILE`` (and ``ENFILE``, ``ENOBUFS``, ``ENOMEM``) sheds the oldest waiting connection and backs off.
    It stands in for the ``asyncio.Server`` uvicorn would create (``close``, ``wait_closed``)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        factory: Callable[[], asyncio.Protocol],
        guard: ConnectionGuard,
    ) -> None:
        self.loop, self.sock, self.factory, self.guard = loop, sock, factory, guard
        self.sockets = [sock]
        self._reading = False
        self._paused_for_fds = False
        self._backoff = _BACKOFF_MIN
        self._retry: asyncio.TimerHandle | None = None
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        guard._acceptors.append(self)

    def start(self) -> None:
        if not self._closed and not self._reading:
            self.loop.add_reader(self.sock.fileno(), self._ready)
            self._reading = True

    def _stop_reading(self) -> None:
        if self._reading:
            self.loop.remove_reader(self.sock.fileno())
            self._reading = False

    def resume_if_paused(self) -> None:
        if self._paused_for_fds and self.guard.fds_in_use() < self.guard.limits.fd_budget:
            self._paused_for_fds = False
            self.start()

    def _ready(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            if self.guard.fds_in_use() >= self.guard.limits.fd_budget:
                # every descriptor is taken: wait for one to be released (closing one if none is closing)
                self._stop_reading()
                self._paused_for_fds = True
                if self.guard.pending == 0 and self.guard.open_fds <= len(self.guard.live):
                    self.guard.shed_oldest("no descriptor left for connections")
                return
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                self._backoff = _BACKOFF_MIN
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                self._failed(exc)
                return
            self._backoff = _BACKOFF_MIN
            conn.setblocking(False)
            self.guard.pending += 1
            task = self.loop.create_task(self._connect(conn))
            self._tasks.add(task)  # referenced until done (the loop holds tasks weakly)
            task.add_done_callback(self._tasks.discard)

    def _failed(self, exc: OSError) -> None:
        shed = exc.errno in _RESOURCE_ERRNOS and self.guard.shed_oldest("accept failed: out of descriptors")
        log.warning(
            "accept() failed (%s); retrying in %.2f s%s",
            exc,
            self._backoff,
            ", after closing the oldest waiting connection" if shed else "",
            extra={"kind": f"accept:{exc.errno}"},
        )
        self._stop_reading()
        self._retry = self.loop.call_later(self._backoff, self._retry_accept)
        self._backoff = min(self._backoff * 2, _BACKOFF_MAX)

    def _retry_accept(self) -> None:
        self._retry = None
        self.start()

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(self.factory, conn)
        except Exception as exc:  # pragma: no cover - a socket that died between accept and now
            conn.close()
            log.warning("a new connection failed: %s", exc, extra={"kind": "connect"})
        finally:
            self.guard.pending -= 1
            self.guard.released()

    # asyncio.Server's interface, as uvicorn's shutdown uses it
    def close(self) -> None:
        self._closed = True
        self._stop_reading()
        if self._retry is not None:
            self._retry.cancel()
        self.sock.close()

    async def wait_closed(self) -> None:
        return None


def listening_sockets(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Bound, listening, non-blocking sockets for every address ``host`` resolves to (as asyncio's
    ``create_server`` binds them)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    seen: set[tuple] = set()
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            if sys.platform != "win32":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


class GuardedServer(uvicorn.Server):
    """``uvicorn.Server`` listening through :class:`Acceptor` (the rest of its life cycle unchanged), with
    the event loop's errors logged one line each."""

    def __init__(self, config: uvicorn.Config, guard: ConnectionGuard) -> None:
        super().__init__(config)
        self.guard = guard

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        from uvicorn.config import STARTUP_FAILURE

        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)
        config = self.config
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_loop_exception_handler)

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=_loop
            )

        try:
            listeners = sockets or listening_sockets(config.host, config.port, config.backlog)
        except OSError as exc:
            log.error("cannot listen on %s:%s: %s", config.host, config.port, exc)
            await self.lifespan.shutdown()
            sys.exit(STARTUP_FAILURE)
        acceptors = [Acceptor(loop, sock, create_protocol, self.guard) for sock in listeners]
        for acceptor in acceptors:
            acceptor.start()
        self.servers = acceptors  # type: ignore[assignment]  # close() and wait_closed(), as uvicorn uses them
        self.started = True
