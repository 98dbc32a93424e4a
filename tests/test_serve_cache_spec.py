"""``kvlab serve --cache SPEC``: every conversation rolls over the spec's sinks + window, its window stored as
the spec's codec (packed codes), and each response says which policy held the cache and how many bytes.

The engine is driven directly with a tiny random-weight Llama (fast, and exact: its greedy tokens are
compared with a coded :class:`~kvlab.hf.RollingCache` fed by hand, token for token); the command line's
refusals run through the CLI tables' runner (each before any model loads).
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.hf.cache import head_dim_of
from kvlab.hf.rolling_cache import rolling_cache_for
from kvlab.loop import GREEDY
from kvlab.serve.engine import Engine, EngineSettings, Request, check_settings, serve_policy
from kvlab.serve.metrics import Metrics
from kvlab.store import open_store
from kvlab.streaming.generate import feed
from tests.cli_runner import Runner, assert_one_line_exit_2

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = "sinks=4,window=96,chunk=32,codec=kivi4"  # kivi4 keeps a 32-slot full-precision tail: 96 is its least
SINKS, WINDOW, CHUNK = 4, 96, 32
UNCHUNKED = 10**9  # a prefill budget no prompt reaches: each forward as the hand-fed loop runs it


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Reply:
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.finished = threading.Event()

    def __call__(self, ev: tuple) -> None:
        self.events.append(ev)
        if ev[0] in ("done", "error"):
            self.finished.set()

    def done(self) -> dict:
        assert self.finished.wait(120), self.events
        assert self.events[-1][0] == "done", self.events[-1]
        return self.events[-1][2]


def _ask(engine: Engine, ids: list[int], n: int, salt: str = "") -> dict:
    reply = _Reply()
    engine.submit(Request(ids=list(ids), max_new_tokens=n, sampling=GREEDY, emit=reply, salt=salt))
    return reply.done()


def _coded_cache(handle):
    policy = serve_policy(SPEC)
    return rolling_cache_for(
        handle,
        window=WINDOW,
        sinks=SINKS,
        evict_chunk=CHUNK,
        codec=policy.quantizer(head_dim_of(handle.config)),
    )


def _generate(handle, cache, logits, n: int) -> tuple[list[int], torch.Tensor]:
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = feed(handle, cache, [out[-1]])
    return out, logits


def test_serve_runs_sinks_window_specs_only_and_sets_the_window_from_the_spec():
    s = EngineSettings(cache="window=96, sinks=4, chunk=32, codec=kivi4")
    assert (s.window, s.sinks, s.evict_chunk, s.cache) == (WINDOW, SINKS, CHUNK, SPEC)
    assert s.policy.spec == SPEC and not s.policy.exact and s.policy.codec_name == "kivi4"
    assert EngineSettings(cache="sinks=2,window=256").evict_chunk == 64  # the rolling cache's default
    plain = EngineSettings(window=64, sinks=4, evict_chunk=16)  # no spec: full-precision sinks + window
    assert (
        plain.cache is None
        and plain.policy.spec == "sinks=4,window=64,chunk=16"
        and plain.policy.codec is None
    )
    for spec in ("full", "int4", "kivi:int2", "sinks=4,codec=kivi4"):
        with pytest.raises(BadInputError, match="kvlab serve runs sinks \\+ window caches"):
            EngineSettings(cache=spec)
    for spec in ("h2o,keep=0.25", "snapkv:0.5"):  # scored layouts run only while they keep their budget
        with pytest.raises(BadInputError, match="add every=N"):
            EngineSettings(cache=spec)
    with pytest.raises(BadInputError, match="per-head budgets"):
        EngineSettings(cache="tova,keep=0.5,every=8,heads=ada")
    scored = EngineSettings(cache="h2o, budget=64, every=16")
    assert scored.policy.layout.rolls() is None and scored.cache == "h2o,budget=64,every=16"
    with pytest.raises(BadInputError, match="unknown codec"):
        EngineSettings(cache="sinks=4,window=96,codec=nope4")


def test_a_window_too_small_for_the_codec_is_refused_before_anything_is_built(tiny_model):
    h = tiny_model("llama")
    with pytest.raises(BadInputError, match="holds none"):
        check_settings(h, EngineSettings(cache="sinks=4,window=64,codec=kivi4"))
    check_settings(h, EngineSettings(cache="sinks=4,window=64,codec=kivi4,tail=0"))  # no tail: it fits


def test_a_conversation_over_a_coded_window_equals_the_hand_fed_cache_and_stays_bounded(tiny_model):
    """Ten turns (about five windows): each reply's greedy tokens equal a coded RollingCache fed by hand,
    each response names the policy and the bytes the conversation's cache holds (the hand-fed cache's own),
    and those bytes stop growing once the window is full."""
    h = tiny_model("llama")
    metrics = Metrics()
    e = Engine(h, EngineSettings(cache=SPEC, prefill_chunk=UNCHUNKED), metrics=metrics)
    try:
        from kvlab.serve.app import create_app

        create_app(e, model_id="tiny")  # registers the policy's info gauge
        cache, ids, logits = _coded_cache(h), [], None
        sizes, n = [], 12
        for turn in range(10):
            new = _ids(40 if turn else 150, turn)  # the first prompt alone outgrows the window
            ids = ids + new
            info = _ask(e, ids, n)
            if turn == 0:  # as the engine feeds a new conversation: the head, then the rest
                logits = feed(h, cache, new[: SINKS + WINDOW])
                logits = feed(h, cache, new[SINKS + WINDOW :])
            else:
                logits = feed(h, cache, new)
            out, logits = _generate(h, cache, logits, n)
            assert info["completion_ids"] == out, turn
            assert info["cache"] == {
                "spec": SPEC,
                "kind": "window",
                "layout": "sinks_window",
                "sinks": SINKS,
                "window": WINDOW,
                "codec": "kivi4",
                "quantizer": "kivi",
                "bits": 4,
                "exact": False,
            }
            assert info["source"] == ("none" if turn == 0 else "session")
            assert info["cache_bytes"] == cache.nbytes() > 0
            sizes.append(info["cache_bytes"])
            ids = ids + out
        assert len(ids) > 5 * WINDOW and cache.rolls > 3
        # bounded: never more than the sinks + window + one chunk in full precision would take ...
        text = h.config
        kv_heads = text.num_key_value_heads
        fp_slot = text.num_hidden_layers * 2 * kv_heads * head_dim_of(text) * 4  # bytes of one float32 slot
        assert max(sizes) <= (SINKS + WINDOW + CHUNK) * fp_slot
        # ... and no more late in the conversation than once the window first filled
        assert max(sizes[3:]) <= max(sizes[:3])
        # the idle session's bytes are what /metrics reports, with the policy as an info gauge
        page = metrics.render().decode()
        assert f"kvlab_idle_session_bytes {float(cache.nbytes())}" in page
        assert (
            f'kvlab_cache_policy_info{{codec="kivi4",exact="false",layout="sinks_window",spec="{SPEC}"}} 1.0'
            in page
        )
        assert e.status()["settings"]["cache"] == SPEC
    finally:
        e.stop()


def test_the_coded_window_holds_fewer_bytes_than_the_full_precision_one(tiny_model):
    h = tiny_model("llama")
    prompt = _ids(300, 7)
    sizes = {}
    for spec in (SPEC, "sinks=4,window=96,chunk=32"):
        e = Engine(h, EngineSettings(cache=spec, prefill_chunk=UNCHUNKED))
        try:
            info = _ask(e, prompt, 8)
            assert info["cache"]["spec"] == spec and info["cache"]["exact"] is False
            sizes[spec] = info["cache_bytes"]
            assert e.session_bytes() == info["cache_bytes"]
        finally:
            e.stop()
    assert sizes[SPEC] < 0.6 * sizes["sinks=4,window=96,chunk=32"], sizes


def test_a_stored_prefix_is_full_precision_and_seeds_every_policy_alike(tiny_model):
    """A head stored by a full-precision server is hit by a coded one on the same store: the blocks are the
    model's own prompt K/V whatever the policy (the codec applies when they are seeded), so the coded reply
    equals the coded server's without a store, and the hand-fed coded cache's."""
    h = tiny_model("llama")
    store = open_store("memory")
    prompt = _ids(200, 11)
    plain = Engine(
        h, EngineSettings(cache="sinks=4,window=96,chunk=32", prefill_chunk=UNCHUNKED), store=store
    )
    try:
        assert _ask(plain, prompt, 4)["source"] == "none"
    finally:
        plain.stop()
    coded = Engine(h, EngineSettings(cache=SPEC, prefill_chunk=UNCHUNKED), store=store)
    alone = Engine(h, EngineSettings(cache=SPEC, prefill_chunk=UNCHUNKED))
    try:
        hit, computed = _ask(coded, prompt, 16), _ask(alone, prompt, 16)
    finally:
        coded.stop()
        alone.stop()
    assert hit["source"] == "store" and hit["cached_tokens"] > 0 and computed["source"] == "none"
    cache = _coded_cache(h)
    feed(h, cache, prompt[: SINKS + WINDOW])
    out, _ = _generate(h, cache, feed(h, cache, prompt[SINKS + WINDOW :]), 16)
    assert hit["completion_ids"] == computed["completion_ids"] == out


# -- the command line: one line and exit 2, before the model loads ------------------------------------------
BAD = [
    (["serve", "--cache", "h2o,keep=0.25"], "add every=N"),
    (["serve", "--cache", "full"], "kvlab serve runs sinks + window caches"),
    (["serve", "--cache", "kivi4"], "kvlab serve runs sinks + window caches"),
    (["serve", "--cache", "sinks=4,window=96,codec=nope4"], "unknown codec"),
    (["serve", "--cache", "sinks=4,window=0"], "window must be >= 1"),
    (["serve", "--cache", ""], "empty cache spec"),
    (["serve", "--cache", SPEC, "--window", "64"], "drop --window"),
    (["serve", "--cache", SPEC, "--sinks", "2", "--evict-chunk", "8"], "drop --sinks, --evict-chunk"),
]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    # a model folder that is here (--model is checked while the options are read) but holds no weights:
    # were a refusal missed, nothing could load
    model = tmp_path_factory.mktemp("no-weights")
    (model / "config.json").write_text("{}")
    run = Runner(tmp_path_factory.mktemp("serve-cache-runs"))
    for argv, _ in BAD:
        run.submit(" ".join(argv), argv + ["--model", str(model), "--port", "1"])
    yield run
    run.close()


@pytest.mark.parametrize("argv, fragment", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_cache_spec_is_one_line_and_exit_2(runner, argv, fragment):
    assert_one_line_exit_2(runner.result(" ".join(argv)), fragment)


# -- end to end: the bundled SmolLM2 behind `kvlab serve --cache`, through the openai client -------------------
@pytest.mark.process
def test_kvlab_serve_cache_serves_a_rolling_coded_conversation_to_the_openai_client(tmp_path):
    from tests.test_serve import Server, converse

    server = Server(tmp_path, "--cache", SPEC, "--max-tokens", "48", keys=(), admin=None)
    try:
        assert f"cache {SPEC}: 4 sinks + the last 96 slots, in kivi4 codes" in server.log.read_text()
        client = server.client("none")
        infos, _, seen = converse(client, 6)
        for info in infos:
            assert info["cache"]["spec"] == SPEC and info["cache"]["exact"] is False
            assert info["cache"]["codec"] == "kivi4"
        sizes, rolls = [info["cache_bytes"] for info in infos], sum(info["rolls"] for info in infos)
        assert seen > 2 * WINDOW and rolls > 0, (seen, rolls)
        # bounded: under what the pinned system prompt + window + one chunk take in full precision
        fp_slot = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, keys and values, 3 KV heads of 64, float32
        assert max(sizes) <= (max(SINKS, info["pinned_tokens"]) + WINDOW + CHUNK) * fp_slot, sizes
        page = server.get("/metrics")[2].decode()
        assert f'spec="{SPEC}"' in page and "kvlab_cache_policy_info" in page
    finally:
        server.stop()
