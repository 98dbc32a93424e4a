"""Issue 28: what a policy does offline (the eval's compressed context) equals what the live cache it
names holds after the same context, for every registered score and codec and the rolling windows, on
tiny models of several families; and a question run on either gives the same logits."""

from __future__ import annotations

import pytest
import torch

from kvlab.eval.specs import parse_cache_spec
from kvlab.hf.compressed_cache import CompressedCache
from kvlab.policy.catalogue import OFFLINE_SCORES
from kvlab.policy.evict import POLICIES, kept_per_head, observe
from kvlab.policy.quant.methods import QUANTIZERS, quantizer_names
from kvlab.policy.spec import cache_for
from tests.tolerances import assert_forward_close

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCORES = sorted(POLICIES)
CODECS = [n for n in quantizer_names() if n in QUANTIZERS and n != "prerope"] + ["rotation+qjl"]
FAMILIES = ["llama", "qwen2"]


def _spec_for(kind: str, name: str) -> str:
    if kind == "score":
        return f"{name},keep=0.5"
    fixed = QUANTIZERS.get(name.split("+")[0])
    return f"codec={name}" if fixed is not None and fixed.fixed_bits else f"codec={name}4"


def _live_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(cache, CompressedCache):
        return [
            layer.decoded() if layer.segments or layer.sink_keys is not None else (layer.keys, layer.values)
            for layer in cache.layers
        ]
    return cache.kept_layers()


def _offline(h, spec_text: str, n_ctx: int):
    """The spec, a seeded context and question, and what the policy makes of the context offline
    (a KVSnapshot: masked for an eviction) with the K/V bytes it holds."""
    spec = parse_cache_spec(spec_text)
    ids = torch.randint(
        0, h.config.vocab_size, (n_ctx + 6,), generator=torch.Generator().manual_seed(5)
    ).tolist()
    ctx, question = ids[:n_ctx], ids[n_ctx:]
    source = observe(h, ctx) if spec.needs_queries else h.prefill(ctx, all_logits=False).snapshot
    offline, nbytes, _ = spec.policy.layout.apply(spec.policy, source, h)
    return spec, ctx, question, offline, nbytes


def _check(h, spec_text: str, n_ctx: int = 72) -> None:
    spec, ctx, question, offline, _ = _offline(h, spec_text, n_ctx)
    keys, values = kept_per_head(offline)[:2] if offline.is_masked else (offline.keys, offline.values)
    live = cache_for(spec.policy, h)
    with torch.no_grad():
        h.run(torch.tensor([ctx]), live)
        held = _live_layers(live)
        for (k, v), ok, ov in zip(held, keys, values, strict=True):
            assert_forward_close([k, v], [ok, ov], h, what=f"{spec_text}: held K/V")
        got = h.run(torch.tensor([question]), live).logits[0].float()
    want = h.forward(question, past=offline, positions=list(range(n_ctx, n_ctx + len(question)))).logits
    assert_forward_close(got, want, h, what=f"{spec_text}: question logits")


@pytest.mark.parametrize("family", [*FAMILIES, "qwen3"])  # Qwen3: queries scored after its q_norm
@pytest.mark.parametrize("score", SCORES)
def test_every_registered_score(tiny_model, family, score):
    if score in OFFLINE_SCORES:  # an extra pass after the context (kvzip): live refuses, never other queries
        from kvlab.errors import BadInputError

        h = tiny_model(family)
        spec, *_, offline, _ = _offline(h, _spec_for("score", score), 72)
        assert offline.is_masked
        with pytest.raises(BadInputError, match="live cache cannot run it"):
            cache_for(spec.policy, h)
        return
    _check(tiny_model(family), _spec_for("score", score))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("codec", CODECS)
def test_every_registered_codec(tiny_model, family, codec):
    _check(tiny_model(family), _spec_for("codec", codec))  # group sizes cut to the tiny heads


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "spec",
    [
        "sinks=4,window=40,chunk=8",
        "sinks=2,window=64,chunk=32,codec=int4",
        "sinks=4,window=96,chunk=32,codec=kivi2",
    ],
)
def test_rolling_windows(tiny_model, family, spec):
    h = tiny_model(family)
    _check(h, spec, n_ctx=150)


SHARES = ["heads=ada", "layers=pyramid", "heads=ada,layers=pyramid"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("score", ["h2o", "snapkv", "knorm", "tova"])
def test_shared_budgets_live_equal_offline(tiny_model, family, share, score):
    """A live cache with per-head (ragged) or per-layer budgets holds exactly the offline ragged cache's slots,
    head by head, and a question on it gives the masked snapshot's logits."""
    h = tiny_model(family)
    n_ctx, spec_text = 72, f"{score},keep=0.5,{share}"
    spec, ctx, question, offline, nbytes = _offline(h, spec_text, n_ctx)
    live = cache_for(spec.policy, h)
    with torch.no_grad():
        h.run(torch.tensor([ctx]), live)
        assert live.nbytes == nbytes  # ragged: only the kept slots are held
        for i, layer in enumerate(live.layers):
            valid = offline.valid[i][0]  # [Hkv, T]
            for head in range(valid.shape[0]):
                want_k = offline.keys[i][0, head][valid[head]]
                want_v = offline.values[i][0, head][valid[head]]
                got_k = layer.head_keys[head][0] if "ada" in share else layer.keys[0, head]
                got_v = layer.head_values[head][0] if "ada" in share else layer.values[0, head]
                assert_forward_close(
                    [got_k, got_v], [want_k, want_v], h, what=f"{spec_text}: layer {i} head {head}"
                )
        got = h.run(torch.tensor([question]), live).logits[0].float()
        step = h.run(torch.tensor([[question[-1]]]), live).logits[0].float()  # a one-token decode step
    want = h.forward(question, past=offline, positions=list(range(n_ctx, n_ctx + len(question)))).logits
    assert_forward_close(got, want, h, what=f"{spec_text}: question logits")
    more = h.forward(
        [*question, question[-1]], past=offline, positions=list(range(n_ctx, n_ctx + len(question) + 1))
    ).logits
    assert_forward_close(step, more[-1:], h, what=f"{spec_text}: decode step logits")


def test_ada_refusals_are_one_line_before_anything_runs(tiny_model):
    h = tiny_model("llama")
    from kvlab.errors import BadInputError

    for bad in ("h2o,keep=0.5,heads=ada,every=8", "knorm,keep=0.5,heads=ada,codec=int4"):
        with pytest.raises(BadInputError, match="ada"):
            cache_for(bad, h)
    live = cache_for("knorm,keep=0.5,heads=ada", h)
    with pytest.raises(BadInputError, match="per sequence"):
        h.run(torch.tensor([[1, 2, 3, 4, 5, 6]] * 2), live)
    assert live.layers[0].seen == 0


def test_pyramid_with_every_keeps_each_layers_budget_while_decoding(tiny_model):
    h = tiny_model("llama")
    live = cache_for("knorm,keep=0.5,layers=pyramid,every=8", h)
    ids = torch.randint(0, h.config.vocab_size, (80,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        h.run(ids[None, :64], live)
        budgets = [layer.budget for layer in live.layers]
        assert len(set(budgets)) > 1 and sum(budgets) == 32 * len(budgets)  # a pyramid, the same total
        for t in ids[64:]:
            h.run(t.view(1, 1), live)
            assert all(layer.held <= b + 8 for layer, b in zip(live.layers, budgets, strict=True))
    assert all(layer.evictions > 1 for layer in live.layers)
