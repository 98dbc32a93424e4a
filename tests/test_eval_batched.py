"""The eval runs a trial's caches as rows of one batch: each row's answer and logits equal that cache run
alone, an external cache (another library's quantizer) joins the batch as a row, and the teacher-forced
span ends at the full cache's end-of-sequence token."""

from __future__ import annotations

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.eval.run import run_trial
from kvlab.eval.specs import parse_cache_specs
from kvlab.eval.tasks import make_trial
from kvlab.model.handle import ModelHandle
from tests.test_eval_tasks import HAYSTACK, WordTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def handle(tiny_llama_2x64):
    return ModelHandle(tiny_llama_2x64.model, WordTokenizer(), name="tiny-llama")


def test_batched_rows_equal_each_cache_alone(handle):
    trial = make_trial("niah_single", handle, 160, 3, HAYSTACK)
    specs = ["full", "h2o:0.5", "snapkv:0.25", "int4", "window:0.5", "tova,keep=0.5,heads=ada"]
    together = {r["spec"]: r for r in run_trial(handle, trial, parse_cache_specs(specs), max_new_tokens=6)}
    for spec in specs[1:]:
        alone = {
            r["spec"]: r
            for r in run_trial(handle, trial, parse_cache_specs(["full", spec]), max_new_tokens=6)
        }
        a, b = together[spec], alone[spec]
        assert (
            a["output"] == b["output"]
            and a["kv_bytes"] == b["kv_bytes"]
            and a["kept_slots"] == b["kept_slots"]
        )
        assert a["compared_tokens"] == b["compared_tokens"]
        assert a["kld"] == pytest.approx(b["kld"], rel=1e-3, abs=1e-5)  # batched matmuls round differently
    assert together["full"]["kld"] == 0 and together["full"]["top1"] == 1


def test_external_caches_join_the_batch(handle):
    trial = make_trial("vt", handle, 160, 1, HAYSTACK)
    seen = {}

    def external(snapshot):
        seen["len"] = snapshot.seq_len
        noisy = snapshot.replace(values=tuple(v + 0.5 * torch.randn_like(v) for v in snapshot.values))
        return {"same": (snapshot, snapshot.nbytes), "noisy": (noisy, 123)}

    rows = {
        r["spec"]: r
        for r in run_trial(handle, trial, parse_cache_specs(["full"]), max_new_tokens=5, external=external)
    }
    assert set(rows) == {"full", "same", "noisy"} and seen["len"] == rows["full"]["context_tokens"]
    assert rows["same"]["kind"] == "external" and rows["same"]["output"] == rows["full"]["output"]
    assert rows["same"]["kld"] == pytest.approx(0, abs=1e-6) and rows["noisy"]["kld"] > 0
    assert rows["noisy"]["kv_bytes"] == 123
    with pytest.raises(BadInputError, match="repeats"):
        run_trial(
            handle, trial, parse_cache_specs(["full"]), max_new_tokens=2, external=lambda s: {"full": (s, 1)}
        )


def test_the_reference_span_ends_at_the_end_of_sequence_token(handle):
    trial = make_trial("niah_single", handle, 160, 2, HAYSTACK)
    got = {}
    run_trial(handle, trial, parse_cache_specs(["full"]), max_new_tokens=8, on_reference=got.update)
    answer, stop = got["answer"], handle.eos_ids()
    assert all(t not in stop for t in answer[:-1])  # nothing after a stop token is compared
    assert got["forced"] == got["question"] + answer[:-1]
    assert got["full_logits"].shape[0] == len(got["forced"])
