"""Eviction policies: each a small dataclass with one ``score()``; higher scores are kept.

A policy sees one layer at a time through a :class:`LayerView` and returns ``[batch, kv_heads, T]``
scores; :func:`~kvlab.policy.evict.select.keep_indices` then keeps the top ``n`` slots per head,
always including the first ``sinks`` slots and the last ``window`` slots the policy asks for (a
:class:`~kvlab.policy.SinksWindow`).

Adding a policy: subclass :class:`Policy` with a ``name`` in a new module under
``kvlab/policy/evict/methods/``; it is registered by name when the module is imported (every
module there is imported with :mod:`kvlab.policy.evict`), so ``make_policy``, the command line
and the study's policy lists see it (``methods/random_sinks.py`` is the example). Add the name to
:data:`kvlab.policy.catalogue.SCORES` too: cache specs are read from there, without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from kvlab.errors import BadInputError
from kvlab.policy.evict.observe import Probe, attention_weights

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(eq=False)
class LayerView:
    """One layer of a prefilled context (or of a live cache about to evict).

    ``keys``/``values`` ``[B, Hkv, T, D]``; ``positions`` ``[T]``, or ``[B, Hkv, T]`` when each head
    holds other tokens (a cache that has evicted before); ``queries [B, Hq, n, D]`` post-RoPE (the
    context's own queries, or None when only the cache is known); ``scaling`` the softmax scale.
    ``query_slots [n]``: the slot each query sits at (it sees slots ``0..slot``, the causal mask); None
    means the queries are the context's own, one per slot (``n == T``). A live cache that evicts while
    decoding carries only the queries fed since its last eviction, at the last ``n`` slots.
    ``probe``: the extra pass the policy asked for (:meth:`Policy.probe_ids`), all layers' (read
    ``probe.queries[layer]``); None where none was run (a live cache runs none). ``window``: a sliding
    layer's (each query sees only the slots after its own minus the window), None for full attention.
    """

    layer: int
    num_layers: int
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor | None = None
    scaling: float = 1.0
    query_slots: torch.Tensor | None = None
    probe: Probe | None = None
    window: int | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def seq_len(self) -> int:
        return self.keys.shape[-2]

    def require_queries(self, who: str) -> torch.Tensor:
        if self.queries is None:
            raise BadInputError(
                f"{who} scores tokens by attention and needs the context's queries: "
                "use kvlab.policy.observe(model, tokens) and evict the Observation"
            )
        return self.queries

    def slots_of_queries(self) -> torch.Tensor:
        """``[n]`` the slot of each query (``0..T-1`` when the queries are the context's own)."""
        q = self.require_queries("this policy")
        if self.query_slots is not None:
            return self.query_slots.to(q.device)
        return torch.arange(q.shape[2], device=q.device)

    def recent_attention(self, n: int) -> torch.Tensor:
        """Attention of the last ``n`` queries, averaged over them and over each KV head's query group: ``[B, Hkv, T]``."""
        key = ("recent", n)
        if key not in self._memo:
            q = self.require_queries("this policy")
            n = min(n, q.shape[2])
            slots = self.slots_of_queries()[q.shape[2] - n :]
            a = attention_weights(q[:, :, q.shape[2] - n :], self.keys, self.scaling, slots, self.window)
            self._memo[key] = _group_mean(a.mean(dim=2), self.keys.shape[1])
        return self._memo[key]

    @cached_property
    def received(self) -> torch.Tensor:
        """Attention each slot received from every query the view carries, ``[B, Hkv, T]`` (sum over queries, group mean)."""
        q = self.require_queries("this policy")
        slots_all = self.slots_of_queries()
        n = q.shape[2]
        total = torch.zeros(q.shape[0], q.shape[1], self.seq_len, device=q.device)
        for s in range(0, n, 256):
            e = min(s + 256, n)
            # causal: these queries see no slot past the last one's, so the rest is left out (its weights
            # are exact zeros; a quarter of the T x T work at 4k tokens, half of it in all)
            end = min(int(slots_all[s:e].max()) + 1, self.seq_len)
            a = attention_weights(
                q[:, :, s:e], self.keys[:, :, :end], self.scaling, slots_all[s:e], self.window
            )
            total[..., :end] += a.sum(dim=2)
        return _group_mean(total, self.keys.shape[1])


def _group_mean(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, T]`` -> ``[B, Hkv, T]``: mean over the query heads sharing each KV head."""
    b, hq, t = x.shape
    return x.view(b, kv_heads, hq // kv_heads, t).mean(dim=2)


def _broadcast(score_t: torch.Tensor, view: LayerView) -> torch.Tensor:
    b, h = view.keys.shape[:2]
    return score_t.to(torch.float32)[None, None, :].expand(b, h, -1)


#: every policy class by name, filled as classes are defined (see :meth:`Policy.__init_subclass__`)
REGISTRY: dict[str, type[Policy]] = {}


@dataclass(frozen=True)
class Policy:
    """Base: ``sinks`` first slots and ``window`` last slots are always kept."""

    sinks: int = 0
    window: int = 0
    name = "policy"
    needs_queries = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if isinstance(name, str):
            other = REGISTRY.get(name)
            if other is not None and other.__qualname__ != cls.__qualname__:
                raise TypeError(
                    f"two eviction policies are named '{name}': {other.__module__} and {cls.__module__}"
                )
            REGISTRY[name] = cls

    def score(self, view: LayerView) -> torch.Tensor:
        raise NotImplementedError

    def probe_ids(self, context: list[int], tokenizer: PreTrainedTokenizerBase | None) -> list[int] | None:
        """Tokens of an extra pass to feed right after the ``context`` (its ids) before scoring, or None
        (the default: the context's own queries suffice). Offline, :func:`~kvlab.policy.evict.evict`
        runs it through the :class:`~kvlab.policy.evict.Observation`'s handle and hands it to
        :meth:`score` as ``view.probe``; ``tokenizer`` is the model's (None when it has none)."""
        return None


@dataclass(frozen=True)
class SlidingWindow(Policy):
    """Keep the most recent tokens."""

    name = "window"

    def score(self, view: LayerView) -> torch.Tensor:
        return _broadcast(torch.arange(view.seq_len, device=view.keys.device), view)


@dataclass(frozen=True)
class StreamingLLM(SlidingWindow):
    """Attention sinks + the most recent tokens (Xiao et al. 2023)."""

    sinks: int = 4
    name = "streaming_llm"


@dataclass(frozen=True)
class H2O(Policy):
    """Heavy hitters: attention accumulated over every context query, plus a recent window."""

    window: int = 16
    name = "h2o"
    needs_queries = True

    def score(self, view: LayerView) -> torch.Tensor:
        return view.received


@dataclass(frozen=True)
class SnapKV(Policy):
    """Attention from the last ``observe`` queries, average-pooled over ``kernel`` neighbours; the window is kept.

    As SnapKV's reference code (and kvpress's SnapKVPress) pools: over the slots before the window only, the
    zero padding counted in each mean. The window's slots keep their raw attention; ``keep_indices`` keeps
    them whatever they score. kvpress's default window is 64; ``SnapKV(window=64, observe=64)`` keeps the
    slots it keeps (``benchmarks/results/snapkv_vs_kvpress.md``).
    """

    window: int = 32
    observe: int = 32
    kernel: int = 5
    name = "snapkv"
    needs_queries = True

    def score(self, view: LayerView) -> torch.Tensor:
        a = view.recent_attention(self.observe)
        cut = a.shape[-1] - min(self.window, a.shape[-1])
        if cut == 0:  # every slot is in the window
            return a
        pooled = torch.nn.functional.avg_pool1d(
            a[..., :cut], self.kernel, stride=1, padding=self.kernel // 2, count_include_pad=True
        )
        return torch.cat([pooled, a[..., cut:]], dim=-1)


@dataclass(frozen=True)
class TOVA(Policy):
    """Attention of the last query, averaged over every head of the layer (Oren et al. 2024, as the
    official code and kvpress's TOVAPress do): one score per slot, so every KV head keeps the same slots."""

    name = "tova"
    needs_queries = True

    def score(self, view: LayerView) -> torch.Tensor:
        a = view.recent_attention(1)  # [B, Hkv, T]: the group mean; equal groups, so their mean is all heads'
        return a.mean(dim=1, keepdim=True).expand_as(a)


@dataclass(frozen=True)
class KeyNorm(Policy):
    """Keep low-norm keys (they draw more attention, Devoto et al. 2024; kvpress's Knorm)."""

    name = "knorm"

    def score(self, view: LayerView) -> torch.Tensor:
        return -view.keys.float().norm(dim=-1)


@dataclass(frozen=True)
class RandomPolicy(Policy):
    """The control: uniform random scores (seeded per layer)."""

    seed: int = 0
    name = "random"

    def score(self, view: LayerView) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1000 + view.layer)
        b, h = view.keys.shape[:2]
        # drawn on the host, so a seed gives the same scores on every device, then moved to the keys
        return torch.rand(b, h, view.seq_len, generator=gen, device="cpu").to(view.keys.device)
