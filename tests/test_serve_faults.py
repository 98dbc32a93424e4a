"""``kvlab serve`` replicas and restarts on one store (issue 48 item 7): two replicas writing one disk store
and one Redis at once, a server stopped (SIGTERM, SIGKILL) with streams open and restarted on its store, and
a replica killed (SIGKILL) in the middle of its store writes.

Every server is a real ``kvlab serve`` subprocess on 127.0.0.1 running a tiny random-weight model from a
local folder (``tests/tiny_serve.py``: milliseconds a token, so the faults, not the model, take the time).
Replies are greedy with log-probabilities, and each is compared token for token (log-probabilities within
2e-3) with the same request served by a server that reused nothing: a wrong cache served would show there.
Deadlines are on progress (a stream must end, a block must appear), never on how fast a loaded machine is.
The store alone under kill -9 (four worker processes on one disk store and Redis, killed mid put and mid
lookup) is ``tests/test_store_soak.py``; a server killed mid stream, ``tests/test_serve.py``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import start_redis_server, stop_process
from tests.test_serve import KEY_A, KEY_B, Server
from tests.tiny_serve import (
    LOGPROB_TOL,
    Reference,
    Stream,
    body,
    build_tiny_model,
    post,
    reply_tokens,
    text,
    verify,
    wait_for,
)

pytestmark = pytest.mark.process

CACHE = "sinks=4,window=512"  # the head stored: 516 tokens, 8 blocks of 64
BLOCK = 64
#: The server's disk made slow: a file's fsync waits 0.2 s first, so a block being written sits as a
#: temporary file that long and a SIGKILL can be aimed at it
SLOW_DISK = (
    "import os, stat, time\n_fsync = os.fsync\n"
    "def _slow(fd):\n    if not stat.S_ISDIR(os.fstat(fd).st_mode):\n        time.sleep(0.2)\n    _fsync(fd)\n"
    "os.fsync = _slow"
)
#: A slow Redis write: the block's bytes (SET) follow its index entry (HSET) 0.2 s later
SLOW_REDIS = (
    "import time, redis\n_set = redis.Redis.set\n"
    "def _slow(self, *a, **k):\n    time.sleep(0.2)\n    return _set(self, *a, **k)\nredis.Redis.set = _slow"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny):
    s = Server(tmp_path_factory.mktemp("reference"), "--model", tiny, "--cache", CACHE)
    yield Reference(s.port, tiny, KEY_A)
    s.stop()


def _serve(tmp: Path, tiny: str, store: str, prelude: str | None = None) -> Server:
    return Server(tmp, "--model", tiny, "--cache", CACHE, "--store", store, prelude=prelude)


def _redis_blocks(client) -> set[str]:
    return {k.decode().split(":")[-1] for k in client.scan_iter("kvlab:b:*")}


def _dangling(client) -> set[str]:
    """Index entries (``kvlab:c:PARENT`` -> child) whose block is not in Redis: a write cut between them."""
    blocks = _redis_blocks(client)
    kids = {k.decode() for key in client.scan_iter("kvlab:c:*") for k in client.hkeys(key)}
    return kids - blocks


@pytest.fixture(params=["disk", "redis"])
def store(request, tmp_path):
    """(kind, store argument, Redis client or None): a disk folder, or a private redis-server."""
    if request.param == "disk":
        yield "disk", str(tmp_path / "store"), None
        return
    import redis

    url, proc = start_redis_server(tmp_path)
    try:
        yield "redis", url, redis.Redis.from_url(url)
    finally:
        stop_process(proc)


DOCS = [text(seed, 55) for seed in range(4)]
QUESTIONS = [f" Question {j}: what comes after {w}?" for j, w in enumerate(("river", "ember", "quartz"))]


def test_two_replicas_on_one_store_share_prefixes_and_serve_no_wrong_cache(store, tmp_path, tiny, reference):
    kind, where, client = store
    a, b = _serve(tmp_path, tiny, where), _serve(tmp_path, tiny, where)
    try:
        # sharing: what A stored, B loads (Redis: once A's writer thread has written it)
        probe = text(99, 55)
        status, first = post(a.port, body(tiny, probe + QUESTIONS[0], 8), KEY_A)
        assert status == 200 and first["kvlab"]["cached_tokens"] == 0, first
        if client is not None:
            full = first["usage"]["prompt_tokens"] // BLOCK
            wait_for("A's blocks in Redis", lambda: len(_redis_blocks(client)) >= full)
        status, shared = post(b.port, body(tiny, probe + QUESTIONS[1], 8), KEY_A)
        assert status == 200, shared
        info = shared["kvlab"]
        assert info["source"] == "store" and info["cached_tokens"] >= BLOCK, info
        assert info["store_tiers"].get(kind, 0) >= 1, info
        reference.check(probe + QUESTIONS[1], 8, shared)
        # both at once: every document x question to both replicas, four clients, shuffled
        jobs = [(d + q, s) for d in DOCS for q in QUESTIONS for s in (a, b)]
        random.Random(7).shuffle(jobs)
        replies: list[tuple[str, int, dict]] = []
        errors: list[str] = []

        def client_loop(mine: list[tuple[str, Server]]) -> None:
            for prompt, s in mine:
                try:
                    replies.append((prompt, *post(s.port, body(tiny, prompt, 8), KEY_A)))
                except OSError as exc:
                    errors.append(f"{prompt[:30]}: {exc!r}")

        threads = [threading.Thread(target=client_loop, args=(jobs[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not errors and len(replies) == len(jobs), errors
        assert all(status == 200 for _, status, _ in replies), [r for r in replies if r[1] != 200]
        for prompt, _, doc in replies:
            reference.check(prompt, 8, doc)
        # the check can tell a wrong cache: no two prompts' reference replies are alike
        prompts = sorted({p for p, _, _ in replies})
        for i, p in enumerate(prompts):
            ids, lp = reply_tokens(reference(p, 8))
            for q in prompts[i + 1 :]:
                ids_q, lp_q = reply_tokens(reference(q, 8))
                gap = max((abs(x - y) for x, y in zip(lp, lp_q, strict=False)), default=0.0)
                assert ids != ids_q or gap > 5 * LOGPROB_TOL, (p, q, gap)
        from_store = [d["kvlab"] for _, _, d in replies if d["kvlab"]["source"] == "store"]
        shared_tier = [i for i in from_store if i["store_tiers"].get(kind)]
        print(
            f"{kind}: {len(replies)} replies, {len(from_store)} from the store, {len(shared_tier)} from {kind}"
        )
        assert from_store, "no request of the concurrent phase was served from the store"
    finally:
        b.stop()
        a.stop()
    code, report = verify(where)
    # at least each document's first 5 blocks (a document is ~370 tokens with the template)
    assert code == 0 and report[kind]["corrupt"] == [] and report[kind]["ok"] >= 4 * 5, report


STREAM_TOKENS = 96


def _long_replies(reference: Reference, count: int) -> list[str]:
    """Prompts (sharing a document) whose greedy reply runs to STREAM_TOKENS tokens (a random model may
    pick its end token early; those are skipped)."""
    found = []
    for j in range(20):
        prompt = DOCS[0] + f" Tell me story number {j}."
        if reference(prompt, STREAM_TOKENS)["choices"][0]["finish_reason"] == "length":
            found.append(prompt)
        if len(found) == count:
            return found
    raise AssertionError(f"only {len(found)} of 20 prompts get a reply of {STREAM_TOKENS} tokens")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_server_stopped_with_streams_open_restarts_on_its_store(sig, tmp_path, tiny, reference):
    where = str(tmp_path / "store")
    prompts = _long_replies(reference, 4)
    s = _serve(tmp_path, tiny, where)
    keys = [KEY_A, KEY_B] * 2  # two tenants: a key's share of the batch (3 of 4) would hold one stream back
    streams = [
        Stream(s.port, body(tiny, p, STREAM_TOKENS, stream=True), k)
        for p, k in zip(prompts, keys, strict=True)
    ]
    readers = [threading.Thread(target=st.read, daemon=True) for st in streams]
    for t in readers:
        t.start()
    wait_for("every stream's first tokens", lambda: all(len(st.tokens) >= 3 for st in streams), 180)
    signalled, at_signal = time.monotonic(), [len(st.tokens) for st in streams]
    s.proc.send_signal(sig)
    assert max(at_signal) < STREAM_TOKENS, at_signal  # every stream was open when the signal came
    for t in readers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in readers), "a client still waits 120 s after the server's signal"
    s.proc.wait(timeout=60)
    ends = [round(st.ended - signalled, 2) for st in streams]
    print(f"{signal.Signals(sig).name}: streams ended {ends} s after it; done: {[st.done for st in streams]}")
    for prompt, st in zip(prompts, streams, strict=True):
        want = reference(prompt, STREAM_TOKENS)["choices"][0]["logprobs"]["content"]
        assert st.done or st.error is not None, "a stream ended without [DONE] and without an error"
        assert len(st.tokens) <= len(want) and (not st.done or len(st.tokens) == len(want))
        for (tok, lp), w in zip(st.tokens, want, strict=False):  # what came is the reference's beginning
            assert tok == w["bytes"] and abs(lp - w["logprob"]) <= 2e-3, (prompt[-20:], tok, w)
    if sig == signal.SIGTERM:  # drained: each stream ran to its end within --shutdown-timeout (30 s)
        assert all(st.done for st in streams), [st.error for st in streams]
    again = _serve(tmp_path, tiny, where)
    try:
        # the same prompts, served from what the first server stored
        for prompt, key in zip(prompts, keys, strict=True):
            status, doc = post(again.port, body(tiny, prompt, STREAM_TOKENS), key)
            assert status == 200, doc
            assert doc["kvlab"]["source"] == "store" and doc["kvlab"]["store_tiers"].get("disk", 0) >= 1
            reference.check(prompt, STREAM_TOKENS, doc)
    finally:
        again.stop()
    code, report = verify(where)
    assert code == 0 and report["disk"]["corrupt"] == [] and report["disk"]["ok"] >= 5, report


def test_a_client_that_stops_reading_does_not_hold_the_shutdown(tmp_path, tiny):
    """A reply whose client reads nothing blocks its sends for good: a SIGTERM then waited for it for ever
    (uvicorn's default); with ``--shutdown-timeout`` the reply is cut and the server exits. The reply is a
    prompt of ~12,500 tokens scored with 20 alternatives each (MBs: more than the sockets' buffers hold;
    a stream would end wherever the random model picks its end token)."""
    limits = ["--max-logprob-entries", "400000", "--max-response-bytes", str(64 << 20)]
    s = Server(tmp_path, "--model", tiny, "--cache", CACHE, "--shutdown-timeout", "3", *limits)
    doc = {"model": tiny, "prompt": text(7, 2000), "max_tokens": 0, "echo": True, "logprobs": 20}
    payload = json.dumps(doc).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", s.port))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
    sock.sendall(f"{head}Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode())
    sock.sendall(payload)
    try:
        sock.settimeout(120)
        first = sock.recv(4096)  # the reply has started (its head and first bytes), and is read no further
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        time.sleep(2)
        signalled = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(timeout=120)
        took = time.monotonic() - signalled
        rest = b"".join(iter(lambda: sock.recv(1 << 20), b""))  # what was buffered, then EOF
    finally:
        sock.close()
        s.kill()
    length = int(first.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    got = len(first) - first.index(b"\r\n\r\n") - 4 + len(rest)
    print(
        f"exited {took:.1f} s after SIGTERM; the client got {got:,} of the reply's {length:,} bytes, then EOF"
    )
    assert got < length  # cut, not finished
    assert "timeout graceful shutdown exceeded" in s.log.read_text()


def _flood(s: Server, tiny: str, seeds: range, sent: list[str], answered: list[str]) -> None:
    """Unique prompts (each a new chain of blocks to store), one a seed, one at a time, while the server lives."""
    for seed in seeds:
        prompt = text(seed, 60)
        sent.append(prompt)
        try:
            status, _ = post(s.port, body(tiny, prompt, 1), KEY_A, timeout=60)
        except OSError:
            return
        if status == 200:
            answered.append(prompt)


def _parents(kind: str, where: str, client) -> dict[str, str]:
    """Each stored block's parent: the disk's files, or Redis's index entries whose block is there."""
    from kvlab.store.disk import DiskTier

    if kind == "disk":
        return {e.hash: e.parent for e in DiskTier(where, create=False).entries()}
    blocks = _redis_blocks(client)
    return {
        kid.decode(): key.decode().split(":")[-1]
        for key in client.scan_iter("kvlab:c:*")
        for kid in client.hkeys(key)
        if kid.decode() in blocks
    }


def _tear(kind: str, where: str, client, rng: random.Random) -> list[str]:
    """Damage two stored blocks as a torn write would leave them at rest (one cut to half its bytes, one with
    a flipped byte): the first block of one chain and the second of another, so lookups reach both."""
    parents = _parents(kind, where, client)
    roots = sorted(h for h, p in parents.items() if p not in parents)
    first, other = rng.sample([r for r in roots if r in parents.values()], 2)  # chains of 2+ blocks
    second = sorted(h for h, p in parents.items() if p == other)[0]
    for h, cut in ((first, True), (second, False)):
        if kind == "disk":
            path = Path(where, "blocks", parents[h], f"{h}.kvb")
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2] if cut else _flipped(data))
        else:
            data = client.get(f"kvlab:b:{h}")
            client.set(f"kvlab:b:{h}", data[: len(data) // 2] if cut else _flipped(data))
    return [first, second]


def _flipped(data: bytes) -> bytes:
    at = len(data) - 100  # in the tensor bytes, which the checksum covers
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]


def _ready_to_kill(kind: str, where: str, client, answered: list[str]) -> bool:
    """Whether a write is under way and the store holds two chains of 2+ blocks to tear afterwards."""
    if len(answered) < 4:
        return False
    parents = _parents(kind, where, client)
    if len({p for p in parents.values() if p in parents and parents[p] not in parents}) < 2:
        return False
    return bool(_cut_writes(kind, where, client))  # last: the kill follows at once


def _cut_writes(kind: str, where: str, client) -> set[str]:
    """Blocks whose write is under way: a temporary file (disk), an index entry without its bytes (Redis)."""
    if kind == "disk":
        return {t.name[1:].split(".kvb.")[0] for t in Path(where, "blocks").glob("*/.*.tmp")}
    return _dangling(client)


def test_a_replica_killed_mid_store_write_serves_no_torn_block_after_restart(
    store, tmp_path, tiny, reference
):
    kind, where, client = store
    s = _serve(tmp_path, tiny, where, prelude=SLOW_DISK if kind == "disk" else SLOW_REDIS)
    sent: list[str] = []
    answered: list[str] = []
    flood = [
        threading.Thread(target=_flood, args=(s, tiny, range(1000 + i, 1024, 2), sent, answered))
        for i in range(2)
    ]
    for t in flood:
        t.start()
    try:  # aimed at a write under way (4 prompts answered first, so there is something to tear)
        wait_for("a store write", lambda: _ready_to_kill(kind, where, client, answered), 240)
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(timeout=60)
    finally:
        s.kill()
        for t in flood:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in flood), "a client still waits 120 s after the SIGKILL"
    cut = _cut_writes(kind, where, client)
    assert cut, "the SIGKILL did not land in a write"  # it was aimed at one, and such a write cannot finish
    code, report = verify(where)
    assert code == 0 and report[kind]["corrupt"] == [], report  # a killed write leaves no bad block
    torn = _tear(kind, where, client, random.Random(3))
    code, report = verify(where)
    assert code == 1 and len(report[kind]["corrupt"]) == 2, report
    again = _serve(tmp_path, tiny, where)
    try:
        hits = 0
        for prompt in sent:  # every prompt sent before the kill: a clean miss or a verified hit, never torn
            status, doc = post(again.port, body(tiny, prompt, 8), KEY_A)
            assert status == 200, doc
            reference.check(prompt, 8, doc)
            hits += doc["kvlab"]["source"] == "store"
        if client is not None:  # Redis is written behind the engine: let the writer finish
            wait_for("the rewritten blocks in Redis", lambda: set(torn) | cut <= _redis_blocks(client))
    finally:
        again.stop()
    # disk: every answered prompt was stored before its reply (one chain torn at its root: a miss); Redis
    # writes behind the engine, so what was still queued at the kill is not there
    assert hits >= (len(answered) - 1 if kind == "disk" else 1), (hits, len(answered))
    code, report = verify(where)
    assert code == 0 and report[kind]["corrupt"] == [], report  # the lookups moved the torn blocks out
    if kind == "disk":
        assert len(list(Path(where, "quarantine").iterdir())) == 2
    stored = set(_parents(kind, where, client))
    assert set(torn) | cut <= stored, "later puts did not write the torn and the cut blocks again"
    print(
        f"{kind}: {len(sent)} prompts sent, {len(answered)} answered, {len(cut)} block(s) cut mid-write, "
        f"{hits} store hits after the restart"
    )
