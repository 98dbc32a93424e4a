"""The one decode loop: pick a token per row, feed it, repeat — greedy or sampled, batched, with stops.

Every generation in kvlab runs here: :meth:`ModelHandle.generate` and ``generate_rows`` (snapshots),
:func:`kvlab.streaming.stream_generate` and chat (a live rolling cache), greedy decoding on evicted
caches, the decode-speed measurements. The loop knows nothing about caches: the caller passes
``feed(tokens [B]) -> logits [B, vocab]``, which runs one new token per row through whatever cache
it holds and returns the next logits. So a new cache kind never needs a new loop.

Rows stop independently (a stop token ends its row; the token is reported); finished rows keep being
fed their last token while others continue (their outputs are ignored), because one batched forward
per step costs about what one row does on a CPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from kvlab.errors import BadInputError

Feed = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Sampling:
    """How a token is picked from logits: greedy (``temperature=0``) or sampled with nucleus ``top_p``.

    Sampling is seeded: the same ``seed`` gives the same tokens (one ``torch.Generator`` per loop).
    Every finite temperature ``> 0`` is valid, however small: probabilities are computed in float64 from
    ``(logits - max) / temperature``, which is ``<= 0`` and never overflows to ``+inf`` (``logits /
    1e-310`` would, and ``softmax`` of it is NaN). Where ``gap / temperature`` passes float64's range
    it becomes ``-inf`` and that token's probability exactly 0, which is the ``temperature -> 0`` limit:
    below about ``1e-300`` (and for any temperature far below the logits' gaps, e.g. ``1e-6``) a pick is
    the argmax, the tied best tokens shared at random.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:
            raise BadInputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BadInputError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """``[B]`` token ids from ``[B, vocab]`` logits."""
        if self.greedy:
            return logits.argmax(-1)
        scaled = logits.double().cpu()
        # shifted by each row's max first: every entry <= 0, the best exactly 0, so no temperature overflows
        scaled = (scaled - scaled.max(dim=-1, keepdim=True).values) / self.temperature
        probs = torch.softmax(scaled, dim=-1)
        if self.top_p < 1:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least the top token)
            drop = sorted_p.cumsum(-1) - sorted_p >= self.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        return torch.multinomial(probs, 1, generator=generator)[:, 0].to(logits.device)


GREEDY = Sampling()


@dataclass(frozen=True)
class DecodeStep:
    """One step of the loop: the token each row picked (None for rows that had already stopped)."""

    step: int
    tokens: tuple[int | None, ...]
    stopped: tuple[bool, ...]  # rows finished after this step (a stop token or an earlier stop)
    fed: bool  # whether the tokens were fed (the caller's cache holds them)
    seconds: float  # wall time of the feed (0.0 when not fed)
    logits: torch.Tensor | None = None  # [B, vocab] the tokens were picked from (keep_logits=True)

    def token(self, row: int = 0) -> int:
        """Row ``row``'s token at this step (an error for a row that had already stopped)."""
        tok = self.tokens[row]
        if tok is None:
            raise BadInputError(f"row {row} stopped before step {self.step}")
        return tok


def decode_loop(
    feed: Feed,
    first_logits: torch.Tensor,
    max_new_tokens: int | None,
    *,
    sampling: Sampling = GREEDY,
    stop_ids: Iterable[int] = (),
    feed_last: bool = False,
    keep_logits: bool = False,
) -> Iterator[DecodeStep]:
    """Yield one :class:`DecodeStep` per generated position, forever if ``max_new_tokens`` is None.

    ``first_logits``: ``[vocab]`` or ``[B, vocab]`` next-token logits after the prompt. The loop stops
    when every row has picked a stop token or after ``max_new_tokens`` steps. The last step's
    tokens are fed only with ``feed_last`` (a streaming cache that must hold every yielded token);
    otherwise a cache ends one token short, ready for a caller who decides what comes next.
    """
    if max_new_tokens is not None and max_new_tokens < 1:
        raise BadInputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    logits = first_logits[None] if first_logits.ndim == 1 else first_logits
    rows = logits.shape[0]
    stops = {int(s) for s in stop_ids}
    stopped = [False] * rows
    last = torch.zeros(rows, dtype=torch.long, device="cpu")  # picked on the host; each feed moves them
    generator = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
    step = 0
    while max_new_tokens is None or step < max_new_tokens:
        picked = sampling.pick(logits, generator).cpu()
        tokens: list[int | None] = []
        for r in range(rows):
            if stopped[r]:
                tokens.append(None)
                continue
            last[r] = picked[r]
            tokens.append(int(picked[r]))
            stopped[r] = int(picked[r]) in stops
        done = all(stopped) or (max_new_tokens is not None and step == max_new_tokens - 1)
        kept = logits.float().cpu() if keep_logits else None
        seconds, fed = 0.0, not done or feed_last
        if fed:
            t0 = time.perf_counter()
            logits = feed(last.clone())
            logits = logits[None] if logits.ndim == 1 else logits
            seconds = time.perf_counter() - t0
        yield DecodeStep(step, tuple(tokens), tuple(stopped), fed, seconds, kept)
        if done:
            return
        step += 1
