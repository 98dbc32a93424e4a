"""The strided layout (``stride=N,recent=N``), a layout written in one file
(``src/kvlab/policy/layouts/strided.py``), through every command that reads a cache spec: the spec reader,
``generate``, stream-ppl, the eval and ``kvlab serve`` (tests/test_serve_strided.py). Exact where exactness
is defined: ``stride=1`` is the full cache bit for bit, and the live cache holds exactly the slots its
offline application keeps, with the same logits on top."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.eval.run import run_trial
from kvlab.eval.specs import parse_cache_spec, parse_cache_specs
from kvlab.policy.evict import kept_per_head
from kvlab.policy.layouts import LAYOUTS
from kvlab.policy.spec import cache_for, parse
from kvlab.streaming.generate import HeldBytes, policy_generate
from kvlab.streaming.perplexity import streaming_perplexity, summarize
from tests.tolerances import assert_forward_close

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = "stride=4,recent=16"


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


def test_the_spec_reader_finds_it_in_the_registry():
    p = parse(" Stride=4, recent=16 ")
    assert p.layout.name == "strided" and isinstance(p.layout, LAYOUTS["strided"])
    assert p.spec == SPEC and p.kind == "strided" and not p.exact
    assert p.to_json() == {"spec": SPEC, "kind": "strided", "layout": "strided", "stride": 4, "recent": 16}
    assert p.describe() == "one slot in 4 + the last 16 slots, in full precision"
    for bad, message in [
        ("stride=0", "stride must be >= 1"),
        ("stride=4,window=8", "stride apply to a strided layout only"),
        ("stride=4,keep=0.5", "only apply to a score"),
        ("stride=4,codec=int4", "drop codec="),
        ("stride=x", "is not an integer"),
    ]:
        with pytest.raises(BadInputError, match=message):
            parse(bad)


def _context(h, n: int, seed: int = 5) -> list[int]:
    return torch.randint(0, h.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_stride_one_is_the_full_cache_bit_for_bit(tiny_model, family):
    h = tiny_model(family)
    ids = _context(h, 40)
    full, strided = cache_for("full", h), cache_for("stride=1,recent=0", h)
    with torch.no_grad():
        for piece in (ids[:30], ids[30:31], ids[31:40]):
            a = h.run(torch.tensor([piece]), full).logits
            b = h.run(torch.tensor([piece]), strided).logits
            assert torch.equal(a, b)
    assert strided.kept == full.kept == 40 and strided.evictions == 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_live_holds_what_the_offline_application_keeps(tiny_model, family):
    """After a 72-token context the live cache holds slots 0, 4, ..., 52 and 56..71, equal to the eval's
    masked snapshot; a question and a decode step on either give the same logits."""
    h = tiny_model(family)
    n_ctx, ids = 72, _context(h, 78)
    ctx, question = ids[:n_ctx], ids[n_ctx:]
    spec = parse_cache_spec(SPEC)
    offline, nbytes, _ = spec.policy.layout.apply(spec.policy, h.prefill(ctx, all_logits=False).snapshot, h)
    live = cache_for(spec.policy, h)
    with torch.no_grad():
        h.run(torch.tensor([ctx]), live)
        assert live.positions().tolist() == [*range(0, 56, 4), *range(56, 72)] and live.nbytes == nbytes
        keys, values = kept_per_head(offline)[:2]
        for (k, v), ok, ov in zip(live.kept_layers(), keys, values, strict=True):
            assert_forward_close([k, v], [ok, ov], h, what="held K/V")
        got = h.run(torch.tensor([question]), live).logits[0].float()
    want = h.forward(question, past=offline, positions=list(range(n_ctx, n_ctx + len(question)))).logits
    assert_forward_close(got, want, h, what="question logits")
    # the question's tokens now live in the cache: slots 56..59 fell out of the recent 16 (60 is a 4th)
    assert live.positions().tolist() == [*range(0, 64, 4), *range(62, 78)]


def test_generate_runs_it_and_stride_one_generates_as_full(llama):
    prompt = list(range(1, 25))

    def generate(spec: str, n: int) -> tuple[list[int], object, HeldBytes]:
        cache, held = cache_for(spec, llama), HeldBytes()
        return list(policy_generate(llama, cache, prompt, n, held=held)), cache, held

    assert generate("stride=1,recent=0", 12)[0] == generate("full", 12)[0]
    tokens, cache, held = generate(SPEC, 60)
    assert len(tokens) == 60 and cache.tokens_seen == 24 + 60
    assert cache.kept == len(range(0, 84 - 16, 4)) + 16 and cache.evictions > 0
    assert held.peak < generate("full", 60)[2].peak * 33 / 84 * 1.1  # the slots held, not every token


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny_serve import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def test_generate_cli_json(capsys, model_dir):
    from kvlab.cli import main

    argv = ["generate", "once upon a time", "-n", "6", "--cache", SPEC, "--json", "--model", model_dir]
    assert main([*argv, "--device", "cpu"]) in (0, None)
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["tokens"] == 6 and doc["policy"]["spec"] == SPEC and doc["policy"]["kind"] == "strided"


def test_eval_cli(capsys, model_dir, tmp_path):
    """``kvlab eval ruler --cache stride=...``: a column next to the full cache; ``stride=1`` is the full one."""
    from kvlab.cli import main

    argv = ["eval", "ruler", "--model", model_dir, "--cache", "full", "--cache", "stride=1,recent=0", "--cache",
            SPEC, "--lengths", "600", "--tasks", "niah_single", "--trials", "1", "-n", "4", "--out", str(tmp_path),
            "--device", "cpu"]  # fmt: skip
    assert main(argv) in (0, None)
    rows = {r["spec"]: r for r in json.loads((tmp_path / "ruler.json").read_text())["rows"]}
    full, same, strided = rows["full"], rows["stride=1,recent=0"], rows[SPEC]
    assert same["output"] == full["output"] and same["kld"] == 0 and same["kv_bytes"] == full["kv_bytes"]
    n = strided["context_tokens"]
    assert strided["kind"] == "strided" and strided["kept_slots"] == len(range(0, n - 16, 4)) + 16


def test_stream_ppl_scores_it_and_stride_one_scores_as_full(llama):
    ids = torch.randint(1, 500, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    res = streaming_perplexity(
        llama, ids, window=64, methods=["full", "stride=1,recent=0", SPEC, "recompute"], recompute_samples=10
    )
    rows = {r["method"]: r for r in summarize(res, "random", 64)}
    assert rows["stride=1,recent=0"]["ppl_all"] == pytest.approx(rows["full"]["ppl_all"], rel=1e-5)
    assert (
        rows[SPEC]["path"] == "loop"
        and rows[SPEC]["peak_held_bytes"] < rows["stride=1,recent=0"]["peak_held_bytes"]
    )


def test_the_eval_runs_it_and_stride_one_is_the_reference(llama):
    from kvlab.eval.tasks import make_trial
    from kvlab.model.handle import ModelHandle
    from tests.test_eval_tasks import HAYSTACK, WordTokenizer

    handle = ModelHandle(llama.model, WordTokenizer(), name="tiny-llama")
    trial = make_trial("niah_single", handle, 160, 3, HAYSTACK)
    specs = parse_cache_specs(["full", "stride=1,recent=0", SPEC])
    rows = {r["spec"]: r for r in run_trial(handle, trial, specs, max_new_tokens=6)}
    same, strided = rows["stride=1,recent=0"], rows[SPEC]
    assert same["output"] == rows["full"]["output"] and same["kld"] == pytest.approx(0, abs=1e-6)
    n = strided["context_tokens"]
    assert strided["kind"] == "strided" and strided["kept_slots"] == len(range(0, n - 16, 4)) + 16
    assert strided["kv_bytes"] < rows["full"]["kv_bytes"]


def test_serve_takes_it_and_refuses_a_codec_in_one_line(capsys, tmp_path):
    """``kvlab serve`` runs it (its conversations: tests/test_serve_strided.py) and names it among what it
    serves; a strided layout over a codec is still refused while the options are read, before anything loads."""
    from kvlab.cli import main
    from kvlab.policy.layouts.base import serve_caches
    from kvlab.serve.engine import EngineSettings

    assert EngineSettings(cache=" Stride=4, recent=16 ").cache == SPEC
    assert "strided caches (stride=N,recent=N" in serve_caches()
    (tmp_path / "config.json").write_text("{}")
    code = main(["serve", "--cache", f"{SPEC},codec=int4", "--model", str(tmp_path), "--port", "1"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "a strided layout keeps its slots in full precision" in err[0], err
