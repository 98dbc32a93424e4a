"""``kvlab eval --capture``: a sinks + window cache's answer through the step ``kvlab serve --capture`` runs.

The eval's own runtime (:func:`kvlab.eval.run._answer`) feeds the question and the answer to a live batch
(:meth:`~kvlab.model.ModelHandle.live_rows`). Under ``--capture compile|cuda-graph`` a sinks + window cache
in the model's dtype (:meth:`~kvlab.policy.layouts.base.CachePolicy.captured_roll`) answers instead through
a row of :class:`~kvlab.hf.captured_rows.CapturedRows`: one captured :class:`~kvlab.hf.graphs.RollingDecoder`
step over ring rows, ``torch.compile``-d or a CUDA graph, the server's own.

As a server does, the row's cache takes the question in one eager forward (a prefill), and the answer is
decoded through the captured step, one token a step; the full cache's answer is teacher-forced through the
step too (or read off the greedy pass, where it is that answer's start).

The eval's rule holds on both runtimes: the question and the answer are never compressed. The row keeps
the policy's sinks and a window widened by the question and the answer (``room``): the context's rolled
K/V (:meth:`~kvlab.policy.layouts.Layout.apply`, the same for both runtimes), then every token fed on top,
nothing evicted; a cache that evicted is refused, never scored. The rolled slots sit at positions
``p..p+n-1`` (the live cache's, the question at ``p+n``); the row holds them at ``0..n-1``, the question at
``n``: one RoPE shift of every key, as a re-base makes (relative error ~1e-7), and the same distances for
attention. So a captured row equals the eager row up to that shift and the arithmetic of one token a step
(tested within 1e-5 on the logits: ``tests/test_eval_capture.py``). The rows are built once, for the
widest cache a run captures, and again (wider) only if a trial needs more room.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from kvlab.errors import KvlabError
from kvlab.hf.captured_rows import CapturedRows
from kvlab.hf.rolling_cache import RollingCache, rolling_cache_for
from kvlab.hf.static_rolling import check_ring_model
from kvlab.loop import decode_loop
from kvlab.rope.fast import rotate_by

if TYPE_CHECKING:
    from kvlab.cache.snapshot import KVSnapshot
    from kvlab.model.handle import ModelHandle
    from kvlab.policy.layouts.base import Roll

ROOM = 256  # the question + answer tokens a row holds on top of its window, at least


class CapturedAnswers:
    """One eval run's captured rows (one row, built on the first captured cache; see the module)."""

    def __init__(self, handle: ModelHandle, mode: Literal["compile", "cuda-graph"]) -> None:
        check_ring_model(handle.config)  # a ring layer attends globally: no sliding-window layers
        if handle.rope is not None:
            handle.rope.require_shift_exact("a captured answer (its keys move to positions 0..n-1)")
        self.handle, self.mode = handle, mode
        self.rows: CapturedRows | None = None
        self.size = (0, 0, 0)  # the sinks, window and room the rows hold
        self.builds = 0  # how many times rows were built (a compile or capture each)

    def _cache(self, sinks: int, window: int, room: int) -> RollingCache:
        """An eager cache of ``sinks`` + ``window + room`` slots; it never evicts here (chunk 1: the least
        room a row needs beyond its slots)."""
        return rolling_cache_for(self.handle, window=window + room, sinks=sinks, evict_chunk=1)

    def _room(self, roll: Roll, need: int) -> int:
        """The room of rows that hold ``roll`` plus ``need`` tokens (built, or rebuilt wider, here)."""
        sinks, window, room = self.size
        if self.rows is None or roll.sinks > sinks or roll.window > window or need > room:
            sinks, window = max(sinks, roll.sinks), max(window, roll.window)
            room = max(room, ROOM, 1 << (need - 1).bit_length())
            rule = self._cache(sinks, window, room).rule
            self.rows = CapturedRows(self.handle, rule, 1, self.mode, most_sinks=sinks)
            self.size, self.builds = (sinks, window, room), self.builds + 1
        return room

    def _feed(self, row: int, tokens: list[int]) -> list[torch.Tensor]:
        """Feed ``tokens`` to ``row`` one step each: the logits after each."""
        assert self.rows is not None
        return [self.rows.step([row], [t])[0] for t in tokens]

    def _kept_all(self, row: int, room: int) -> None:
        assert self.rows is not None
        if self.rows.evictions(row):
            raise KvlabError(f"a captured row evicted with {room} slots of room: not scored")

    def _keys_from_zero(self, snap: KVSnapshot) -> tuple[torch.Tensor, ...]:
        """The keys of ``snap`` (one row of contiguous positions ``p..p+n-1``) moved to ``0..n-1``: one RoPE shift
        for every key, as a re-base moves them (:func:`~kvlab.rope.fast.rotate_by`); attention sees the same
        distances, the question comes right after them."""
        first = snap.next_position - snap.seq_len
        here = torch.arange(first, snap.next_position, device="cpu")  # a snapshot's positions: on the host
        if snap.batch_size != 1 or not torch.equal(snap.positions.cpu(), here):
            raise KvlabError(f"a captured answer needs one row of contiguous positions: {snap}")
        if first == 0:
            return snap.keys
        rope = self.handle.rope
        if rope is None:  # without RoPE nothing says the same distances survive a move: refuse, not guess
            raise KvlabError("a captured answer moves the rolled keys to 0..n-1, which needs a RoPE model")
        shifted = []
        for i, k in enumerate(snap.keys):
            spec = rope.for_layer(i)
            shifted.append(k if spec is None else rotate_by(k, -first, spec))
        return tuple(shifted)

    def answer(
        self,
        roll: Roll,
        snap: KVSnapshot,
        question: list[int],
        n_new: int,
        stop: set[int],
        reference: list[int],
    ) -> tuple[list[int], torch.Tensor]:
        """The greedy answer of ``snap`` (the context as ``roll``'s cache holds it) to ``question``, and its
        logits on ``question + reference[:-1]`` (the full cache's answer, teacher-forced), as
        :func:`kvlab.eval.run._answer` gives them."""
        room = self._room(roll, len(question) + n_new)
        rows = self.rows
        assert rows is not None
        cache = self._cache(roll.sinks, roll.window, room)
        for layer, k, v in zip(cache.layers, self._keys_from_zero(snap), snap.values, strict=True):
            layer.update(k, v)  # the rolled context's slots, at 0..n-1: nothing evicted
        # the question in one eager forward, as a server prefills (its logits at every position), then the
        # answer decoded through the captured step, as a server decodes
        ids = torch.tensor([question], dtype=torch.long, device=self.handle.device)
        asked = list(self.handle.run(ids, cache, logits_to_keep=0).logits[0].float().unbind(0))
        if cache.evictions:
            raise KvlabError(f"a captured row's cache evicted with {room} slots of room: not scored")
        answer, fed = self._greedy(row_of=cache, first=asked[-1], n_new=n_new, stop=stop, room=room)
        n = len(reference) - 1
        if answer[:n] != reference[:-1] or len(fed) < n:  # else the forced answer is this one's start
            row = rows.join(cache)
            try:
                fed = self._feed(row, reference[:-1])
                self._kept_all(row, room)
            finally:
                rows.leave(row, into=None)
        return answer, torch.stack(asked + fed[:n])

    def _greedy(
        self, row_of: RollingCache, first: torch.Tensor, n_new: int, stop: set[int], room: int
    ) -> tuple[list[int], list[torch.Tensor]]:
        """The greedy answer from ``row_of``'s state (left unchanged) and the logits after each token fed."""
        assert self.rows is not None
        row = self.rows.join(row_of)
        fed: list[torch.Tensor] = []

        def feed(t: torch.Tensor) -> torch.Tensor:
            fed.extend(self._feed(row, [int(t[0])]))
            return fed[-1][None]

        try:
            answer = [s.token(0) for s in decode_loop(feed, first, n_new, stop_ids=stop)]
            self._kept_all(row, room)
        finally:
            self.rows.leave(row, into=None)
        return answer, fed
