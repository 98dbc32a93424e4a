"""Per-head (AdaKV) budgets in a live cache, stored ragged: each KV head holds only its own kept slots.

Invariant: after its prefill a layer of ``CompressedCache(..., heads="ada")`` holds, per KV head ``h``,
exactly the slots :func:`kvlab.policy.evict.budgets.ada_indices` keeps for that head (the layer's
budget over all its heads together), as ``[B, n_h, D]`` keys and values at their original positions,
plus every token fed since; a forward over it equals one over the masked snapshot of the same slots
(:meth:`~kvlab.policy.evict.budgets.RaggedCache.masked`, tested). Nothing pruned is kept, unlike
kvpress's ``AdaKVPress`` (which masks pruned keys and keeps them all).

Data: per layer and KV head a keys, values and positions tensor of its own length. Operations: the
prefill attends to everything (plain attention) and then selects; each later forward appends its
tokens to every head and hands the heads to a :class:`~kvlab.hf.cache_steps.RaggedStep` (kvlab's one
attention function, :mod:`kvlab.hf.step`), which attends each group of query heads over its KV head's
slots, the new tokens causal among themselves. The cache must be bound to its model (``model=``) so that step opens.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.cache import PADDED_BATCH, rows_at_different_positions
from kvlab.hf.cache_steps import RaggedStep
from kvlab.hf.compressed_layer import CompressedLayer
from kvlab.hf.step import current
from kvlab.policy.evict.budgets import ada_indices
from kvlab.policy.evict.policies import LayerView
from kvlab.policy.quant.pack import tensor_bytes


class RaggedLayer(CompressedLayer):
    """A :class:`~kvlab.hf.compressed_layer.CompressedLayer` whose eviction shares the layer's budget over
    its KV heads (AdaKV) and then stores each head ragged (``head_keys``, ``head_values``,
    ``head_positions``: lists over KV heads)."""

    def __init__(self, rule: Any, index: int):
        super().__init__(rule, index)
        self.head_keys: list[torch.Tensor] = []
        self.head_values: list[torch.Tensor] = []
        self.head_positions: list[torch.Tensor] = []

    @property
    def held(self) -> int:
        """The most slots one KV head holds (what one head's attention reads)."""
        if not self.evicted:
            return super().held
        return max(k.shape[-2] for k in self.head_keys)

    @property
    def nbytes(self) -> int:
        if not self.evicted:
            return super().nbytes
        return tensor_bytes(*self.head_keys, *self.head_values)

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.evicted:
            raise BadInputError(
                "a per-head (ada) layer holds a different number of slots per head: read head_keys / "
                "head_values (or kept_per_head), not one rectangular tensor"
            )
        return super().decoded()

    def kept_positions(self) -> torch.Tensor:
        if self.evicted:
            raise BadInputError(
                "a per-head (ada) layer keeps a different number of slots per head: read head_positions"
            )
        return super().kept_positions()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.evicted:
            if key_states.shape[0] != 1:  # refused before anything changes
                raise BadInputError(
                    f"per-head (ada) budgets are chosen per sequence; got a batch of {key_states.shape[0]}"
                )
            return super().update(key_states, value_states, *args, **kwargs)  # the prefill: evicts
        if rows_at_different_positions(args, kwargs):
            raise BadInputError(PADDED_BATCH % "CompressedCache with per-head (ada) budgets")
        step = current(RaggedStep)
        if step is None:
            raise UnsupportedModelError(
                "a per-head (ada) cache attends through kvlab's step: use it on the model it was bound to "
                "(cache_for(spec, model) or CompressedCache(..., model=model))"
            )
        n = key_states.shape[-2]
        pos = torch.arange(self.seen, self.seen + n, device="cpu")
        self.seen += n
        for h in range(len(self.head_keys)):
            self.head_keys[h] = torch.cat((self.head_keys[h], key_states[:, h]), dim=-2)
            self.head_values[h] = torch.cat((self.head_values[h], value_states[:, h]), dim=-2)
            self.head_positions[h] = torch.cat(
                (self.head_positions[h], pos.expand(key_states.shape[0], n)), -1
            )
        self.most_held = max(self.most_held, self.held)
        step.views[self.index] = (self.head_keys, self.head_values)
        return key_states, value_states

    def _evict(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """The prefill's eviction: score every slot, keep AdaKV's per-head selection of ``budget * H``."""
        rule = self.rule
        b, h, n_new, d = k.shape
        queries = self._queries(n_new, positions, d)
        slots = None
        if queries is not None and queries.shape[2] != n_new:
            slots = torch.arange(n_new - queries.shape[2], n_new, device=k.device)
        view = LayerView(
            self.index,
            rule.num_layers,
            k,
            v,
            positions.expand(b, h, n_new).to(k.device),
            queries,
            rule.scaling,
            slots,
        )
        policy = rule.policy
        if policy is None:  # CompressedCache builds RaggedLayers only with a policy
            raise BadInputError("per-head (ada) budgets need an eviction policy")
        kept = ada_indices(policy.score(view), int(self.budget or 0), policy.sinks, policy.window)
        for head, ix in enumerate(kept):
            ix = ix.to(k.device)
            self.head_keys.append(k[:, head].gather(1, ix[..., None].expand(-1, -1, d)).clone())
            self.head_values.append(v[:, head].gather(1, ix[..., None].expand(-1, -1, v.shape[-1])).clone())
            self.head_positions.append(positions[ix.cpu()])
        self.keys, self.values = k[:, :, :0].clone(), v[:, :, :0].clone()  # nothing rectangular is held
        self.pending_queries, self.recent_queries, self.fresh = None, [], 0
        self.evicted = True
        self.evictions += 1
        self.remove_hook()
        return k, v
