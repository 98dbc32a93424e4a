"""kvpress's way of compressing, in one call: compress the context once, leave the question whole.

A kvpress user writes ``pipe(context, question=q, press=SnapKVPress(compression_ratio=0.5))``. Here:
``Press("snapkv", compression_ratio=0.5).generate(model, context_ids, question_ids)`` prefills the
context through a :class:`~kvlab.hf.compressed_cache.CompressedCache` that evicts right after that
forward (so the question never influences what is kept, as in kvpress), then feeds the question and
answers from the compressed cache with kvlab's one decode loop. ``compression_ratio`` is the fraction
*removed* (kvpress's convention); kvlab's ``keep`` is one minus it. Any registered eviction policy
works (``kvlab.policy.evict.POLICIES``: streaming_llm, h2o, snapkv, tova, knorm, learned, ...).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvlab.errors import BadInputError
from kvlab.hf.compressed_cache import CompressedCache
from kvlab.loop import GREEDY, Sampling, decode_loop
from kvlab.model.handle import ModelLike, as_handle
from kvlab.policy.evict import make_policy
from kvlab.policy.evict.policies import Policy


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

    def cache(self, model: ModelLike) -> CompressedCache:
        """A fresh cache that evicts after its first forward (a transformers model or a ModelHandle)."""
        hf = as_handle(model).model
        policy = make_policy(self.policy) if isinstance(self.policy, str) else self.policy
        return CompressedCache(hf.config, policy=policy, keep=self.keep, model=hf)

    @torch.no_grad()
    def generate(
        self,
        model: ModelLike,
        context_ids: Sequence[int] | torch.Tensor,
        question_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int = 32,
        *,
        sampling: Sampling = GREEDY,
        stop_ids: Iterable[int] = (),
    ) -> list[int]:
        """The answer's token ids: the context compressed, the question and the answer not.

        ``model``: a transformers causal LM or a kvlab ``ModelHandle``. Greedy unless ``sampling`` says
        otherwise; stops after ``max_new_tokens`` or at a token of ``stop_ids``.
        """
        handle = as_handle(model)
        context = torch.as_tensor(context_ids, dtype=torch.long, device=handle.device).reshape(1, -1)
        question = torch.as_tensor(question_ids, dtype=torch.long, device=handle.device).reshape(1, -1)
        if context.shape[-1] < 1 or question.shape[-1] < 1:
            raise BadInputError("a press needs a non-empty context and a non-empty question")
        cache = self.cache(handle)
        try:
            handle.run(context, cache, logits_to_keep=1)  # evicts right after this forward
            first = handle.run(question, cache, logits_to_keep=1).logits[0, -1].float()

            def feed(tokens: torch.Tensor) -> torch.Tensor:
                return handle.run(tokens.reshape(1, -1), cache, logits_to_keep=1).logits[:, -1].float()

            steps = decode_loop(feed, first, max_new_tokens, sampling=sampling, stop_ids=stop_ids)
            return [step.token(0) for step in steps]
        finally:
            cache.close()
