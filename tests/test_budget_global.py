"""``heads=global`` (kvpress KVzipPress's default allocation): the top ``round(keep * T) * L * H`` scores over
every layer and KV head together, each head's sinks and window forced in; offline only (the eval's path),
refused by every live cache."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.eval.specs import parse_cache_spec
from kvlab.policy.evict import make_policy, observe
from kvlab.policy.evict.budgets import evict_ragged, global_indices
from kvlab.policy.evict.select import layer_views
from tests.test_eval_tasks import HAYSTACK, WordTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SPEC = "h2o,keep=0.5,heads=global,sinks=2,window=3"


class Tokenizer(WordTokenizer):
    """The eval tests' word tokenizer, callable as ``kvlab generate`` calls a Hugging Face one."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}


@pytest.fixture(scope="module")
def llama(tiny_model):
    from kvlab.model.handle import ModelHandle

    return ModelHandle(tiny_model("llama").model, Tokenizer(), name="tiny-llama")


def _brute_force(
    scores: list[torch.Tensor], n_keep: int, sinks: int, window: int
) -> set[tuple[int, int, int]]:
    """The kept (layer, head, slot) triples by sorting every score in Python, the protected slots first."""
    t = scores[0].shape[-1]
    protected = set(range(sinks)) | set(range(t - window, t))
    entries = [
        (float(s[0, h, j]), (i, h, j))
        for i, s in enumerate(scores)
        for h in range(s.shape[1])
        for j in range(t)
    ]
    forced = {key for _, key in entries if key[2] in protected}
    free = sorted((e for e in entries if e[1] not in forced), key=lambda e: -e[0])
    total = n_keep * len(scores) * scores[0].shape[1]
    return forced | {key for _, key in free[: total - len(forced)]}


def test_the_selection_is_the_top_scores_over_every_layer_and_head(llama):
    ids = torch.randint(1, 500, (1, 61), generator=torch.Generator().manual_seed(0))
    obs = observe(llama, ids)
    policy = make_policy("h2o", sinks=2, window=3)
    scores = [policy.score(v) for v in layer_views(obs, policy)]
    n_keep = round(
        0.5 * 61
    )  # 30: Python rounds 30.5 to the even neighbour (kvpress would keep 1 more per 2 heads)
    want = _brute_force(scores, n_keep, 2, 3)
    rc = evict_ragged(obs, policy, keep=0.5, heads="global")
    got = {(i, h, int(j)) for i, layer in enumerate(rc.slots) for h, ix in enumerate(layer) for j in ix[0]}
    n_l, n_h = len(scores), scores[0].shape[1]
    assert got == want and rc.held_slots == n_keep * n_l * n_h == len(want)
    assert len({c for layer in rc.counts for c in layer}) > 1  # heads keep different counts
    assert [[ix.tolist() for ix in layer] for layer in rc.slots] == [
        [ix.tolist() for ix in layer] for layer in global_indices(scores, n_keep, 2, 3)
    ]
    # the eval's path: the layout applied to the context gives that ragged cache, masked, and its bytes
    spec = parse_cache_spec(SPEC)
    snap, nbytes, extra = spec.policy.layout.apply(spec.policy, obs, llama)
    valid = {(i, h, j) for i, v in enumerate(snap.valid) for h, j in (v[0].nonzero().tolist())}
    assert valid == want and nbytes == rc.nbytes
    assert extra["kept_per_layer"] == [sum(c) for c in rc.counts] and sum(extra["kept_per_layer"]) == len(
        want
    )
    per_slot = 2 * snap.keys[0].shape[-1] * snap.keys[0].element_size()
    assert nbytes == len(want) * per_slot and extra["kv_bytes_masked"] == 61 * n_l * n_h * per_slot


def test_refusals_of_the_selection():
    s = [torch.rand(1, 2, 10), torch.rand(1, 2, 10)]
    with pytest.raises(BadInputError, match="smaller than the 4 sinks"):
        global_indices(s, 3, sinks=4)
    with pytest.raises(BadInputError, match=r"\[1, H, T\]"):
        global_indices([torch.rand(2, 2, 10)], 3)
    from kvlab.policy.evict.budgets import allocate

    with pytest.raises(BadInputError, match="drop layers=pyramid"):
        allocate(s, 5, heads="global", layers="pyramid")


def _eval(llama, tmp_path, monkeypatch, capsys, *specs: str) -> list[dict]:
    import kvlab
    from kvlab.cli import main

    monkeypatch.setattr(kvlab, "load_model", lambda *a, **k: llama)
    hay = tmp_path / "hay.txt"
    hay.write_text(HAYSTACK[:20_000])
    argv = ["eval", "ruler", *(x for s in specs for x in ("--cache", s)), "--lengths", "256", "--tasks",
            "niah_single", "--trials", "1", "--out", str(tmp_path), "--device", "cpu", "--haystack", str(hay)]  # fmt: skip
    code = main(argv)
    assert code == 0, capsys.readouterr().err
    return json.loads((tmp_path / "ruler.json").read_text())["rows"]


def test_keep_one_is_the_full_cache_and_kvzip_runs_in_the_eval(llama, tmp_path, monkeypatch, capsys):
    rows = _eval(llama, tmp_path, monkeypatch, capsys, "full", "h2o,keep=1.0,heads=global", "kvzip,keep=0.5,heads=global")  # fmt: skip
    full, every, kz = rows
    t = full["context_tokens"]
    assert every["kld"] == 0.0 and every["top1"] == 1.0 and every["output"] == full["output"]
    assert every["kept_slots"] == t and every["kv_bytes"] == full["kv_bytes"]
    assert every["kept_per_head_min"] == every["kept_per_head_max"] == t
    assert kz["kept_slots"] == round(0.5 * t) and kz["kv_bytes"] == full["kv_bytes"] * round(0.5 * t) // t
    assert kz["kept_per_head_min"] < kz["kept_per_head_max"] and kz["heads"] == "global"


def test_live_caches_refuse_it(llama, monkeypatch, capsys):
    from kvlab.cli import main
    from kvlab.hf.compressed_cache import CompressedCache
    from kvlab.policy.spec import cache_for
    from kvlab.serve.policy import serve_policy

    with pytest.raises(BadInputError, match="heads=global runs offline only"):
        CompressedCache(llama.config, policy=make_policy("h2o"), keep=0.5, heads="global", model=llama.model)
    with pytest.raises(BadInputError, match="heads=global runs offline only"):
        cache_for("h2o,keep=0.5,heads=global", llama)
    with pytest.raises(BadInputError, match="per-head budgets"):
        serve_policy("h2o,budget=64,every=16,heads=global")
    # kvlab generate: refused once the model is loaded (the live cache is built), one line, exit 2
    monkeypatch.setattr("kvlab.model.load_model", lambda *a, **k: llama)
    code = main(
        ["generate", "a b c d e f", "-n", "2", "--cache", "h2o,keep=0.5,heads=global", "--device", "cpu"]
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "heads=global runs offline only" in err[0], err


@pytest.mark.real_model
def test_global_beats_uniform_kvzip_on_the_bundled_model(smollm):
    """The comparison that asked for it: KVzip at keep 0.5 on a ~600-token RULER context, KL to the full
    cache on the question (teacher-forced) lower with the global share than with the uniform budget."""
    from kvlab.eval.tasks import encoder, make_trial
    from kvlab.metrics.divergence import compare_logits

    trial = make_trial("niah_single", smollm, 600, 0)
    enc = encoder(smollm)
    ctx, question = enc(trial.context), enc(trial.question)
    obs = observe(smollm, ctx)
    full = smollm.forward(question, obs.snapshot).logits
    kl = {}
    for spec in ("kvzip,keep=0.5,heads=global", "kvzip,keep=0.5"):
        cs = parse_cache_spec(spec)
        snap, _, _ = cs.policy.layout.apply(cs.policy, obs, smollm)
        kl[spec] = compare_logits(full, smollm.forward(question, snap).logits).kl
    assert kl["kvzip,keep=0.5,heads=global"] < kl["kvzip,keep=0.5"], kl
