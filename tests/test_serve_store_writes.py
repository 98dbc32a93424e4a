"""``kvlab serve`` over a Redis that cannot take writes (issue 48 item 2): a new prompt's blocks are written
behind the engine (the Redis tier's write-behind queue), so a Redis that holds every write for seconds
delays neither the request that stored them nor another request decoding meanwhile.

A real server subprocess (the bundled SmolLM2, as in ``tests/test_serve.py``) on a private redis-server.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import start_redis_server, stop_process
from tests.test_serve import MODEL, Server, chat

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install 'kvlab[redis]')")

PAUSE_S = 8.0  # Redis holds every write this long (CLIENT PAUSE ... WRITE); reads are answered


def _stream_times(client, text: str, n: int, out: list[float]) -> None:
    """Stream a greedy reply of ``n`` tokens, appending each content chunk's arrival time to ``out``."""
    messages = [{"role": "user", "content": text}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=n, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            out.append(time.monotonic())


@pytest.fixture
def served(tmp_path, monkeypatch):
    """``kvlab serve --store redis://...`` on a private redis-server: (server, redis client)."""
    url, proc = start_redis_server(tmp_path)
    # a write waits out the whole pause (no timeout, so no breaker): only the queue keeps it off the engine
    monkeypatch.setenv("KVLAB_REDIS_TIMEOUT_S", "30")
    try:
        s = Server(tmp_path, "--store", url)
        try:
            yield s, redis.Redis.from_url(url)
        finally:
            s.stop()
    finally:
        stop_process(proc)


def test_a_redis_that_holds_every_write_delays_no_request(served):
    s, r = served
    context = " Some context for the store to keep." * 12
    started = time.monotonic()
    assert chat(s.client(), [{"role": "user", "content": "Warm up." + context}], n=4).choices
    normal = time.monotonic() - started
    blocks_before = len(list(r.scan_iter("kvlab:b:*")))
    assert blocks_before >= 1  # the warm-up's blocks reached Redis
    ticks: list[float] = []
    decoding = threading.Thread(
        target=_stream_times, args=(s.client(), "Count from one to fifty.", 48, ticks), daemon=True
    )
    decoding.start()
    deadline = time.monotonic() + 120
    while len(ticks) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(ticks) >= 3, "the decoding request never started"
    r.client_pause(int(PAUSE_S * 1000), all=False)  # WRITE: writes wait, reads are answered
    paused_at = time.monotonic()
    reply = chat(s.client(), [{"role": "user", "content": "A new prompt." + context}], n=4)
    assert reply.choices[0].message.content
    took = time.monotonic() - paused_at
    decoding.join(timeout=120)
    during = [b - a for a, b in zip(ticks, ticks[1:], strict=False) if b > paused_at]
    # Writing in the engine's thread, both would wait for the pause (8 s); behind it, neither does
    assert took < min(PAUSE_S - 2, 3 * normal + 2), (took, normal)
    assert during and max(during) < PAUSE_S / 2, during
    # the queued blocks reach Redis once it takes writes again
    deadline = paused_at + PAUSE_S + 20
    while time.monotonic() < deadline and len(list(r.scan_iter("kvlab:b:*"))) <= blocks_before:
        time.sleep(0.2)
    assert len(list(r.scan_iter("kvlab:b:*"))) > blocks_before, "the queued blocks never reached Redis"
    log = s.log.read_text()
    assert "Traceback" not in log
