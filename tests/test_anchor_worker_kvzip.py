"""benchmarks/anchors/anchor_worker.py: a press that wraps the prefill itself (kvpress's KVzipPress) takes its own
``with press(model)`` prefill while the hook presses keep sharing one, and its row says so.

No kvpress needed: the presses are stand-ins with kvpress's two interfaces (``forward_hook`` for the shared
prefill; a context manager that masks (head, slot) pairs on the attention modules as it is left, and reads
``prefix_length`` after the forward, for KVzip). The masks change no logits here (kvpress's attention patch
is not installed); what is checked is the routing, the prefix rule and the kept-slot counts.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "anchors"))
import anchor_worker  # noqa: E402

HEADER = (1, 2, 3)  # the "chat header" the stand-in KVzip counts as its prefix


class KeepFirst:
    """A hook press: each layer keeps its first half of the slots."""

    def post_init_from_model(self, model):
        pass

    def forward_hook(self, module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        n = layer.keys.shape[-2] // 2
        layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
        return output


class OwnPrefill:
    """KVzipPress's shape: a prefix length set before the forward and read after it; on leaving, masks on
    every attention module (layer l masks slots 0..l of KV head 0)."""

    def __init__(self):
        self.seen: list[tuple[int, int]] = []  # (cache length, prefix_length) as each block was left

    def post_init_from_model(self, model):
        pass

    @contextlib.contextmanager
    def __call__(self, model):
        self.prefix_length = len(HEADER)
        caches = []
        forward = model.model.forward
        model.model.forward = lambda *a, **kw: caches.append(kw["past_key_values"]) or forward(*a, **kw)
        try:
            yield
        finally:
            model.model.forward = forward
        self.seen.append((caches[0].layers[0].keys.shape[-2], self.prefix_length))
        for i, attn in enumerate(anchor_worker._attention_layers(model)[1]):
            attn.masked_key_indices = (torch.zeros(i + 1, dtype=torch.long),) * 2 + (torch.arange(i + 1),)


@pytest.mark.parametrize(("lead", "used"), [((7, 8, 9), 0), (HEADER, len(HEADER))])
def test_own_prefill_press_beside_the_shared_one(tiny_llama_2x64, monkeypatch, lead, used):
    model = tiny_llama_2x64.model
    own = OwnPrefill()
    monkeypatch.setattr(
        anchor_worker, "make_press", lambda name, ratio: own if name == "kvzip" else KeepFirst()
    )
    monkeypatch.setattr(anchor_worker, "chat_header", lambda model_dir: HEADER)
    gen = torch.Generator().manual_seed(0)
    ctx = [*lead, *torch.randint(10, 500, (37,), generator=gen).tolist()]
    trial = {"key": "t/40/0", "task": "t", "length": 40, "trial": 0, "seed": 0, "context": ctx}
    trial.update(question=[20, 21, 22], answer=[30, 31, 7], max_new_tokens=4)
    job = {"presses": ["keep", "kvzip"], "ratios": [0.5], "stop_ids": [7]}
    rows = {
        r["setup"]: r
        for r in anchor_worker.ruler_trial(model, job, trial, anchor_worker.ruler_setups(job), False)
    }

    assert [r["prefill"] for r in rows.values()] == ["shared", "shared", "own"]
    assert rows["keep:0.5"]["prefill_s"] == rows["full"]["prefill_s"]
    assert own.seen == [(len(ctx), used)]  # one prefill of its own, the prefix reset unless the ids carry it
    kz = rows["kvzip:0.5"]
    assert (kz["kvzip_prefix_kvpress"], kz["kvzip_prefix_used"]) == (len(HEADER), used)
    assert kz["seconds"] >= kz["prefill_s"] > 0  # its own prefill is its own cost
    assert kz["kept_slots"] == len(ctx)  # masks drop nothing from the cache
    assert kz["kept_per_layer"] == [2 * len(ctx) - 1, 2 * len(ctx) - 2]  # 2 KV heads; layer l masks l + 1
    assert kz["masked_slots"] == 3
    assert rows["keep:0.5"]["kept_per_layer"] == [2 * (len(ctx) // 2)] * 2
    assert rows["full"]["kept_per_layer"] == [2 * len(ctx)] * 2
    for r in rows.values():
        assert "error" not in r and len(r["answer_ids"]) >= 1
    assert all(
        getattr(a, "masked_key_indices", None) is None for a in anchor_worker._attention_layers(model)[1]
    )
