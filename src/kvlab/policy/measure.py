"""Measuring a compressed context against the uncompressed one, with fixed reference queries.

Shapes: reference ``queries`` per layer ``[B, Hq, n, D]`` (the *future* queries, computed with the
uncompressed cache); keys/values ``[B, Hkv, T, D]`` (or ``[B, Hkv, n_keep, D]`` after eviction).
Everything returns per-layer numpy arrays so curves over layers and windows can be bootstrapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvlab.cache.handle_view import HandleView
from kvlab.metrics.divergence import Divergence, compare_logits
from kvlab.metrics.logits import nll
from kvlab.policy.evict.observe import expand_kv


@dataclass(frozen=True)
class Distortion:
    """Per layer: q·k relative error and correlation, attention KL (nats), attention-output relative error."""

    qk_rel_error: np.ndarray
    qk_corr: np.ndarray
    attn_kl: np.ndarray
    out_rel_error: np.ndarray
    kept_mass: np.ndarray  # attention mass (of the uncompressed distribution) on the slots still held


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a @ b) / (a.norm() * b.norm() + 1e-30))


@dataclass(frozen=True, eq=False)
class Reference:
    """Per layer, what the uncompressed cache gives the reference queries (computed once per context).

    ``scores`` ``[B, Hq, n, T]`` raw ``q·k``; ``log_attn`` the log-softmax of ``scores * scaling``;
    ``out`` ``[B, Hq, n, D]`` the attention output.
    """

    scores: tuple[torch.Tensor, ...]
    log_attn: tuple[torch.Tensor, ...]
    out: tuple[torch.Tensor, ...]


def reference(
    queries: tuple[torch.Tensor, ...],
    keys: tuple[torch.Tensor, ...],
    values: tuple[torch.Tensor, ...],
    scaling: float,
) -> Reference:
    """The uncompressed side of :func:`distortion`, to share between many compressed caches."""
    s, la, o = [], [], []
    for q, k, v in zip(queries, keys, values, strict=True):
        hq = q.shape[1]
        sc = q.float() @ expand_kv(k.float(), hq).transpose(-1, -2)
        lg = torch.log_softmax(sc * scaling, dim=-1)
        s.append(sc)
        la.append(lg)
        o.append(lg.exp() @ expand_kv(v.float(), hq))
    return Reference(tuple(s), tuple(la), tuple(o))


def distortion(
    queries: tuple[torch.Tensor, ...],
    keys: tuple[torch.Tensor, ...],
    values: tuple[torch.Tensor, ...],
    new_keys: tuple[torch.Tensor, ...],
    new_values: tuple[torch.Tensor, ...],
    scaling: float,
    slots: tuple[torch.Tensor, ...] | None = None,
    ref: Reference | None = None,
) -> Distortion:
    """Compare attention of ``queries`` over the reference cache and over the compressed one.

    ``slots`` (per layer ``[B, Hkv, n_keep]``) marks an evicted cache: q·k and KL are then taken on the
    kept slots only (KL to the renormalised reference), and ``kept_mass`` says how much attention they held.
    ``ref`` (from :func:`reference` on the same queries, keys, values) skips recomputing the reference side.
    """
    ref = ref if ref is not None else reference(queries, keys, values, scaling)
    out: dict[str, list[float]] = {
        k: [] for k in ("qk_rel_error", "qk_corr", "attn_kl", "out_rel_error", "kept_mass")
    }
    for i, q in enumerate(queries):
        hq = q.shape[1]
        k_new, v_new = expand_kv(new_keys[i].float(), hq), expand_kv(new_values[i].float(), hq)
        s_ref, log_a, o_ref = ref.scores[i], ref.log_attn[i], ref.out[i]
        s_new = q.float() @ k_new.transpose(-1, -2)
        log_b = torch.log_softmax(s_new * scaling, dim=-1)
        if slots is not None:
            idx = expand_kv(slots[i][..., None], hq)[..., 0]  # [B, Hq, n_keep]
            g = idx[:, :, None, :].expand(-1, -1, q.shape[2], -1)
            s_ref = s_ref.gather(-1, g)
            log_kept = log_a.gather(-1, g)
            log_mass = torch.logsumexp(log_kept, dim=-1, keepdim=True)
            log_cmp = log_kept - log_mass
            out["kept_mass"].append(float(log_mass.exp().mean()))
        else:
            log_cmp = log_a
            out["kept_mass"].append(1.0)
        out["qk_rel_error"].append(float((s_new - s_ref).norm() / s_ref.norm()))
        out["qk_corr"].append(_corr(s_ref, s_new))
        kl = (log_cmp.exp() * (log_cmp - log_b)).sum(-1)
        out["attn_kl"].append(float(kl.mean()))
        o_new = log_b.exp() @ v_new
        out["out_rel_error"].append(float((o_new - o_ref).norm() / o_ref.norm()))
    return Distortion(**{k: np.array(v) for k, v in out.items()})


def continuation_nll(logits: torch.Tensor, continuation: list[int]) -> np.ndarray:
    """NLL (nats) of ``continuation[1:]`` given ``logits [n, vocab]`` of the continuation tokens."""
    return nll(logits[:-1], torch.as_tensor(continuation[1:], device=logits.device)).cpu().numpy()


def continuation_quality(
    logits: torch.Tensor, continuation: list[int], full_logits: torch.Tensor
) -> tuple[np.ndarray, Divergence]:
    """:func:`continuation_nll` of ``logits`` and how far they are from ``full_logits`` (the same
    continuation teacher-forced on the uncompressed context, ``[n, vocab]``): mean per-token
    ``KL(full || compressed)`` in nats (float64) and top-1 agreement over all ``n`` rows
    (:func:`kvlab.metrics.divergence.compare_logits`)."""
    return continuation_nll(logits, continuation), compare_logits(full_logits, logits)


def time_decode_ms(
    handle: HandleView, cache: Any, first_token: int, start_position: int, steps: int
) -> float:
    """Median milliseconds per greedy decode step on ``cache`` (which it extends), through :func:`kvlab.loop.decode_loop`."""
    from kvlab.loop import decode_loop

    position = start_position

    def feed(tokens: torch.Tensor) -> torch.Tensor:
        nonlocal position
        out = handle.run(tokens[:, None], cache, positions=torch.tensor([position], device=handle.device))
        position += 1
        return out.logits[:, -1]

    first = torch.zeros(1, int(handle.config.vocab_size), device=handle.device)
    first[0, int(first_token)] = 1.0  # the loop's first pick is ``first_token``
    with torch.no_grad():
        times = [s.seconds * 1000 for s in decode_loop(feed, first, steps, feed_last=True)]
    return float(np.median(times))
