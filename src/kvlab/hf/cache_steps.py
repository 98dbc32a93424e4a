"""The attention steps a live cache's own layers answer: packed codes and ragged heads.

Invariant: a cache's rule only *describes* its storage (a codec, budgets shared over layers or heads);
which step a bound forward opens is decided here, from that description (:func:`open_cache_step`), and
a layer hands its view to the step of its own forward (:func:`packed_step`, or
:func:`kvlab.hf.step.current`). A layer without a view is left to SDPA.

Data: a :class:`PackedStep` holds each layer's packed-code view until that layer's attention consumes
it; a :class:`RaggedStep` each ragged layer's per-head keys and values. Operations: open one for a
forward (through :func:`kvlab.hf.step.open_step`) and, when it closes, refuse a forward that did not
attend through transformers' attention interface in every layer (its output would ignore the views).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvlab.errors import UnsupportedModelError
from kvlab.hf.step import Step, causal_after, current, open_step
from kvlab.rope.layers import sliding_windows, text_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kvlab.hf.live_cache import LiveCache

Finish = Callable[[Any], None]


@dataclass(eq=False)
class PackedStep(Step):
    """One decode forward on the packed codes: each layer's view, until its attention consumes it."""

    rule: Any
    views: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    consumed: int = 0
    paths: set[str] = field(default_factory=set)  # which packed-code paths the layers took

    def attend(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kw
    ) -> tuple[torch.Tensor, None] | None:
        """A decode query over its layer's packed segments plus the full-precision sinks, tail and new token
        (:func:`kvlab.policy.quant.attention.decode_attention`); None (SDPA) for a layer with no view."""
        view = self.views.pop(module.layer_idx, None)
        if view is None:
            return None
        from kvlab.policy.quant.attention import decode_attention

        plan, fp_k, fp_v = view
        b, heads, q_len, d = query.shape
        out = decode_attention(plan, query[0, :, -1], fp_k, fp_v, kw.get("scaling") or d**-0.5)
        self.consumed += 1
        self.paths.add(plan.path)
        return out.to(query.dtype).reshape(1, 1, heads, d), None


@dataclass(eq=False)
class RaggedStep(Step):
    """One forward on a cache whose layers (``layers="pyramid"``) or heads (``heads="ada"``) hold different
    numbers of slots: the model's one mask (sized by layer 0) cannot fit them, so every layer attends
    here, its new tokens causal after its own held slots; a ragged layer's per-head keys and values
    arrive in ``views``."""

    views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)
    consumed: int = 0

    def attend(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kw
    ) -> tuple[torch.Tensor, None] | None:
        """Each KV head's query group over that head's own slots; the last ``q_len`` slots of every head are
        the queries' own tokens (causal). A layer without a view: SDPA over its keys, the same causality."""
        view = self.views.pop(module.layer_idx, None)
        if view is None:
            q_len, t = query.shape[2], key.shape[2]
            mask = None
            if q_len > 1:
                mask = causal_after(q_len, t, query.device)
            kw.pop("is_causal", None)
            return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kw)
        ks, vs = view
        b, heads, q_len, d = query.shape
        groups = heads // len(ks)
        scale = kw.get("scaling") or d**-0.5
        out = query.new_empty((b, q_len, heads, d))
        for h, (k, v) in enumerate(zip(ks, vs, strict=True)):
            q = query[:, h * groups : (h + 1) * groups]  # [B, g, q_len, D]
            scores = (q @ k[:, None].transpose(-1, -2)) * scale  # [B, g, q_len, T_h]
            if q_len > 1:
                t = k.shape[-2]
                scores = scores.masked_fill(~causal_after(q_len, t, q.device), float("-inf"))
            w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
            out[:, :, h * groups : (h + 1) * groups] = (w @ v[:, None]).transpose(1, 2)
        self.consumed += 1
        return out, None


def packed_step(rule: Any) -> PackedStep | None:
    """The packed-code step of ``rule``'s cache in progress in this thread (innermost), if any."""
    step = current(PackedStep)
    return step if step is not None and step.rule is rule else None


def open_cache_step(cache: LiveCache, model: PreTrainedModel, kwargs: dict) -> Finish | None:
    """The cache's own attention for one bound forward, opened, and what closes it; None for SDPA.

    Budgets shared over layers or heads (``rule.shared``), once evicted, attend through a
    :class:`RaggedStep`; a codec's one-token steps over the packed codes (:func:`_open_packed_step`);
    anything else (the full cache, a plain rolling window, a prefill) through SDPA."""
    rule = cache.rule
    if getattr(rule, "shared", False) and cache.layers[0].evicted:
        step = RaggedStep()
        return _opened(
            model,
            step,
            "so a per-head (ada) cache cannot run on it (discard the cache)",
        )
    if getattr(rule, "codec", None) is None:
        return None
    return _open_packed_step(cache, rule, model, kwargs)


def _opened(
    model: PreTrainedModel, step: PackedStep | RaggedStep, why: str, then: Finish | None = None
) -> Finish:
    """``step`` opened on ``model``; the returned function closes it, runs ``then`` and refuses a forward
    that left a view unread (``why``: what that means for the cache)."""
    close = open_step(model, step)

    def finish(out: Any) -> None:
        close()
        if then is not None:
            then(out)
        if out is not None and step.views:
            raise UnsupportedModelError(
                f"the model did not attend through transformers' attention interface in every layer, {why}"
            )

    return finish


def _open_packed_step(cache: LiveCache, rule: Any, model: PreTrainedModel, kwargs: dict) -> Finish | None:
    """A one-token step of a bound coded cache (a :class:`~kvlab.hf.compressed_cache.CompressedCache`, or a
    :class:`~kvlab.hf.rolling_cache.RollingCache` over codes) whose layers attend over their packed codes,
    counted in ``cache.packed_steps`` and ``cache.packed_steps_by_path``; None where the step takes the
    reference path: more than one token, not float32, attention that is not plain, no packed path for
    the device."""
    from kvlab.policy.quant.attention import packed_path

    x = kwargs.get("input_ids")
    x = x if isinstance(x, torch.Tensor) else kwargs.get("inputs_embeds")
    if (
        not isinstance(x, torch.Tensor)
        or tuple(x.shape[:2]) != (1, 1)
        or getattr(model, "dtype", None) != torch.float32
        or not attends_plainly(model)
        or packed_path(x.device, rule.packed_path) is None
    ):
        return None
    step = PackedStep(rule)

    def count(_out: Any) -> None:
        cache.packed_steps += step.consumed > 0
        for p in step.paths:
            cache.packed_steps_by_path[p] += 1

    why = (
        "so its output ignores the packed codes (the cache itself is intact: re-run the step without binding "
        "the cache to the model)"
    )
    return _opened(model, step, why, then=count)


_EXTRAS: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()


def attention_extras(model: PreTrainedModel) -> frozenset[str]:
    """What the model's attention does besides softmax over the slots it is given, read once per model:
    ``"soft-capping"`` (of the logits), ``"learned sinks"``, ``"sliding window"``, ``"no layer index"``."""
    if model not in _EXTRAS:
        mods = [m for name, m in model.named_modules() if name.endswith("self_attn")]
        cfg = text_config(model.config)
        found = {"no attention layers"} if not mods else set()
        if getattr(cfg, "attn_logit_softcapping", None):
            found.add("soft-capping")
        if any(w is not None for w in sliding_windows(model.config)):  # Mistral's modules do not say so
            found.add("sliding window")
        for m in mods:
            if getattr(m, "sinks", None) is not None:
                found.add("learned sinks")
            if getattr(m, "sliding_window", None):
                found.add("sliding window")
            if not hasattr(m, "layer_idx"):
                found.add("no layer index")
        _EXTRAS[model] = frozenset(found)
    return _EXTRAS[model]


def attends_plainly(model: PreTrainedModel) -> bool:
    """Softmax attention with nothing the packed-code or ragged step would drop (no logit soft-capping,
    no learned sinks, no sliding window)."""
    return not attention_extras(model)
