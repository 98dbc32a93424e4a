"""benchmarks/snapkv_vs_kvpress.py: the comparison counts the slots one side keeps and the other does not.

The kvpress side is stood in for by SnapKV's reference algorithm written out in the tests (no kvpress
here): with the same window kvlab keeps the same slots (0 differ), with the other window it does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.test_evict import snapkv_reference_scores

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import snapkv_vs_kvpress as bench  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_same_window_keeps_the_same_slots_and_the_other_window_does_not(tiny_llama_2x64):
    tiny = tiny_llama_2x64
    # 300 tokens: every budget (75 at ratio 0.75) holds the 64-slot window, where the two sides would tie
    ids = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    with tiny.eager_attention():
        attn = tiny.prefill(ids, output_attentions=True).attentions
    kv_heads = tiny.config.num_key_value_heads
    press = {}
    for w in bench.WINDOWS:
        ref = snapkv_reference_scores(attn, kv_heads, w).float()
        press[f"scores/ctx/{w}"] = ref
        for ratio in bench.RATIOS:
            n = int(len(ids) * (1 - ratio))
            press[f"kept/ctx/{w}/{ratio}"] = ref.topk(n, dim=-1).indices.sort(dim=-1).values
    rows, worst = bench.kvlab_side(tiny, {"ctx": ids}, press)
    assert len(rows) == len(bench.WINDOWS) ** 2 * len(bench.RATIOS)
    assert worst < 1e-5
    for r in rows:
        if r["kvpress_window"] == r["kvlab_window"]:
            assert r["slots_differing"] == 0, r
        else:
            assert r["slots_differing"] > 0, r
    text = bench.report(rows, worst, type("A", (), {"trials": 1, "length": len(ids)})(), 1.0)
    assert "slots kept by one side only: 0 in all." in text
