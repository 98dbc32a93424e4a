"""Runs kvpress presses and transformers' QuantizedCache (quanto) on the token ids kvlab measured.

Executed by ``benchmarks/anchors/run_anchors.py`` inside its own virtual environment (kvpress 0.5.5 pins
``transformers<5.3``); it never imports kvlab. Token ids come from kvlab, so both sides see identical
inputs (no second tokenizer involved). Two job kinds:

* ``compression`` (the default, ``benchmarks/compression.py``): a JSON job (model folder, token windows,
  needle trials, budgets); output: one JSON document of rows (bytes, per-window perplexity, needle hits,
  decode ms).
* ``ruler`` (``benchmarks/eval_ruler.py``): RULER-style trials (context ids, question ids, the full
  cache's answer ids), inline in the job or streamed from a JSONL file kvlab appends to while it runs
  (ended by ``{"end": true}``). Per trial the context is prefilled ONCE with every press hooked in (see
  :func:`shared_press_prefill`: each press's own ``forward_hook`` compresses its own cache from the same
  layer inputs, which is what ``with press(model)`` does, without one prefill per press; the first trial
  is checked against one standalone ``with press(model)`` prefill per setup). A press that wraps the
  prefill itself (``kvzip``: KVzipPress runs its reconstruction pass as ``with press(model)`` is left, and
  masks the (head, slot) pairs it drops) takes its own prefill that way (:data:`OWN_PREFILL`; its row says
  ``prefill: own``; ``kept_per_layer`` counts what each layer attends over). Then the question runs
  uncompressed at the positions after the context (kvpress's convention): greedy answer ids (returned for
  kvlab to decode and score; setups whose caches have the same shape, the presses of one ratio, decode as
  the rows of one batch, see :func:`decode_groups`), and one teacher-forced pass over question + the full cache's answer (minus
  its last token) gives KL(P_full || P_press) per token, computed here with the float64 formula of
  ``kvlab.metrics.divergence.token_kl``, against this worker's own uncompressed ("full") cache on the same
  tokens; the full cache's top-1 agreement with kvlab's full-cache argmax (and, where kvlab saved them,
  KL to kvlab's full logits) checks that both sides run the same model. Output: JSONL, one line per
  (trial, setup), appended as they finish, after a ``meta`` line (versions).
* ``snapkv_slots`` (``benchmarks/snapkv_vs_kvpress.py``): contexts (ids) and SnapKV window sizes; per
  context and window, one prefill under ``SnapKVPress(window_size=w)``, each layer's scores as the press
  computed them and the slots kvpress's own ``ScorerPress.compress`` keeps at each ratio (its
  ``compute_n_kept`` and ``topk``). Output: one ``torch.save`` file of tensors.
"""

from __future__ import annotations

import functools
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
        "pyramidkv": kvpress.PyramidKVPress,
        "kvzip": kvpress.KVzipPress,  # wraps the prefill itself: OWN_PREFILL
    }
    if name == "adakv_snapkv":  # per-head budgets (AdaKV) over SnapKV's scores; masks, frees nothing
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio))
    return cls[name](compression_ratio=ratio)


#: presses that wrap the prefill themselves (KVzipPress: its reconstruction pass runs when ``with press(model)``
#: is left), so they cannot share :func:`shared_press_prefill`; each takes its own (:func:`own_prefills`)
OWN_PREFILL = frozenset({"kvzip"})


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
    """Run the job at ``job_path`` (its ``kind``: ``compression``, the default, ``ruler`` or
    ``snapkv_slots``), writing its results to ``out_path``."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    with open(job_path) as f:
        job = json.load(f)
    kind = job.get("kind", "compression")
    runners = {"compression": compression_main, "ruler": ruler_main, "snapkv_slots": snapkv_slots_main}
    if kind not in runners:
        raise SystemExit(f"anchor worker: unknown job kind {kind!r} (one of {', '.join(runners)})")
    runners[kind](job, out_path)


def compression_main(job: dict, out_path: str) -> None:
    """benchmarks/compression.py's job: perplexity, needle and decode time per press and quanto setup."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

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


# -- job kind "ruler": RULER-style trials on kvlab's ids ---------------------------------------------------


def token_kl(full: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per-token KL(P_full || P_other) in nats, float64: the formula of ``kvlab.metrics.divergence.token_kl``."""
    lp = torch.log_softmax(full.to(torch.float64), dim=-1)
    lq = torch.log_softmax(other.to(torch.float64), dim=-1)
    p = lp.exp()
    terms = torch.where(p > 0, p * (lp - lq), torch.zeros((), dtype=torch.float64))
    return terms.sum(-1).clamp_min(0.0)


def _mean(x: torch.Tensor) -> float | None:
    return float(x.mean()) if x.numel() else None


def divergence(full: torch.Tensor, other: torch.Tensor) -> dict:
    """Mean KL (inf if any token is inf: counted apart, as kvlab does) and top-1 over all rows."""
    kl = token_kl(full, other)
    finite = kl[torch.isfinite(kl)]
    return {
        "kl": float(finite.mean())
        if finite.numel() == kl.numel() and kl.numel()
        else (float("inf") if kl.numel() else None),
        "top1": _mean((full.argmax(-1) == other.argmax(-1)).double()),
        "n": int(kl.numel()),
    }


def iter_ruler_trials(job: dict, poll_s: float = 0.5, idle_timeout_s: float = 7200.0):
    """The job's trials: inline (``trials``) or streamed from ``trials_file`` until an ``{"end": true}`` line."""
    if "trials" in job:
        yield from job["trials"]
        return
    path, pos, buf, idle = job["trials_file"], 0, "", 0.0
    while True:
        try:
            with open(path) as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
        except FileNotFoundError:
            chunk = ""
        buf += chunk
        lines = buf.split("\n")
        buf = lines.pop()  # an unfinished last line waits for its newline
        for line in lines:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("end"):
                return
            yield rec
        if chunk:
            idle = 0.0
        else:
            time.sleep(poll_s)
            idle += poll_s
            if idle > idle_timeout_s:
                raise TimeoutError(f"no new trial in {path} for {idle_timeout_s:.0f} s")


def ruler_setups(job: dict) -> list[dict]:
    setups = [{"name": "full", "press": None, "ratio": 0.0}]
    for press in job["presses"]:
        for ratio in job["ratios"]:
            setups.append({"name": f"{press}:{ratio:g}", "press": press, "ratio": float(ratio)})
    return setups


def _attention_layers(model):
    lm = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return lm, [layer.self_attn for layer in lm.layers]


@torch.no_grad()
def shared_press_prefill(
    model, context: list[int], setups: list[dict], presses: dict, masks: dict | None = None
) -> tuple[dict, dict]:
    """One prefill of ``context``; every press compresses its own copy of each layer's cache.

    A kvpress press compresses layer l's cache in a forward hook on layer l's attention, after that
    layer attended over the full context; the hidden states passed on are the uncompressed forward's, so
    every press sees the same hook inputs whether it runs alone or beside others. Here one hook per
    layer copies the layer's full K/V into each press's own ``DynamicCache`` and calls that press's own
    ``forward_hook`` with that cache as ``past_key_values`` (exactly what ``with press(model)`` runs).
    Returns ``({setup name: cache}, {setup name: error})``; ``full`` is the uncompressed cache. A press that
    masks keys instead of dropping them (AdaKV) leaves ``module.masked_key_indices`` for kvpress's attention
    patch: it is moved into ``masks[setup name][layer]`` (the module is cleared, so the next press and the
    other setups' decoding do not see it); :func:`masked_keys` puts it back for that setup's decoding.
    """
    from transformers import DynamicCache

    lm, attns = _attention_layers(model)
    full = DynamicCache(config=model.config)
    caches = {"full": full}
    errors: dict[str, str] = {}
    for s in setups:
        if s["press"] is not None:
            caches[s["name"]] = DynamicCache(config=model.config)

    def hook(module, args, kwargs, output):
        idx = module.layer_idx
        keys, values = full.layers[idx].keys, full.layers[idx].values
        for s in setups:
            name = s["name"]
            if s["press"] is None or name in errors:
                continue
            cache = caches[name]
            layer = cache.layers[idx]
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values  # the press replaces them with its compressed copy
            try:
                presses[name].forward_hook(module, args, {**kwargs, "past_key_values": cache}, output)
                mk = getattr(module, "masked_key_indices", None)
                if mk is not None:
                    module.masked_key_indices = None
                    if masks is not None:
                        masks.setdefault(name, {})[idx] = mk
            except Exception as exc:  # one failing press must not cost the others their rows
                errors[name] = f"{type(exc).__name__}: {exc}"
        return output

    hooks = []
    try:
        for attn in attns:
            attn.rotary_emb = lm.rotary_emb  # as BasePress.__call__ does
            hooks.append(attn.register_forward_hook(hook, with_kwargs=True))
        model.model(input_ids=torch.tensor([context]), past_key_values=full)
    finally:
        for h in hooks:
            h.remove()
    for name in errors:
        caches.pop(name, None)
    return caches, errors


class masked_keys:
    """While decoding one setup: each attention module's ``masked_key_indices`` set to that setup's (None for
    a setup that masks nothing), cleared on exit."""

    def __init__(self, model, layer_masks: dict | None):
        self.attns, self.masks = _attention_layers(model)[1], layer_masks or {}

    def __enter__(self):
        for i, attn in enumerate(self.attns):
            attn.masked_key_indices = self.masks.get(i)

    def __exit__(self, *exc):
        for attn in self.attns:
            attn.masked_key_indices = None


def masked_count(layer_masks: dict | None) -> int:
    return sum(int(m[0].numel()) for m in (layer_masks or {}).values())


def cache_facts(cache, layer_masks: dict | None) -> dict:
    """What a setup's cache keeps: ``kept_slots`` (layer 0's length), ``kv_bytes`` held (a masking press holds
    its masked keys too), ``kept_per_layer`` (the (head, slot) pairs each layer attends over: held less
    masked, summed over batch rows and KV heads); for a masking press also ``masked_slots`` and
    ``kv_bytes_unmasked`` (the bytes of what it keeps)."""
    held = [int(layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2]) for layer in cache.layers]
    masks = layer_masks or {}
    out = {
        "kept_slots": _cache_len(cache),
        "kv_bytes": _cache_bytes(cache),
        "kept_per_layer": [n - (int(masks[i][0].numel()) if i in masks else 0) for i, n in enumerate(held)],
    }
    if layer_masks is not None:
        n_masked = masked_count(layer_masks)
        out["masked_slots"] = n_masked
        out["kv_bytes_unmasked"] = int(out["kv_bytes"] - n_masked * out["kv_bytes"] / max(1, sum(held)))
    return out


@functools.cache
def chat_header(model_dir: str) -> tuple[int, ...]:
    """The ids KVzipPress counts as its ``prefix_length``: the chat template's text before a user message,
    derived as KVzipPress derives it (kvpress's pipeline puts the context in that message)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.chat_template is None:
        return ()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "dummy context"}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=False,
    )
    return tuple(tok.encode(text.split("dummy context")[0], add_special_tokens=False))


@torch.no_grad()
def standalone_press_prefill(model, context: list[int], press, info: dict | None = None):
    """kvpress's own way: ``with press(model):`` around the context forward (the check of the shared one, and
    the prefill of an OWN_PREFILL press, whose reconstruction pass runs on this cache as the block is left).

    KVzipPress takes its context's first ``prefix_length`` ids (the chat header, :func:`chat_header`) as no
    content: never scored, so evicted first, apart from its 4 sinks. Its reconstruction then starts at that
    offset. kvlab's contexts carry no header, so it is set to 0 unless the ids do begin with the header;
    ``info`` receives both values (``kvzip_prefix_kvpress``, ``kvzip_prefix_used``)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with press(model):
        model.model(input_ids=torch.tensor([context]), past_key_values=cache)
        n = getattr(press, "prefix_length", None)
        if n is not None:  # KVzipPress: set in __call__ before the forward, read after it
            if tuple(context[:n]) != chat_header(model.config.name_or_path):
                press.prefix_length = 0
            if info is not None:
                info.update(kvzip_prefix_kvpress=n, kvzip_prefix_used=press.prefix_length)
    return cache


def take_masks(model) -> dict:
    """``{layer: masked (batch, head, slot) indices}`` a press left on the attention modules, cleared there."""
    out = {}
    for i, attn in enumerate(_attention_layers(model)[1]):
        if getattr(attn, "masked_key_indices", None) is not None:
            out[i] = attn.masked_key_indices
            attn.masked_key_indices = None
    return out


def own_prefills(model, ctx: list[int], setups: list[dict], presses: dict, caches: dict, masks: dict) -> dict:
    """Each OWN_PREFILL setup's cache (into ``caches``) and masks (into ``masks``) from its own
    :func:`standalone_press_prefill`; returns ``{setup name: row fields}`` (``prefill: own``, its
    ``prefill_s``, KVzip's prefix, or ``error``)."""
    out: dict[str, dict] = {}
    for s in setups:
        if s["press"] not in OWN_PREFILL:
            continue
        row = out[s["name"]] = {"prefill": "own"}
        t0 = time.perf_counter()
        try:
            caches[s["name"]] = standalone_press_prefill(model, ctx, presses[s["name"]], row)
            masks[s["name"]] = take_masks(model)
        except Exception as exc:  # one failing press must not cost the others their rows
            take_masks(model)
            row["error"] = f"{type(exc).__name__}: {exc}"
        row["prefill_s"] = time.perf_counter() - t0
    return out


def _ragged_layers(cache) -> bool:
    """Layers of different lengths (PyramidKV): transformers builds one mask from layer 0's length, which
    fits no other layer for a multi-token input, so such a cache is fed one token at a time (no mask)."""
    return len({int(layer.keys.shape[-2]) for layer in cache.layers}) > 1


@torch.no_grad()
def _one_by_one(model, cache, tokens: list[int], start: int) -> torch.Tensor:
    rows = []
    for i, t in enumerate(tokens):
        rows.append(
            model(
                input_ids=torch.tensor([[t]]), past_key_values=cache, position_ids=torch.tensor([[start + i]])
            )
            .logits[0, -1]
            .float()
        )
    return torch.stack(rows)


@torch.no_grad()
def greedy_until(model, cache, prompt: list[int], start: int, n: int, stop: set[int]) -> list[list[int]]:
    """Greedy ids after ``prompt`` (positions from ``start``) for every row of ``cache``, at most ``n`` each,
    each row ending at its first stop id (kept); rows that stopped are fed on (rows never see each other)
    until all stopped. A ragged cache (one row) takes the prompt one token at a time."""
    rows = int(cache.layers[0].keys.shape[0])
    ids, pos = torch.tensor([prompt] * rows), start
    if _ragged_layers(cache) and len(prompt) > 1:
        _one_by_one(model, cache, prompt[:-1], start)
        ids, pos = torch.tensor([prompt[-1:]]), start + len(prompt) - 1
    out: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    for _ in range(n):
        position_ids = torch.arange(pos, pos + ids.shape[1])[None].expand(rows, -1)
        logits = model(
            input_ids=ids, past_key_values=cache, position_ids=position_ids, logits_to_keep=1
        ).logits
        pos += ids.shape[1]
        nxt = logits[:, -1].argmax(-1).tolist()
        for r, t in enumerate(nxt):
            if not done[r]:
                out[r].append(int(t))
                done[r] = int(t) in stop
        if all(done):
            break
        ids = torch.tensor(nxt)[:, None]
    return out


@torch.no_grad()
def forced_logits(model, cache, tokens: list[int], start: int) -> torch.Tensor:
    """Teacher-forced logits ``[rows, len(tokens), vocab]`` (float32) over ``tokens`` for every row."""
    if _ragged_layers(cache):
        return _one_by_one(model, cache, tokens, start)[None]
    rows = int(cache.layers[0].keys.shape[0])
    pos = torch.arange(start, start + len(tokens))[None].expand(rows, -1)
    ids = torch.tensor([tokens] * rows)
    return model(input_ids=ids, past_key_values=cache, position_ids=pos).logits.float()


def _cache_len(cache) -> int:
    return int(cache.layers[0].keys.shape[-2])


def _cache_bytes(cache) -> int:
    return sum(_nbytes(layer.keys) + _nbytes(layer.values) for layer in cache.layers)


def decode_groups(caches: dict, masks: dict) -> list[list[str]]:
    """Setups whose caches can decode as the rows of one batch, in the caches' order.

    Rows of one batch need the same length in every layer (no padding, so no mask changes the
    arithmetic) and no masked keys (AdaKV's masks live on the attention modules, one set for all rows).
    The weights are streamed once per step for the whole batch, which is what a decode step costs here."""
    groups: dict[tuple, list[str]] = {}
    for name, cache in caches.items():
        alone = name in masks or _ragged_layers(cache)
        key = ("alone", name) if alone else tuple(int(layer.keys.shape[-2]) for layer in cache.layers)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _stacked(model, caches: list):
    """A new ``DynamicCache`` whose rows are ``caches`` (each of batch 1), layer by layer."""
    from transformers import DynamicCache

    out = DynamicCache(config=model.config)
    for i in range(len(caches[0].layers)):
        keys = torch.cat([c.layers[i].keys for c in caches])
        values = torch.cat([c.layers[i].values for c in caches])
        out.update(keys, values, i)
    return out


def decode_group(model, caches: dict, names: list[str], masks: dict, question, forced, start, n, stop):
    """``{name: (answer ids, teacher-forced logits)}`` for one group of :func:`decode_groups`.

    One setup decodes alone, as kvpress's pipeline would (greedy and the forced pass each on a copy of its
    cache); several decode as the rows of one batch built from their caches. Either way the setups' own
    caches are left as they were."""
    import copy

    if len(names) == 1:
        cache = caches[names[0]]
        with masked_keys(model, masks.get(names[0])):
            answers = greedy_until(model, copy.deepcopy(cache), question, start, n, stop)
            logits = forced_logits(model, copy.deepcopy(cache), forced, start)
    else:
        group = [caches[name] for name in names]
        answers = greedy_until(model, _stacked(model, group), question, start, n, stop)
        logits = forced_logits(model, _stacked(model, group), forced, start)
    return {name: (answers[r], logits[r]) for r, name in enumerate(names)}


def ruler_trial(model, job: dict, trial: dict, setups: list[dict], verify: bool) -> list[dict]:
    """Every setup on one trial: answer ids, kept slots, KL / top-1 to this worker's full cache.

    The hook presses share one prefill (``prefill: shared``), an OWN_PREFILL press takes its own (``prefill:
    own``, its ``prefill_s``); all then decode alike. Setups whose caches have the same shape decode
    together (:func:`decode_groups`); ``seconds`` of each row is its share of its group's decode time plus
    its own prefill, if any (so the shared ``prefill_s`` and the rows' ``seconds`` sum to the trial's time)."""
    presses = {s["name"]: make_press(s["press"], s["ratio"]) for s in setups if s["press"] is not None}
    for p in presses.values():
        p.post_init_from_model(model)
    ctx, question, answer = trial["context"], trial["question"], trial["answer"]
    forced = question + answer[:-1]
    start, stop = len(ctx), set(job["stop_ids"])
    t0 = time.perf_counter()
    masks: dict = {}
    hooked = [s for s in setups if s["press"] not in OWN_PREFILL]
    caches, errors = shared_press_prefill(model, ctx, hooked, presses, masks)
    shared = {"prefill": "shared", "prefill_s": time.perf_counter() - t0}
    own = own_prefills(model, ctx, setups, presses, caches, masks)
    head = {k: trial[k] for k in ("key", "task", "length", "trial", "seed")}
    rows: dict[str, dict] = {}
    for s in setups:
        row = {
            **head,
            "setup": s["name"],
            "press": s["press"],
            "ratio": s["ratio"],
            **own.get(s["name"], shared),
        }
        rows[s["name"]] = row
        if s["name"] in errors:
            row["error"] = errors[s["name"]]
        if "error" in row:
            continue
        try:
            cache = caches[s["name"]]
            if verify and s["press"] is not None and row["prefill"] == "shared":  # equals kvpress's own?
                check_standalone(model, ctx, s, cache, masks, row)
            row.update(cache_facts(cache, masks.get(s["name"])))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
    live = {name: c for name, c in caches.items() if "error" not in rows[name]}
    ref = None
    rows_answer = slice(len(question) - 1, None)
    for names in decode_groups(live, masks):  # "full" comes first: its logits are the reference
        t1 = time.perf_counter()
        try:
            decoded = decode_group(
                model, live, names, masks, question, forced, start, int(trial["max_new_tokens"]), stop
            )
        except Exception as exc:
            for name in names:
                rows[name]["error"] = f"{type(exc).__name__}: {exc}"
            continue
        share = (time.perf_counter() - t1) / len(names)
        for name in names:
            row, (answer_ids, logits) = rows[name], decoded[name]
            row["answer_ids"] = answer_ids
            row["batch_rows"] = len(names)
            if row["press"] is None:
                ref = logits
                row.update(full_checks(trial, logits))
            if ref is None:
                row["error"] = "the full cache failed: no reference logits"
                continue
            div = divergence(ref, logits)
            div_a = divergence(ref[rows_answer], logits[rows_answer])
            row.update(
                kld=div["kl"],
                top1=div["top1"],
                compared_tokens=div["n"],
                kld_answer=div_a["kl"],
                top1_answer=div_a["top1"],
                seconds=share + (row["prefill_s"] if row["prefill"] == "own" else 0.0),
            )
    for row in rows.values():
        if "error" in row:
            print(f"{head['key']} {row['setup']}: FAILED {row['error']}", file=sys.stderr, flush=True)
    return list(rows.values())


def full_checks(trial: dict, logits: torch.Tensor) -> dict:
    """This worker's full cache against kvlab's: top-1 agreement with kvlab's argmax, KL to its saved logits."""
    out = {}
    if trial.get("kvlab_full_argmax") is not None:
        agree = logits.argmax(-1) == torch.tensor(trial["kvlab_full_argmax"])
        out["top1_vs_kvlab_full"] = float(agree.double().mean())
    if trial.get("kvlab_full_logits"):
        out["kl_kvlab_full_vs_this_full"] = divergence(torch.load(trial["kvlab_full_logits"]), logits)["kl"]
    return out


def check_standalone(model, ctx: list[int], setup: dict, cache, masks: dict, row: dict) -> None:
    """Record how far the shared prefill's cache for ``setup`` is from kvpress's own ``with press(model)``."""
    alone = standalone_press_prefill(model, ctx, make_press(setup["press"], setup["ratio"]))
    alone_masks = take_masks(model)
    ours = masks.get(setup["name"], {})
    if alone_masks.keys() != ours.keys() or any(
        set(zip(*(t.tolist() for t in alone_masks[i]), strict=True))
        != set(zip(*(t.tolist() for t in ours[i]), strict=True))
        for i in ours
    ):
        row["check_masked_keys_differ"] = True
    row["check_max_abs_diff_vs_standalone"] = max(
        max(float((a.keys - b.keys).abs().max()), float((a.values - b.values).abs().max()))
        if a.keys.shape == b.keys.shape
        else float("inf")
        for a, b in zip(cache.layers, alone.layers, strict=True)
    )


def snapkv_slots_main(job: dict, out_path: str) -> None:
    """SnapKVPress's scores and kept slots per layer (see the module docstring)."""
    import kvpress
    from kvpress.utils import compute_n_kept
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(int(job.get("threads", 1)))
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()
    out: dict[str, torch.Tensor] = {}
    for name, context in job["contexts"].items():
        for w in job["windows"]:
            press = kvpress.SnapKVPress(compression_ratio=0.5, window_size=int(w))
            scores: list[torch.Tensor] = []
            score = press.score

            def capture(*args, _score=score, _scores=scores, **kwargs):
                s = _score(*args, **kwargs)
                _scores.append(s.detach().clone())
                return s

            press.score = capture
            with torch.no_grad(), press(model):
                model.model(input_ids=torch.tensor([context]), past_key_values=DynamicCache())
            stacked = torch.stack([s[0] for s in scores])  # [layers, kv heads, T]
            out[f"scores/{name}/{w}"] = stacked
            for ratio in job["ratios"]:
                n = compute_n_kept(stacked.shape[-1], float(ratio))
                out[f"kept/{name}/{w}/{ratio}"] = stacked.topk(n, dim=-1).indices.sort(dim=-1).values
            print(f"{name} window {w}: {len(scores)} layers", file=sys.stderr, flush=True)
    torch.save(out, out_path)


def ruler_main(job: dict, out_path: str) -> None:
    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(int(job.get("threads", 1)))
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()
    setups = ruler_setups(job)
    meta = {
        "meta": True,
        "versions": {
            "kvpress": getattr(kvpress, "__version__", "0.5.5"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "threads": torch.get_num_threads(),
        "setups": [s["name"] for s in setups],
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }
    with open(out_path, "w") as f:
        f.write(json.dumps(meta) + "\n")
    t0, n = time.perf_counter(), 0
    for trial in iter_ruler_trials(job):
        verify = n == 0 and job.get("verify_first", True)
        rows = ruler_trial(model, job, trial, setups, verify)
        with open(out_path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        n += 1
        print(
            f"trial {trial['key']} done ({n} in {time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    with open(out_path, "a") as f:
        f.write(json.dumps({"done": True, "trials": n, "seconds": time.perf_counter() - t0}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
