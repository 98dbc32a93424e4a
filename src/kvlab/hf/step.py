"""One step context: how a kvlab cache gets the attention it needs inside a transformers forward.

Invariant: while a forward runs on a kvlab cache that attends in its own way (the rows of a batch each
on their own rolling cache, a masked past, a one-token decode over packed codes), the model's attention
implementation is :data:`KVLAB_ATTENTION` and the innermost :class:`Step` of *this thread* answers each
layer's attention; with no step (another thread's forward on the same model, a model left switched)
it is plain SDPA, so nothing ever reads another forward's state.

Data: one thread-local (:data:`THREAD`) holding the steps in progress (innermost last) and the finish
callbacks of the bound caches' forward hooks (:mod:`kvlab.hf.binding`), one entry per hooked call.

Operations: :func:`open_step` switches the model and pushes a step (returning what undoes both);
:func:`stepping` is the same as a context manager; :func:`current` finds the innermost step of a kind
(a cache layer hands its view to the step of its own forward). A :class:`Step` whose ``attend`` returns
None for a layer leaves that layer to SDPA.

The captured decode steps (:mod:`kvlab.hf.graphs`) register their own fixed attention: a step captured
as a CUDA graph or compiled with ``fullgraph=True`` cannot consult a thread-local at run time.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

if TYPE_CHECKING:
    from transformers import PreTrainedModel

KVLAB_ATTENTION = "kvlab"

S = TypeVar("S", bound="Step")


class Step:
    """One forward's attention state; a subclass answers :meth:`attend` for the layers it owns."""

    def attend(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kw
    ) -> tuple[torch.Tensor, Any] | None:
        raise NotImplementedError


class _Thread(threading.local):
    """This thread's steps in progress (innermost last) and its bound forwards' finish callbacks."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.calls: list[Callable[[Any], None] | None] = []


THREAD = _Thread()


def _attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kw
):
    step = THREAD.steps[-1] if THREAD.steps else None
    out = step.attend(module, query, key, value, attention_mask, **kw) if step is not None else None
    return out if out is not None else sdpa_attention_forward(module, query, key, value, attention_mask, **kw)


AttentionInterface.register(KVLAB_ATTENTION, _attention)


Fresh = tuple[torch.Tensor, torch.Tensor]  # one layer's new keys and values, not yet in the cache


def grouped_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    fresh: Fresh | None = None,
    **kw: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA with each KV head's query heads stacked along the query axis, so keys and values are read
    once per KV head and never copied: transformers repeats them per query head (``repeat_kv``) for
    every masked multi-token forward and every compiled step, which at 32k tokens on an 8B model
    writes 16 GiB per forward. The same function as SDPA; ``attention_mask`` is 4-D with one row per KV
    head (or one for all: ``[B, 1 | Hkv, n, total]``); calls without one go to SDPA. ``fresh``: one
    query's own key and value ``[B, Hkv, 1, D]``, attended beside ``key``/``value`` and never masked
    (a cache that writes them after the step, :class:`~kvlab.hf.ring_rows.RingRows` on a CPU)."""
    b, heads, n, d = query.shape
    groups = heads // key.shape[1]
    if fresh is not None:
        q = query.reshape(b, key.shape[1], groups, d)
        out = _one_query(q, key, value, attention_mask, kw.get("scaling") or d**-0.5, fresh)
        return out.reshape(b, heads, n, d).transpose(1, 2).contiguous(), None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4 or groups == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    q = query.reshape(b, key.shape[1], groups * n, d)  # head j*groups + i, token t -> row i*n + t
    mask = attention_mask.repeat(1, 1, groups, 1) if n > 1 else attention_mask
    if n == 1 and q.device.type == "cpu":  # one query: SDPA's CPU flash kernel takes ~10x two matmuls here
        out = _one_query(q, key, value, mask, kw.get("scaling") or d**-0.5)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, key, value, attn_mask=mask, scale=kw.get("scaling")
        )
    return out.reshape(b, heads, n, d).transpose(1, 2).contiguous(), None


def _one_query(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    fresh: Fresh | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, Hkv, groups, D]`` (one token's query heads) over ``key``/``value``
    ``[B, Hkv, T, D]`` under ``mask`` (additive or boolean, ``[B, 1 | Hkv, 1, T]``), and over ``fresh``
    (a key and value ``[B, Hkv, 1, D]`` every query sees) if given. Compiled, the products are written as
    sums that inductor fuses into one pass over the keys and one over the values (its autotuned GEMM
    templates, which the frozen CPU step uses for the weights, take ~5x at these shapes)."""
    compiled = torch.compiler.is_compiling()
    if compiled:
        # the query written out first: left to inductor, its producer (the RoPE, cos and sin of the position
        # included) was computed inside the scores' loop, once per cached slot: most of that kernel's time
        # at 330 slots in the frozen CPU step (torch.profiler, the bundled model); a no-op outside a graph
        q = torch.ops.prims.inductor_force_stride_order(q, q.stride())
        scores = (q.unsqueeze(-2) * key.unsqueeze(-3)).sum(-1) * scale
    else:
        scores = (q @ key.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if fresh is not None:
        scores = torch.cat([scores, (q * fresh[0]).sum(-1, keepdim=True) * scale], dim=-1)
    w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    w, w_fresh = (w[..., :-1], w[..., -1:]) if fresh is not None else (w, None)
    out = (w.unsqueeze(-1) * value.unsqueeze(-3)).sum(-2) if compiled else w @ value
    return out if fresh is None or w_fresh is None else out + w_fresh * fresh[1]


def causal_after(q_len: int, total: int, device: Any) -> torch.Tensor:
    """``[q_len, total]`` bool: the last ``q_len`` of ``total`` slots are the queries' own tokens, each
    seeing every slot before it and itself (the invariant of every kvlab cache: new tokens come last)."""
    at = torch.arange(q_len, device=device)[:, None] + (total - q_len)
    return torch.arange(total, device=device)[None, :] <= at


def current(kind: type[S]) -> S | None:
    """The innermost step of this thread if it is a ``kind``, else None."""
    step = THREAD.steps[-1] if THREAD.steps else None
    return step if isinstance(step, kind) else None


def open_step(model: PreTrainedModel, step: Step) -> Callable[[], None]:
    """Switch ``model`` to :data:`KVLAB_ATTENTION` with ``step`` innermost; returns what undoes both."""
    before = model.config._attn_implementation
    model.set_attn_implementation(KVLAB_ATTENTION)
    THREAD.steps.append(step)

    def close() -> None:
        THREAD.steps.remove(step)
        model.set_attn_implementation(before)

    return close


@contextlib.contextmanager
def stepping(model: PreTrainedModel, step: Step) -> Iterator[Step]:
    """:func:`open_step` for the forwards run inside."""
    close = open_step(model, step)
    try:
        yield step
    finally:
        close()
