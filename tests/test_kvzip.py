"""KVzip (issue 49): slots scored by the attention of a reconstruction pass, so the kept set is the context's
alone; checked against the model's own attention weights, budgets, the refusals and the eval CLI."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.policy.evict import evict, make_policy, observe
from kvlab.policy.evict.budgets import evict_ragged
from kvlab.policy.evict.methods.kvzip import REPEAT_PROMPT, KVzip
from kvlab.policy.evict.select import layer_views
from tests.test_eval_tasks import HAYSTACK, WordTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny(tiny_llama_2x64):
    from kvlab.model.handle import ModelHandle

    return ModelHandle(tiny_llama_2x64.model, WordTokenizer(), name="tiny-llama")


def test_scores_are_the_reconstruction_pass_attention(tiny):
    """Each slot's score is the most attention the model itself gives it (output_attentions) from any token
    of context + repeat prompt + context, over the query heads of its KV group."""
    ctx = _ids(48, 1, 512)
    probe = KVzip().probe_ids(ctx, tiny.tokenizer)
    prompt = WordTokenizer().encode(REPEAT_PROMPT)
    assert probe == [*prompt, *ctx] and prompt  # the repeat prompt, then the context again
    obs = observe(tiny, ctx)
    views = layer_views(obs, KVzip())
    att = tiny.prefill([*ctx, *probe], output_attentions=True).attentions
    t, hkv = len(ctx), obs.snapshot.num_kv_heads
    for view, a in zip(views, att, strict=True):
        hq = a.shape[1]
        want = a[0, :, t:, :t].float().amax(dim=1).view(hkv, hq // hkv, t).amax(dim=1)
        got = KVzip(chunk=7).score(view)[0]  # chunks of 7 pass tokens: the running max is the max
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert obs.probes and len(obs.probes) == 1  # the pass ran once and was kept
    layer_views(obs, KVzip())
    assert len(obs.probes) == 1


def test_probe_without_a_tokenizer_and_the_bos():
    class Bos(WordTokenizer):
        bos_token_id = 7

    assert KVzip().probe_ids([3, 4], None) == [3, 4]  # no tokenizer: the context alone, again
    prompt = Bos().encode(REPEAT_PROMPT)
    assert KVzip().probe_ids([7, 3, 4], Bos()) == [*prompt, 3, 4]  # a leading BOS opens a sequence only


def test_the_kept_set_does_not_depend_on_the_question(tiny):
    """The same context under two questions keeps the same slots (the question never enters the score);
    a query-aware score (SnapKV over context + question) keeps different ones."""
    ctx, q1, q2 = _ids(64, 2, 512), _ids(8, 3, 512), _ids(8, 4, 512)
    kept = []
    for q in (q1, q2):
        obs = observe(tiny, ctx)  # what the eval compresses: the context, before any question
        kept.append(evict(obs, KVzip(), keep=0.5).valid)
        snap = evict(observe(tiny, [*ctx, *q]), make_policy("snapkv", window=0, observe=8), keep=0.5)
        kept.append(tuple(v[..., : len(ctx)] for v in snap.valid))
    assert all(torch.equal(a, b) for a, b in zip(kept[0], kept[2], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(kept[1], kept[3], strict=True))


@pytest.mark.parametrize("budget", [{"keep": 0.25}, {"keep": 0.5}, {"n_keep": 10}])
def test_budgets_are_kept(tiny, budget):
    ctx = _ids(40, 5, 512)
    obs = observe(tiny, ctx)
    ev = evict(obs, KVzip(sinks=2, window=3), **budget)
    n = budget.get("n_keep") or round(budget["keep"] * len(ctx))
    for v in ev.valid:
        assert bool((v.sum(-1) == n).all()) and bool(v[..., :2].all()) and bool(v[..., -3:].all())
    ragged = evict_ragged(obs, KVzip(), keep=0.5, heads="ada", layers="pyramid")
    assert ragged.held_slots == sum(sum(c) for c in ragged.counts)
    assert abs(ragged.kept_fraction - 0.5) < 0.05


def test_spec_spellings_and_refusals(tiny):
    from kvlab.eval.specs import parse_cache_spec
    from kvlab.hf.compressed_cache import CompressedCache
    from kvlab.policy.catalogue import OFFLINE_SCORES
    from kvlab.policy.evict import POLICIES
    from kvlab.policy.spec import cache_for
    from kvlab.serve.policy import serve_policy

    # the catalogue's offline-only scores are the registered ones that ask for an extra pass
    assert set(OFFLINE_SCORES) == {n for n, p in POLICIES.items() if p().probe_ids([0], None) is not None}
    a, b = parse_cache_spec("kvzip,keep=0.25"), parse_cache_spec("kvzip:0.75")
    assert a.policy.layout == b.policy.layout and a.needs_queries
    with pytest.raises(BadInputError, match="reconstruction pass"):  # a bare snapshot has no pass to run
        evict(tiny.prefill(_ids(20, 6, 512)).snapshot, KVzip(), keep=0.5)
    # live: refused where the spec is read (serve, before a model loads) and where the cache is built
    with pytest.raises(BadInputError, match="live cache cannot run it"):
        serve_policy("kvzip,budget=64,every=16")
    with pytest.raises(BadInputError, match="live cache cannot run it"):
        cache_for("kvzip,keep=0.5", tiny)
    # a CompressedCache built by hand with the policy: refused at the prefill, never scored by other queries
    live = CompressedCache(tiny.config, policy=KVzip(), keep=0.5, model=tiny.model)
    with pytest.raises(BadInputError, match="live cache cannot run it"):
        tiny.run(torch.tensor([_ids(20, 6, 512)]), live)
    live.close()


def test_eval_ruler_runs_kvzip(tiny, tmp_path, monkeypatch, capsys):
    import kvlab
    from kvlab.cli import main

    monkeypatch.setattr(kvlab, "load_model", lambda *a, **k: tiny)
    hay = tmp_path / "hay.txt"
    hay.write_text(HAYSTACK[:20_000])
    code = main(
        ["eval", "ruler", "--cache", "full", "--cache", "kvzip:0.5", "--lengths", "256", "--tasks",
         "niah_single", "--trials", "1", "--out", str(tmp_path), "--device", "cpu", "--haystack", str(hay)]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    rows = json.loads((tmp_path / "ruler.json").read_text())["rows"]
    full, kz = rows
    assert kz["spec"] == "kvzip:0.5" and kz["kept_slots"] == round(0.5 * full["context_tokens"])
    assert kz["kv_bytes"] < full["kv_bytes"] and kz["kld"] > 0
    assert make_policy("kvzip").name == "kvzip"
