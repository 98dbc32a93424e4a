"""A learned eviction policy: a tiny MLP over per-token features, trained to predict future attention.

Features per (layer, KV head, slot): log mean attention received from the context's queries so far,
log attention from the last 32 queries, log key and value norms, relative position, log distance
from the end, layer depth, and a first-slot flag. Target: log of the attention the *next* ``future``
queries (the continuation of the text) pay to the slot, z-scored within each (window, layer, head) so
the model learns a ranking. Weights are a few KB of JSON in ``kvlab/policy/weights/``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvlab.cache.handle_view import HandleView
from kvlab.errors import BadInputError
from kvlab.policy.evict.observe import attention_weights, observe
from kvlab.policy.evict.policies import LayerView, Policy, _group_mean
from kvlab.policy.evict.select import layer_views

FEATURES = (
    "log_received_mean",
    "log_recent_attention",
    "log_key_norm",
    "log_value_norm",
    "relative_position",
    "log_distance_from_end",
    "layer_depth",
    "is_first",
)
WEIGHTS_DIR = Path(__file__).resolve().parents[1] / "weights"
DEFAULT_WEIGHTS = WEIGHTS_DIR / "learned_evictor.json"
_EPS = 1e-8


def token_features(view: LayerView) -> torch.Tensor:
    """``[B, Hkv, T, len(FEATURES)]`` float32 features of every slot of one layer."""
    t = view.seq_len
    slot = torch.arange(t, dtype=torch.float32, device=view.keys.device)
    seen_by = (t - slot).clamp_min(1)  # context queries that can see each slot
    b, h = view.keys.shape[:2]

    def bc(x: torch.Tensor) -> torch.Tensor:
        return x[None, None].expand(b, h, t)

    feats = [
        torch.log(view.received / seen_by + _EPS),
        torch.log(view.recent_attention(32) + _EPS),
        torch.log(view.keys.float().norm(dim=-1) + _EPS),
        torch.log(view.values.float().norm(dim=-1) + _EPS),
        bc(slot / max(t - 1, 1)),
        bc(torch.log1p(t - 1 - slot)),
        torch.full((b, h, t), view.layer / max(view.num_layers - 1, 1), device=view.keys.device),
        bc((slot == 0).float()),
    ]
    return torch.stack(feats, dim=-1)


@dataclass(frozen=True)
class MLPWeights:
    mean: np.ndarray
    std: np.ndarray
    w1: np.ndarray  # [F, hidden]
    b1: np.ndarray
    w2: np.ndarray  # [hidden]
    b2: float
    meta: dict

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Scores of features ``x [..., F]``, on ``x``'s device."""

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(a, dtype=torch.float32, device=x.device)

        z = (x - t(self.mean)) / t(self.std)
        return torch.tanh(z @ t(self.w1) + t(self.b1)) @ t(self.w2) + self.b2

    def to_json(self) -> dict:
        return {
            "features": list(FEATURES),
            "mean": self.mean.tolist(),
            "std": self.std.tolist(),
            "w1": self.w1.tolist(),
            "b1": self.b1.tolist(),
            "w2": self.w2.tolist(),
            "b2": float(self.b2),
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, data: dict) -> MLPWeights:
        if list(data.get("features", [])) != list(FEATURES):
            raise BadInputError(
                "the evictor weights were trained on other features; retrain with kvlab train-evictor"
            )
        return cls(
            np.array(data["mean"]),
            np.array(data["std"]),
            np.array(data["w1"]),
            np.array(data["b1"]),
            np.array(data["w2"]),
            float(data["b2"]),
            dict(data.get("meta", {})),
        )


@lru_cache(maxsize=8)
def load_weights(path: str | None = None) -> MLPWeights:
    p = Path(path) if path else DEFAULT_WEIGHTS
    if not p.is_file():
        raise BadInputError(f"no learned-evictor weights at {p}; train them with: kvlab train-evictor")
    try:
        return MLPWeights.from_json(json.loads(p.read_text()))
    except (json.JSONDecodeError, KeyError, ValueError) as exc:
        raise BadInputError(
            f"{p} is not a valid evictor weights file ({exc}); retrain with kvlab train-evictor"
        ) from None


@dataclass(frozen=True)
class LearnedPolicy(Policy):
    """Scores slots with the trained MLP (weights from ``weights`` or the bundled file)."""

    weights: str | None = None
    window: int = 0
    name = "learned"
    needs_queries = True

    def score(self, view: LayerView) -> torch.Tensor:
        return load_weights(self.weights).predict(token_features(view))


def training_rows(
    handle: HandleView,
    tokens: list[int],
    context: int,
    future: int,
    max_rows_per_head: int = 128,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Features of the first ``context`` slots and their z-scored log future attention.

    One prefill of ``context + future`` tokens: features use only the context's queries (causal, so
    exactly what an evictor would see at that point); the target is the attention the ``future``
    queries pay to each context slot.
    """
    obs = observe(handle, tokens[: context + future])
    snap = obs.snapshot
    ctx_snap = snap.slice(0, context)
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for view in layer_views(
        type(obs)(ctx_snap, tuple(q[:, :, :context] for q in obs.queries), obs.logits, obs.scaling)
    ):
        q_future = obs.queries[view.layer][:, :, context:]
        att = attention_weights(q_future, snap.keys[view.layer], obs.scaling)[..., :context]
        target = torch.log(_group_mean(att.mean(dim=2), snap.num_kv_heads) + 1e-6)  # [B, Hkv, context]
        target = (target - target.mean(-1, keepdim=True)) / (target.std(-1, keepdim=True) + 1e-6)
        feats = token_features(view)
        for h in range(feats.shape[1]):
            pick = rng.choice(context, size=min(max_rows_per_head, context), replace=False)
            xs.append(feats[0, h, pick].cpu().numpy())
            ys.append(target[0, h, pick].cpu().numpy())
    return np.concatenate(xs), np.concatenate(ys)


def fit_mlp(
    x: np.ndarray, y: np.ndarray, *, hidden: int = 16, steps: int = 1500, seed: int = 0, lr: float = 0.01
) -> tuple[MLPWeights, list[float]]:
    """Full-batch Adam on mean squared error; returns the weights and the loss curve. A small MLP on
    numpy rows: it trains on the host (seeded, the same weights on every machine)."""
    torch.manual_seed(seed)
    mean, std = x.mean(0), x.std(0) + 1e-6
    xt, mu, sd, yt = (torch.as_tensor(a, dtype=torch.float32, device="cpu") for a in (x, mean, std, y))
    xt = (xt - mu) / sd
    w1 = torch.nn.Parameter(torch.randn(x.shape[1], hidden, device="cpu") / math.sqrt(x.shape[1]))
    b1 = torch.nn.Parameter(torch.zeros(hidden, device="cpu"))
    w2 = torch.nn.Parameter(torch.randn(hidden, device="cpu") / math.sqrt(hidden))
    b2 = torch.nn.Parameter(torch.zeros((), device="cpu"))
    opt = torch.optim.Adam([w1, b1, w2, b2], lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((torch.tanh(xt @ w1 + b1) @ w2 + b2 - yt) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    weights = MLPWeights(
        mean, std, w1.detach().numpy(), b1.detach().numpy(), w2.detach().numpy(), float(b2.detach()), {}
    )
    return weights, losses


def train_evictor(
    handle: HandleView,
    texts: list[list[int]],
    *,
    context: int = 512,
    future: int = 64,
    hidden: int = 16,
    steps: int = 1500,
    seed: int = 0,
    progress: Any = None,
) -> tuple[MLPWeights, dict]:
    """Generate data from ``texts`` (token lists), hold out the last quarter, fit, report held-out quality."""
    if len(texts) < 2:
        raise BadInputError("train-evictor needs at least 2 windows (one is held out)")
    start = time.perf_counter()
    rows = []
    for i, toks in enumerate(texts):
        if len(toks) < context + future:
            raise BadInputError(
                f"window {i} has {len(toks)} tokens, fewer than context + future = {context + future}"
            )
        rows.append(training_rows(handle, toks, context, future, seed=seed + i))
        if progress:
            progress(i + 1, len(texts))
    n_test = max(1, len(rows) // 4)
    x_tr, y_tr = (np.concatenate([r[k] for r in rows[:-n_test]]) for k in (0, 1))
    x_te, y_te = (np.concatenate([r[k] for r in rows[-n_test:]]) for k in (0, 1))
    data_s = time.perf_counter() - start
    weights, losses = fit_mlp(x_tr, y_tr, hidden=hidden, steps=steps, seed=seed)
    pred = weights.predict(torch.as_tensor(x_te, dtype=torch.float32, device="cpu")).numpy()
    report = {
        "windows": len(texts),
        "held_out_windows": n_test,
        "context": context,
        "future": future,
        "train_rows": int(len(y_tr)),
        "test_rows": int(len(y_te)),
        "final_train_mse": losses[-1],
        "test_mse": float(((pred - y_te) ** 2).mean()),
        "test_spearman": _spearman(pred, y_te),
        "test_spearman_received_only": _spearman(x_te[:, 0], y_te),
        "data_seconds": data_s,
        "fit_seconds": time.perf_counter() - start - data_s,
    }
    return MLPWeights(
        weights.mean, weights.std, weights.w1, weights.b1, weights.w2, weights.b2, report
    ), report


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def save_weights(weights: MLPWeights, path: str | Path | None = None) -> Path:
    from kvlab.cache.io import atomic_write_bytes

    p = Path(path) if path else DEFAULT_WEIGHTS
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(p, (json.dumps(weights.to_json(), indent=1) + "\n").encode())
    load_weights.cache_clear()
    return p
