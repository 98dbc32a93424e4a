"""The serving engine under stress from its own tenants: a row that fails fails alone, a long prompt is
prefilled in pieces between decode steps (and ends in the cache it would have in one go), a cancelled
request stops within one step or one piece.

Most tests drive :class:`kvlab.serve.engine.Engine` directly with a tiny random-weight Llama (fast and
exact: its greedy tokens are compared with a rolling cache fed at once, token for token); the last ones
run a real ``kvlab serve`` with the bundled SmolLM2 through the ``openai`` client.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.hf.rolling_cache import RollingLayer, rolling_cache_for
from kvlab.loop import GREEDY, Sampling
from kvlab.serve import engine as engine_mod
from kvlab.serve.engine import Engine, EngineSettings, Request, check_settings
from kvlab.store import open_store
from kvlab.streaming.generate import feed
from tests.test_serve import KEY_A, KEY_B, MODEL, Server
from tests.tolerances import forward_tol

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW, SINKS, EVICT = 64, 4, 16
UNCHUNKED = 10**9  # a prefill budget no prompt reaches: the forwards of the path before chunking


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Events:
    """A request's ``emit``: every event in order (``log``, when given, is shared with other recorders)."""

    def __init__(self, name: str = "", log: list | None = None, on=None) -> None:
        self.name, self.events, self.log, self.on = name, [], log, on
        self.finished = threading.Event()

    def __call__(self, ev: tuple) -> None:
        self.events.append(ev)
        if self.log is not None:
            self.log.append((self.name, ev[0]))
        if self.on is not None:
            self.on(self, ev)
        if ev[0] in ("done", "error"):
            self.finished.set()

    def wait(self) -> tuple:
        assert self.finished.wait(120), self.events
        return self.events[-1]

    def tokens(self) -> int:
        return sum(1 for e in self.events if e[0] == "token" and e[1] is not None)

    def output(self) -> list[int]:
        last = self.wait()
        assert last[0] == "done", last
        return last[2]["completion_ids"]

    def info(self) -> dict:
        return next(e[1] for e in self.events if e[0] == "start")


def _request(ids, n, emit, sampling: Sampling = GREEDY, **kw) -> Request:
    return Request(ids=list(ids), max_new_tokens=n, sampling=sampling, emit=emit, **kw)


@contextlib.contextmanager
def _engine(handle, store=None, **kw) -> Iterator[Engine]:
    e = Engine(handle, EngineSettings(window=WINDOW, sinks=SINKS, evict_chunk=EVICT, **kw), store=store)
    try:
        yield e
    finally:
        e.stop()


def _idle(e: Engine) -> None:
    deadline = time.monotonic() + 60
    while (e.active() or e.queue_depth()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert e.active() == 0 and e.queue_depth() == 0


def _solo(handle, prompt: list[int], n: int) -> list[int]:
    """The greedy reply on a rolling cache fed as the engine did before chunking: the head (sinks + window
    tokens), then the rest, each in forwards of the cache's headroom (``feed``)."""
    cache = rolling_cache_for(handle, window=WINDOW, sinks=SINKS, evict_chunk=EVICT)
    logits, out = feed(handle, cache, prompt[: SINKS + WINDOW]), []
    if len(prompt) > SINKS + WINDOW:
        logits = feed(handle, cache, prompt[SINKS + WINDOW :])
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = feed(handle, cache, [out[-1]])
    return out


# -- sampling ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [5e-324, 1e-320, 1e-310, 1e-300, 1e-9])
def test_a_vanishing_temperature_picks_the_argmax_never_nan(temperature):
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 8
    for top_p in (1.0, 0.3):
        sampling = Sampling(temperature, top_p=top_p, seed=1)
        for dtype in (torch.float32, torch.bfloat16):
            picks = sampling.pick(logits.to(dtype), torch.Generator().manual_seed(1))
            assert picks.tolist() == logits.to(dtype).argmax(-1).tolist()
    # tied best tokens share the limit; the others get exactly nothing
    tied = torch.tensor([[3.0, 3.0, 2.999]])
    picks = {int(Sampling(1e-320).pick(tied, torch.Generator().manual_seed(s))) for s in range(20)}
    assert picks == {0, 1}


def test_an_infinite_temperature_is_refused():
    with pytest.raises(BadInputError, match="finite"):
        Sampling(math.inf)


# -- a row that fails fails alone ---------------------------------------------------------------------------
def test_a_row_whose_pick_fails_or_whose_temperature_vanishes_leaves_the_others_intact(
    tiny_model, monkeypatch
):
    h = tiny_model("llama")
    healthy, vanishing, poisoned = _ids(40, 1), _ids(30, 2), _ids(20, 3)
    n = 24
    boom = Sampling(temperature=0.5, seed=666)
    real_pick, calls = Sampling.pick, []

    def pick(self, logits, generator=None):
        if self is boom:
            calls.append(1)
            if len(calls) == 4:
                raise RuntimeError("poisoned pick")
        return real_pick(self, logits, generator)

    monkeypatch.setattr(Sampling, "pick", pick)
    with _engine(h, max_batch=3) as e:
        a, b, c = Events(), Events(), Events()
        e.submit_many(
            [
                _request(healthy, n, a),
                _request(vanishing, n, b, Sampling(temperature=1e-310, seed=1)),
                _request(poisoned, n, c, boom),
            ]
        )
        assert c.wait()[0] == "error" and "poisoned pick" in str(c.wait()[1])
        assert c.tokens() == 3  # three tokens, then its own failure
        assert a.output() == _solo(h, healthy, n)
        assert b.output() == _solo(h, vanishing, n)  # 1e-310 is the greedy limit, not a NaN
        _idle(e)
        assert c.info()["session"] not in e.sessions  # dropped, never served again
        assert {a.info()["session"], b.info()["session"]} <= set(e.sessions)
        d = Events()
        e.submit(_request(poisoned, 4, d))  # the worker lives on
        assert d.output() == _solo(h, poisoned, 4)


def test_a_row_that_fails_inside_the_batched_forward_fails_alone(tiny_model, monkeypatch):
    """The batched forward raises part-way (after the first layer wrote every row's token): it is undone,
    its rows run one by one, only the failing row fails and the others' replies are their solo ones."""
    h = tiny_model("llama")
    prompts, n = [_ids(70, 4), _ids(25, 5), _ids(10, 6)], 30
    with _engine(h, max_batch=3) as e:
        made: list = []
        real_for = engine_mod.cache_for

        def cache_for(*args, **kw):
            made.append(real_for(*args, **kw))
            return made[-1]

        monkeypatch.setattr(engine_mod, "cache_for", cache_for)
        real_update = RollingLayer.update

        def update(self, key_states, value_states, *args, **kw):
            if len(made) > 1 and self is made[1].layers[1] and self.tokens_seen >= 25 + 6:
                raise RuntimeError("poisoned forward")
            return real_update(self, key_states, value_states, *args, **kw)

        monkeypatch.setattr(RollingLayer, "update", update)
        events = [Events() for _ in prompts]
        e.submit_many([_request(p, n, ev) for p, ev in zip(prompts, events, strict=True)])
        assert events[1].wait()[0] == "error" and "poisoned forward" in str(events[1].wait()[1])
        assert events[1].tokens() == 7
        assert events[0].output() == _solo(h, prompts[0], n)
        assert events[2].output() == _solo(h, prompts[2], n)
        _idle(e)
        assert events[1].info()["session"] not in e.sessions


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_an_undone_step_leaves_the_cache_exactly_as_it_was(tiny_model, family):
    """Steps undone (whole, or failed after some layers wrote) through rolls, re-bases and (Gemma-3's local
    layers) sliding-window trims: the cache continues bit for bit as its twin that never took them."""
    h = tiny_model(family)

    def cache():
        return rolling_cache_for(h, window=80, sinks=SINKS, evict_chunk=EVICT, max_position=300)

    a, b = cache(), cache()
    prompt = _ids(90, 7)
    feed(h, a, prompt)
    feed(h, b, prompt)
    tokens = _ids(150, 8)
    for i, tok in enumerate(tokens):
        undo = a.checkpoint()
        feed(h, a, [(tok + 1) % 500])
        undo()
        undo = a.checkpoint()
        layer = a.layers[len(a.layers) - 1]
        layer.update = _raise  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            feed(h, a, [(tok + 2) % 500])
        del layer.update
        undo()
        assert torch.equal(feed(h, a, [tok]), feed(h, b, [tok])), i
    assert a.rolls >= 5 and a.rebases >= 1
    assert (a.rolls, a.rebases, a.next_position, a.kept) == (b.rolls, b.rebases, b.next_position, b.kept)
    for (ka, va), (kb, vb) in zip(a.kept_layers(), b.kept_layers(), strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def _raise(*args, **kw):
    raise RuntimeError("a layer failed mid-step")


# -- chunked prefill ------------------------------------------------------------------------------------------
def _serve(h, chunk: int, script, store_spec: str | None = None):
    """Run ``script(submit)`` on an engine with this prefill budget; returns its outputs and the sessions."""
    store = open_store(store_spec) if store_spec else None
    with _engine(h, store=store, prefill_chunk=chunk, prefill_alone=chunk) as e:

        def submit(ids, n, **kw) -> Events:
            ev = Events()
            e.submit(_request(ids, n, ev, **kw))
            ev.wait()
            return ev

        out = script(submit)
        _idle(e)
        return out, dict(e.sessions)


@pytest.mark.parametrize("path", ["new", "store", "session", "scored"])
def test_a_prompt_prefilled_in_pieces_ends_as_it_would_in_one_go(tiny_model, path):
    """Pieces of 7 tokens (cut anywhere, rolls held between the pieces of one forward) against the
    forwards of the unchunked path: the same replies, scores and caches, through many rolls and re-bases
    (a 2,500-token prompt in a window of 64 passes the model's maximum position, 2,048)."""
    h = tiny_model("llama")
    long, other = _ids(2500, 9), _ids(200, 10)

    def script(submit):
        if path == "new":
            r = submit(long, 12)
            return [(r.output(), r.info()["source"])]
        if path == "store":  # a miss computes and stores the head; the next prompt sharing it hits
            first = submit(long[:300], 6)
            second = submit(long[:64] + other, 6)
            return [(r.output(), r.info()["source"], r.info()["cached_tokens"]) for r in (first, second)]
        if path == "session":  # the conversation continues with its reply and a long new turn
            first = submit(long[:300], 8)
            second = submit(long[:300] + first.output() + long[300:], 8)
            return [(r.output(), r.info()["source"], r.info()["cached_tokens"]) for r in (first, second)]
        # scoring: every prompt token's log-probability, then a continuation scored through the session
        first = submit(long[:700], 0, logprobs=2, score_prompt=True)
        second = submit(long[:1100], 1, logprobs=2, score_prompt=True)
        return [(r.wait()[2]["_prompt_logprobs"], r.info()["source"]) for r in (first, second)]

    pieces, sessions = _serve(h, 7, script, "memory" if path == "store" else None)
    whole, sessions_whole = _serve(h, UNCHUNKED, script, "memory" if path == "store" else None)
    if path == "scored":
        assert [s for _, s in pieces] == [s for _, s in whole] == ["none", "session"]
        for (got, _), (want, _) in zip(pieces, whole, strict=True):
            assert len(got) == len(want) and got[0] is None and want[0] is None
            for g, w in zip(got[1:], want[1:], strict=True):
                assert g[0] == w[0] and abs(g[1] - w[1]) <= 1e-4
                assert [t for t, _ in g[2]] == [t for t, _ in w[2]]
    else:
        assert pieces == whole
    if path == "new":
        assert pieces[0][0] == _solo(h, long, 12)
        (only,) = sessions.values()
        assert only.cache.rolls >= 30 and only.cache.rebases >= 1
    if path == "store":
        assert [p[1] for p in pieces] == ["none", "store"] and pieces[1][2] == 64
    if path == "session":
        assert pieces[1][1] == "session" and pieces[1][2] == 300 + 8
    for s in sessions.values():  # each conversation's cache, against the unchunked engine's
        (twin,) = [t for t in sessions_whole.values() if t.ids == s.ids]
        assert (s.cache.rolls, s.cache.next_position, s.cache.kept) == (
            twin.cache.rolls,
            twin.cache.next_position,
            twin.cache.kept,
        )
        for (k, v), (kt, vt) in zip(s.cache.kept_layers(), twin.cache.kept_layers(), strict=True):
            tol = forward_tol(h, [kt, vt])
            assert (k - kt).abs().max() <= tol and (v - vt).abs().max() <= tol


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_pieces_with_the_roll_held_equal_one_forward(tiny_model, family):
    """The mechanism under the engine's chunked prefill, on full and (Gemma-3's local layers) sliding-window
    layers: each forward of ``feed`` cut at random points, the roll held between its pieces, gives the same
    logits and cache as the forward whole; cut without holding the roll, it does not."""
    h = tiny_model(family)
    prompt = _ids(700, 15)
    cuts = torch.Generator().manual_seed(16)

    def cache():
        return rolling_cache_for(h, window=80, sinks=SINKS, evict_chunk=EVICT, max_position=400)

    whole, held, loose = cache(), cache(), cache()
    want = feed(h, whole, prompt)
    for start in range(0, len(prompt), whole.headroom):
        forward = prompt[start : start + whole.headroom]
        at = 0
        while at < len(forward):
            n = int(torch.randint(1, 30, (1,), generator=cuts))
            piece = torch.tensor([forward[at : at + n]])
            got = h.run(piece, held, logits_to_keep=1).logits[0, -1].float()
            h.run(piece, loose, logits_to_keep=1)
            at += n
            if at < len(forward):
                held.hold_roll()
    assert whole.rolls >= 5 and whole.rebases >= 1
    assert (got - want).abs().max() <= forward_tol(h, want)
    assert (held.rolls, held.rebases, held.next_position, held.kept) == (
        whole.rolls,
        whole.rebases,
        whole.next_position,
        whole.kept,
    )

    def newest(a, b):  # a sliding layer may hold slots beyond its reach a little longer (trimmed once per
        n = min(a.shape[-2], b.shape[-2])  # chunk): the newest ones, all its next query sees, are compared
        assert n >= 63
        return a[..., -n:, :], b[..., -n:, :]

    for (k, v), (kw, vw) in zip(held.kept_layers(), whole.kept_layers(), strict=True):
        (k, kw), (v, vw) = newest(k, kw), newest(v, vw)
        tol = forward_tol(h, [kw, vw])
        assert (k - kw).abs().max() <= tol and (v - vw).abs().max() <= tol
    worst = max(
        float((a - b).abs().max()) / forward_tol(h, [b])
        for (k, _), (kw, _) in zip(loose.kept_layers(), whole.kept_layers(), strict=True)
        for a, b in [newest(k, kw)]
    )
    assert worst > 100  # a full-attention layer saw other tokens


def _recorded(h, monkeypatch, log: list) -> None:
    """Log every forward: ``("run", rows, tokens, id(cache))`` in the order the worker runs them."""
    real_run = h.run

    def run(input_ids, cache=None, **kw):
        ids = torch.as_tensor(input_ids)
        ids = ids[None] if ids.ndim == 1 else ids
        log.append(("run", int(ids.shape[0]), int(ids.shape[1]), id(cache)))
        return real_run(input_ids, cache, **kw)

    monkeypatch.setattr(h, "run", run)


def _decoding_during_prefill(h, monkeypatch, chunk: int) -> tuple[int, list[int], dict]:
    """A decodes; a 10,000-token prompt B arrives after A's third token. Returns A's tokens while B was
    prefilled, the prompt tokens computed between two of A's decode steps, and B's status while prefilled."""
    log: list = []
    long = _ids(10_000, 11)
    seen: dict = {}
    with _engine(h, prefill_chunk=chunk, max_batch=2) as e:

        def after_third(rec: Events, ev: tuple) -> None:
            if ev[0] == "token" and rec.tokens() == 3:
                e.submit(_request(long, 2, b))
                log.append(("B", "submitted"))

        a = Events("A", log, on=after_third)
        b = Events("B", log)
        _recorded(h, monkeypatch, log)
        real_piece = e._piece

        def piece(p, budget):
            if p.req.emit is b and "status" not in seen:
                seen["status"] = [s for s in e.status()["sessions"] if s["state"] == "prefilling"]
                seen["active"], seen["prefilling"] = e.active(), e.prefilling()
            return real_piece(p, budget)

        monkeypatch.setattr(e, "_piece", piece)
        e.submit(_request(_ids(20, 12), 200, a))
        assert b.wait()[0] == "done" and a.wait()[0] == "done"
        _idle(e)
        a_cache = id(e.sessions[a.info()["session"]].cache)
    during = log[log.index(("B", "submitted")) : log.index(("B", "start"))]
    a_tokens = sum(1 for entry in during if entry == ("A", "token"))
    between, fed = [], 0
    for entry in during:
        if entry[0] == "run" and entry[3] == a_cache:  # A's decode step
            between.append(fed)
            fed = 0
        elif entry[0] == "run":  # a piece of B's prompt
            fed += entry[2]
    return a_tokens, [*between, fed], seen


def test_a_long_prompt_delays_a_decoding_row_by_one_chunk_at_most(tiny_model, monkeypatch):
    h = tiny_model("llama")
    a_tokens, between, seen = _decoding_during_prefill(h, monkeypatch, 256)
    assert max(between) <= 256 and sum(between) == 10_000
    assert a_tokens >= 10_000 // 256 - 2  # A got a token after every budget of B's prefill
    (status,) = seen["status"]
    assert status["prompt_tokens"] == 10_000 and 0 <= status["prefilled"] < 10_000
    assert seen["active"] == 2 and seen["prefilling"] == 1
    monkeypatch.undo()
    a_tokens, between, _ = _decoding_during_prefill(h, monkeypatch, UNCHUNKED)
    assert a_tokens <= 1 and max(between) == 10_000  # before chunking: one long wait


def test_while_no_row_decodes_a_prompt_is_fed_prefill_alone_tokens_an_iteration(tiny_model, monkeypatch):
    """Alone, a prompt is fed ``prefill_alone`` tokens an iteration; from the moment a row decodes (here a
    short prompt finished earlier in the same iteration), ``prefill_chunk`` counted from the iteration's start."""
    h = tiny_model("llama")
    with _engine(h, prefill_chunk=16, prefill_alone=48) as e:
        spent: list[int] = []
        real = e._prefill_some
        monkeypatch.setattr(e, "_prefill_some", lambda: spent.append(real()) or spent[-1])
        lone = Events()
        e.submit(_request(_ids(200, 15), 1, lone))
        assert lone.wait()[0] == "done"
        _idle(e)
        assert spent == [48, 48, 48, 48, 8]
        spent.clear()
        short, long = Events(), Events()
        with e._cv:  # both wait when the worker next looks: admitted in one iteration
            e.submit(_request(_ids(10, 16), 40, short))
            e.submit(_request(_ids(300, 17), 1, long))
        assert long.wait()[0] == "done" and short.wait()[0] == "done"
        _idle(e)
        assert spent == [16] * 19 + [6]  # 10 + 6, then 16 an iteration while the short one decodes
        assert short.tokens() == 40


# -- cancelled requests -----------------------------------------------------------------------------------------
def test_a_cancelled_request_stops_within_one_step_or_one_piece(tiny_model, monkeypatch):
    h = tiny_model("llama")
    prompt = _ids(30, 13)
    with _engine(h, prefill_chunk=64) as e:
        # decoding: cancelled as its fifth token is reported; it is fed, then the row stops (no event)
        def cancel_at_five(rec: Events, ev: tuple) -> None:
            if ev[0] == "token" and rec.tokens() == 5:
                req.cancelled.set()

        a = Events(on=cancel_at_five)
        req = _request(prompt, 100, a)
        e.submit(req)
        _idle(e)
        assert a.tokens() == 5 and [ev[0] for ev in a.events] == ["start", *["token"] * 5]
        (session,) = e.sessions.values()  # returned: its cache holds exactly the tokens it was fed
        assert session.ids == prompt + _solo(h, prompt, 5) and session.cache.tokens_seen == len(prompt) + 5
        # prefilling: cancelled after its third piece; no fourth piece runs, nothing is emitted
        pieces: list[int] = []
        b = Events()
        long = _request(_ids(5000, 14), 10, b)
        real_piece = e._piece

        def piece(p, budget):
            done = real_piece(p, budget)
            pieces.append(done)
            if len(pieces) == 3:
                long.cancelled.set()
            return done

        monkeypatch.setattr(e, "_piece", piece)
        e.submit(long)
        _idle(e)
        assert len(pieces) == 3 and b.events == []
        assert set(e.sessions) == {session.id}  # a cache cut mid-prompt is dropped
        c = Events()
        e.submit(_request(session.ids + [7], 3, c))  # the returned session continues
        assert c.output() and (c.info()["source"], c.info()["cached_tokens"]) == ("session", len(prompt) + 5)


def test_prefill_chunk_must_be_positive(tiny_model):
    with pytest.raises(BadInputError, match="prefill-chunk"):
        check_settings(tiny_model("llama"), EngineSettings(window=WINDOW, prefill_chunk=0))


# -- the real server and command line ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chunked_server(tmp_path_factory):
    s = Server(
        tmp_path_factory.mktemp("serve-isolation"),
        "--window",
        "256",
        "--prefill-chunk",
        "64",
        "--max-batch",
        "3",
        "--max-tokens",
        "64",
    )
    yield s
    s.stop()


def _stream(client, prompt: str, n: int, times: list[float] | None = None) -> str:
    parts = []
    for chunk in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True
    ):
        if chunk.choices and chunk.choices[0].text:
            parts.append(chunk.choices[0].text)
            if times is not None:
                times.append(time.perf_counter())
    return "".join(parts)


COUNTING = "Count from 1 to 100: 1, 2, 3, 4,"


def test_through_the_server_a_tenants_long_or_poisoned_request_leaves_anothers_stream_intact(chunked_server):
    """Tenant A streams while tenant B sends a vanishing temperature and then a ~3,000-token prompt: A's
    stream is its solo reply, and its longest pause is a fraction of B's prefill (64-token pieces)."""
    a, b = chunked_server.client(KEY_A), chunked_server.client(KEY_B)
    alone = _stream(a, COUNTING, 48)
    results: dict = {}

    def tenant_b() -> None:
        tiny = b.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=1e-310)
        results["tiny"] = tiny.choices[0].text
        sent = time.perf_counter()
        long = b.completions.create(model=MODEL, prompt="The sky is blue. " * 600, max_tokens=2)
        results["long"] = (sent, time.perf_counter(), long.model_extra["kvlab"])

    times: list[float] = []
    thread = threading.Thread(target=tenant_b)
    started = {"thread": False}

    def on_time() -> None:
        if len(times) == 2 and not started["thread"]:
            started["thread"] = True
            thread.start()

    parts = []
    for chunk in a.completions.create(
        model=MODEL, prompt=COUNTING, max_tokens=48, temperature=0, stream=True
    ):
        if chunk.choices and chunk.choices[0].text:
            parts.append(chunk.choices[0].text)
            times.append(time.perf_counter())
            on_time()
    thread.join(120)
    assert "".join(parts) == alone
    greedy = b.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0)
    assert results["tiny"] == greedy.choices[0].text  # the T -> 0 limit
    sent, answered, info = results["long"]
    assert info["computed_tokens"] + info["cached_tokens"] >= 3000
    during = [t for t in times if sent <= t <= answered]
    gaps = [t1 - t0 for t0, t1 in zip(times, times[1:], strict=False) if t1 >= sent]
    prefill_s = info["prefill_ms"] / 1000
    print(
        f"A's pauses while B's {info['computed_tokens']}-token prompt was prefilled in {prefill_s:.2f} s: "
        f"{len(during)} tokens, longest {max(gaps):.3f} s"
    )
    assert len(during) >= 5 and max(gaps) < prefill_s / 4
    health = chunked_server.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert health[0] == 200


@pytest.mark.process
def test_the_command_line_takes_a_vanishing_temperature_and_checks_the_prefill_chunk(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "kvlab"]
    done = subprocess.run(
        [*run, "generate", "hi", "-t", "1e-320", "-n", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    greedy = subprocess.run(
        [*run, "generate", "hi", "-t", "0", "-n", "4"], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.stdout == greedy.stdout
    bad = subprocess.run(
        [*run, "serve", "--prefill-chunk", "0", "--store", str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and "--prefill-chunk" in lines[0], bad.stderr
    assert not (tmp_path / "store").exists()
