"""KVzip (Kim et al. 2025): score each slot by the attention it draws while the model reconstructs the context.

The reconstruction pass feeds a repeat prompt and then the context again, right after the context; a slot's
score is the most softmax attention any of those tokens gives it, over the query heads of its KV group.
No question takes part, so the slots kept serve whatever question comes later (a compressed prefix can be
reused by requests whose questions differ). kvpress ships the method as ``KVzipPress``.

The pass is a :class:`~kvlab.policy.evict.observe.Probe` (:meth:`KVzip.probe_ids`), run offline through
the :class:`~kvlab.policy.evict.Observation`'s handle: the repeat prompt and the context fed on its cache.
A live cache runs no such pass, so it refuses this score in one line rather than score by other queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvlab.errors import BadInputError
from kvlab.policy.evict.observe import attention_weights
from kvlab.policy.evict.policies import LayerView, Policy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: the text between the context and its repetition (encoded without special tokens; none without a tokenizer)
REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"


@dataclass(frozen=True)
class KVzip(Policy):
    """The most attention each slot receives from the reconstruction pass: max over its tokens and over the
    query heads of the slot's KV group. Their softmax runs over the context and the pass's own tokens
    before it (causal), as in the pass itself. ``chunk`` pass tokens are scored at a time (memory only)."""

    chunk: int = 256
    name = "kvzip"
    needs_queries = True

    def probe_ids(self, context: list[int], tokenizer: PreTrainedTokenizerBase | None) -> list[int]:
        """The repeat prompt, then the context again (without a leading BOS, which opens a sequence only)."""
        if tokenizer is None:
            return list(context)
        prompt = list(tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False))
        bos = getattr(tokenizer, "bos_token_id", None)
        return [*prompt, *(context[1:] if context and context[0] == bos else context)]

    def score(self, view: LayerView) -> torch.Tensor:
        if view.probe is None:
            raise BadInputError(
                "kvzip scores slots by a reconstruction pass after the context, which runs offline only "
                "(kvlab.policy.evict.evict on an Observation, kvlab eval); a live cache cannot run it yet"
            )
        queries, keys = view.probe.queries[view.layer], view.probe.keys[view.layer]
        t, n = view.seq_len, queries.shape[2]
        slots = torch.arange(t, t + n, device=queries.device)
        best = torch.zeros(queries.shape[0], queries.shape[1], t, device=queries.device)
        for s in range(0, n, self.chunk):
            a = attention_weights(
                queries[:, :, s : s + self.chunk], keys, view.scaling, slots[s : s + self.chunk]
            )
            best = torch.maximum(best, a[..., :t].amax(dim=2))
        b, hq, _ = best.shape
        hkv = view.keys.shape[1]
        return best.view(b, hkv, hq // hkv, t).amax(dim=2)
