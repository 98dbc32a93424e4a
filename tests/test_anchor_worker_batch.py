"""benchmarks/anchors/anchor_worker.py: presses of one shape decode as the rows of one batch, and each row
gives what that press's cache gives decoded alone (kvpress's own way), without touching the caches.

No kvpress needed: the worker's decoding is transformers and torch only; here the "presses" are
hand-made subsets of one prefilled cache's slots, as a scorer press keeps them.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "anchors"))
import anchor_worker  # noqa: E402


def _kept(model, full, slots_per_layer):
    """A DynamicCache holding, in each layer, the full cache's slots at the given (sorted) indices."""
    from transformers import DynamicCache

    out = DynamicCache(config=model.config)
    for i, slots in enumerate(slots_per_layer):
        idx = torch.tensor(slots)
        out.update(full.layers[i].keys[:, :, idx].clone(), full.layers[i].values[:, :, idx].clone(), i)
    return out


def test_batched_rows_equal_each_press_decoded_alone(tiny_llama_2x64):
    from transformers import DynamicCache

    model = tiny_llama_2x64.model
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(3, 500, (40,), generator=gen).tolist()
    question = torch.randint(3, 500, (4,), generator=gen).tolist()
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model(input_ids=torch.tensor([ctx]), past_key_values=full)
    layers = len(full.layers)
    caches = {"full": full}
    for r in range(3):  # three "presses" keeping 20 of 40 slots each, different ones per layer
        caches[f"p{r}:0.5"] = _kept(
            model,
            full,
            [sorted(torch.randperm(40, generator=gen)[:20].tolist()) for _ in range(layers)],
        )
    caches["q:0.25"] = _kept(model, full, [list(range(10, 40))] * layers)
    before = {n: [(lay.keys.clone(), lay.values.clone()) for lay in c.layers] for n, c in caches.items()}

    groups = anchor_worker.decode_groups(caches, masks={})
    assert groups == [["full"], ["p0:0.5", "p1:0.5", "p2:0.5"], ["q:0.25"]]
    # a press with masked keys (AdaKV) never shares a batch: its masks live on the modules
    assert anchor_worker.decode_groups(caches, masks={"p1:0.5": {}})[1:3] == [
        ["p0:0.5", "p2:0.5"],
        ["p1:0.5"],
    ]

    stop = {7}
    forced = question + [11, 12, 13]
    decoded = anchor_worker.decode_group(
        model, caches, groups[1], {}, question, forced, start=len(ctx), n=6, stop=stop
    )
    for name in groups[1]:
        alone = copy.deepcopy(caches[name])
        [answer] = anchor_worker.greedy_until(model, alone, question, len(ctx), 6, stop)
        [logits] = anchor_worker.forced_logits(model, copy.deepcopy(caches[name]), forced, len(ctx))
        got_answer, got_logits = decoded[name]
        assert got_answer == answer
        assert got_logits.shape == logits.shape
        # float32 matmuls of batch 3 vs batch 1 may round differently; the logits are O(1)
        torch.testing.assert_close(got_logits, logits, atol=1e-5, rtol=1e-5)
    for name, cache in caches.items():  # the batch is built from copies: no press's cache moved
        for (k, v), lay in zip(before[name], cache.layers, strict=True):
            assert torch.equal(k, lay.keys) and torch.equal(v, lay.values)


def test_batched_greedy_stops_each_row_at_its_own_stop_id(tiny_llama_2x64):
    from transformers import DynamicCache

    model = tiny_llama_2x64.model
    ctx = list(range(3, 33))
    rows = []
    for shift in range(2):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model.model(input_ids=torch.tensor([[t + shift for t in ctx]]), past_key_values=cache)
        rows.append(cache)
    free = [anchor_worker.greedy_until(model, copy.deepcopy(c), [5, 6], 30, 8, set())[0] for c in rows]
    stop = {free[0][2]}  # row 0 stops at its third id; row 1 at that id if it ever says it
    batched = anchor_worker.greedy_until(model, anchor_worker._stacked(model, rows), [5, 6], 30, 8, stop)
    for got, ids in zip(batched, free, strict=True):
        cut = next((i + 1 for i, t in enumerate(ids) if t in stop), len(ids))
        assert got == ids[:cut]
    assert len(batched[0]) <= 3
