"""``kvlab serve --capture``: the engine's decoding conversations through one captured step over ring rows.

The reference is the same engine without capture (each conversation's own eager cache, batched per row):
the same requests, arriving at the same points, give the same greedy tokens, the same rolls and the same
kept slots, and a conversation continued after its reply reuses the cache its captured row wrote back.
The engine is driven directly with a tiny random-weight Llama (its eager path is itself tested against a
rolling cache fed alone, ``test_serve_isolation``); the last test runs ``kvlab serve --capture compile`` with
the bundled model through the ``openai`` client.
"""

from __future__ import annotations

import pytest

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.serve.engine import EngineSettings, check_settings
from tests.test_serve_isolation import Events, _engine, _idle, _ids, _request

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _script(h, capture: str) -> list[tuple]:
    """Four requests (one pinning a 10-token system prompt; one arriving while two decode; one continuing a
    finished conversation) on three rows; per request its tokens, rolls, kept slots and cached tokens."""
    with _engine(h, max_batch=3, capture=capture) as e:
        a, b, c = Events(), Events(), Events()
        pa, pb, pc = _ids(70, 1), _ids(25, 2), _ids(10, 3)
        e.submit_many([_request(pa, 40, a), _request(pb, 30, b, pinned=10)])
        while b.tokens() < 5:  # c joins while a and b decode
            b.finished.wait(0.005)
        e.submit(_request(pc, 90, c))
        out_a = a.output()
        d = Events()
        e.submit(_request([*pa, *out_a, *_ids(5, 4)], 20, d))  # continues a's conversation
        results = []
        for ev in (a, b, c, d):
            info = ev.wait()[2]
            results.append((ev.output(), info["rolls"], info["kept_tokens"], info["cached_tokens"]))
        _idle(e)
        assert d.info()["session"] == a.info()["session"]
    return results


@pytest.mark.parametrize("capture", ["eager", "compile"])
def test_captured_rows_serve_what_the_eager_engine_serves(capture, tiny_model):
    h = tiny_model("llama")
    want, got = _script(h, "off"), _script(h, capture)
    assert got == want
    assert sum(r[1] for r in got) >= 7  # the windows rolled (window 64, chunks of 16)
    assert got[3][3] > 100  # the continuation reused a's written-back cache


def test_the_status_of_a_conversation_in_a_captured_row_is_current(tiny_model):
    """While a conversation decodes in a row, the status page counts its row's tokens, not the eager cache
    it joined from (written back only when the reply ends)."""
    with _engine(tiny_model("llama"), max_batch=2, capture="eager") as e:
        ev = Events()
        e.submit(_request(_ids(30, 7), 90, ev))
        while ev.tokens() < 40 and not ev.finished.is_set():
            ev.finished.wait(0.005)
        decoding = [s for s in e.status()["sessions"] if s["state"] == "decoding"]
        ev.wait()
        _idle(e)
    assert len(decoding) == 1
    assert decoding[0]["seen"] >= 30 + 40 - 1  # the prompt and the tokens decoded so far
    assert decoding[0]["rolls"] >= 1  # window 64: it rolled in the row


def test_capture_refusals(tiny_model):
    h = tiny_model("llama")
    with pytest.raises(BadInputError, match="sinks \\+ window"):
        check_settings(h, EngineSettings(cache="h2o,budget=64,every=16", capture="compile"))
    with pytest.raises(BadInputError, match="model's dtype"):
        check_settings(h, EngineSettings(cache="sinks=4,window=256,codec=kivi4", capture="compile"))
    with pytest.raises(BadInputError, match="capture must be"):
        check_settings(h, EngineSettings(capture="graphs"))  # type: ignore[arg-type]
    with pytest.raises(UnsupportedModelError, match="sliding-window layers"):
        check_settings(tiny_model("gemma3"), EngineSettings(window=64, capture="compile"))


def test_auto_capture_on_a_cpu_is_what_pays_there_per_command():
    """``--capture auto`` on a CPU: serve's compiled rows (about 2x eager, serve_decode.md); off elsewhere
    (generate's lockstep ring is not measured faster compiled on a CPU); cuda-graph needs a GPU."""
    from kvlab.cli.common import capture_on

    assert capture_on("auto", "cpu") == "off"
    assert capture_on("auto", "cpu", on_cpu="compile") == "compile"
    assert capture_on("compile", "cpu") == "compile"
    with pytest.raises(BadInputError, match="needs a CUDA device"):
        capture_on("cuda-graph", "cpu", on_cpu="compile")


def _conversations(server) -> list[tuple[str, int]]:
    """Two conversations at once (one with a system prompt), then the first continued: each reply's text
    and the rolls its response reports."""
    import threading

    from tests.test_serve import chat

    long = "Remember this context. " * 40
    first = [
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": long + "Tell a story."},
        ],
        [{"role": "user", "content": "Count from one to fifty in words."}],
    ]
    replies: list = [None, None]

    def run(i: int) -> None:
        replies[i] = chat(server.client(), first[i], n=60)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    more = [*first[0], {"role": "assistant", "content": replies[0].choices[0].message.content}]
    more.append({"role": "user", "content": "And another one."})
    replies.append(chat(server.client(), more, n=30))
    return [(r.choices[0].message.content, r.model_extra["kvlab"]["rolls"]) for r in replies]


@pytest.mark.real_model
@pytest.mark.process
@pytest.mark.slow
def test_kvlab_serve_capture_compile_answers_as_eager_serve(tmp_path):
    """``kvlab serve --capture compile`` (torch.compile on this CPU) and ``kvlab serve`` give the bundled
    model's conversations the same greedy replies and rolls, through the ``openai`` client."""
    from tests.test_serve import Server

    answers = {}
    for capture in ("off", "compile"):
        # the compiled server compiles and autotunes a step per width before it listens: minutes, with load
        server = Server(tmp_path, "--capture", capture, "--max-batch", "2", start_s=600)
        try:
            answers[capture] = _conversations(server)
            status = server.get("/health")[2]
        finally:
            server.stop()
        assert f'"capture":"{capture}"'.encode() in status
    assert answers["compile"] == answers["off"]
    assert sum(rolls for _, rolls in answers["off"]) >= 3  # the windows (96 + 4 sinks) rolled


def test_a_fresh_model_compiles_its_captured_step_before_anything_else():
    """The server builds its compiled step at start-up, before the model ran once: nothing the traced step
    reads may be computed lazily under a lock (a ``cached_property`` of the handle was)."""
    from kvlab.model.random import tiny_random_model
    from kvlab.serve.engine import captured_rows
    from tests.conftest import config_path

    h = tiny_random_model(config_path("llama"))  # not the cached fixture: nothing has run on it
    rows = captured_rows(h, EngineSettings(window=64, sinks=4, evict_chunk=16).policy, 2, "compile")
    assert rows.decoder.captures == len(rows.pool.widths) == 2  # a step of one row and of both
