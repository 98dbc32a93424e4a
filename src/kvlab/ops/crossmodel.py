"""Caches across models: transplant between identical geometries, and learned linear maps ("C2C-lite").

A transplant relabels one model's cache as another's. It is only defined when both models cache
the same thing per slot: same layers, KV heads, head size and RoPE, and the same token for each
slot (same tokenizer, or the receiver's token ids given explicitly for every slot).

Between different geometries, :func:`fit_cache_map` learns, per receiver layer and KV head, a ridge
regression from the sharer's de-rotated keys (and, separately, values) of the depth-matched layer
to the receiver's. Keys are compared without RoPE so the map learns content, not position. Its
held-out explained variance says how much of one model's cache is a linear function of the other's.
:func:`cache_map_grid` does the same for every (sharer layer, receiver layer) pair. Models with one
RoPE per layer type (Gemma-3: local and global layers) pass per-layer specs from :func:`layer_ropes`.
Different tokenizers need a text-span alignment first (:mod:`kvlab.model.align`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

import numpy as np
import torch

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import BadInputError, IncompatibleCacheError
from kvlab.rope.ops import apply_rope, remove_rope
from kvlab.rope.spec import RopeSpec, rope_for_layer

if TYPE_CHECKING:
    from kvlab.model.handle import ModelHandle

PerLayerSpecs = Sequence[RopeSpec | None]


def same_tokenizer(a: Any, b: Any) -> bool:
    """True when two ModelHandles map text to the same ids (same vocabulary; tokenizer-less: same size)."""
    if a.tokenizer is None or b.tokenizer is None:
        return (
            a.tokenizer is None
            and b.tokenizer is None
            and int(a.config.vocab_size) == int(b.config.vocab_size)
        )
    return a.tokenizer.get_vocab() == b.tokenizer.get_vocab()


def geometry(handle: ModelHandle) -> tuple[int, int, int]:
    f = handle.facts
    return (f.num_layers, f.num_kv_heads, f.head_dim)


def layer_ropes(handle: ModelHandle) -> list[RopeSpec | None]:
    """The RoPE each cache layer's keys carry (one spec per layer; None for a layer without RoPE), so keys
    can be de-rotated layer by layer for cross-model maps, also on hybrid models (Gemma-3 local/global)."""
    return [rope_for_layer(handle.rope, i) for i in range(handle.facts.num_layers)]


def transplant(
    snap: KVSnapshot, donor: Any, receiver: Any, *, token_ids: Sequence[int] | torch.Tensor | None = None
) -> KVSnapshot:
    """``snap`` (made by ``donor``) relabelled as ``receiver``'s cache, for a receiver of identical geometry.

    Raises :class:`IncompatibleCacheError` when the geometry or RoPE differ, and when the tokenizers
    differ unless ``token_ids`` (the receiver's id for every slot, ``[T]``) spell out the alignment.
    Tensors are converted to the receiver's dtype; ``snap`` is not modified.
    """
    if snap.fingerprint != donor.fingerprint:
        raise IncompatibleCacheError(f"the cache was not made by the donor model {donor.name}")
    if geometry(donor) != geometry(receiver):
        raise IncompatibleCacheError(
            f"cache geometry (layers, kv heads, head dim) differs: {geometry(donor)} vs {geometry(receiver)}; "
            "use fit_cache_map for models of different geometry"
        )
    rd, rr = donor.rope, receiver.rope
    if (rd is None) != (rr is None) or (
        rd is not None and (rd.inv_freq != rr.inv_freq or rd.pairing != rr.pairing)
    ):
        raise IncompatibleCacheError(
            "the two models rotate keys differently (RoPE differs); a transplant would misplace every key"
        )
    ids = snap.token_ids
    if token_ids is not None:
        ids = (
            torch.as_tensor(token_ids, dtype=torch.long, device="cpu")
            .reshape(1, -1)
            .expand(snap.batch_size, -1)
        )
        if ids.shape[1] != snap.seq_len:
            raise BadInputError(f"token_ids has {ids.shape[1]} ids for a cache of {snap.seq_len} slots")
    elif not same_tokenizer(donor, receiver):
        raise IncompatibleCacheError(
            f"{donor.name} and {receiver.name} tokenize differently; pass token_ids= (the receiver's id for each slot, "
            "from a span alignment) to say what each slot holds"
        )
    return snap.to(dtype=receiver.dtype).replace(
        token_ids=ids.clone(),
        fingerprint=receiver.fingerprint,
        model_name=receiver.name,
        rope=rr,
        provenance="transplanted",
    )


# -- C2C-lite: ridge maps between caches --------------------------------------------------------------
def depth_matched_layers(src_layers: int, dst_layers: int) -> list[int]:
    """For each receiver layer, the sharer layer at the same relative depth."""
    if dst_layers == 1:
        return [src_layers - 1]
    return [round(i * (src_layers - 1) / (dst_layers - 1)) for i in range(dst_layers)]


def _features(
    snaps: Sequence[KVSnapshot], which: str, layer: int, ropes: PerLayerSpecs | None = None
) -> torch.Tensor:
    """``[N, kv_heads, head_dim]`` float64 rows: de-rotated keys or values of one layer, all slots of all snaps.

    Keys are de-rotated with ``ropes[layer]`` when given (per-layer RoPE), else with the snapshot's RoPE.
    """
    rows = []
    for s in snaps:
        t = s.keys[layer] if which == "k" else s.values[layer]
        t = t[0].double()  # [H, T, D]
        rope = ropes[layer] if ropes is not None else rope_for_layer(s.rope, layer)
        if which == "k" and rope is not None:
            t = remove_rope(t, s.positions, rope)
        rows.append(t.transpose(0, 1))  # [T, H, D]
    return torch.cat(rows)


def ridge_fit(x: torch.Tensor, y: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form ridge ``y ≈ x @ W + b`` (x ``[N, din]``, y ``[N, dout]``, float64); returns (W, b)."""
    xm, ym = x.mean(0), y.mean(0)
    xc, yc = x - xm, y - ym
    gram = xc.T @ xc + alpha * x.shape[0] * torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    w = torch.linalg.solve(gram, xc.T @ yc)
    return w, ym - xm @ w


def explained_variance(y: torch.Tensor, pred: torch.Tensor) -> float:
    """``1 - SSE / SST`` over all output dims (1 = perfect, 0 = as good as the mean, < 0 worse)."""
    sst = float(((y - y.mean(0)) ** 2).sum())
    return 1.0 - float(((y - pred) ** 2).sum()) / sst if sst > 0 else float("nan")


@dataclass(frozen=True)
class CacheMap:
    """Per receiver layer and head, ridge weights from the depth-matched sharer layer (all heads)."""

    src_layer: tuple[int, ...]
    k_weights: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per dst layer: W [Hs*Ds, Hd*Dd], b [Hd*Dd]
    v_weights: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    dst_heads: int
    dst_head_dim: int
    alpha: float
    ev_k: np.ndarray  # [dst_layers, dst_heads] held-out explained variance
    ev_v: np.ndarray
    ev_k_identity: np.ndarray | None = (
        None  # same geometry only: explained variance of "use the sharer's as is"
    )
    ev_v_identity: np.ndarray | None = None
    src_ropes: tuple[RopeSpec | None, ...] | None = None  # per sharer layer, when not the snapshot's own
    needs_token_ids: bool = False  # fitted across tokenizers: applying it needs the receiver's ids per slot


class MapOptions(TypedDict, total=False):
    """The keyword options of :func:`fit_cache_map` and :func:`cache_map_grid`: ``alpha``, the ridge
    penalty relative to the features' variance (> 0, default 1e-3), and ``src_ropes`` / ``dst_ropes``
    (from :func:`layer_ropes`), which de-rotate keys per layer for models whose snapshots carry no
    single RoPE (Gemma-3)."""

    alpha: float
    src_ropes: PerLayerSpecs | None
    dst_ropes: PerLayerSpecs | None


@dataclass(frozen=True)
class _Split:
    """Aligned sharer and receiver snapshots, for training and testing (checked), and the map's options."""

    src_train: Sequence[KVSnapshot]
    dst_train: Sequence[KVSnapshot]
    src_test: Sequence[KVSnapshot]
    dst_test: Sequence[KVSnapshot]
    alpha: float = 1e-3
    src_ropes: PerLayerSpecs | None = None
    dst_ropes: PerLayerSpecs | None = None

    def __post_init__(self) -> None:
        train, test = (len(self.src_train), len(self.dst_train)), (len(self.src_test), len(self.dst_test))
        if not train[0] or not test[0] or train[0] != train[1] or test[0] != test[1]:
            raise BadInputError(
                "need equally many sharer and receiver snapshots, for both training and testing"
            )
        for a, b in zip([*self.src_train, *self.src_test], [*self.dst_train, *self.dst_test], strict=True):
            if a.seq_len != b.seq_len:
                raise IncompatibleCacheError(
                    f"a sharer cache holds {a.seq_len} tokens and its receiver pair {b.seq_len}; "
                    "align them by text spans first (kvlab.model.align.align_by_spans)"
                )
        if self.alpha <= 0:
            raise BadInputError(f"ridge alpha must be > 0, got {self.alpha}")

    def x(self, which: str, layer: int, test: bool = False) -> torch.Tensor:
        """The sharer's features of one layer (:func:`_features`), training or test slots."""
        return _features(self.src_test if test else self.src_train, which, layer, self.src_ropes)

    def y(self, which: str, layer: int, test: bool = False) -> torch.Tensor:
        """The receiver's features of one layer, training or test slots."""
        return _features(self.dst_test if test else self.dst_train, which, layer, self.dst_ropes)


def fit_cache_map(
    src_train: Sequence[KVSnapshot],
    dst_train: Sequence[KVSnapshot],
    src_test: Sequence[KVSnapshot],
    dst_test: Sequence[KVSnapshot],
    **options: Unpack[MapOptions],
) -> CacheMap:
    """Fit ridge maps sharer -> receiver on aligned snapshots (slot ``t`` of each pair holds the same token).

    Pairs must have equal lengths (align by text spans first when tokenizers differ). Explained
    variance is measured on the test pairs, per receiver layer and KV head, for keys and values.
    For identical geometries the ridge penalty shrinks toward the identity map (the plain
    transplant), so a strong penalty falls back to the transplant instead of to zero.
    ``options``: :class:`MapOptions`.
    """
    split = _Split(src_train, dst_train, src_test, dst_test, **options)
    s0, d0 = src_train[0], dst_train[0]
    pairs = depth_matched_layers(s0.num_layers, d0.num_layers)
    same_geometry = (s0.num_layers, s0.num_kv_heads, s0.head_dim) == (
        d0.num_layers,
        d0.num_kv_heads,
        d0.head_dim,
    )
    hd, dd = d0.num_kv_heads, d0.head_dim
    weights: dict[str, list] = {"k": [], "v": []}
    ev = {w: np.zeros((d0.num_layers, hd)) for w in ("k", "v", "k_id", "v_id")}
    for li, sl in enumerate(pairs):
        for which in ("k", "v"):
            xtr, ytr = split.x(which, sl).flatten(1), split.y(which, li)
            xte, yte = split.x(which, sl, test=True).flatten(1), split.y(which, li, test=True)
            if same_geometry:  # shrink toward "use the sharer's cache as is" (W = I), not toward zero
                w, b = ridge_fit(xtr, ytr.flatten(1) - xtr, split.alpha * float(xtr.var(0).mean()))
                w = w + torch.eye(w.shape[0], dtype=w.dtype, device=w.device)
            else:
                w, b = ridge_fit(xtr, ytr.flatten(1), split.alpha * float(xtr.var(0).mean()))
            pred = (xte @ w + b).reshape(yte.shape)
            weights[which].append((w.float(), b.float()))
            for h in range(hd):
                ev[which][li, h] = explained_variance(yte[:, h], pred[:, h])
                if same_geometry:
                    ev[f"{which}_id"][li, h] = explained_variance(
                        yte[:, h], split.x(which, li, test=True)[:, h]
                    )
    return CacheMap(
        src_layer=tuple(pairs),
        k_weights=tuple(weights["k"]),
        v_weights=tuple(weights["v"]),
        dst_heads=hd,
        dst_head_dim=dd,
        alpha=split.alpha,
        ev_k=ev["k"],
        ev_v=ev["v"],
        ev_k_identity=ev["k_id"] if same_geometry else None,
        ev_v_identity=ev["v_id"] if same_geometry else None,
        src_ropes=tuple(split.src_ropes) if split.src_ropes is not None else None,
    )


def cache_map_grid(
    src_train: Sequence[KVSnapshot],
    dst_train: Sequence[KVSnapshot],
    src_test: Sequence[KVSnapshot],
    dst_test: Sequence[KVSnapshot],
    **options: Unpack[MapOptions],
) -> tuple[np.ndarray, np.ndarray]:
    """Held-out explained variance of a ridge map for every (sharer layer, receiver layer) pair.

    Returns ``(ev_k, ev_v)``, each ``[sharer_layers, receiver_layers]``, the mean over receiver KV heads.
    Same inputs and rules as :func:`fit_cache_map` (which fits only the depth-matched pairs).
    """
    split = _Split(src_train, dst_train, src_test, dst_test, **options)
    ns, nd = src_train[0].num_layers, dst_train[0].num_layers
    ev = {w: np.zeros((ns, nd)) for w in ("k", "v")}
    for which in ("k", "v"):
        ys = [(split.y(which, li), split.y(which, li, test=True)) for li in range(nd)]
        for sl in range(ns):
            xtr, xte = split.x(which, sl).flatten(1), split.x(which, sl, test=True).flatten(1)
            # one ridge solve serves every receiver layer: factor the Gram matrix once
            xm = xtr.mean(0)
            xc = xtr - xm
            lam = split.alpha * float(xtr.var(0).mean()) * xtr.shape[0]
            chol = torch.linalg.cholesky(
                xc.T @ xc + lam * torch.eye(xc.shape[1], dtype=xc.dtype, device=xc.device)
            )
            for li, (ytr, yte) in enumerate(ys):
                y2 = ytr.flatten(1)
                ym = y2.mean(0)
                w = torch.cholesky_solve(xc.T @ (y2 - ym), chol)
                pred = ((xte - xm) @ w + ym).reshape(yte.shape)
                ev[which][sl, li] = float(
                    np.mean([explained_variance(yte[:, h], pred[:, h]) for h in range(yte.shape[1])])
                )
    return ev["k"], ev["v"]


def apply_cache_map(
    cmap: CacheMap,
    snap: KVSnapshot,
    receiver: Any,
    *,
    token_ids: Sequence[int] | torch.Tensor | None = None,
) -> KVSnapshot:
    """The receiver-model cache predicted from a sharer cache: mapped de-rotated keys, re-rotated with the receiver's RoPE.

    A map fitted across tokenizers (``cmap.needs_token_ids``) needs ``token_ids``, the receiver's token
    for every slot of ``snap`` (from a span alignment); otherwise :class:`IncompatibleCacheError`.
    """
    if len(cmap.src_layer) != receiver.facts.num_layers or max(cmap.src_layer) >= snap.num_layers:
        raise IncompatibleCacheError("this cache map was fitted for other models (layer counts differ)")
    ids = snap.token_ids.clone()
    if token_ids is not None:
        ids = torch.as_tensor(token_ids, dtype=torch.long, device="cpu").reshape(1, -1)
        if ids.shape[1] != snap.seq_len:
            raise BadInputError(f"token_ids has {ids.shape[1]} ids for a cache of {snap.seq_len} slots")
    elif cmap.needs_token_ids:
        raise IncompatibleCacheError(
            "this map was fitted between models with different tokenizers; pass token_ids= (the receiver's "
            "token for each slot, from kvlab.model.align.align_by_spans) to say what each mapped slot holds"
        )
    dst_ropes = layer_ropes(receiver)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for li, sl in enumerate(cmap.src_layer):
        for which, out in (("k", keys), ("v", values)):
            w, b = (cmap.k_weights if which == "k" else cmap.v_weights)[li]
            x = _features([snap], which, sl, cmap.src_ropes).flatten(1).float()
            if x.shape[1] != w.shape[0]:
                raise IncompatibleCacheError(
                    f"sharer cache has {x.shape[1]} features per slot, the map expects {w.shape[0]}"
                )
            y = (
                (x @ w + b).reshape(snap.seq_len, cmap.dst_heads, cmap.dst_head_dim).transpose(0, 1)
            )  # [H, T, D]
            dst_rope = dst_ropes[li]
            if which == "k" and dst_rope is not None:
                y = apply_rope(y.double(), snap.positions, dst_rope).float()
            out.append(y[None].to(receiver.dtype).contiguous())
    return KVSnapshot(
        keys=tuple(keys),
        values=tuple(values),
        token_ids=ids,
        positions=snap.positions.clone(),
        rope=receiver.rope,
        fingerprint=receiver.fingerprint,
        model_name=receiver.name,
        provenance="transplanted",
    )


def fit_cross_model_map(
    src: Any,
    dst: Any,
    train_texts: Sequence[str],
    test_texts: Sequence[str],
    *,
    alpha: float = 1e-2,
    grid: bool = False,
    skip_first: int = 1,
):
    """Ridge maps src -> dst cache ("C2C-lite") fitted on span-aligned slots of texts.

    Returns ``(cmap, grid_ev, info)``: the depth-matched :class:`~kvlab.ops.crossmodel.CacheMap`
    (with held-out explained variance on ``test_texts``), the all-pairs explained variance
    ``(ev_k, ev_v)`` of :func:`~kvlab.ops.crossmodel.cache_map_grid` when ``grid`` (else None), and
    counts of aligned slots and coverage.
    """
    from kvlab.model.align import aligned_snapshots

    if not train_texts or not test_texts:
        raise BadInputError("need at least one training text and one test text")
    pairs = {
        name: [aligned_snapshots(src, dst, t, skip_first=skip_first) for t in texts]
        for name, texts in (("train", train_texts), ("test", test_texts))
    }
    sr, dr = layer_ropes(src), layer_ropes(dst)
    args = (
        [p[0] for p in pairs["train"]],
        [p[1] for p in pairs["train"]],
        [p[0] for p in pairs["test"]],
        [p[1] for p in pairs["test"]],
    )
    cmap = fit_cache_map(*args, alpha=alpha, src_ropes=sr, dst_ropes=dr)
    if not same_tokenizer(src, dst):
        cmap = replace(cmap, needs_token_ids=True)
    grid_ev = cache_map_grid(*args, alpha=alpha, src_ropes=sr, dst_ropes=dr) if grid else None
    alignments = [p[2] for ps in pairs.values() for p in ps]
    info = {
        "train_slots": sum(len(p[2]) for p in pairs["train"]),
        "test_slots": sum(len(p[2]) for p in pairs["test"]),
        "src_tokens": sum(len(a.src_ids) for a in alignments),
        "dst_tokens": sum(len(a.dst_ids) for a in alignments),
        "coverage_src": sum(len(a) for a in alignments) / max(1, sum(len(a.src_ids) for a in alignments)),
        "coverage_dst": sum(len(a) for a in alignments) / max(1, sum(len(a.dst_ids) for a in alignments)),
    }
    return cmap, grid_ev, info
