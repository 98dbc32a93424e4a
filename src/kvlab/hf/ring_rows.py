"""Conversations that are not in lockstep, decoded together through one captured step.

:class:`~kvlab.hf.static_rolling.StaticRollingCache` feeds its rows in lockstep: one ``slot_pos``, one
write index, one roll plan for every row. A server's conversations are not in lockstep: each holds
its own number of tokens at its own positions, rolls at its own time and pins its own system prompt
in its sinks. :class:`RingRows` holds ``rows`` of them in one set of ring buffers, so that one step
(eager, ``torch.compile``-d or a CUDA graph, :class:`~kvlab.hf.graphs.RollingDecoder`) decodes them all:

* **Invariant**: row ``r``'s slots are exactly the slots of a one-row
  :class:`~kvlab.hf.static_rolling.StaticRollingCache` following that conversation's own rule; its
  state *is* that cache, built over views of row ``r`` (``storage[:, r]``, ``slot_pos[r]``, the write
  index ``[r]``), so every roll, sink placement and re-base is the one-row cache's own code.
* **Storage**: keys and values ``[layers, rows, heads, capacity + 1, head_dim]``, ``slot_pos [rows,
  capacity + 1]``, the write index ``[rows, 1]``; ``capacity`` fits the widest rule served (the most
  sinks a pinned system prompt takes, plus the window and a chunk). The last slot is scratch: a row
  not fed in a step (free, or a conversation that sits one step out) writes there, and no query reads it.
* **A step** (captured): the mask ``slot_pos[r] <= position[r]`` per row, each row's new K/V scattered
  at its own slot; the weights are read once for every row. A step computes only the first ``width``
  rows, the fewest of :attr:`widths` (powers of two and ``rows``) holding every fed row: rows are taken
  lowest first, so one conversation decodes through a one-row step. On a CPU the new K/V are attended beside the
  slots (the mask ``slot_pos[r] < position[r]``) and written by :meth:`commit` after the step, in place
  and outside any graph.
* **Between steps** (host): :meth:`prepare` asks each fed row's cache to apply its pending roll and
  point its write index; :meth:`advance` counts the feed. A conversation joins from its eager
  :class:`~kvlab.hf.RollingCache` (:meth:`join`, exact: :meth:`StaticRollingCache.load`) and leaves
  back into it (:meth:`leave`, exact: :meth:`StaticRollingCache.store_into`), so everything else a
  server does with a conversation (prefill in pieces, stored prefixes, undo) stays on the eager cache.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlab.errors import BadInputError
from kvlab.hf.rolling_cache import RollingCache, RollRule
from kvlab.hf.static_rolling import EMPTY, StaticRollingCache


class RingRows(StaticRollingCache):
    """``rows`` conversations' rings in one set of buffers (see the module). Not thread-safe.

    Args:
        config: the model config.
        rule: the rule of a conversation without a pinned prompt (sinks, window, chunk, RoPE, maximum).
        rows: conversations decoded at once.
        most_sinks: the most sinks a conversation may keep (its pinned system prompt); sizes the rows.
        dtype, device: of the model's K/V.
    """

    def __init__(
        self,
        config: Any,
        rule: RollRule,
        *,
        rows: int,
        most_sinks: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if rule.codec is not None:
            raise BadInputError(
                "RingRows holds the window in the model's dtype: a codec's rule has no captured step"
            )
        most = max(int(most_sinks), int(rule.policy.sinks))
        widest = most + int(rule.policy.window or 0) + rule.evict_chunk
        super().__init__(config, rule, batch=rows, dtype=dtype, device=device, capacity=widest + 1)
        self._config = config
        self.scratch = self.capacity - 1
        self.slot_pos = torch.full((rows, self.capacity), EMPTY, dtype=torch.long, device=self.device)
        self._write_index[1] = torch.full((rows, 1), self.scratch, dtype=torch.long, device=self.device)
        self._positions = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        # on a CPU a step leaves each layer's new K/V in ``fresh`` and attends them beside the slots, and
        # commit() writes them after it: compiled, an in-graph per-row write became a copy of every row's
        # whole buffer in every layer (inductor's functional scatter), and one kept in place read stale slots
        self.defer = self.device.type == "cpu"
        # a step computes the first `width` rows, the fewest of `widths` that holds every fed row (rows are
        # taken lowest first): one conversation costs a one-row step, not `rows` (a graph per width)
        self.widths = sorted({1 << i for i in range(rows.bit_length()) if 1 << i <= rows} | {rows})
        self.least = 1  # the narrowest width the next step may take (a warm-up of every width)
        # deferring, a step reads only the slots its rows ever wrote: [0, span), a dynamic size in a graph
        self._spans = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        self.rows: list[StaticRollingCache | None] = [None] * rows
        self.feeding: list[int] = []  # the rows the next feed writes (set by the caller before it)

    # -- conversations join and leave ------------------------------------------------------------------
    def join(self, cache: RollingCache) -> int:
        """Take a conversation's state from its eager ``cache`` (unchanged) into a free row; returns the row."""
        free = [r for r, row in enumerate(self.rows) if row is None]
        if not free:
            raise BadInputError(f"every one of the {self.batch} rows is taken")
        r = free[0]
        cap = cache.sinks + int(cache.window) + cache.evict_chunk
        if cap > self.scratch or cache.rule.codec is not None:
            raise BadInputError(
                f"a conversation keeping {cache.describe()} does not fit rows of {self.scratch} slots in the model's dtype"
            )
        views = {name: t[:, r : r + 1, :, :cap] for name, t in self.storage.items()}
        self.slot_pos[r].fill_(EMPTY)
        row = StaticRollingCache(
            self._config,
            cache.rule,
            dtype=self.dtype,
            device=self.device,
            views=(views, self.slot_pos[r, :cap]),
        )
        row._write_index[1] = self._write_index[1][r]
        self.rows[r] = row.load(cache)
        return r

    def leave(self, r: int, into: RollingCache | None = None) -> None:
        """Free row ``r``, its state written back into ``into`` first (an eager cache with its rule), if given."""
        row = self.row(r)
        self.rows[r] = None
        self._write_index[1][r] = self.scratch
        if into is not None:
            row.store_into(into)

    def row(self, r: int) -> StaticRollingCache:
        """Row ``r``'s conversation (a one-row cache over this cache's buffers: its counts, ``describe()``)."""
        row = self.rows[r] if 0 <= r < self.batch else None
        if row is None:
            raise BadInputError(f"row {r} holds no conversation")
        return row

    # -- between steps -----------------------------------------------------------------------------------
    def prepare(self, n: int) -> torch.Tensor:
        """Before a one-token feed of the rows in :attr:`feeding`: each applies its pending roll and points
        its write index (the others at the scratch slot); returns the ``[rows, 1]`` positions."""
        if n != 1:
            raise BadInputError(f"RingRows decodes one token per row, got a feed of {n}")
        fed = set(self.feeding)
        need = max(self.least, max(fed, default=0) + 1)
        self.width = min(w for w in self.widths if w >= need)
        for r in range(self.batch):
            if r in fed:
                self._positions[r] = self.row(r).prepare(1)
            else:
                self._write_index[1][r] = self.scratch
                self._positions[r] = 0
        if self.defer:  # at least 2 slots: a graph specialises sizes 0 and 1
            reach = max([2] + [row.reach for row in self.rows[: self.width] if row is not None])
            self.span = self._spans[:reach]
            torch._dynamo.maybe_mark_dynamic(self.span, 0)
        return self._positions

    def write_index(self, n: int) -> torch.Tensor:
        """``[width, 1]``: the slot each computed row's token is written to (the scratch slot if not fed)."""
        if n != 1:
            raise BadInputError(f"RingRows decodes one token per row, got a feed of {n}")
        return self._write_index[1][: self.width]

    def advance(self) -> None:
        for r in self.feeding:
            self.row(r).advance()

    def commit(self) -> None:
        """Write the step's new K/V (:attr:`fresh`, every layer) at each row's write slot, in place: one
        scatter per K and V for all layers; rows not fed write the scratch slot."""
        if not self.fresh:
            return
        at = self.write_index(1)  # [width, 1]
        for part, name in enumerate(("keys", "values")):
            buf = self.storage[name][:, : self.width]
            new = torch.stack([self.fresh[i][part] for i in range(len(self.layers))]).to(buf.dtype)
            index = at[None, :, None, :, None].expand(buf.shape[0], -1, buf.shape[2], -1, buf.shape[-1])
            buf.scatter_(3, index, new)
        self.fresh.clear()

    def load(self, cache: RollingCache) -> StaticRollingCache:
        raise BadInputError("RingRows takes conversations one at a time: join()")

    def describe(self) -> str:
        held = sum(row is not None for row in self.rows)
        return f"RingRows({held} of {self.batch} rows held, {self.scratch} slots each)"
