"""Rolling decode at graph speed: one :class:`StaticRollingCache` step captured once, replayed per token.

A decode step of a large model on a GPU is hundreds of small kernels; run eagerly, launching them
costs more than running them (8B geometry, batch 1: ~60 ms eager against a few ms of memory
traffic). :class:`RollingDecoder` removes that overhead the way transformers' ``StaticCache`` does,
without giving up the roll:

* ``mode="cuda-graph"``: each feed size is captured into a ``torch.cuda.CUDAGraph`` the first time it
  runs (after two eager warm-ups that compute the real result), then replayed;
* ``mode="compile"``: the step is ``torch.compile(fullgraph=True)``-d (``"reduce-overhead"``, i.e.
  inductor plus CUDA graphs, on CUDA; on the CPU inductor with the weights frozen into the graph and
  packed for its C++ GEMM templates, since a CPU decode step is bound by reading the weights, and its
  kernels called from a C++ wrapper rather than a Python one);
* ``mode="eager"``: the same step, uncaptured (the reference the other two are tested against).

The step reads only fixed tensors (the feed's token ids and positions, the cache's buffers, its
``slot_pos`` and write index) and builds the mask on the device; everything that changes shape or
needs Python — evicting a chunk, re-rotating the sinks, a re-base — happens in
:meth:`StaticRollingCache.prepare` between steps. Tokens can stay on the device from one step to the
next (:meth:`RollingDecoder.feed` takes a device tensor), so a decode loop need not synchronise.

Prompts longer than one feed are prefilled through an eager :class:`~kvlab.hf.RollingCache` with the
same rule (one forward per ``headroom`` tokens, any length) and loaded into the static cache.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import types
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from transformers import AttentionInterface

from kvlab.errors import BadInputError
from kvlab.hf.rolling_cache import RollingCache
from kvlab.hf.runner import Runner
from kvlab.hf.static_rolling import StaticRollingCache
from kvlab.hf.step import grouped_sdpa
from kvlab.kernels import gemv, split_attention
from kvlab.policy.quant.codecs.int4rows import decode_rows

if TYPE_CHECKING:
    from torch._dynamo.types import GuardFilterEntry

log = logging.getLogger(__name__)

Mode = Literal["auto", "eager", "compile", "cuda-graph"]
MODES = ("auto", "eager", "compile", "cuda-graph")
GROUPED_ATTENTION = "kvlab_grouped"
SPLIT_ATTENTION = "kvlab_split"
VISIBILITY = "kvlab_visibility"  # the attention kwarg carrying (slot_pos, positions) to the split kernel
FRESH = "kvlab_fresh"  # the attention kwarg carrying a deferring cache's new K/V per layer (RingRows, CPU)


def _grouped_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kw: Any
) -> tuple[torch.Tensor, None]:
    """:func:`~kvlab.hf.step.grouped_sdpa`, reading the int4 rows of a StaticRollingCache packed."""
    kw.pop(VISIBILITY, None)  # the mask says the same
    fresh = kw.pop(FRESH, None)  # the step's own K/V, written after it: attended beside the cache
    if key.dtype == torch.uint8:  # int4 rows of a StaticRollingCache read packed: decode them here
        key, value = (decode_rows(t, query.shape[-1], query.dtype) for t in (key, value))
    own = fresh[module.layer_idx] if fresh is not None else None
    return grouped_sdpa(module, query, key, value, attention_mask, fresh=own, **kw)


def _split_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kw: Any
) -> tuple[torch.Tensor, None]:
    """The grouped layout attended by :mod:`kvlab.kernels.split_attention` (Triton, CUDA): the cache is
    also split across programs, so a decode step streams it at full occupancy; int4 rows are decoded
    inside the kernel (no full-precision copy of the window is ever made). ``kvlab_visibility`` (the
    cache's slot positions and the feed's positions, passed by :class:`RollingDecoder` through the model's
    attention kwargs): the kernel applies the mask's rule instead of reading the mask."""
    b, heads, n, d = query.shape
    q = query.reshape(b, key.shape[1], heads // key.shape[1] * n, d)
    scale = kw.get("scaling") or d**-0.5
    out = split_attention.attend(q, key, value, attention_mask, scale, kw.get(VISIBILITY))
    return out.reshape(b, heads, n, d).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_ATTENTION, _grouped_attention)
AttentionInterface.register(SPLIT_ATTENTION, _split_attention)


@contextlib.contextmanager
def _attention(config: Any, name: str) -> Iterator[None]:
    """The model's attention function set to ``name`` inside (the attribute transformers' attention
    modules read at each call; a cheap setter), restored on the way out."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


# The frozen CPU step's inductor settings besides its options: the weights folded in as constants, and
# the graph's kernels called from C++ rather than from a Python function of ~500 calls a step (0.96x the
# step's time over 5 compiles each, alternated in one process: benchmarks/results/compile_ab.md; it
# compiles ~30 s longer). Read when a graph is compiled.
FROZEN_INDUCTOR: dict[str, object] = {"freezing": True, "cpp_wrapper": True}


class _ModelParts:
    """What a captured or compiled step took of its model as it was made, checked before each step: the
    model (the same object), every module's children, parameters, buffers and forward hooks (the same
    objects), and every parameter's and buffer's version counter (it moves when the tensor is changed in
    place) and data pointer (it moves when ``.data`` is assigned, which leaves the counter). A CPU graph
    holds the weights as constants (frozen), a CUDA graph reads them where they were, and Dynamo runs the
    hooks it traced first (its default): each would go on as if nothing had changed. Not seen: a write through ``.data`` in place (``w.data[0] = 0``),
    which moves no counter; change a weight in place under ``torch.no_grad()`` instead. About 0.3 ms for
    the bundled model (warm; about 1 ms right after a step has streamed the weights)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.modules = list(model.modules())
        self.parts = self._now()
        self.tensors = [t for t in self.parts if isinstance(t, torch.Tensor)]
        self.versions = self._versions()
        self._held = {id(t) for t in self.tensors}

    def _now(self) -> list[object]:
        return [
            x
            for m in self.modules
            for d in (m._modules, m._parameters, m._buffers, m._forward_hooks, m._forward_pre_hooks)
            for x in d.values()
        ]

    def _versions(self) -> list[tuple[int, int]]:
        return [(t._version, t.data_ptr()) for t in self.tensors]

    def same(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` (the step's model now) is the model these parts were taken of, unchanged."""
        now = self._now()
        return (
            model is self.model
            and len(now) == len(self.parts)
            and all(map(operator.is_, now, self.parts))
            and self._versions() == self.versions
        )

    def guards(self, entries: Sequence[GuardFilterEntry]) -> list[bool]:
        """Dynamo's guards a compiled step keeps (its ``guard_filter_fn``): all but those matching one of
        the model's parameters or buffers by identity (frozen, there is one per tensor), which :meth:`same`
        checks before each step, and on a path that reaches it from the model through modules this
        check holds (``self.handle.model``: :meth:`RollingDecoder._step`'s path; any other path keeps
        its guard). Each one reached its tensor through a chain of cold dictionaries: without them the
        bundled model's guard check took about 0.7 ms less, right after a step had streamed the weights
        (issue 46's note of 2026-12-01; the step's share: ``benchmarks/results/gemv_rate.md``)."""
        return [
            not (
                e.guard_type == "ID_MATCH"
                and e.has_value
                and id(e.value) in self._held
                and e.name.startswith("self.handle.model.")
            )
            for e in entries
        ]


class RollingDecoder:
    """Feed tokens through a :class:`StaticRollingCache` with captured steps.

    Args:
        handle: a :class:`~kvlab.model.ModelHandle` on the cache's device.
        cache: an empty or loaded :class:`StaticRollingCache` (:func:`static_rolling_cache_for`).
        mode: ``"cuda-graph"``, ``"compile"``, ``"eager"``, or ``"auto"`` (CUDA graphs on CUDA, eager
            elsewhere).
        compile_mode: ``torch.compile``'s mode for ``mode="compile"`` (default: ``"reduce-overhead"``
            on CUDA; elsewhere ``"frozen"``: inductor with the weights frozen into the graph as constants,
            packed for its C++ GEMM templates and autotuned, its kernels called from a C++ wrapper, which
            holds a second copy of the weights and compiles for a minute or two; ``"default"``: inductor's
            default).

    Each step returns the ``[batch, vocab]`` float32 logits of the feed's last token (a new tensor).
    The decoder owns the cache while it runs: do not feed the cache by other means in between.
    """

    def __init__(
        self,
        handle: Runner,
        cache: StaticRollingCache,
        *,
        mode: Mode = "auto",
        compile_mode: str | None = None,
    ) -> None:
        if mode not in MODES:
            raise BadInputError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not callable(getattr(handle, "run", None)):
            raise BadInputError("RollingDecoder needs a kvlab ModelHandle: kvlab.as_handle(model, tokenizer)")
        self.handle = handle
        if self.handle.device != cache.device:
            raise BadInputError(f"the model is on {self.handle.device}, the cache on {cache.device}")
        cuda = cache.device.type == "cuda"
        if mode == "auto":
            mode = "cuda-graph" if cuda else "eager"
        if mode == "cuda-graph" and not cuda:
            raise BadInputError("mode='cuda-graph' needs the model and cache on a CUDA device")
        self.mode, self.cache = mode, cache
        # split-KV attention (Triton) where it runs, else SDPA over the grouped layout; chosen once,
        # here, so nothing inside a captured or compiled step imports or queries the device
        # (the split kernel reads one slot_pos for every row: rows not in lockstep, RingRows, attend by SDPA)
        split = cache.slot_pos.ndim == 1 and split_attention.prepare(cache.device)
        self.attention = SPLIT_ATTENTION if split else GROUPED_ATTENTION
        self._ids: dict[int, torch.Tensor] = {}
        self._pos: dict[int, torch.Tensor] = {}
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._compiled: Callable[[int], torch.Tensor] | None = None
        self._compiled_sizes: set[tuple[int, int]] = set()  # (feed size, rows computed)
        self._parts: _ModelParts | None = None  # the model as the captured or compiled steps took it
        self._compile_mode = compile_mode or ("reduce-overhead" if cuda else "frozen")
        self.captures = 0  # graphs captured (cuda-graph) or feed sizes compiled

    # -- public ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Feed a prompt of any length (eagerly, through a :class:`RollingCache` with the same rule) into
        the empty cache; returns the last token's ``[batch, vocab]`` logits."""
        c = self.cache
        if c.tokens_seen:
            raise BadInputError("prefill() needs an empty cache; continue with feed()")
        ids = self._as_rows(token_ids)
        r = c.rule
        eager = RollingCache(
            self.handle.config,
            r.rope,
            window=int(r.policy.window or 1),
            sinks=r.policy.sinks,
            evict_chunk=r.evict_chunk,
            max_position=r.max_position or None,
            rebase=r.rebase,
        )
        step = eager.headroom
        logits = torch.empty(0, device=c.device)
        for a in range(0, ids.shape[1], step):
            out = self.handle.run(ids[:, a : a + step], eager, logits_to_keep=1)
            logits = out.logits[:, -1].float()
        c.load(eager)
        return logits

    @torch.no_grad()
    def feed(self, tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Feed ``tokens`` (``[batch, n]``, ``[n]`` for one row, or a ``[batch]`` column of one token per
        row when the cache has several rows; 1 <= n <= evict_chunk) and return the last token's logits."""
        ids = self._as_rows(tokens)
        n = ids.shape[1]
        positions = self.cache.prepare(n)
        if n not in self._ids:
            self._ids[n] = torch.zeros((self.cache.batch, n), dtype=torch.long, device=self.cache.device)
            self._pos[n] = torch.zeros((self.cache.batch, n), dtype=torch.long, device=self.cache.device)
        self._ids[n].copy_(ids)
        self._pos[n].copy_(positions.expand(self.cache.batch, -1))
        logits = self._run(n)
        self.cache.advance()
        return logits

    def decode_feed(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """A ``feed(tokens [batch]) -> logits [batch, vocab]`` for :func:`kvlab.loop.decode_loop`."""
        return lambda tokens: self.feed(tokens.reshape(self.cache.batch, 1))

    # -- the step -------------------------------------------------------------------------------------
    def _step(self, n: int) -> torch.Tensor:
        """What a graph captures: one forward of the feed in ``_ids[n]`` at ``_pos[n]``."""
        w = self.cache.width  # the rows this step computes (the first; all but for RingRows)
        ids, pos = self._ids[n][:w], self._pos[n][:w]
        mask = self.cache.attention_mask(pos, self.handle.dtype)
        # the split kernel applies the mask's rule from the positions rather than reading the mask
        extra: dict[str, object] | None = None
        if self.attention == SPLIT_ATTENTION:
            extra = {VISIBILITY: (self.cache.slot_pos, pos)}
        elif self.cache.defer:  # the new K/V attended from here, written by commit() after the step
            extra = {FRESH: self.cache.fresh}
        out = self.handle.run(
            ids, self.cache, positions=pos, attention_mask=mask, logits_to_keep=1, attention_kwargs=extra
        )
        return out.logits[:, -1].float()

    def _run(self, n: int) -> torch.Tensor:
        logits = self._run_step(n)
        self.cache.commit()  # a deferring cache's new K/V, in place, outside any graph
        return logits

    def _run_step(self, n: int) -> torch.Tensor:
        if self.mode != "eager":
            if self._parts is None:  # taken before the first step: what it captures or compiles
                self._parts = _ModelParts(self.handle.model)
            elif not self._parts.same(self.handle.model):
                log.warning("the model changed since its %s step was made: making it again", self.mode)
                self._graphs, self._compiled, self._compiled_sizes = {}, None, set()
                self._parts = _ModelParts(self.handle.model)
        if self.mode == "cuda-graph" and (n, self.cache.width) in self._graphs:
            graph, out = self._graphs[n, self.cache.width]
            graph.replay()
            return out.clone()
        # int4 rows encoded by Triton where the attention is Triton's; inductor fuses its own (compile)
        fused = self.attention == SPLIT_ATTENTION and self.mode != "compile"
        with _attention(self.handle.config, self.attention), self.cache.packed_reads(fused):
            if self.mode == "eager":
                return self._step(n)
            if self.mode == "compile":
                return self._run_compiled(n)
            return self._capture(n)

    def _run_compiled(self, n: int) -> torch.Tensor:
        if self._compiled is None:
            # torch.compile takes a mode or options, not both: the modes as options, plus fp16 casts
            # rounded as eagerly (the int4 codec's stored scales must equal what its codes were made from)
            options: dict[str, Any] = {
                "reduce-overhead": {"triton.cudagraphs": True},
                "max-autotune": {"max_autotune": True, "triton.cudagraphs": True},
                "max-autotune-no-cudagraphs": {"max_autotune": True},
                # the CPU's default: the weights frozen into the graph and packed for inductor's C++ GEMM
                # templates (a decode step is bound by reading the weights: ~2x aten's fp32 GEMV, one thread)
                "frozen": {"max_autotune": True},  # and freezing, patched in around each call (below)
            }.get(self._compile_mode or "default", {})
            if self.cache.codec != "none":
                options = {**options, "emulate_precision_casts": True}
            # static shapes, but for a cache that reads a span of its slots (that size alone is dynamic)
            dynamic = None if self.cache.span is not None else False
            if self._parts is not None:  # taken before the first step (_run_step)
                options = {**options, "guard_filter_fn": self._parts.guards}
            self._compiled = torch.compile(self._own_step(), fullgraph=True, dynamic=dynamic, options=options)
        frozen = self._compile_mode == "frozen"
        if (n, self.cache.width) not in self._compiled_sizes:  # a new size: what the step mutates is static
            # (not where the weights are frozen: freezing folds every static tensor in as a constant, the
            # cache's buffers too, which would then never change; a CPU graph needs no fixed addresses)
            for t in [] if frozen else [*self.cache.static_tensors(), self._ids[n], self._pos[n]]:
                torch._dynamo.mark_static_address(t)
            self._compiled_sizes.add((n, self.cache.width))
            self.captures += 1
        # FROZEN_INDUCTOR is read while the graph is compiled (on a call), not from torch.compile's options;
        # with it, the step's one-row linears routed to kvlab::gemv where it builds (kvlab.kernels.gemv)
        with (
            torch._inductor.config.patch({**gemv.settings(), **FROZEN_INDUCTOR})
            if frozen
            else contextlib.nullcontext(),
            torch._dynamo.config.patch(automatic_dynamic_shapes=False),  # what changes is marked so
        ):
            return self._compiled(n).clone()

    def _own_step(self) -> Callable[[int], torch.Tensor]:
        """:meth:`_step` as a function of this decoder's own (a copy of its code object). Dynamo keeps the
        graphs it compiled, and counts recompiles against its limit (8), per code object: decoders sharing
        one added up (a process that made a few failed with "recompile limit exceeded") and kept the graphs
        of decoders long gone."""
        f = RollingDecoder._step
        own = types.FunctionType(
            f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__
        )
        return types.MethodType(own, self)

    def _capture(self, n: int) -> torch.Tensor:
        # Warm up on a side stream (these runs compute this feed for real: the same slots, the same
        # values each time), then capture; nothing runs during capture.
        side = torch.cuda.Stream(self.cache.device)
        side.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                result = self._step(n)
        torch.cuda.current_stream(self.cache.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._step(n)
        self._graphs[n, self.cache.width] = (graph, out)
        self.captures += 1
        return result.clone()

    def _as_rows(self, tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        dev = self.cache.device
        ids = tokens.to(dev) if isinstance(tokens, torch.Tensor) else torch.tensor(list(tokens), device=dev)
        ids = ids.long()
        if ids.ndim == 1:
            ids = ids[:, None] if self.cache.batch > 1 and ids.shape[0] == self.cache.batch else ids[None]
        if ids.ndim != 2 or ids.shape[0] != self.cache.batch or ids.shape[1] < 1:
            raise BadInputError(
                f"expected token ids [batch={self.cache.batch}, n >= 1], got shape {tuple(ids.shape)}"
            )
        return ids
