"""Strict HTTP/1.1 request framing (RFC 9112), checked on a connection's raw bytes before h11 parses them.

h11 (under uvicorn) lets through framings that a proxy in front of the server may read differently, which
is how requests are smuggled: both ``Content-Length`` and ``Transfer-Encoding`` (h11 frames by the
latter; a proxy framing by the former sees a second request in the body), a ``Content-Length`` list
(``0, 0``), a header continued on the next line (obs-fold), lines ending in a bare LF, chunk extensions of
any length; and it waits for the bytes of any chunk size (``10000000000000000``: 2^64) until the body
timeout. :class:`RequestFraming` follows the stream request by request: it holds each request head until
it is whole and checked, then hands it on, and hands on the body as it arrives while checking its
framing (``Content-Length`` bytes, or each chunk-size line, chunk end and trailer section). The first
byte that breaks a rule ends the stream: what came before it is handed on, nothing after it ever is, and
the caller answers 400 and closes the connection (RFC 9112 section 6.1: a server that cannot frame a
request must close it).

Refused: ``Content-Length`` together with ``Transfer-Encoding``; more than one ``Content-Length`` (equal
or not) or one that is not 1 to 18 digits (a sign, a space inside, a list); ``Transfer-Encoding`` other
than exactly ``chunked`` (another coding, ``xchunked``, two headers), or in an HTTP/1.0 request; a header
line starting with a space or tab (obs-fold) or with whitespace before its colon; a CR or LF that is not
part of CRLF anywhere in a head, a chunk-size line or the trailers; an empty line before the request
line; a head over ``max_head_bytes``; a chunk size that is not 1 to 16 hex digits (a sign, ``0x``, none),
or over ``MAX_CHUNK_BYTES``; a chunk-size line over ``MAX_CHUNK_LINE`` bytes (extensions included) or
with a malformed extension; chunk data not followed by CRLF.
"""

from __future__ import annotations

import re

MAX_CHUNK_BYTES = 2**31  # one chunk; the app's body limit (1 MiB by default) applies to the body after it
MAX_CHUNK_LINE = 1024  # a chunk-size line with its extensions and CRLF
DEFAULT_MAX_HEAD_BYTES = 16 * 1024  # h11's default bound on an incomplete head (uvicorn's too)

_BARE_CR_OR_LF = re.compile(rb"(?<!\r)\n|\r(?=[^\n])")  # a CR at the very end may await its LF
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_CHUNK_LINE = re.compile(
    rb"([0-9A-Fa-f]{1,16})"  # chunk-size
    rb"((?:[ \t]*;[ \t]*" + _TOKEN + rb"(?:[ \t]*=[ \t]*(?:" + _TOKEN + rb'|"(?:[^"\\\r\n]|\\[^\r\n])*"))?)*)'
    rb"[ \t]*\r\n"
)
_DIGITS = re.compile(rb"[0-9]{1,18}")
_HEX_17 = re.compile(rb"[0-9A-Fa-f]{17}")

HEAD, BODY, CHUNK_SIZE, CHUNK_DATA, CHUNK_END, TRAILERS = (
    "head",
    "body",
    "chunk size",
    "chunk data",
    "chunk end",
    "trailers",
)


class RequestFraming:
    """One connection's request framing, fed its bytes in order (see the module's docstring)."""

    def __init__(self, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES) -> None:
        self.max_head_bytes = max_head_bytes
        self.state = HEAD
        self.problem: str | None = None  # set once the stream broke a rule: nothing more is handed on
        self._buf = bytearray()  # a head, chunk-size line, chunk end or trailer section not yet whole
        self._left = 0  # body or chunk bytes still to come

    @property
    def held(self) -> int:
        """Bytes received and not yet handed on (a request head, or a line of a chunked body, in part)."""
        return len(self._buf)

    def feed(self, data: bytes) -> tuple[bytes, str | None]:
        """The bytes that may be parsed now, and why the stream was refused (None while it is fine). Once
        refused, every later call hands on nothing."""
        if self.problem is not None:
            return b"", self.problem
        out: list[bytes] = []
        view = memoryview(data)
        try:
            while view:
                view = self._step(view, out)
        except _Refused as exc:
            self.problem = str(exc)
            self._buf.clear()
        return b"".join(out), self.problem

    # -- one state's worth of bytes; returns what is left of ``data`` ---------------------------------------
    def _step(self, data: memoryview, out: list[bytes]) -> memoryview:
        if self.state in (BODY, CHUNK_DATA):
            take = min(self._left, len(data))
            out.append(bytes(data[:take]))
            self._left -= take
            if self._left == 0:
                self.state = HEAD if self.state == BODY else CHUNK_END
            return data[take:]
        if self.state == CHUNK_END:
            take = min(2 - len(self._buf), len(data))
            self._buf += data[:take]
            if len(self._buf) == 2:
                if self._buf != b"\r\n":
                    raise _Refused("chunk data not followed by CRLF")
                out.append(bytes(self._buf))
                self._buf.clear()
                self.state = CHUNK_SIZE
            return data[take:]
        return self._line_step(data, out)

    def _line_step(self, data: memoryview, out: list[bytes]) -> memoryview:
        """A head, chunk-size line or trailer section: held until its end (``\\r\\n\\r\\n``, or ``\\r\\n`` for
        a chunk-size line and an empty trailer section), then checked and handed on."""
        start = max(0, len(self._buf) - 3)  # the end may straddle two reads
        self._buf += data
        line = self.state == CHUNK_SIZE
        end = -1
        if self.state == TRAILERS and self._buf[:2] == b"\r\n":
            end = 2
        else:
            at = self._buf.find(b"\r\n" if line else b"\r\n\r\n", start)
            end = -1 if at < 0 else at + (2 if line else 4)
        whole = bytes(self._buf[:end]) if end >= 0 else bytes(self._buf)
        bad = _BARE_CR_OR_LF.search(whole)
        if bad is not None:
            raise _Refused(
                f"a bare {'LF' if whole[bad.start()] == 10 else 'CR'} in the {self.state} (CRLF only)"
            )
        limit = MAX_CHUNK_LINE if line else self.max_head_bytes
        if (end if end >= 0 else len(self._buf)) > limit:
            raise _Refused(f"the {self.state} {'line ' if line else ''}is over {limit} bytes")
        if end < 0:
            return memoryview(b"")
        rest = memoryview(bytes(self._buf[end:]))
        self._buf.clear()
        if self.state == HEAD:
            self._head(whole)
        elif line:
            self._chunk_size(whole)
        else:
            self._fields(whole[:-2].split(b"\r\n") if len(whole) > 2 else [])
            self.state = HEAD
        out.append(whole)
        return rest

    def _head(self, head: bytes) -> None:
        """Check a whole request head; set up its body's framing."""
        lines = head[:-4].split(b"\r\n")
        if not lines[0]:
            raise _Refused("an empty line before the request line")
        fields = self._fields(lines[1:])
        lengths, codings = fields.get(b"content-length", []), fields.get(b"transfer-encoding", [])
        if lengths and codings:
            raise _Refused("both Content-Length and Transfer-Encoding")
        if codings:
            if lines[0].endswith(b" HTTP/1.0"):
                raise _Refused("Transfer-Encoding in an HTTP/1.0 request")
            if len(codings) > 1 or codings[0].lower() != b"chunked":
                raise _Refused("Transfer-Encoding other than exactly 'chunked'")
            self.state = CHUNK_SIZE
            return
        if len(lengths) > 1:
            raise _Refused("more than one Content-Length")
        if lengths and not _DIGITS.fullmatch(lengths[0]):
            raise _Refused("a Content-Length that is not 1 to 18 digits")
        self._left = int(lengths[0]) if lengths else 0
        self.state = BODY if self._left else HEAD

    @staticmethod
    def _fields(lines: list[bytes]) -> dict[bytes, list[bytes]]:
        """Field lines (a head's or trailers') by lower-case name, values stripped of their spaces and tabs."""
        fields: dict[bytes, list[bytes]] = {}
        for raw in lines:
            if raw[:1] in (b" ", b"\t"):
                raise _Refused("a header line continued on the next (obs-fold)")
            name, colon, value = raw.partition(b":")
            if colon and name != name.strip(b" \t"):
                raise _Refused("whitespace before a header's colon")
            fields.setdefault(name.lower(), []).append(value.strip(b" \t"))
        return fields

    def _chunk_size(self, line: bytes) -> None:
        if _HEX_17.match(line):
            raise _Refused("a chunk size of more than 16 hex digits")
        match = _CHUNK_LINE.fullmatch(line)
        if match is None:
            raise _Refused("a chunk-size line that is not 1 to 16 hex digits and well-formed extensions")
        size = int(match.group(1), 16)
        if size > MAX_CHUNK_BYTES:
            raise _Refused(f"a chunk of {size} bytes (at most {MAX_CHUNK_BYTES})")
        self._left = size
        self.state = CHUNK_DATA if size else TRAILERS


class _Refused(Exception):
    pass
