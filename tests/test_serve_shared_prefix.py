"""``kvlab serve --cache POLICY,budget=N,every=N[,prefix=SCORE]``: a system prompt longer than the budget is
compressed once, alone, stored under the policy and shared by every conversation that starts with it
(:mod:`kvlab.serve.prefixes`). Each answer equals a cache built by hand from the compressed prefix; a hit
equals a miss; another server on the same store folder starts from the stored record; a tampered record is
recomputed, never served; a different policy or tenant never sees it.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.loop import GREEDY
from kvlab.policy.spec import cache_for, parse
from kvlab.serve.engine import Engine, EngineSettings, Request
from kvlab.store import open_store
from tests.test_serve_cache_spec import _ids, _Reply

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = "h2o,budget=24,every=8"
PINNED = 50


def _ask(engine: Engine, ids: list[int], n: int = 6, salt: str = "", pinned: int = PINNED) -> dict:
    reply = _Reply()
    engine.submit(
        Request(ids=list(ids), max_new_tokens=n, sampling=GREEDY, emit=reply, salt=salt, pinned=pinned)
    )
    return reply.done()


def _by_hand(h, spec: str, system: list[int], rest: list[int], n: int = 6) -> tuple[list[int], int]:
    """The compressed prefix seeded by hand, the rest fed in one forward, then greedy steps."""
    policy = parse(spec)
    cache = cache_for(policy.live(), h)
    cache.seed_kept(policy.layout.compress_prefix(h, system), len(system))
    out: list[int] = []
    with torch.no_grad():
        logits = h.run(torch.tensor([rest]), cache, logits_to_keep=1).logits[0, -1]
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = h.run(torch.tensor([out[-1:]]), cache, logits_to_keep=1).logits[0, -1]
    kept = cache.kept
    cache.close()
    return out, kept


@pytest.mark.parametrize("spec", [SPEC, f"{SPEC},prefix=kvzip", "knorm,keep=0.5,every=8,codec=int8"])
def test_conversations_sharing_a_system_prompt_start_from_one_compressed_prefix(tiny_model, tmp_path, spec):
    h = tiny_model("llama")
    system = _ids(PINNED, 1)
    e = Engine(h, EngineSettings(cache=spec), store=open_store(tmp_path / "store"))
    try:
        infos = [_ask(e, system + _ids(9, 10 + i)) for i in range(3)]
        for i, info in enumerate(infos):
            out, kept = _by_hand(h, spec, system, _ids(9, 10 + i))
            assert info["completion_ids"] == out, i
            cp = info["compressed_prefix"]
            assert cp["tokens"] == PINNED and cp["policy"] == parse(spec).spec
            assert cp["source"] == ("computed" if i == 0 else "memory")
            assert info["source"] == ("none" if i == 0 else "compressed-prefix")
            assert info["cached_tokens"] == (0 if i == 0 else PINNED)
            assert info["kept_tokens"] == kept < PINNED + 9 + 6
        assert e.prefixes.counts == {"computed": 1, "reused": 2, "warnings": 0}
        from kvlab.serve.status import status_page

        stats = e.store_stats()["compressed_prefixes"]
        assert stats["hits"]["memory"] == 2 and stats["rejected"] == 0
        page = status_page("tiny", e.status(), e.store_stats())
        assert (
            "compressed shared prefixes: 1 computed, 2 reused (2 from memory), 0 stored records rejected"
            in page
        )
    finally:
        e.stop()
    # another server on the same folder (a replica, or a restart) starts from the stored record
    e2 = Engine(h, EngineSettings(cache=spec), store=open_store(tmp_path / "store"))
    try:
        info = _ask(e2, system + _ids(9, 10))
        assert info["compressed_prefix"]["source"] == "disk"
        assert info["completion_ids"] == infos[0]["completion_ids"]
    finally:
        e2.stop()


def test_another_policy_or_tenant_never_sees_the_compressed_prefix(tiny_model, tmp_path):
    h = tiny_model("llama")
    system, q = _ids(PINNED, 1), _ids(9, 10)
    store = tmp_path / "store"
    for spec, salt, source in (
        (SPEC, "a", "computed"),
        (SPEC, "a", "memory"),
        (SPEC, "b", "computed"),  # another tenant's salt
        (f"{SPEC},prefix=kvzip", "a", "computed"),  # another policy
    ):
        e = Engine(h, EngineSettings(cache=spec), store=open_store(store))
        try:
            if source == "memory":
                _ask(e, system + q, salt=salt)
            info = _ask(e, system + q, salt=salt)
            assert info["compressed_prefix"]["source"] == source, (spec, salt)
        finally:
            e.stop()


def test_a_tampered_compressed_prefix_is_recomputed_not_served(tiny_model, tmp_path):
    h = tiny_model("llama")
    system, q = _ids(PINNED, 1), _ids(9, 10)
    e = Engine(h, EngineSettings(cache=SPEC), store=open_store(tmp_path / "store"))
    try:
        first = _ask(e, system + q)
    finally:
        e.stop()
    (record,) = [f for f in (tmp_path / "store" / "compressed").rglob("*") if f.is_file()]
    data = bytearray(record.read_bytes())
    data[-20] ^= 0x40  # one bit of a tensor
    record.write_bytes(bytes(data))
    e = Engine(h, EngineSettings(cache=SPEC), store=open_store(tmp_path / "store"))
    try:
        info = _ask(e, system + q)
        assert info["compressed_prefix"]["source"] == "computed"
        assert info["completion_ids"] == first["completion_ids"]
        assert e.prefixes.store is not None and e.prefixes.store.counters.rejected >= 1
    finally:
        e.stop()


def test_replicas_on_one_redis_share_the_compressed_prefix_and_a_tampered_one_is_recomputed(
    tiny_model, redis_url
):
    """Two servers on one Redis (no shared folder): the second starts from the first's record; a record
    changed in Redis is a miss, recomputed to the same answer, never served."""
    import uuid

    import redis

    from kvlab.store.memory import MemoryTier
    from kvlab.store.redis_tier import RedisTier
    from kvlab.store.store import KVStore

    h = tiny_model("llama")
    system, q = _ids(PINNED, 1), _ids(9, 10)
    prefix = f"kvlabtest-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    answers, sources = [], []
    try:
        for step in range(3):
            store = KVStore([MemoryTier(), RedisTier(redis_url, prefix=prefix)])
            e = Engine(h, EngineSettings(cache=SPEC), store=store)
            try:
                info = _ask(e, system + q)
            finally:
                e.stop()
            answers.append(info["completion_ids"])
            sources.append(info["compressed_prefix"]["source"])
            if step == 1:  # flip one byte of the stored record
                (key,) = [k for k in client.scan_iter(f"{prefix}:compressed:*")]
                data = bytearray(client.get(key))
                data[-7] ^= 0x01
                client.set(key, bytes(data))
        assert sources == ["computed", "redis", "computed"]
        assert answers[0] == answers[1] == answers[2]
    finally:
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)


def test_a_short_system_prompt_or_an_exact_layout_is_not_compressed(tiny_model):
    h = tiny_model("llama")
    for spec, pinned in ((SPEC, 20), ("sinks=4,window=96", PINNED)):
        e = Engine(h, EngineSettings(cache=spec))
        try:
            info = _ask(e, _ids(PINNED, 1) + _ids(9, 10), pinned=pinned)
            assert "compressed_prefix" not in info
        finally:
            e.stop()


@pytest.mark.process
def test_kvlab_serve_shares_a_compressed_document_with_the_openai_client(tmp_path):
    """End to end on the bundled model: two conversations with one long system message and different questions;
    the second starts from the first's compressed document (KVzip), the metrics count it."""
    from tests.test_serve import Server

    spec = "h2o,budget=48,every=32,prefix=kvzip"
    server = Server(tmp_path, "--cache", spec, "--max-tokens", "8", keys=(), admin=None)
    try:
        client = server.client("none")
        document = " ".join(
            f"Room {i} of the museum holds a painting of a {w}." for i, w in enumerate("abcdefghij")
        )
        infos = []
        for question in ("Which room holds the painting of a c?", "Which room holds the painting of a g?"):
            reply = client.chat.completions.create(
                model="smollm2-135m",
                messages=[{"role": "system", "content": document}, {"role": "user", "content": question}],
                max_tokens=8,
                temperature=0,
            )
            infos.append(reply.model_extra["kvlab"])
        first, second = (info["compressed_prefix"] for info in infos)
        assert first["source"] == "computed" and second["source"] == "memory"
        assert first["tokens"] == second["tokens"] > 48 and first["kept"] == second["kept"] == 48
        assert infos[1]["source"] == "compressed-prefix" and infos[1]["cached_tokens"] == second["tokens"]
        page = server.get("/metrics")[2].decode()
        assert 'kvlab_compressed_prefixes_total{source="memory"} 1.0' in page
        assert 'kvlab_compressed_prefixes_total{source="computed"} 1.0' in page
    finally:
        server.stop()
