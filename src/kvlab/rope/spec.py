"""What a model's rotary position embedding is, read from the model's own code.

A :class:`RopeSpec` holds the inverse frequencies the model itself computes (so every scaling scheme
transformers implements, default, linear, llama3, yarn, comes out right without kvlab re-deriving it),
the number of rotated dimensions (partial rotary, e.g. Phi-2), how dimensions are paired, and whether
a shift of cached keys is exact (it is not for dynamic NTK or longrope, whose frequencies depend on
the sequence length).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvlab.errors import BadInputError, UnsupportedModelError

Pairing = Literal["half", "interleaved"]

# RoPE types whose frequencies do not depend on the sequence length: a rotation by delta is exact.
SHIFT_EXACT_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
# Families whose attention pairs dimension 2i with 2i+1 (GPT-J style) instead of i with i + d/2.
INTERLEAVED_MODEL_TYPES = frozenset({"gptj", "codegen", "cohere", "cohere2", "glm", "glm4", "chatglm"})


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one model.

    ``inv_freq[i]`` is the angle (radians per token) of rotary pair ``i``; ``rotary_dim`` leading
    dimensions of each head are rotated (``2 * len(inv_freq)``), the rest pass through.
    """

    inv_freq: tuple[float, ...]
    head_dim: int
    rope_type: str = "default"
    pairing: Pairing = "half"
    attention_scaling: float = 1.0
    theta: float | None = None
    shift_exact: bool = True
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)

    def inv_freq_tensor(self, dtype: torch.dtype = torch.float64, device: Any = "cpu") -> torch.Tensor:
        key = (dtype, str(device))
        if key not in self._cache:
            self._cache[key] = torch.tensor(self.inv_freq, dtype=dtype, device=device)
        return self._cache[key]

    def periods_tokens(self) -> list[float]:
        """Period of each rotary pair in tokens (2*pi / inv_freq), fastest first."""
        return [2 * math.pi / f if f > 0 else math.inf for f in self.inv_freq]

    def frequencies_cycles_per_token(self) -> list[float]:
        return [f / (2 * math.pi) for f in self.inv_freq]

    def require_shift_exact(self, what: str = "this operation") -> None:
        if not self.shift_exact:
            raise UnsupportedModelError(
                f"{what} needs a position-independent RoPE, but this model uses rope_type "
                f"'{self.rope_type}' whose frequencies depend on the sequence length; re-prefill instead"
            )

    def to_json(self) -> dict:
        return {
            "inv_freq": list(self.inv_freq),
            "head_dim": self.head_dim,
            "rope_type": self.rope_type,
            "pairing": self.pairing,
            "attention_scaling": self.attention_scaling,
            "theta": self.theta,
            "shift_exact": self.shift_exact,
        }

    @classmethod
    def from_json(cls, data: Any) -> RopeSpec:
        """Parse :meth:`to_json` output, checking every field (a snapshot header is untrusted input)."""

        def num(v: Any, what: str, *, positive: bool = True) -> float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise BadInputError(f"RoPE spec: {what} must be a finite number, got {v!r:.40}")
            if positive and v <= 0:
                raise BadInputError(f"RoPE spec: {what} must be positive, got {v!r:.40}")
            return float(v)

        keys = {"inv_freq", "head_dim", "rope_type", "pairing", "attention_scaling", "theta", "shift_exact"}
        if not isinstance(data, dict) or set(data) != keys:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise BadInputError(f"RoPE spec must be an object with fields {sorted(keys)}, got {got}")
        head_dim = data["head_dim"]
        if type(head_dim) is not int or not 2 <= head_dim <= 65_536:
            raise BadInputError(f"RoPE spec: head_dim must be an integer in [2, 65536], got {head_dim!r:.40}")
        inv = data["inv_freq"]
        if not isinstance(inv, list) or not 1 <= len(inv) <= head_dim // 2:
            raise BadInputError(f"RoPE spec: inv_freq must be a list of 1..{head_dim // 2} numbers")
        inv_freq = tuple(num(x, "inv_freq[i]") for x in inv)
        if not isinstance(data["rope_type"], str) or not 0 < len(data["rope_type"]) <= 64:
            raise BadInputError("RoPE spec: rope_type must be a short non-empty string")
        if data["pairing"] not in ("half", "interleaved"):
            raise BadInputError(
                f"RoPE spec: pairing must be 'half' or 'interleaved', got {data['pairing']!r:.40}"
            )
        if type(data["shift_exact"]) is not bool:
            raise BadInputError("RoPE spec: shift_exact must be true or false")
        theta = data["theta"]
        return cls(
            inv_freq=inv_freq,
            head_dim=head_dim,
            rope_type=data["rope_type"],
            pairing=data["pairing"],
            attention_scaling=num(data["attention_scaling"], "attention_scaling"),
            theta=None if theta is None else num(theta, "theta"),
            shift_exact=data["shift_exact"],
        )

    def summary(self) -> str:
        rot = f"{self.rotary_dim}/{self.head_dim} dims"
        theta = f"theta={self.theta:g}" if self.theta else "theta=?"
        return f"{self.rope_type} RoPE, {theta}, {rot} rotated, {self.pairing} pairing"


def _rope_params(config: Any) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_type" not in params and params:
        # Hybrid models keep one dict per layer type; kvlab does not shift those exactly.
        raise UnsupportedModelError(
            "this model uses different RoPE settings per layer type (hybrid local/global attention); "
            "kvlab's RoPE operations support one RoPE per model"
        )
    return dict(params) if isinstance(params, dict) else {}


def _per_layer_type_bases(rotary: Any) -> dict[str, float] | None:
    """``{layer type: RoPE base}`` for a rotary module that keeps one RoPE per layer type (Gemma-3 keeps
    ``sliding_attention_inv_freq`` and ``full_attention_inv_freq``), else None."""
    types = getattr(rotary, "layer_types", None)
    if not types or not all(isinstance(getattr(rotary, f"{t}_inv_freq", None), torch.Tensor) for t in types):
        return None
    params = getattr(getattr(rotary, "config", None), "rope_parameters", None) or {}
    out = {}
    for t in types:
        theta = (params.get(t) or {}).get("rope_theta") if isinstance(params, dict) else None
        if theta is None:  # inv_freq[i] = base ** (-2i / dim): the base from the second frequency
            inv = getattr(rotary, f"{t}_inv_freq").detach().to(torch.float64)
            theta = float(inv[1] ** (-inv.numel())) if inv.numel() > 1 else float("nan")
        out[str(t)] = float(theta)
    return out


def _refuse_per_layer_type(bases: dict[str, float]) -> UnsupportedModelError:
    listed = ", ".join(f"{t}: base {b:,.0f}" for t, b in bases.items())
    return UnsupportedModelError(
        f"this model uses a different RoPE per layer type ({listed}); kvlab's RoPE operations (shifts, "
        "de-rotation, rolling caches, snapshots with positions) support one RoPE per model so far"
    )


def _find_rotary_module(model: torch.nn.Module) -> torch.nn.Module | None:
    for m in model.modules():
        bases = _per_layer_type_bases(m)
        if bases is not None:
            raise _refuse_per_layer_type(bases)
    found = [m for m in model.modules() if hasattr(m, "inv_freq") and isinstance(m.inv_freq, torch.Tensor)]
    if len(found) > 1:
        raise UnsupportedModelError(
            f"this model has {len(found)} rotary embeddings (e.g. Gemma-3's local and global RoPE); "
            "kvlab's RoPE operations support one RoPE per model"
        )
    return found[0] if found else None


def _rotary_class_for_config(config: Any) -> type | None:
    """The model family's own RotaryEmbedding class, found in its modeling module."""
    model_type = getattr(config, "model_type", None)
    if not model_type:
        return None
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return None
    classes = [
        obj
        for name, obj in vars(module).items()
        if name.endswith("RotaryEmbedding") and isinstance(obj, type) and issubclass(obj, torch.nn.Module)
    ]
    # Prefer the plain class (e.g. LlamaRotaryEmbedding) over variants like ...DynamicNTKScalingRotaryEmbedding.
    classes.sort(key=lambda c: len(c.__name__))
    return classes[0] if classes else None


def rope_spec_from_model(model: torch.nn.Module) -> RopeSpec | None:
    """The RoPE spec of a loaded model, read from its rotary-embedding module; None without RoPE."""
    rotary = _find_rotary_module(model)
    if rotary is None:
        return None
    return _spec_from_rotary(rotary, model.config)


def rope_spec_from_config(config: Any) -> RopeSpec | None:
    """The RoPE spec of a model family, built by the family's own rotary class from a config alone."""
    params, types = getattr(config, "rope_parameters", None), getattr(config, "layer_types", None)
    if isinstance(params, dict) and types and set(types) <= set(params):  # one RoPE per layer type
        raise _refuse_per_layer_type(
            {str(t): float(dict(params[t] or {}).get("rope_theta", float("nan"))) for t in sorted(set(types))}
        )
    cls = _rotary_class_for_config(config)
    if cls is None:
        return None
    try:
        rotary = cls(config)
    except Exception as exc:  # a rotary class with an unusual signature
        raise UnsupportedModelError(
            f"could not build the rotary embedding of {config.model_type}: {exc}"
        ) from exc
    return _spec_from_rotary(rotary, config)


def _spec_from_rotary(rotary: torch.nn.Module, config: Any) -> RopeSpec:
    params = _rope_params(config)
    rope_type = str(getattr(rotary, "rope_type", None) or params.get("rope_type") or "default")
    inv_freq = rotary.inv_freq.detach().to("cpu", torch.float64)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    model_type = getattr(config, "model_type", "")
    return RopeSpec(
        inv_freq=tuple(float(x) for x in inv_freq.tolist()),
        head_dim=head_dim,
        rope_type=rope_type,
        pairing="interleaved" if model_type in INTERLEAVED_MODEL_TYPES else "half",
        attention_scaling=float(getattr(rotary, "attention_scaling", 1.0) or 1.0),
        theta=float(theta) if theta is not None else None,
        shift_exact=rope_type in SHIFT_EXACT_TYPES,
    )
