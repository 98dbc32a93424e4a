"""The quantizers: each a small dataclass that turns one span of a layer's K/V into real packed bytes.

Shapes: ``keys``/``values`` are ``[batch, kv_heads, n, head_dim]`` (keys post-RoPE, as cached);
``positions`` is ``[n]``. A quantizer's :meth:`Quantizer.encode` returns a :class:`Segment` whose
``decode()`` gives the approximate K/V back and whose ``nbytes`` counts every byte it holds (codes,
scales, zero points, sketch bits). Sinks (the first ``sinks`` slots) and a recent ``window`` stay in
full precision; :func:`split_plan` decides which slots are quantized, for snapshots and the HF cache alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.policy.quant.pack import pack_bits, tensor_bytes, unpack_bits
from kvlab.policy.quant.rotation import (
    rotate_heads,
    rotation_matrix,
    sketch_estimate,
    sketch_matrix,
    unrotate_heads,
)
from kvlab.policy.quant.scalar import (
    QuantizedTensor,
    check_bits,
    check_group,
    quantize,
    quantize_lloyd,
)
from kvlab.policy.window import SinksWindow
from kvlab.rope.ops import apply_rope, remove_rope
from kvlab.rope.spec import RopeSpec


class Code(Protocol):
    @property
    def nbytes(self) -> int: ...

    def decode(self) -> torch.Tensor: ...


@dataclass(frozen=True, eq=False)
class TokenCode:
    """Per-token groups along head_dim."""

    q: QuantizedTensor

    @property
    def nbytes(self) -> int:
        return self.q.nbytes

    def decode(self) -> torch.Tensor:
        return self.q.dequantize()

    def gather(self, index: torch.Tensor, *more: TokenCode) -> TokenCode:
        """The tokens ``index [B, H, n]`` of this code followed by ``more`` (along tokens), exactly:
        per-token codes, scales and zero points are copied, never re-quantized."""
        return TokenCode(self.q.gather(index, *(c.q for c in more)))


@dataclass(frozen=True, eq=False)
class ChannelCode:
    """Per-channel groups along tokens (stored transposed, ``[B, H, D, n]``)."""

    q: QuantizedTensor

    @property
    def nbytes(self) -> int:
        return self.q.nbytes

    def decode(self) -> torch.Tensor:
        return self.q.dequantize().transpose(-1, -2)


@dataclass(frozen=True, eq=False)
class PreRopeCode:
    """Keys quantized before RoPE; decoding re-applies RoPE at their positions (positions are metadata)."""

    inner: Code
    positions: torch.Tensor
    rope: RopeSpec

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def decode(self) -> torch.Tensor:
        pre = self.inner.decode()
        return apply_rope(pre, self.positions.to(pre.device), self.rope).to(pre.dtype)


@dataclass(frozen=True, eq=False)
class RotatedCode:
    """Codes of ``(x - c_t m_t) R^T`` per head; optional 1-bit sketch of the rotated residual.

    ``mean`` (fp16 ``[B, H, 1, D]``) is a per-segment mean (pre-RoPE for keys, re-rotated to each slot's
    position on decode); ``coef`` (fp16 ``[B, H, n]``) is each slot's least-squares coefficient on it
    (None: coefficient 1, plain centring). Sketch: packed signs ``[B, H, n, m]`` and fp16 norms ``[B, H, n]``.
    """

    inner: TokenCode
    rot: torch.Tensor
    signs: torch.Tensor | None = None
    norms: torch.Tensor | None = None
    sketch_dim: int = 0
    mean: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    rope: RopeSpec | None = None
    coef: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        sketch = (self.signs, self.norms) if self.signs is not None else ()
        return self.inner.nbytes + tensor_bytes(self.mean, self.coef, *sketch)

    def decode(self) -> torch.Tensor:
        y = self.inner.q.dequantize().float()
        if self.signs is not None and self.norms is not None:
            b, h, n, d = y.shape
            bits = unpack_bits(self.signs, 1, b * h * n * self.sketch_dim).view(b, h, n, self.sketch_dim)
            proj = sketch_matrix(d, self.sketch_dim, device=y.device)
            y = y + sketch_estimate(bits.float() * 2 - 1, self.norms.float(), proj)
        out = unrotate_heads(y, self.rot)
        if self.mean is not None:
            m = _rotated_mean(self.mean, self.positions, self.rope, out.shape)
            out = out + (m if self.coef is None else self.coef.float()[..., None] * m)
        return out.to(self.inner.q.dtype)


def _rotated_mean(
    mean: torch.Tensor, positions: torch.Tensor | None, rope: RopeSpec | None, shape: torch.Size
) -> torch.Tensor:
    """The pre-RoPE mean key ``[B, H, 1, D]`` placed at every slot's position: ``[B, H, n, D]`` float32."""
    m = mean.float().expand(shape)
    if rope is None:
        return m
    assert positions is not None  # a mean under RoPE is stored with its slots' positions (_centre)
    # float32 angles are plenty for an fp16 mean, and encode and decode both come through here
    return apply_rope(m, positions.to(m.device), rope, compute_dtype=torch.float32).float()


@dataclass(frozen=True, eq=False)
class Segment:
    """One quantized span of a layer: ``n`` slots of keys and values."""

    keys: Code
    values: Code
    length: int

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.decode(), self.values.decode()


def decode_between(
    first: tuple[torch.Tensor | None, torch.Tensor | None],
    segments: list[Segment] | tuple[Segment, ...],
    last: tuple[torch.Tensor | None, torch.Tensor | None],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``first``, then the ``segments`` decoded in ``dtype``, then ``last``, concatenated along
    slots (a None part left out): a layer's sinks, codes and full-precision tail as one tensor each."""
    parts = [first, *((k.to(dtype), v.to(dtype)) for k, v in (s.decode() for s in segments)), last]
    ks = [k for k, _ in parts if k is not None]
    return torch.cat(ks, dim=-2), torch.cat([v for _, v in parts if v is not None], dim=-2)


def _per_token(x: torch.Tensor, bits: int, group: int, symmetric: bool) -> TokenCode:
    return TokenCode(quantize(x, bits, group, symmetric=symmetric))


def _per_channel(x: torch.Tensor, bits: int, group: int, symmetric: bool) -> ChannelCode:
    return ChannelCode(quantize(x.transpose(-1, -2).contiguous(), bits, group, symmetric=symmetric))


#: every codec (quantizer class) by its ``kind``, filled as classes are defined (see
#: :meth:`Quantizer.__init_subclass__`); ``codecs/`` adds more, one file each
QUANTIZERS: dict[str, type[Quantizer]] = {}


@dataclass(frozen=True)
class Quantizer:
    """Base: ``bits`` per element, ``group_size`` elements per scale, full-precision ``sinks`` and ``window``.

    A subclass with its own ``kind`` registers itself (the command line and the study read
    :data:`QUANTIZERS`; the cache-spec parser reads its entry in :data:`kvlab.policy.catalogue.CODECS`,
    which a test keeps equal); ``fixed_bits`` names a codec whose width is part of its kind and name (fp8, int4rows).
    """

    bits: int = 4
    group_size: int = 64
    sinks: int = 0
    window: int = 0
    symmetric: bool = False

    kind = "base"
    fixed_bits: ClassVar[int | None] = None
    uses_positions: ClassVar[bool] = False  # encode/decode read the slots' RoPE positions

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if isinstance(kind, str):
            other = QUANTIZERS.get(kind)
            if other is not None and other.__qualname__ != cls.__qualname__:
                raise TypeError(f"two codecs are named '{kind}': {other.__module__} and {cls.__module__}")
            QUANTIZERS[kind] = cls

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if self.group_size < 1:
            raise BadInputError(f"group size must be >= 1, got {self.group_size}")
        if self.sinks < 0 or self.window < 0:
            raise BadInputError("sinks and window must be >= 0")

    @property
    def name(self) -> str:
        extra = (f"+{self.sinks}sink" if self.sinks else "") + (f"+w{self.window}" if self.window else "")
        return f"{self.kind}{extra}" if self.fixed_bits else f"{self.kind}-int{self.bits}{extra}"

    def token_multiple(self) -> int:
        """Quantized spans must hold a multiple of this many slots (per-channel groups run along tokens)."""
        return 1

    def rolling_block(self) -> int:
        """Slots a rolling window encodes together (:mod:`kvlab.hf.coded_rolling`): 32, rounded up to
        whole token groups; one segment per generated token would slow every step."""
        m = self.token_multiple()
        return m * math.ceil(32 / m)

    def check(self, head_dim: int, rope: RopeSpec | None) -> None:
        """Raise a clear error if this quantizer cannot encode a cache of this geometry."""
        check_group(head_dim, self.group_size)

    def encode(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rope: RopeSpec | None
    ) -> Segment:
        raise NotImplementedError


@dataclass(frozen=True)
class PerTokenQuantizer(Quantizer):
    """Naive baseline: keys and values per token, groups along head_dim (what most int4 caches do)."""

    kind = "pertoken"

    def encode(self, keys, values, positions, rope) -> Segment:
        return Segment(
            _per_token(keys, self.bits, self.group_size, self.symmetric),
            _per_token(values, self.bits, self.group_size, self.symmetric),
            keys.shape[-2],
        )


@dataclass(frozen=True)
class KIVIQuantizer(Quantizer):
    """KIVI: keys per channel (groups of ``group_size`` tokens), values per token, recent window in fp."""

    bits: int = 2
    group_size: int = 32
    window: int = 32
    kind = "kivi"

    def token_multiple(self) -> int:
        return self.group_size

    def encode(self, keys, values, positions, rope) -> Segment:
        return Segment(
            _per_channel(keys, self.bits, self.group_size, self.symmetric),
            _per_token(values, self.bits, self.group_size, self.symmetric),
            keys.shape[-2],
        )


@dataclass(frozen=True)
class PreRopeQuantizer(Quantizer):
    """KVQuant-style: keys de-rotated to pre-RoPE, quantized per channel; values per token."""

    group_size: int = 32
    kind = "prerope"
    uses_positions = True

    def token_multiple(self) -> int:
        return self.group_size

    def check(self, head_dim: int, rope: RopeSpec | None) -> None:
        super().check(head_dim, rope)
        if rope is None:
            raise UnsupportedModelError(
                "pre-RoPE key quantization needs a model with rotary position embeddings"
            )
        rope.require_shift_exact("pre-RoPE key quantization")

    def encode(self, keys, values, positions, rope) -> Segment:
        pre = remove_rope(keys, positions.to(keys.device), rope)
        k = PreRopeCode(_per_channel(pre, self.bits, self.group_size, self.symmetric), positions, rope)
        return Segment(k, _per_token(values, self.bits, self.group_size, self.symmetric), keys.shape[-2])


CENTER_MODES = ("proj", "mean", "none")
GRIDS = ("lloyd", "uniform")


@dataclass(frozen=True)
class RotatedQuantizer(Quantizer):
    """Centre, rotate each head (Hadamard x random signs, or Haar-random), then quantize per token.

    Keys: ``center="proj"`` (default) takes the per-segment mean ``m`` of the pre-RoPE keys and removes
    from each key ``k_t`` its least-squares multiple ``c_t m_t`` (``m_t`` = ``m`` rotated to the slot's
    position, ``c_t = k_t·m_t / |m_t|^2``, stored fp16), so no residual is longer than its key.
    ``"mean"`` subtracts ``m_t`` itself (``c_t = 1``; it *lengthens* keys far from the mean, such as the
    attention-sink token, whose logit error then dominates), ``"none"`` skips centring. Values are
    centred the same way on their own mean (no RoPE) when ``center_values`` (``proj`` mode only).

    ``grid="lloyd"`` (default) codes each group of the rotated residual on the Lloyd-Max levels of the
    normal distribution with one fp16 scale per group; ``"uniform"`` uses min/max codes with an fp16 scale
    and zero point. Budget at 4 bits and ``group_size = head_dim = 64``: 32 code bytes + 2 (scale) +
    2 (coefficient) per token and head, the same 36 bytes as naive asymmetric int4 (32 + scale + zero),
    plus one fp16 mean per head and segment (amortised). Segments shorter than ``min_center`` slots
    (decode-time single tokens) are not centred, so a mean is never stored for one token.

    With ``sketch=True`` keys use ``bits - 1`` bits plus a 1-bit sign sketch of the residual
    (``head_dim`` sketch rows, one bit per element, + an fp16 norm), TurboQuant/QJL-style.
    """

    rotation: str = "hadamard"
    sketch: bool = False
    center: str | bool = "proj"
    center_values: bool = True
    grid: str = "lloyd"
    min_center: int = 16
    seed: int = 0
    kind = "rotation"
    uses_positions = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.center, bool):
            object.__setattr__(self, "center", "proj" if self.center else "none")
        if self.center not in CENTER_MODES:
            raise BadInputError(f"unknown centring '{self.center}'; choose one of {', '.join(CENTER_MODES)}")
        if self.grid not in GRIDS:
            raise BadInputError(f"unknown grid '{self.grid}'; choose one of {', '.join(GRIDS)}")

    @property
    def name(self) -> str:
        base = super().name
        return base.replace("rotation", "rotation+qjl" if self.sketch else "rotation", 1)

    def check(self, head_dim: int, rope: RopeSpec | None) -> None:
        super().check(head_dim, rope)
        if self.rotation == "hadamard" and head_dim & (head_dim - 1):
            raise UnsupportedModelError(
                f"a Hadamard rotation needs a power-of-two head_dim, this model has {head_dim}; use rotation='random'"
            )
        if self.sketch and self.bits < 2:
            raise BadInputError("the residual sketch needs at least 2 bits (bits - 1 for the codes)")

    def _code(self, x: torch.Tensor, bits: int) -> TokenCode:
        if self.grid == "lloyd":
            return TokenCode(quantize_lloyd(x, bits, self.group_size))
        return _per_token(x, bits, self.group_size, self.symmetric)

    def _centre(self, x: torch.Tensor, positions: torch.Tensor, rope: RopeSpec | None) -> tuple:
        """``(residual, extra)``: ``x`` minus its (scaled) mean, and the RotatedCode fields that restore it."""
        if self.center == "none" or x.shape[-2] < self.min_center:
            return x, {}
        pos = positions.to(x.device)
        pre = remove_rope(x, pos, rope, compute_dtype=torch.float32) if rope is not None else x
        mean = pre.mean(dim=2, keepdim=True).to(torch.float16)
        m = _rotated_mean(mean, positions, rope, x.shape)
        extra = {"mean": mean, "positions": positions, "rope": rope}
        if self.center == "mean":
            return x - m, extra
        coef = ((x * m).sum(-1) / (m * m).sum(-1).clamp_min(1e-30)).to(torch.float16)
        return x - coef.float()[..., None] * m, {**extra, "coef": coef}

    def encode(self, keys, values, positions, rope) -> Segment:
        h, d = keys.shape[1], keys.shape[-1]
        rot = rotation_matrix(d, self.rotation, self.seed, h, keys.device)
        k, kextra = self._centre(keys.float(), positions, rope)
        v, vextra = values.float(), {}
        if self.center_values and self.center == "proj":
            v, vextra = self._centre(v, positions, None)
        rk, rv = rotate_heads(k, rot), rotate_heads(v, rot)
        if not self.sketch:
            kcode = RotatedCode(self._code(rk, self.bits), rot, **kextra)
        else:
            inner = self._code(rk, self.bits - 1)
            resid = rk - inner.decode().float()
            proj = sketch_matrix(d, d, device=rk.device)
            signs = (resid @ proj.T) >= 0
            kcode = RotatedCode(
                inner,
                rot,
                pack_bits(signs.to(torch.uint8), 1),
                resid.norm(dim=-1).to(torch.float16),
                d,
                **kextra,
            )
        vcode = RotatedCode(self._code(rv.to(values.dtype), self.bits), rot, **vextra)
        return Segment(kcode, vcode, keys.shape[-2])


def split_plan(length: int, sinks: int, window: int, multiple: int) -> tuple[int, int]:
    """``(start, stop)`` of the quantized slots of a ``length``-slot layer.

    Slots ``[0, start)`` are full-precision sinks, ``[stop, length)`` the full-precision recent window
    (plus up to ``multiple - 1`` slots that do not fill a token group): the layout of
    :class:`~kvlab.policy.SinksWindow`, with the quantized middle cut to whole token groups.
    """
    start, window_start = SinksWindow(sinks, window).bounds(length)
    return start, start + ((window_start - start) // multiple) * multiple


def quantizer_names() -> list[str]:
    """Every name :func:`make_quantizer` takes: the registered kinds and ``rotation+qjl``."""
    import kvlab.policy.quant.codecs  # noqa: F401  (registers the codecs in codecs/)

    return [*QUANTIZERS, "rotation+qjl"]


def make_quantizer(method: str, bits: int | None = None, **options) -> Quantizer:
    """``make_quantizer("rotation", 4, sinks=4)``; methods: :func:`quantizer_names` (pertoken, kivi,
    prerope, rotation, rotation+qjl, and each codec in ``codecs/``, e.g. fp8)."""
    names = quantizer_names()
    if method == "rotation+qjl":
        method, options = "rotation", {**options, "sketch": True}
    if method not in QUANTIZERS:
        raise BadInputError(f"unknown quantizer '{method}'; choose one of {', '.join(names)}")
    cls = QUANTIZERS[method]
    if cls.fixed_bits is not None:
        if bits not in (None, cls.fixed_bits):
            raise BadInputError(f"quantizer '{method}' has {cls.fixed_bits} bits, got {bits}")
        bits = cls.fixed_bits
    if bits is None:
        raise BadInputError(f"quantizer '{method}' needs a bit width")
    return cls(bits=bits, **options)
