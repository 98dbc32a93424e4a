"""Fidelity per response (issue 49 item 2): ``kvlab serve --fidelity-sample`` and ``"kvlab": {"fidelity": true}``
score what the cache policy cost an answer: the response's tokens teacher-forced on the exact full cache,
``KL(full || served)`` and top-1 agreement per response, in ``usage.fidelity`` or at ``kvlab.fidelity_url``.

In-process tests drive an :class:`~kvlab.serve.engine.Engine` on a tiny random Llama; the server tests run
``kvlab serve`` on the tiny local model of ``tests/tiny_serve.py`` (no download).
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from kvlab.loop import GREEDY
from kvlab.policy.spec import parse
from kvlab.serve.engine import Engine, EngineSettings, Request
from kvlab.serve.fidelity import ScoringJob
from tests.test_cheap_paths import run_cli
from tests.test_serve import ADMIN, KEY_A, KEY_B, Server
from tests.tiny_serve import Stream, build_tiny_model, text

H2O = "h2o,budget=32,every=8"
TURNS = 12  # the acceptance's conversation


class _Events:
    def __init__(self) -> None:
        self.done_ev, self.info = threading.Event(), None

    def __call__(self, event: tuple) -> None:
        if event[0] in ("done", "error"):
            self.info = event[2] if event[0] == "done" else event[1]
            self.done_ev.set()


def _ask(engine: Engine, ids: list[int], n: int) -> tuple[dict, dict]:
    """One scored request on ``engine``: its info and its fidelity record's result."""
    events = _Events()
    fid = engine.fidelity.open("")
    engine.submit(Request(ids=ids, max_new_tokens=n, sampling=GREEDY, emit=events, fidelity=fid))
    assert events.done_ev.wait(60) and isinstance(events.info, dict), events.info
    deadline = time.monotonic() + 60
    while (read := engine.fidelity.read(fid, ""))[1] is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert read[0]
    return events.info, read[1]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("spec", [H2O, "sinks=4,window=512"])
def test_the_engine_scores_a_conversation_against_its_full_cache(tiny_model, spec):
    """Each turn's response scored: the evicting policy moves at least one distribution (kl > 0), the full
    window (nothing evicted) scores kl 0 and top-1 agreement 1, the whole reply's tokens compared."""
    h = tiny_model("llama")
    engine = Engine(h, EngineSettings(cache=spec))
    try:
        ids: list[int] = []
        kls = []
        for turn in range(4):
            ids = ids + [(7 * turn + 3 * i) % 200 + 1 for i in range(30)]
            info, result = _ask(engine, ids, 6)
            assert info["fidelity_url"].startswith("/v1/fidelity/fid-")
            assert result["tokens"] == len(info["completion_ids"]) == 6
            assert result["policy"] == parse(spec).spec and 0 <= result["top1"] <= 1 and result["kl"] >= 0
            kls.append(result["kl"])
            ids = ids + info["completion_ids"]
        if spec == H2O:
            assert max(kls) > 0, kls
        else:
            assert max(kls) <= 1e-6, kls
    finally:
        engine.stop()


@pytest.mark.usefixtures("one_torch_thread")
def test_scoring_feeds_at_most_its_chunk_between_decode_steps_while_a_request_decodes(
    tiny_model, monkeypatch
):
    """The low-priority bound: while another request decodes, each worker iteration teacher-forces at most
    ``fidelity_chunk`` tokens; the score still completes, and the decoding request is served in full."""
    h = tiny_model("llama")
    engine = Engine(h, EngineSettings(cache=H2O, fidelity_chunk=4))
    budgets: list[tuple[int, bool]] = []
    feed = ScoringJob.feed

    def spy(job: ScoringJob, handle, budget: int) -> int:
        budgets.append((budget, bool(engine._active)))
        return feed(job, handle, budget)

    monkeypatch.setattr(ScoringJob, "feed", spy)
    try:
        fid = engine.fidelity.open("")
        scored, other = _Events(), _Events()
        engine.submit(
            Request(ids=list(range(1, 120)), max_new_tokens=3, sampling=GREEDY, emit=scored, fidelity=fid)
        )
        engine.submit(Request(ids=list(range(5, 40)), max_new_tokens=80, sampling=GREEDY, emit=other))
        assert scored.done_ev.wait(60) and other.done_ev.wait(60)
        assert isinstance(other.info, dict) and other.info["completion_tokens"] == 80
        deadline = time.monotonic() + 60
        while engine.fidelity.read(fid, "")[1] is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert engine.fidelity.read(fid, "")[1]["tokens"] == 3
        live = [b for b, decoding in budgets if decoding]
        assert live and max(live) <= 4, budgets
    finally:
        engine.stop()


@pytest.mark.usefixtures("one_torch_thread")
def test_a_response_past_the_model_positions_is_skipped_not_scored(tiny_model, monkeypatch):
    """No full-cache reference exists past the model's positions: the record says why and holds no score."""
    h = tiny_model("llama")
    # the reference's limit (the rolling cache goes past it)
    monkeypatch.setattr(type(h), "max_positions", property(lambda self: 40))
    engine = Engine(h, EngineSettings(cache="sinks=4,window=24"))
    try:
        _, result = _ask(engine, list(range(1, 50)), 4)
        assert "kl" not in result and "top1" not in result and "positions" in result["skipped"]
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-fidelity")))


def _chat(server: Server, messages: list[dict], key: str = KEY_A, **extra) -> dict:
    doc = {"model": server.model, "messages": messages, "max_tokens": 6, "temperature": 0, **extra}
    status, _, reply = server.post("/v1/chat/completions", doc, key)
    assert status == 200, reply
    return reply


def _follow(server: Server, url: str, key: str = KEY_A) -> dict:
    """The fidelity at ``url``, polled through its 202s."""
    deadline = time.monotonic() + 60
    while True:
        status, headers, body = server.get(url, key)
        doc = json.loads(body)
        if status == 200:
            return doc
        assert (
            status == 202
            and doc["status"] == "pending"
            and {k.lower(): v for k, v in headers.items()}["retry-after"] == "1"
        ), (status, doc)
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _check(fidelity: dict, spec: str, tokens: int) -> None:
    assert set(fidelity) == {"kl", "top1", "tokens", "policy"}, fidelity
    assert fidelity["kl"] >= 0 and 0 <= fidelity["top1"] <= 1
    assert fidelity["tokens"] == tokens and fidelity["policy"] == parse(spec).spec


@pytest.mark.process
def test_a_twelve_turn_conversation_under_h2o_carries_fidelity_in_every_response(tmp_path, tiny):
    """``--fidelity-sample 1``: every response of a 12-turn conversation under H2O carries its score in
    ``usage.fidelity`` (the reply waits up to ``--fidelity-wait``); compression moves some of them (kl > 0);
    ``/metrics`` counts them in the histograms by policy."""
    args = ("--model", tiny, "--cache", H2O, "--fidelity-sample", "1", "--fidelity-wait", "30")
    server = Server(tmp_path, *args)
    server.model = tiny
    try:
        messages: list[dict] = [{"role": "system", "content": "Be brief."}]
        kls = []
        for turn in range(TURNS):
            messages.append({"role": "user", "content": text(turn, 3)})
            reply = _chat(server, messages)
            fidelity = reply["usage"]["fidelity"]
            _check(fidelity, H2O, reply["usage"]["completion_tokens"])
            assert reply["kvlab"]["fidelity_url"].startswith("/v1/fidelity/")
            kls.append(fidelity["kl"])
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
        assert max(kls) > 0, kls
        metrics = server.get("/metrics", ADMIN)[2].decode()
        policy = parse(H2O).spec
        assert f'kvlab_fidelity_kl_count{{policy="{policy}"}} {float(TURNS)}' in metrics
        assert f'kvlab_fidelity_top1_count{{policy="{policy}"}} {float(TURNS)}' in metrics
    finally:
        server.stop()


@pytest.mark.process
def test_the_follow_up_url_the_full_cache_and_the_request_field(tmp_path, tiny):
    """``--fidelity-wait 0``: a response asked to be scored points to its follow-up URL, which gives the
    score (202 while pending) to its key only (another key, an unknown id: 404; no key: 401). A full cache
    scores kl 0 and top-1 1. Unasked with ``--fidelity-sample 0``: nothing is scored. A stream carries the URL.
    ``kvlab.fidelity`` is a boolean, for one generated response."""
    spec = "sinks=4,window=1024"
    server = Server(tmp_path, "--model", tiny, "--cache", spec, "--fidelity-wait", "0")
    server.model = tiny
    try:
        messages = [{"role": "user", "content": text(1, 6)}]
        reply = _chat(server, messages, kvlab={"fidelity": True})
        url = reply["kvlab"]["fidelity_url"]
        assert server.get(url, KEY_B)[0] == 404
        assert server.get(url)[0] == 401
        assert server.get(f"/v1/fidelity/fid-{uuid.uuid4().hex}", KEY_A)[0] == 404
        doc = _follow(server, url)
        assert doc["status"] == "done" and doc["id"] == url.rsplit("/", 1)[1]
        _check(doc["fidelity"], spec, reply["usage"]["completion_tokens"])
        assert doc["fidelity"]["kl"] <= 1e-6 and doc["fidelity"]["top1"] == 1.0
        assert server.get(url, KEY_B)[0] == 404  # still another key's

        plain = _chat(server, messages)
        assert "fidelity_url" not in plain["kvlab"] and "fidelity" not in plain["usage"]

        stream = Stream(
            server.port,
            {
                "model": tiny,
                "messages": messages,
                "max_tokens": 4,
                "stream": True,
                "kvlab": {"fidelity": True},
            },
            KEY_A,
        )
        stream.read()
        assert stream.done and stream.info is not None
        assert _follow(server, stream.info["fidelity_url"])["status"] == "done"

        base = {"model": tiny, "messages": messages, "max_tokens": 2}
        for bad, status in (({"fidelity": "yes"}, 422), ({"fidelty": True}, 422)):
            assert server.post("/v1/chat/completions", {**base, "kvlab": bad})[0] == status, bad
        several = {"model": tiny, "prompt": ["a b", "c d"], "max_tokens": 2, "kvlab": {"fidelity": True}}
        status, _, err = server.post("/v1/completions", several)
        assert status == 400 and err["error"]["param"] == "kvlab.fidelity"
    finally:
        server.stop()


@pytest.mark.process
@pytest.mark.parametrize("value", ["1.5", "-0.1", "nan", "lots"])
def test_bad_fidelity_samples_are_refused_in_one_line_before_torch(tmp_path, value):
    code, _, err, heavy = run_cli(["serve", "--fidelity-sample", value], tmp_path)
    assert code == 2 and heavy == [] and len(err.strip().splitlines()) == 1, err
    assert "--fidelity-sample" in err
