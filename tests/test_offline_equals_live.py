"""Issue 28: what a policy does offline (the eval's compressed context) equals what the live cache it
names holds after the same context, for every registered score and codec and the rolling windows, on
tiny models of several families; and a question run on either gives the same logits."""

from __future__ import annotations

import pytest
import torch

from kvlab.compress.evict import POLICIES, kept_per_head, observe
from kvlab.compress.quant.methods import QUANTIZERS, quantizer_names
from kvlab.eval.run import _snapshot, parse_cache_spec
from kvlab.hf.compressed_cache import CompressedCache
from kvlab.hf.policy_cache import cache_for
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


def _check(h, spec_text: str, n_ctx: int = 72) -> None:
    spec = parse_cache_spec(spec_text)
    ids = torch.randint(
        0, h.config.vocab_size, (n_ctx + 6,), generator=torch.Generator().manual_seed(5)
    ).tolist()
    ctx, question = ids[:n_ctx], ids[n_ctx:]
    source = observe(h, ctx) if spec.needs_queries else h.prefill(ctx, all_logits=False).snapshot
    offline, _, _ = _snapshot(spec, source, h)  # a KVSnapshot: masked for an eviction
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


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("score", SCORES)
def test_every_registered_score(tiny_model, family, score):
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
