"""kvpress's way of compressing, in one call: compress the context once, leave the question whole.

A kvpress user writes ``pipe(context, question=q, press=SnapKVPress(compression_ratio=0.5))``. Here:
``Press("snapkv", compression_ratio=0.5).generate(model, context_ids, question_ids)`` prefills the
context through a :class:`~kvlab.hf.compressed_cache.CompressedCache` that evicts right after that
forward (so the question never influences what is kept, as in kvpress), then ``model.generate``
appends the question and answers from the compressed cache. ``compression_ratio`` is the fraction
*removed* (kvpress's convention); kvlab's ``keep`` is one minus it. Any registered eviction policy
works (``kvlab.compress.evict.REGISTRY``: streaming_llm, h2o, snapkv, tova, knorm, learned, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlab.compress.evict import make_policy
from kvlab.compress.evict.policies import Policy
from kvlab.errors import BadInputError
from kvlab.hf.cache import cache_argument
from kvlab.hf.compressed_cache import CompressedCache


@dataclass(frozen=True)
class Press:
    """An eviction policy (a name, or a configured :class:`Policy`) and the fraction of the context to remove."""

    policy: str | Policy
    compression_ratio: float

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.compression_ratio) < 1.0:
            raise BadInputError(
                f"compression_ratio is the fraction removed, in [0, 1); got {self.compression_ratio}"
            )
        if isinstance(self.policy, str):
            make_policy(self.policy)  # an unknown name fails here, with the known ones listed

    @property
    def keep(self) -> float:
        return 1.0 - float(self.compression_ratio)

    def cache(self, model: Any) -> CompressedCache:
        """A fresh cache that evicts after its first forward (pass it with the context, then generate)."""
        model = _transformers_model(model)
        policy = make_policy(self.policy) if isinstance(self.policy, str) else self.policy
        return CompressedCache(model.config, policy=policy, keep=self.keep, model=model)

    @torch.no_grad()
    def generate(
        self, model: Any, context_ids: torch.Tensor, question_ids: torch.Tensor, **generate_kwargs: Any
    ) -> torch.Tensor:
        """The answer's token ids ``[batch, new]``: the context compressed, the question and answer not.

        ``model`` is a Hugging Face causal LM (or a kvlab ``ModelHandle``); ``generate_kwargs`` go to
        ``model.generate`` (``max_new_tokens``, ``do_sample``, ...).
        """
        model = _transformers_model(model)
        context_ids, question_ids = torch.as_tensor(context_ids), torch.as_tensor(question_ids)
        if context_ids.dim() == 1:
            context_ids, question_ids = context_ids[None], question_ids.reshape(1, -1)
        if context_ids.shape[-1] < 1 or question_ids.shape[-1] < 1:
            raise BadInputError("a press needs a non-empty context and a non-empty question")
        cache = self.cache(model)
        try:
            model(input_ids=context_ids, use_cache=True, **{cache_argument(model): cache})
            full = torch.cat([context_ids, question_ids], dim=-1)
            out = model.generate(
                full,
                attention_mask=torch.ones_like(full),
                **{cache_argument(model): cache},
                **generate_kwargs,
            )
        finally:
            cache.close()
        return out[:, full.shape[-1] :]


def _transformers_model(model: Any) -> Any:
    """A kvlab ModelHandle's transformers model; a transformers model as is."""
    return model if isinstance(model, torch.nn.Module) else model.model
