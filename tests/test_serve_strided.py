"""``kvlab serve --cache stride=N,recent=M``: conversations over the strided layout (one slot in ``stride`` plus
the last ``recent``, at their original positions), each equal to the same strided cache fed by hand, decoded
together with other conversations in one batched step; a conversation that would pass the model's position
limit is refused before it is queued, which bounds its cache (the same rule holds for a scored layout, whose
slots keep their original positions too).

The engine is driven directly with a tiny random-weight Llama (its HTTP refusal through the app, in a thread);
the end-to-end test runs the bundled SmolLM2 behind ``kvlab serve`` and the ``openai`` client.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from html import escape

import pytest

from kvlab.policy.spec import parse
from kvlab.serve.engine import Engine, EngineSettings, Session
from kvlab.serve.status import describe_layout, status_page
from tests.test_serve_cache_spec import _ids
from tests.test_serve_scored import _ByHand, _submit

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STRIDE, RECENT = 4, 16
SPEC = f"stride={STRIDE},recent={RECENT}"


def _invariant(seen: int, stride: int = STRIDE, recent: int = RECENT) -> list[int]:
    """The positions a strided cache holds after ``seen`` tokens (strided.py's docstring)."""
    return [p for p in range(seen) if p % stride == 0 or p >= seen - recent]


def _idle(engine: Engine) -> Session:
    """The engine's one idle session (the cache a conversation left behind)."""
    (session,) = engine.sessions.values()
    return session


def test_a_strided_conversation_equals_its_cache_fed_by_hand_and_holds_the_layouts_slots(tiny_model):
    """Four greedy turns, each reply equal to the same strided cache fed by hand; after each turn the
    engine's cache holds exactly the slots of the layout's invariant, and the response says so."""
    h = tiny_model("llama")
    e = Engine(h, EngineSettings(cache=SPEC))
    try:
        mine, ids, rolls, n = _ByHand(h, SPEC), [], 0, 10
        for turn in range(4):
            new = _ids(60 if turn == 0 else 20, turn)
            ids = ids + new
            info = _submit(e, ids, n).done()
            mine.feed(new)
            out = mine.generate(n)
            assert info["completion_ids"] == out, turn
            assert info["cache"] == {**parse(SPEC).to_json(), "exact": False}
            assert info["source"] == ("none" if turn == 0 else "session")
            seen = len(ids) + n  # the last pick is fed too
            held = _idle(e).cache
            assert held.tokens_seen == seen and held.positions().tolist() == _invariant(seen), turn
            assert info["kept_tokens"] == mine.cache.kept == len(_invariant(seen))
            assert info["cache_bytes"] == mine.cache.nbytes == held.nbytes and info["pinned_tokens"] == 0
            rolls += info["rolls"]
            ids = ids + out
        assert rolls > 0 and mine.cache.evictions == rolls
        (row,) = [s for s in e.status()["sessions"] if s["state"] == "idle"]
        most = parse(SPEC).layout.held_at_most(h.max_positions)
        assert most == len(_invariant(h.max_positions)) and row["window"] == most
        assert row["kept"] == mine.cache.kept and row["pinned"] == row["sinks"] == 0 and not row["budget"]
        assert describe_layout(row) == (
            f"{mine.cache.kept} kept (one slot in 4 + the last 16 slots), at most {most} "
            "(at the model's position limit)"
        )
        assert escape(describe_layout(row)) in status_page("tiny", e.status(), {})
    finally:
        e.stop()


def test_three_strided_conversations_decode_together_each_equal_to_its_cache_fed_by_hand(
    tiny_model, monkeypatch
):
    """Three conversations of four turns, each turn's three requests submitted at once, so their replies are
    decoded in one batched step (recorded); every reply equals its own strided cache fed by hand."""
    import kvlab.serve.engine as engine_module

    rows: list[int] = []
    step = engine_module.step_rolling_rows_isolated

    def recording(handle, caches, tokens):
        rows.append(len(caches))
        return step(handle, caches, tokens)

    monkeypatch.setattr(engine_module, "step_rolling_rows_isolated", recording)
    h = tiny_model("llama")
    e = Engine(h, EngineSettings(cache=SPEC, max_batch=4))
    try:
        mine = [_ByHand(h, SPEC) for _ in range(3)]
        convs: list[list[int]] = [[], [], []]
        n = 12
        for turn in range(4):
            news = [_ids(40 + 7 * i if turn == 0 else 15 + i, 10 * turn + i) for i in range(3)]
            replies = [_submit(e, convs[i] + news[i], n) for i in range(3)]
            infos = [r.done() for r in replies]
            for i, info in enumerate(infos):
                mine[i].feed(news[i])
                out = mine[i].generate(n)
                assert info["completion_ids"] == out, (turn, i)
                assert info["kept_tokens"] == mine[i].cache.kept
                assert info["source"] == ("none" if turn == 0 else "session")
                convs[i] = convs[i] + news[i] + out
        assert max(rows) == 3, rows  # the three decoded in one step
        for session in e.sessions.values():
            assert session.cache.positions().tolist() == _invariant(session.cache.tokens_seen)
    finally:
        e.stop()


# -- the position limit: refused through HTTP, before anything is queued ------------------------------------
@pytest.fixture
def http_engine(tiny_model, request):
    """``(engine, port)``: the app over a tiny Llama (a word tokenizer: prompts are token ids) served by uvicorn
    in a thread of this process, with the cache spec the test is parametrized with."""
    import uvicorn

    from kvlab.model.handle import ModelHandle
    from kvlab.serve.app import create_app
    from tests.test_eval_tasks import WordTokenizer

    h = tiny_model("llama", seed=1)  # its own model: the scored sessions' query hooks stay on it
    handle = ModelHandle(h.model, WordTokenizer(), name="tiny-llama")
    e = Engine(handle, EngineSettings(cache=request.param))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(create_app(e, model_id="tiny"), host="127.0.0.1", port=port, log_config=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield e, port
    server.should_exit = True
    thread.join(timeout=10)
    e.stop()
    for session in e.sessions.values():
        session.cache.close()


def _complete(port: int, ids: list[int], max_tokens: int) -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize("http_engine", [SPEC, "h2o,budget=64,every=16"], indirect=True)
def test_a_conversation_past_the_position_limit_is_refused_before_it_is_queued(http_engine):
    """The tiny Llama's positions end at 2047: a prompt and ``max_tokens`` that need more get one 400 and
    nothing runs (no session, nothing queued, nothing admitted); one that ends exactly at the limit is served.
    A scored layout keeps original positions too: the same rule."""
    e, port = http_engine
    limit = e.handle.max_positions
    assert limit == 2048
    ids = _ids(limit - 10, 3)
    status, doc = _complete(port, ids, 11)
    assert status == 400, doc
    message = doc["error"]["message"]
    assert (
        f"{limit - 10} prompt tokens and max_tokens 11 need positions up to {limit}, past the model's last"
        in message
    )
    assert "keeps original positions" in message and doc["error"]["param"] == "prompt"
    assert e.queue_depth() == 0 and e.active() == 0 and e.idle_sessions() == 0
    status, doc = _complete(port, ids, 10)  # positions 0..2047: the last the model has
    assert status == 200, doc
    assert doc["kvlab"]["cache"]["spec"] == parse(e.settings.cache or "").spec


def test_the_server_refuses_a_strided_cache_on_a_model_without_a_position_limit(tiny_model, monkeypatch):
    """Without a stated position limit nothing would bound a strided conversation's cache."""
    from kvlab.errors import BadInputError
    from kvlab.model.handle import ModelHandle

    h = tiny_model("llama")
    monkeypatch.setattr(ModelHandle, "max_positions", property(lambda self: 0))
    with pytest.raises(
        BadInputError, match="bounded by the model's position limit, which this model's config"
    ):
        Engine(h, EngineSettings(cache=SPEC))
    Engine(h, EngineSettings(cache="h2o,budget=64,every=16")).stop()  # a budget bounds a scored one


# -- end to end: the bundled SmolLM2 behind `kvlab serve --cache stride=4,recent=32`, through the openai client --
@pytest.mark.process
def test_kvlab_serve_serves_a_strided_conversation_to_the_openai_client(tmp_path):
    import openai

    from tests.test_serve import Server, converse

    spec, stride, recent = "stride=4,recent=32", 4, 32
    server = Server(tmp_path, "--cache", spec, "--max-tokens", "48", keys=(), admin=None)
    try:
        assert f"cache {spec}: one slot in 4 + the last 32 slots" in server.log.read_text()
        client = server.client("none")
        infos, _, seen = converse(client, 2)
        for i, info in enumerate(infos):
            assert info["cache"]["spec"] == spec and info["cache"]["kind"] == "strided"
            assert info["cache"]["exact"] is False and info["source"] == ("none" if i == 0 else "session")
        # the cache has seen the whole conversation (the last pick fed too) and holds the layout's slots
        assert infos[-1]["kept_tokens"] == len(_invariant(seen, stride, recent)) < seen
        assert sum(info["rolls"] for info in infos) > 0
        with pytest.raises(openai.BadRequestError, match="keeps original positions"):
            client.completions.create(model="smollm2-135m", prompt=[17] * 8190, max_tokens=8, temperature=0)
        assert server.get("/health")[0] == 200
    finally:
        server.stop()
