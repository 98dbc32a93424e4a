"""Shared budgets: how many slots each KV head (AdaKV) and each layer (PyramidKV) keeps, and a ragged cache
that holds only those slots.

A uniform eviction (:func:`kvlab.policy.evict.evict`) keeps the same ``n_keep`` slots per layer and KV
head. Three published ways to share a budget instead:

* ``heads="ada"`` — AdaKV (Feng et al. 2024, arXiv:2407.11550; kvpress ``AdaKVPress``): in one layer, the
  top ``n_keep * H`` slots over all KV heads together, each head first guaranteed its protected slots
  (the policy's sinks and window) and its own top ``max(1, int(alpha_safeguard * n_keep))`` slots (kvpress's
  safeguard). Scores are compared across heads as they are (kvpress does the same; for the attention-based
  scores, H2O / SnapKV / TOVA, every head's scores are sums of softmax rows, so they share a scale). The
  layer keeps exactly ``n_keep * H`` slots; heads differ.
* ``layers="pyramid"`` — PyramidKV (Cai et al. 2024, arXiv:2406.02069; kvpress ``PyramidKVPress``): the
  total ``n_keep * L`` kept, the bottom layer keeping the most and each layer above fewer, linearly, by
  kvpress's formula (``min = n_keep / beta``, ``max = 2 n_keep - min``, ``max`` capped at the context less the
  protected slots, kvpress's ``q_len - window``, ``min`` then raised to keep the total). Where
  kvpress falls back to a uniform budget because ``min`` is below its window, kvlab raises ``min`` to the
  protected slots (sinks + window) instead, so the pyramid stays; rounding is by largest remainder, so the
  layers' budgets sum to ``n_keep * L`` exactly.
* ``heads="global"`` — kvpress ``KVzipPress``'s default (``layerwise=False``): the top ``n_keep * L * H``
  (layer, head, slot) scores over all layers and KV heads together, each head first keeping its protected
  slots (no safeguard; kvpress gives its first ``n_sink`` tokens the highest score). ``n_keep`` is
  :func:`~kvlab.policy.evict.select.budget_slots`'s ``max(1, round(keep * T))``; kvpress keeps
  ``L*H*T - int(L*H*T * ratio)``: the same where ``keep * T`` is whole, about ``L*H/2`` slots apart at
  ``keep=0.5`` and an odd ``T`` (Python rounds ``T/2`` to the even neighbour). Offline only: a live cache
  evicts a layer before the later layers' scores exist.

AdaKV and PyramidKV compose (``heads=ada,layers=pyramid``: the pyramid's per-layer budget shared by AdaKV).
The result is a :class:`RaggedCache`: per layer and head its own ``[B, n_h, D]`` keys and values. kvpress's
AdaKV keeps every key in memory and masks the pruned ones at attention time (its ``attention_patch``); a
ragged cache frees them: :attr:`RaggedCache.nbytes` counts only the kept slots,
:attr:`RaggedCache.padded_nbytes` what a rectangular per-layer store padded to the layer's largest head would
hold, :attr:`RaggedCache.masked_nbytes` what a masking implementation holds (every slot of the context).
:meth:`RaggedCache.masked` turns it into the masked snapshot a model runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import BadInputError
from kvlab.policy.evict.observe import Observation
from kvlab.policy.evict.policies import Policy
from kvlab.policy.evict.select import budget_slots, check_budget, keep_indices, layer_views
from kvlab.policy.window import SinksWindow
from kvlab.rope.spec import Rope

HEAD_SHARES = ("uniform", "ada", "global")
LAYER_SHARES = ("uniform", "pyramid")
ALPHA_SAFEGUARD = 0.20  # kvpress AdaKVPress's default
BETA = 20  # kvpress PyramidKVPress's default


def pyramid_counts(num_layers: int, length: int, n_keep: int, *, protected: int = 0) -> list[int]:
    """Per-layer budgets falling linearly from the bottom layer to the top, summing to ``n_keep * num_layers``.

    kvpress's ``PyramidKVPress.get_layer_budget`` with its window replaced by ``protected`` (every layer keeps
    at least that many) and exact integer rounding. A budget no layer can hold is an error.
    """
    if num_layers < 1:
        raise BadInputError(f"a pyramid needs at least one layer, got {num_layers}")
    if not 1 <= n_keep <= length:
        raise BadInputError(f"cannot keep {n_keep} of {length} slots; the budget must lie in [1, {length}]")
    if protected > n_keep:
        raise BadInputError(
            f"the budget of {n_keep} slots per layer is smaller than the {protected} protected slots "
            "(sinks + window) every layer of a pyramid keeps"
        )
    total = n_keep * num_layers
    if num_layers == 1:
        return [n_keep]
    lo = max(n_keep / BETA, float(protected), 1.0)  # every layer keeps at least one slot
    hi = 2 * n_keep - lo
    cap = length - protected if length - protected >= n_keep else length  # kvpress: q_len - window
    if hi > cap:  # the bottom layer holds at most the context less the protected slots (kvpress's cap)
        hi = float(cap)
        lo = 2 * n_keep - hi
    step = (hi - lo) / (num_layers - 1)
    exact = [hi - i * step for i in range(num_layers)]
    counts = [math.floor(x + 1e-9) for x in exact]
    rest = total - sum(counts)
    order = sorted(range(num_layers), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:rest]:
        counts[i] += 1
    assert sum(counts) == total and all(protected <= c <= length for c in counts), (counts, total)
    return counts


def _protected_mask(
    h: int, t: int, n_keep: int, sinks: int, window: int, device: torch.device
) -> torch.Tensor:
    """``[H, T]`` bool: the slots every head keeps whatever they score (the first ``sinks``, the last ``window``
    cut to what ``n_keep`` leaves after the sinks, as :func:`keep_indices` cuts them)."""
    must = torch.zeros(h, t, dtype=torch.bool, device=device)
    sink_end, window_start = SinksWindow(sinks, max(0, min(window, n_keep - min(sinks, t)))).bounds(t)
    must[:, :sink_end] = True
    must[:, window_start:] = True
    return must


def ada_indices(
    scores: torch.Tensor,
    n_keep: int,
    sinks: int = 0,
    window: int = 0,
    *,
    alpha_safeguard: float = ALPHA_SAFEGUARD,
) -> list[torch.Tensor]:
    """AdaKV's selection for one layer: per KV head a sorted ``[1, n_h]`` index tensor, ``sum(n_h) == n_keep * H``.

    ``scores [1, H, T]``. Each head keeps its protected slots (the first ``sinks`` and last ``window``, as
    :func:`keep_indices` cuts them to the budget) and its own top ``max(1, int(alpha_safeguard * n_keep))``
    (kvpress's safeguard); the rest of the layer's budget goes to the highest scores over all heads.
    One sequence at a time: heads of two sequences would keep different counts.
    """
    if scores.ndim != 3:
        raise BadInputError(f"scores must be [B, H, T], got shape {tuple(scores.shape)}")
    b, h, t = scores.shape
    if b != 1:
        raise BadInputError(f"per-head (ada) budgets are chosen per sequence; got a batch of {b}")
    check_budget(n_keep, t, sinks)
    if not 0.0 <= alpha_safeguard <= 1.0:
        raise BadInputError(f"alpha_safeguard must lie in [0, 1], got {alpha_safeguard}")
    s = scores[0].float().clone()
    s = torch.where(torch.isfinite(s), s, torch.full_like(s, -1e30))
    floor = max(1, int(n_keep * alpha_safeguard)) if alpha_safeguard > 0 else 0
    must = torch.zeros(h, t, dtype=torch.bool, device=s.device)
    if floor:
        must.scatter_(1, keep_indices(scores, floor, min(sinks, floor), window)[0], True)
    must |= _protected_mask(h, t, n_keep, sinks, window, s.device)
    rest = n_keep * h - int(must.sum())  # each head forces at most n_keep
    keep = must.clone()
    if rest:
        free = s.masked_fill(must, float("-inf")).reshape(-1)
        keep.view(-1)[torch.topk(free, rest).indices] = True
    return [keep[i].nonzero().reshape(1, -1) for i in range(h)]


def global_indices(
    scores: list[torch.Tensor], n_keep: int, sinks: int = 0, window: int = 0
) -> list[list[torch.Tensor]]:
    """kvpress KVzip's selection: per layer and KV head a sorted ``[1, n_lh]`` index tensor, the top
    ``n_keep * L * H`` scores over every layer and head together, each head's protected slots forced in.

    ``scores``: per layer ``[1, H, T]``. Scores are compared across layers and heads as they are (kvpress does
    the same). One sequence at a time, as :func:`ada_indices`.
    """
    if any(s.ndim != 3 or s.shape[0] != 1 for s in scores):
        raise BadInputError(
            f"global budgets take per-layer scores [1, H, T]; got {[tuple(s.shape) for s in scores]}"
        )
    _, h, t = scores[0].shape
    check_budget(n_keep, t, sinks)
    dev = scores[0].device
    s = torch.stack([x[0].float().to(dev) for x in scores])  # [L, H, T]
    s = torch.where(torch.isfinite(s), s, torch.full_like(s, -1e30))
    must = _protected_mask(h, t, n_keep, sinks, window, dev).expand(len(scores), h, t).contiguous()
    keep = must.clone()
    rest = n_keep * h * len(scores) - int(must.sum())
    if rest:
        free = s.masked_fill(must, float("-inf")).reshape(-1)
        keep.view(-1)[torch.topk(free, rest).indices] = True
    return [[keep[i, j].nonzero().reshape(1, -1) for j in range(h)] for i in range(len(scores))]


@dataclass(frozen=True, eq=False)
class RaggedCache:
    """A compressed context whose KV heads keep different numbers of slots.

    Per layer ``l`` and KV head ``h``: ``keys[l][h]``/``values[l][h]`` ``[B, n_lh, D]``, ``positions[l][h]`` and
    ``slots[l][h]`` ``[B, n_lh]`` (sorted, original order; keys stay rotated to their original positions, so
    the next query goes at ``next_position``).
    """

    keys: tuple[tuple[torch.Tensor, ...], ...]
    values: tuple[tuple[torch.Tensor, ...], ...]
    positions: tuple[tuple[torch.Tensor, ...], ...]
    slots: tuple[tuple[torch.Tensor, ...], ...]
    source_len: int
    next_position: int
    rope: Rope | None
    fingerprint: str
    method: str
    heads: str = "uniform"
    layers: str = "uniform"

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def counts(self) -> list[list[int]]:
        """Kept slots per layer and KV head."""
        return [[int(k.shape[-2]) for k in layer] for layer in self.keys]

    @property
    def held_slots(self) -> int:
        return sum(sum(c) for c in self.counts)

    @property
    def kept_fraction(self) -> float:
        heads = sum(len(c) for c in self.counts)
        return self.held_slots / (heads * self.source_len)

    @property
    def nbytes(self) -> int:
        """K/V bytes held: the kept slots only."""
        return sum(t.numel() * t.element_size() for layer in (*self.keys, *self.values) for t in layer)

    def _per_slot(self, layer: int) -> int:
        k, v = self.keys[layer][0], self.values[layer][0]
        return k.shape[0] * (k.shape[-1] * k.element_size() + v.shape[-1] * v.element_size())

    @property
    def padded_nbytes(self) -> int:
        """What a rectangular ``[B, H, max_h n_lh, D]`` store per layer would hold."""
        return sum(self._per_slot(i) * len(c) * max(c) for i, c in enumerate(self.counts))

    @property
    def masked_nbytes(self) -> int:
        """What a masking implementation holds (kvpress AdaKV): every slot of the context, every head."""
        return sum(self._per_slot(i) * len(c) * self.source_len for i, c in enumerate(self.counts))

    def valid(self) -> tuple[torch.Tensor, ...]:
        """Per layer ``[B, H, source_len]`` bool: the context slots each KV head keeps."""
        out = []
        for per_head in self.slots:
            b = per_head[0].shape[0]
            m = torch.zeros(b, len(per_head), self.source_len, dtype=torch.bool, device=per_head[0].device)
            for h, idx in enumerate(per_head):
                m[:, h].scatter_(1, idx, True)
            out.append(m)
        return tuple(out)

    def masked(self, source: KVSnapshot) -> KVSnapshot:
        """``source`` (the snapshot this cache was cut from) with only the kept slots valid: the form
        :meth:`~kvlab.model.ModelHandle.forward` runs. Kept keys and values are the source's own, so the
        forward equals one over the ragged slots alone; this form holds every slot while it computes."""
        if source.fingerprint != self.fingerprint or source.seq_len != self.source_len:
            raise BadInputError("masked() needs the snapshot this ragged cache was cut from")
        return source.replace(valid=tuple(m.to(source.device) for m in self.valid()), provenance="edited")


def allocate(
    scores: list[torch.Tensor],
    n_keep: int,
    *,
    sinks: int = 0,
    window: int = 0,
    heads: str = "uniform",
    layers: str = "uniform",
) -> list[list[torch.Tensor]]:
    """Kept slot indices per layer and KV head (each a sorted ``[B, n_lh]`` tensor) from per-layer scores
    ``[B, H, T]``: ``n_keep`` per head and layer on average, shared as ``heads`` and ``layers`` say."""
    if heads not in HEAD_SHARES:
        raise BadInputError(f"heads must be one of {', '.join(HEAD_SHARES)}, got '{heads}'")
    if layers not in LAYER_SHARES:
        raise BadInputError(f"layers must be one of {', '.join(LAYER_SHARES)}, got '{layers}'")
    if not scores:
        raise BadInputError("no layers to allocate a budget over")
    t = scores[0].shape[-1]
    check_budget(n_keep, t, sinks)
    if heads == "global":
        if layers != "uniform":
            raise BadInputError(f"heads=global already shares the budget across layers; drop layers={layers}")
        return global_indices(scores, n_keep, sinks, window)
    if layers == "pyramid":
        counts = pyramid_counts(len(scores), t, n_keep, protected=min(t, sinks + window))
    else:
        counts = [n_keep] * len(scores)
    out = []
    for s, n in zip(scores, counts, strict=True):
        if heads == "ada":
            out.append(ada_indices(s, n, sinks, window))
        else:
            idx = keep_indices(s, n, sinks, window)
            out.append([idx[:, h] for h in range(idx.shape[1])])
    return out


def evict_ragged(
    source: KVSnapshot | Observation,
    policy: Policy,
    *,
    keep: float | None = None,
    n_keep: int | None = None,
    heads: str = "uniform",
    layers: str = "uniform",
) -> RaggedCache:
    """:func:`kvlab.policy.evict.evict` with shared budgets: a :class:`RaggedCache` holding ``n_keep`` slots
    per head and layer on average (``keep`` or ``n_keep`` as there), chosen by ``policy`` and shared as
    ``heads`` (``uniform`` | ``ada`` | ``global``) and ``layers`` (``uniform`` | ``pyramid``) say."""
    views = layer_views(source, policy)
    snap = source.snapshot if isinstance(source, Observation) else source
    n = budget_slots(snap.seq_len, keep, n_keep)
    idx = allocate(
        [policy.score(v) for v in views],
        n,
        sinks=policy.sinks,
        window=policy.window,
        heads=heads,
        layers=layers,
    )
    keys, values, positions, slots = [], [], [], []
    for view, per_head in zip(views, idx, strict=True):
        ks, vs, ps, ss = [], [], [], []
        for h, ix in enumerate(per_head):
            ix = ix.to(view.keys.device)
            gather = ix[..., None].expand(-1, -1, view.keys.shape[-1])
            ks.append(view.keys[:, h].gather(1, gather).clone())
            vs.append(
                view.values[:, h].gather(1, ix[..., None].expand(-1, -1, view.values.shape[-1])).clone()
            )
            ps.append(snap.positions.to(ix.device)[ix])
            ss.append(ix)
        keys.append(tuple(ks))
        values.append(tuple(vs))
        positions.append(tuple(ps))
        slots.append(tuple(ss))
    return RaggedCache(
        tuple(keys),
        tuple(values),
        tuple(positions),
        tuple(slots),
        snap.seq_len,
        snap.next_position,
        snap.rope,
        snap.fingerprint,
        policy.name,
        heads,
        layers,
    )
