"""Runs kvpress presses and transformers' QuantizedCache (quanto) on the windows kvlab measured.

Executed by ``benchmarks/anchors/run_anchors.py`` inside its own virtual environment (kvpress 0.5.5 pins
``transformers<5.3``); it never imports kvlab. Input: a JSON job (model folder, token windows, needle
trials, budgets); output: one JSON document of rows (bytes, per-window perplexity, needle hits, decode ms).
Token ids come from kvlab, so both sides see identical inputs (no second tokenizer involved).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch


def _nbytes(obj) -> int:
    """Bytes of a tensor or of a tensor subclass (quanto QTensors) through ``__tensor_flatten__``."""
    if obj is None:
        return 0
    if hasattr(obj, "__tensor_flatten__"):
        names, _ = obj.__tensor_flatten__()
        return sum(_nbytes(getattr(obj, n)) for n in names)
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return 0


def cache_nbytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        total += _nbytes(getattr(layer, "keys", None)) + _nbytes(getattr(layer, "values", None))
        total += _nbytes(getattr(layer, "_quantized_keys", None)) + _nbytes(
            getattr(layer, "_quantized_values", None)
        )
    return total


def make_press(name: str, ratio: float):
    import kvpress

    cls = {
        "tova": kvpress.TOVAPress,
        "expected_attention": kvpress.ExpectedAttentionPress,
        "snapkv": kvpress.SnapKVPress,
        "knorm": kvpress.KnormPress,
        "streaming_llm": kvpress.StreamingLLMPress,
    }[name]
    return cls(compression_ratio=ratio)


def make_cache(model, setup: dict):
    from transformers import DynamicCache, QuantizedCache

    if setup["kind"] == "quanto":
        return QuantizedCache(
            "quanto",
            model.config,
            nbits=setup["bits"],
            q_group_size=setup.get("group", 64),
            residual_length=setup.get("residual", 128),
        )
    return DynamicCache()


@torch.no_grad()
def prefill(model, setup: dict, context: list[int]):
    """Context -> compressed cache (kvpress runs the base model without the LM head, as its pipeline does)."""
    import contextlib

    cache = make_cache(model, setup)
    ids = torch.tensor([context])
    ctx = (
        make_press(setup["press"], 1 - setup["keep"])(model)
        if setup["kind"] == "press"
        else contextlib.nullcontext()
    )
    with ctx:
        model.model(input_ids=ids, past_key_values=cache)
    return cache


@torch.no_grad()
def continuation_nll(model, cache, cont: list[int], start: int) -> float:
    ids = torch.tensor([cont])
    pos = torch.arange(start, start + len(cont))[None]
    logits = model(input_ids=ids, past_key_values=cache, position_ids=pos).logits[0, :-1].double()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return float(-logp.mean())


@torch.no_grad()
def greedy(model, cache, prompt: list[int], start: int, n: int) -> list[int]:
    ids, pos, out = torch.tensor([prompt]), start, []
    for _ in range(n):
        position_ids = torch.arange(pos, pos + ids.shape[1])[None]
        logits = model(
            input_ids=ids, past_key_values=cache, position_ids=position_ids, logits_to_keep=1
        ).logits
        pos += ids.shape[1]
        out.append(int(logits[0, -1].argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


@torch.no_grad()
def decode_ms(model, cache, start: int, steps: int) -> float:
    tok, times = 198, []
    for s in range(steps):
        t0 = time.perf_counter()
        logits = model(
            input_ids=torch.tensor([[tok]]), past_key_values=cache, position_ids=torch.tensor([[start + s]])
        ).logits
        times.append((time.perf_counter() - t0) * 1000)
        tok = int(logits[0, -1].argmax())
    times.sort()
    return times[len(times) // 2]


def main(job_path: str, out_path: str) -> None:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    with open(job_path) as f:
        job = json.load(f)
    torch.set_num_threads(int(job.get("threads", 1)))
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    n_ctx = job["context_tokens"]
    setups = [{"name": "full precision", "kind": "full"}]
    for keep in job["keeps"]:
        for press in job["presses"]:
            setups.append(
                {
                    "name": f"kvpress {press} {round(keep * 100)}%",
                    "kind": "press",
                    "press": press,
                    "keep": keep,
                }
            )
    for bits in job["quanto_bits"]:
        setups.append({"name": f"QuantizedCache quanto int{bits}", "kind": "quanto", "bits": bits})
    rows = []
    for setup in setups:
        row = {**setup, "nll": [], "bytes": [], "needle": []}
        try:
            run_setup(model, tok, job, setup, row, n_ctx)
        except Exception as exc:  # one failing anchor must not cost the others their rows
            row["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{setup['name']}: FAILED {row['error']}", file=sys.stderr, flush=True)
        rows.append(row)
        _dump(out_path, rows, len(setups))


def run_setup(model, tok, job: dict, setup: dict, row: dict, n_ctx: int) -> None:
    """Perplexity per window, needle hits and decode ms of one setup, written into ``row``."""
    import copy

    for i, w in enumerate(job["windows"]):
        cache = prefill(model, setup, w[:n_ctx])
        row["bytes"].append(cache_nbytes(cache))
        if i == 0:  # time decoding on a copy of the first window's compressed context (no second prefill)
            try:
                timed = copy.deepcopy(cache)
            except Exception:  # a cache that cannot be copied: prefill it again
                timed = prefill(model, setup, w[:n_ctx])
            row["decode_ms"] = decode_ms(model, timed, n_ctx, job["timing_steps"])
            del timed
        row["nll"].append(continuation_nll(model, cache, w[n_ctx:], n_ctx))
    row["bytes_per_token"] = sum(row["bytes"]) / len(row["bytes"]) / n_ctx
    row["ppl"] = [math.exp(x) for x in row["nll"]]
    print(f"{setup['name']}: ppl {sum(row['ppl']) / len(row['ppl']):.3f}", file=sys.stderr, flush=True)
    if setup["name"] in job["needle_setups"] or setup["kind"] == "full":
        for trial in job["needle"]:
            cache = prefill(model, setup, trial["context"])
            out = greedy(model, cache, trial["question"], len(trial["context"]), 4)
            row["needle"].append(float(trial["word"] in tok.decode(out).lower()))


def _dump(out_path: str, rows: list[dict], total: int) -> None:
    """Write the rows so far (``complete`` says whether every setup ran), so a stopped run keeps its results."""
    import kvpress
    import optimum.quanto
    import transformers

    doc = {
        "rows": rows,
        "versions": {
            "kvpress": getattr(kvpress, "__version__", "0.5.5"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "optimum-quanto": getattr(optimum.quanto, "__version__", "?"),
        },
        "threads": torch.get_num_threads(),
        "complete": len(rows) == total,
        "setups_total": total,
    }
    with open(out_path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
