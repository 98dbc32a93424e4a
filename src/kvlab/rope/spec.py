"""What a model's rotary position embedding is, read from the model's own code.

A :class:`RopeSpec` holds the inverse frequencies the model itself computes (so every scaling scheme
transformers implements, default, linear, llama3, yarn, comes out right without kvlab re-deriving it),
the number of rotated dimensions (partial rotary, e.g. Phi-2), how dimensions are paired, and whether
a shift of cached keys is exact (it is not for dynamic NTK or longrope, whose frequencies depend on
the sequence length).

Hybrid models rotate layers differently: Gemma-3 keeps one RoPE per layer type (local layers base
10,000, global layers 1,000,000), SmolLM3 and Llama-4 leave some layers without RoPE. Their RoPE is a
:class:`LayerRopes`, one :class:`RopeSpec` (or None) per layer; every rotation takes a single
:class:`RopeSpec`, so code that forgets which layer it rotates fails loudly instead of using the wrong
base (``rope.for_layer(i)`` is the one way in, and works on both types).
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

    def for_layer(self, layer: int) -> RopeSpec:
        """The RoPE of one layer: this spec (every layer of a single-RoPE model rotates alike)."""
        return self

    def summary(self) -> str:
        rot = f"{self.rotary_dim}/{self.head_dim} dims"
        theta = f"theta={self.theta:g}" if self.theta else "theta=?"
        return f"{self.rope_type} RoPE, {theta}, {rot} rotated, {self.pairing} pairing"


@dataclass(frozen=True)
class LayerRopes:
    """The RoPE of a hybrid model, one per layer: ``layers[i]`` is layer ``i``'s :class:`RopeSpec`, or
    None for a layer whose keys carry no position (NoPE). ``kinds[i]`` names the layer's type
    (e.g. ``sliding_attention``) for reports."""

    layers: tuple[RopeSpec | None, ...]
    kinds: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.layers or len(self.kinds) != len(self.layers):
            raise BadInputError("per-layer RoPE needs one spec (or None) and one kind per layer")
        dims = {s.head_dim for s in self.layers if s is not None}
        if len(dims) != 1:
            raise BadInputError(f"per-layer RoPE specs disagree on head_dim ({sorted(dims)}) or none rotates")

    def for_layer(self, layer: int) -> RopeSpec | None:
        if not 0 <= layer < len(self.layers):
            raise BadInputError(f"layer {layer} is outside this model's {len(self.layers)} layers")
        return self.layers[layer]

    @property
    def head_dim(self) -> int:
        return next(s.head_dim for s in self.layers if s is not None)

    @property
    def shift_exact(self) -> bool:
        return all(s.shift_exact for s in self.layers if s is not None)

    @property
    def by_kind(self) -> dict[str, RopeSpec | None]:
        """``{layer kind: its RoPE}`` in order of first appearance."""
        out: dict[str, RopeSpec | None] = {}
        for kind, spec in zip(self.kinds, self.layers, strict=True):
            out.setdefault(kind, spec)
        return out

    @property
    def rotary_dim(self) -> int:
        """Rotated dimensions, when every rotating layer rotates the same number (else an error)."""
        dims = {s.rotary_dim for s in self.layers if s is not None}
        if len(dims) != 1:
            raise UnsupportedModelError(
                f"this model's layers rotate different numbers of dims ({sorted(dims)})"
            )
        return dims.pop()

    def periods_tokens(self) -> list[float]:
        """Every layer's periods together (distinct, fastest first): what any layer of the cache can show."""
        return sorted({p for s in self.layers if s is not None for p in s.periods_tokens()})

    def frequencies_cycles_per_token(self) -> list[float]:
        return sorted(
            {f for s in self.layers if s is not None for f in s.frequencies_cycles_per_token()}, reverse=True
        )

    def require_shift_exact(self, what: str = "this operation") -> None:
        for spec in self.layers:
            if spec is not None:
                spec.require_shift_exact(what)

    def to_json(self) -> dict:
        specs = self.by_kind
        return {
            "per_layer": list(self.kinds),
            "specs": {k: (s.to_json() if s is not None else None) for k, s in specs.items()},
        }

    @classmethod
    def from_json(cls, data: Any) -> LayerRopes:
        if not isinstance(data, dict) or set(data) != {"per_layer", "specs"}:
            raise BadInputError("per-layer RoPE must be an object with fields ['per_layer', 'specs']")
        kinds, specs = data["per_layer"], data["specs"]
        if not isinstance(kinds, list) or not 1 <= len(kinds) <= 4096:
            raise BadInputError("per-layer RoPE: per_layer must list 1..4096 layer kinds")
        if not isinstance(specs, dict) or not 1 <= len(specs) <= 64:
            raise BadInputError("per-layer RoPE: specs must map 1..64 layer kinds to RoPE specs")
        parsed = {k: (None if v is None else RopeSpec.from_json(v)) for k, v in specs.items()}
        if any(not isinstance(k, str) or k not in parsed for k in kinds) or set(kinds) != set(parsed):
            raise BadInputError(
                "per-layer RoPE: every layer kind needs exactly one spec, and every spec a layer"
            )
        return cls(layers=tuple(parsed[k] for k in kinds), kinds=tuple(kinds))

    def summary(self) -> str:
        parts = []
        for kind, spec in self.by_kind.items():
            n = self.kinds.count(kind)
            parts.append(f"{kind} ({n} layers): {spec.summary() if spec is not None else 'no RoPE'}")
        return "; ".join(parts)


Rope = RopeSpec | LayerRopes
"""A model's RoPE: one spec for every layer, or one per layer (hybrid models)."""


def rope_from_json(data: Any) -> Rope:
    """Parse either kind of RoPE (a snapshot header is untrusted input; errors are BadInputError)."""
    if isinstance(data, dict) and "per_layer" in data:
        return LayerRopes.from_json(data)
    return RopeSpec.from_json(data)


def map_rope(rope: Rope, fn: Any) -> Rope:
    """``rope`` with ``fn`` applied to each layer's spec (e.g. ``dataclasses.replace`` of one field)."""
    if isinstance(rope, RopeSpec):
        return fn(rope)
    return LayerRopes(layers=tuple(None if s is None else fn(s) for s in rope.layers), kinds=rope.kinds)


def rope_for_layer(rope: Rope | None, layer: int) -> RopeSpec | None:
    """Layer ``layer``'s RoPE, None for a model (or layer) without one."""
    return None if rope is None else rope.for_layer(layer)


def _rope_params(config: Any) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_type" not in params and params:
        # One dict per layer type, but a rotary module with a single inv_freq: kvlab cannot tell which
        # layer uses which, so it refuses rather than guess.
        raise UnsupportedModelError(
            "this model's config gives RoPE settings per layer type but its rotary module keeps one "
            "set of frequencies; kvlab cannot tell which layer uses which"
        )
    return dict(params) if isinstance(params, dict) else {}


def _is_per_layer_type(rotary: Any) -> bool:
    """A rotary module that keeps one RoPE per layer type (Gemma-3: ``sliding_attention_inv_freq`` and
    ``full_attention_inv_freq``, chosen per layer by ``config.layer_types``)."""
    types = getattr(rotary, "layer_types", None)
    if not types:
        return False
    return any(isinstance(getattr(rotary, f"{t}_inv_freq", None), torch.Tensor) for t in types)


def _no_rope_layers(config: Any) -> list[bool] | None:
    """Which layers skip RoPE, as the model's attention decides it; None when every layer rotates.

    SmolLM3, Llama-4 and Mistral-Large-4 read ``config.no_rope_layers[i]`` (1 = rotate, 0 = no RoPE);
    Cohere-2 rotates only its sliding-window layers."""
    n = int(getattr(config, "num_hidden_layers", 0) or 0)
    flags = getattr(config, "no_rope_layers", None)
    if isinstance(flags, (list, tuple)) and len(flags) == n and not all(flags):
        return [not bool(f) for f in flags]
    types = getattr(config, "layer_types", None)
    if getattr(config, "model_type", "") == "cohere2" and types and len(types) == n:
        return [t != "sliding_attention" for t in types]
    return None


def _layer_kinds(config: Any, n: int) -> list[str]:
    types = getattr(config, "layer_types", None)
    return [str(t) for t in types] if types and len(types) == n else ["attention"] * n


def _per_layer(config: Any, spec_of_kind: dict[str, RopeSpec | None], kinds: list[str]) -> Rope:
    nope = _no_rope_layers(config) or [False] * len(kinds)
    layers = tuple(None if skip else spec_of_kind[k] for k, skip in zip(kinds, nope, strict=True))
    kinds = [
        f"{k} (no RoPE)" if skip and spec_of_kind[k] is not None else k
        for k, skip in zip(kinds, nope, strict=True)
    ]
    distinct = {id(s) for s in layers}
    if len(distinct) == 1 and layers[0] is not None:
        return layers[0]  # every layer rotates alike: one spec
    if all(s is None for s in layers):
        raise UnsupportedModelError("this model's RoPE module is used by none of its layers")
    return LayerRopes(layers=layers, kinds=tuple(kinds))


def _per_layer_type_rope(rotary: Any, config: Any) -> Rope:
    """One :class:`RopeSpec` per layer type, each from the rotary module's own buffers."""
    n = int(config.num_hidden_layers)
    kinds = _layer_kinds(config, n)
    params = getattr(config, "rope_parameters", None) or {}
    head_dim = _head_dim(config)
    pairing: Pairing = (
        "interleaved" if getattr(config, "model_type", "") in INTERLEAVED_MODEL_TYPES else "half"
    )
    rope_types = getattr(rotary, "rope_type", None)
    spec_of_kind: dict[str, RopeSpec | None] = {}
    for kind in dict.fromkeys(kinds):
        inv = getattr(rotary, f"{kind}_inv_freq", None)
        if not isinstance(inv, torch.Tensor):
            spec_of_kind[kind] = None  # a layer type without RoPE parameters
            continue
        rope_type = str(
            (rope_types or {}).get(kind, "default") if isinstance(rope_types, dict) else "default"
        )
        theta = (params.get(kind) or {}).get("rope_theta") if isinstance(params, dict) else None
        spec_of_kind[kind] = RopeSpec(
            inv_freq=tuple(float(x) for x in inv.detach().to("cpu", torch.float64).tolist()),
            head_dim=head_dim,
            rope_type=rope_type,
            pairing=pairing,
            attention_scaling=float(getattr(rotary, f"{kind}_attention_scaling", 1.0) or 1.0),
            theta=float(theta) if theta is not None else None,
            shift_exact=rope_type in SHIFT_EXACT_TYPES,
        )
    return _per_layer(config, spec_of_kind, kinds)


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _find_rotary_module(model: torch.nn.Module) -> torch.nn.Module | None:
    found = [
        m
        for m in model.modules()
        if _is_per_layer_type(m) or (hasattr(m, "inv_freq") and isinstance(m.inv_freq, torch.Tensor))
    ]
    if len(found) > 1:
        raise UnsupportedModelError(
            f"this model has {len(found)} rotary embedding modules; kvlab reads one (a single RoPE, or one "
            "per layer type as in Gemma-3) and will not guess which layer uses which"
        )
    return found[0] if found else None


def _rotary_class_for_config(config: Any) -> type | None:
    """The model family's own RotaryEmbedding class, found in its modeling module."""
    model_type = getattr(config, "model_type", None)
    if not model_type:
        return None
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:  # e.g. gemma3_text lives in transformers.models.gemma3: ask the auto mapping
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if class_name is None:
            return None
        try:
            module = importlib.import_module(
                getattr(importlib.import_module("transformers"), class_name).__module__
            )
        except (ImportError, AttributeError, TypeError):
            return None
    classes = [
        obj
        for name, obj in vars(module).items()
        if name.endswith("RotaryEmbedding") and isinstance(obj, type) and issubclass(obj, torch.nn.Module)
    ]
    # Prefer the plain class (e.g. LlamaRotaryEmbedding) over variants like ...DynamicNTKScalingRotaryEmbedding.
    classes.sort(key=lambda c: len(c.__name__))
    return classes[0] if classes else None


def rope_spec_from_model(model: torch.nn.Module) -> Rope | None:
    """The RoPE of a loaded model, read from its rotary-embedding module: one :class:`RopeSpec`, a
    :class:`LayerRopes` for hybrid models, or None without RoPE."""
    rotary = _find_rotary_module(model)
    if rotary is None:
        return None
    return _rope_from_rotary(rotary, model.config)


def rope_spec_from_config(config: Any) -> Rope | None:
    """The RoPE of a model family, built by the family's own rotary class from a config alone."""
    cls = _rotary_class_for_config(config)
    if cls is None:
        return None
    try:
        with torch.device("cpu"):  # a spec is host metadata: read it off a host copy of the module
            rotary = cls(config)
    except Exception as exc:  # a rotary class with an unusual signature
        raise UnsupportedModelError(
            f"could not build the rotary embedding of {config.model_type}: {exc}"
        ) from exc
    return _rope_from_rotary(rotary, config)


def _rope_from_rotary(rotary: torch.nn.Module, config: Any) -> Rope:
    if _is_per_layer_type(rotary):
        return _per_layer_type_rope(rotary, config)
    spec = _spec_from_rotary(rotary, config)
    n = int(getattr(config, "num_hidden_layers", 0) or 0)
    if _no_rope_layers(config) is None or n == 0:
        return spec
    return _per_layer(config, {k: spec for k in _layer_kinds(config, n)}, _layer_kinds(config, n))


def _spec_from_rotary(rotary: torch.nn.Module, config: Any) -> RopeSpec:
    params = _rope_params(config)
    rope_type = str(getattr(rotary, "rope_type", None) or params.get("rope_type") or "default")
    inv_freq = rotary.inv_freq
    if not isinstance(inv_freq, torch.Tensor):
        raise UnsupportedModelError(
            f"the rotary embedding's inv_freq is a {type(inv_freq).__name__}, not a tensor"
        )
    inv_freq = inv_freq.detach().to("cpu", torch.float64)
    head_dim = _head_dim(config)
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
