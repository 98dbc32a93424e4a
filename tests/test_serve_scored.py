"""``kvlab serve --cache POLICY,budget=N,every=N``: conversations over a scored eviction that keeps its budget
while decoding (H2O, key-norm...), each equal to the same live cache fed by hand, decoded together with other
conversations in one batched step, bounded whatever the conversation's length.

The engine is driven directly with a tiny random-weight Llama; the end-to-end test runs the bundled SmolLM2
behind ``kvlab serve`` and the ``openai`` client.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.hf.cache import head_dim_of
from kvlab.loop import GREEDY
from kvlab.policy.spec import cache_for, parse
from kvlab.serve.engine import Engine, EngineSettings, Request
from tests.test_serve_cache_spec import _ids, _Reply

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BUDGET, EVERY = 24, 8
SPECS = [
    f"h2o,budget={BUDGET},every={EVERY}",
    f"knorm,budget={BUDGET},every={EVERY}",
    # a policy added in one file (policy/evict/methods/random_sinks.py) is served by its name alone
    f"random_sinks,budget={BUDGET},every={EVERY}",
    # and survivors stored as per-token codes
    f"tova,budget={BUDGET},every={EVERY},codec=int4",
]


def _submit(engine: Engine, ids: list[int], n: int) -> _Reply:
    reply = _Reply()
    engine.submit(Request(ids=list(ids), max_new_tokens=n, sampling=GREEDY, emit=reply))
    return reply


class _ByHand:
    """One conversation on its own live cache, fed as the engine feeds it: each new part in one forward,
    then one token per step."""

    def __init__(self, h, spec: str) -> None:
        self.h, self.cache, self.logits = h, cache_for(spec, h), None

    def feed(self, ids: list[int]) -> None:
        x = torch.tensor([ids], dtype=torch.long)
        with torch.no_grad():
            self.logits = self.h.run(x, self.cache, logits_to_keep=1).logits[0, -1].float()

    def generate(self, n: int) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            assert self.logits is not None
            out.append(int(self.logits.argmax()))
            self.feed(out[-1:])
        return out


@pytest.mark.parametrize("spec", SPECS)
def test_a_scored_conversation_equals_its_cache_fed_by_hand_and_stays_within_budget(tiny_model, spec):
    """Six turns, each reply's greedy tokens equal to the same policy's cache fed by hand; the cache holds at
    most the budget plus ``every`` slots per layer and head at every turn, and it evicts (``rolls``)."""
    h = tiny_model("llama")
    e = Engine(h, EngineSettings(cache=spec))
    try:
        mine, ids, rolls, n = _ByHand(h, spec), [], 0, 10
        for turn in range(6):
            new = _ids(60 if turn == 0 else 20, turn)
            ids = ids + new
            info = _submit(e, ids, n).done()
            mine.feed(new)
            out = mine.generate(n)
            assert info["completion_ids"] == out, turn
            assert info["cache"]["spec"] == parse(spec).spec and info["cache"]["exact"] is False
            assert info["source"] == ("none" if turn == 0 else "session")
            assert info["kept_tokens"] == mine.cache.kept <= BUDGET + EVERY
            assert info["cache_bytes"] == mine.cache.nbytes and info["pinned_tokens"] == 0
            rolls += info["rolls"]
            ids = ids + out
        assert rolls > 0 and mine.cache.evictions == rolls
        fp_slot = h.config.num_hidden_layers * 2 * h.config.num_key_value_heads * head_dim_of(h.config) * 4
        assert mine.cache.nbytes <= (BUDGET + EVERY) * fp_slot
        (row,) = [s for s in e.status()["sessions"] if s["state"] == "idle"]
        assert row["window"] == BUDGET + EVERY and row["kept"] == mine.cache.kept and row["pinned"] == 0
        from kvlab.serve.status import describe_layout

        assert (
            describe_layout(row)
            == f"{mine.cache.kept} kept by score, at most {BUDGET + EVERY} (budget + every)"
        )
    finally:
        e.stop()


def test_attention_scored_conversations_decode_together_each_with_its_own_queries(tiny_model):
    """Three H2O conversations decoded in one batched step each: every cache scores its evictions by its
    own row's queries (each cache's query hook sees the whole batch), so each equals its own cache fed by
    hand, token for token, through several evictions."""
    h = tiny_model("llama")
    spec = SPECS[0]
    e = Engine(h, EngineSettings(cache=spec, max_batch=4))
    try:
        prompts = [_ids(40 + 7 * i, 10 + i) for i in range(3)]
        n = 3 * EVERY + 5  # several evictions while the three decode together
        replies = [_submit(e, p, n) for p in prompts]
        infos = [r.done() for r in replies]
        for p, info in zip(prompts, infos, strict=True):
            mine = _ByHand(h, spec)
            mine.feed(p)
            out = mine.generate(n)
            assert info["completion_ids"] == out
            assert info["kept_tokens"] == mine.cache.kept <= BUDGET + EVERY and info["rolls"] > 0
    finally:
        e.stop()


def test_a_dropped_scored_conversation_leaves_no_query_hook_behind(tiny_model):
    """Sessions beyond ``max_sessions`` are dropped (least recently used first); their caches' query hooks
    go with them, so the model does not collect one hook per conversation ever served."""
    import gc

    from transformers import DynamicCache

    h = tiny_model("llama")
    q_proj = h.model.model.layers[0].self_attn.q_proj
    e = Engine(h, EngineSettings(cache=SPECS[0], max_sessions=2))
    try:
        for i in range(5):
            _submit(e, _ids(30, 40 + i), 2).done()
        assert e.idle_sessions() == 2
        gc.collect()  # earlier tests' caches too: a hook whose layer is gone removes itself when it next fires
        with torch.no_grad():
            h.run(torch.tensor([_ids(3, 0)]), DynamicCache(config=h.config))
        assert len(q_proj._forward_hooks) == 2  # the two idle sessions' hooks, no more
    finally:
        e.stop()


# -- end to end: the bundled SmolLM2 behind `kvlab serve --cache h2o,...`, through the openai client ----------
@pytest.mark.process
def test_kvlab_serve_serves_an_h2o_conversation_within_its_budget_to_the_openai_client(tmp_path):
    from tests.test_serve import Server, converse

    spec, budget, every = "h2o,budget=64,every=16", 64, 16
    server = Server(tmp_path, "--cache", spec, "--max-tokens", "48", keys=(), admin=None)
    try:
        assert f"cache {spec}: the top 64 slots by h2o, re-scored every 16 tokens" in server.log.read_text()
        client = server.client("none")
        infos, messages, seen = converse(client, 5)
        for i, info in enumerate(infos):
            assert info["cache"]["spec"] == spec and info["cache"]["exact"] is False
            assert info["cache"]["policy"] == "h2o" and info["source"] == ("none" if i == 0 else "session")
        kept, rolls = [info["kept_tokens"] for info in infos], sum(info["rolls"] for info in infos)
        assert seen > 2 * (budget + every) and rolls > 0, (seen, rolls)
        assert max(kept) <= budget + every, kept
        messages.append({"role": "user", "content": "And one more?"})
        stream = client.chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        page = server.get("/metrics")[2].decode()
        assert f'spec="{spec}"' in page and "kvlab_rolls_total" in page
    finally:
        server.stop()
