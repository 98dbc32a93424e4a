"""A loaded model and the few things kvlab does with it: tokenize, prefill, extend a cache, decode.

Every forward pass goes through :meth:`ModelHandle.forward`, which takes an optional
:class:`~kvlab.cache.KVSnapshot` as the past, explicit RoPE positions for the new tokens, and
returns logits plus a new snapshot; the past snapshot is never modified. Queries get the positions
you pass (default: the snapshot's ``next_position`` onward), so a rolled or transplanted cache is
used exactly as its positions say.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import torch

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.cache import (
    cache_argument,
    new_hf_cache,
    sliding_windows,
    snapshot_from_hf,
    to_hf_cache,
)
from kvlab.loop import GREEDY, Sampling, decode_loop
from kvlab.model.facts import ModelFacts, facts_from_config
from kvlab.rope.spec import Rope, rope_spec_from_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kvlab.cache.handle_view import HandleView

TokensLike = str | Sequence[int] | torch.Tensor
#: what every public entry point that runs a model accepts (see :func:`as_handle`)
ModelLike: TypeAlias = "ModelHandle | PreTrainedModel"

_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "transformers_version",
    "_attn_implementation_autoset",
    "dtype",
    "torch_dtype",
    "_commit_hash",
    "quantization_config",
    "use_cache",
    "output_attentions",
}


@dataclass(frozen=True, eq=False)
class Forward:
    """Result of one forward pass.

    Attributes:
        snapshot: the cache after the pass (past slots + the new tokens).
        logits: ``[T_new, vocab]`` float32 logits for the new tokens (batch row 0), or ``[batch, T_new, vocab]``
            when the batch has more than one row.
        attentions: per layer ``[batch, heads, T_new, S_total]`` attention weights, if requested.
    """

    snapshot: KVSnapshot
    logits: torch.Tensor
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    text: str
    snapshot: KVSnapshot
    step_logits: torch.Tensor | None = None  # [steps, vocab] when kept


class ModelHandle:
    """A model, its tokenizer (if any) and kvlab's view of it (facts, RoPE spec, fingerprint)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any = None,
        *,
        name: str = "",
        weights_digest: str | None = None,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.name = name or getattr(model.config, "_name_or_path", "") or model.config.model_type
        self._weights_digest = weights_digest
        # read once here: run() is traced by torch.compile, which cannot enter a cached_property's lock
        self._cache_kwarg = cache_argument(model)

    # -- facts -------------------------------------------------------------------------------------
    @cached_property
    def facts(self) -> ModelFacts:
        n_params = sum(p.numel() for p in self.model.parameters())
        return facts_from_config(self.config, name=self.name, num_parameters=n_params)

    @cached_property
    def rope(self) -> Rope | None:
        """The model's RoPE: one :class:`RopeSpec`, one per layer for hybrid models (Gemma-3's local
        and global bases, SmolLM3's NoPE layers), None without RoPE, and None (with :attr:`rope_problem`
        saying why) for a RoPE kvlab cannot read, so operations that do not move positions still run
        and those that do refuse."""
        try:
            return rope_spec_from_model(self.model)
        except UnsupportedModelError as exc:
            self.rope_problem = str(exc)
            return None

    rope_problem: str | None = None

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_positions(self) -> int:
        return self.facts.max_positions

    def weights_digest(self) -> str:
        """sha256 over every parameter's name, dtype, shape and bytes (computed once)."""
        if self._weights_digest is None:
            h = hashlib.sha256()
            for name, tensor in sorted(self.model.state_dict().items()):
                t = tensor.detach().to("cpu").contiguous()
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
                if t.numel():
                    h.update(t.reshape(-1).view(torch.uint8).numpy())
            self._weights_digest = h.hexdigest()
        return self._weights_digest

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of architecture + config + weights: two caches are comparable only if these match."""
        cfg = {k: v for k, v in self.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
        payload = json.dumps(
            {"config": cfg, "dtype": str(self.dtype), "weights": self.weights_digest()},
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(payload.encode()).hexdigest()

    # -- tokens ------------------------------------------------------------------------------------
    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        """Token ids of ``text`` (plain, no BOS unless the tokenizer adds one), or of a one-turn chat."""
        if self.tokenizer is None:
            raise BadInputError("this model has no tokenizer; pass token ids instead of text")
        if not isinstance(text, str) or not text.strip():
            raise BadInputError("empty text: give at least one non-blank character")
        if chat:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
            )
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(int(i)) for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _as_ids(self, tokens: TokensLike) -> torch.Tensor:
        """``[batch, n]`` token ids on the host (checked there; a snapshot keeps them there)."""
        if isinstance(tokens, str):
            ids = torch.tensor([self.encode(tokens)], dtype=torch.long, device="cpu")
        else:
            ids = torch.as_tensor(tokens, dtype=torch.long, device="cpu")
            if ids.ndim == 1:
                ids = ids[None]
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise BadInputError("no tokens to process: give non-empty text or a non-empty list of token ids")
        vocab = int(self.config.vocab_size)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise BadInputError(f"token ids must lie in [0, {vocab}), got {int(ids.min())}..{int(ids.max())}")
        return ids

    # -- forward passes ----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        tokens: TokensLike,
        past: KVSnapshot | None = None,
        *,
        positions: Sequence[int] | torch.Tensor | None = None,
        output_attentions: bool = False,
        all_logits: bool = True,
    ) -> Forward:
        """Run ``tokens`` on top of ``past`` (or from scratch) and return logits and the new snapshot.

        ``positions`` are the RoPE positions of the new tokens (default: contiguous from
        ``past.next_position``, or 0). The attention mask is causal over cache slots, so every new
        token sees every past slot, whatever its position.
        """
        ids = self._as_ids(tokens).to(self.device)
        n_new = ids.shape[1]
        start = past.next_position if past is not None else 0
        pos = (  # positions are snapshot metadata: on the host (run moves them to the model)
            torch.arange(start, start + n_new, device="cpu")
            if positions is None
            else torch.as_tensor(positions, dtype=torch.long, device="cpu")
        )
        if tuple(pos.shape) != (n_new,):
            raise BadInputError(f"got {tuple(pos.shape)} positions for {n_new} new tokens")
        if self.max_positions and int(pos.max()) >= self.max_positions:
            raise BadInputError(
                f"positions up to {int(pos.max())} exceed the model's maximum of {self.max_positions} "
                f"({n_new} new tokens starting at position {int(pos[0])})"
            )
        if past is not None:
            self._check_own(past)
            if past.batch_size != ids.shape[0]:
                raise BadInputError(f"the cache has batch {past.batch_size}, the tokens batch {ids.shape[0]}")
        total = n_new + (past.seq_len if past is not None else 0)
        windows = self._windows()
        config = None if windows else self.config  # sliding layers: every slot kept, the window masked
        cache = (
            to_hf_cache(past, config, copy=False, masked=True) if past is not None else new_hf_cache(config)
        )
        with self._hiding(past, pos, windows, output_attentions):
            out = self.run(
                ids,
                cache,
                positions=pos,
                output_attentions=output_attentions,
                logits_to_keep=0 if all_logits else 1,
            )
        token_ids = ids.cpu() if past is None else torch.cat((past.token_ids, ids.cpu()), dim=1)
        positions_all = pos if past is None else torch.cat((past.positions.cpu(), pos))
        # A prefill only when every slot is this model's own computation at positions 0..T-1.
        exact = (past is None or past.is_prefill) and torch.equal(
            positions_all, torch.arange(total, device="cpu")
        )
        snapshot = snapshot_from_hf(
            cache,  # the cache this pass extended (transformers 5.24 renamed the output's field)
            token_ids=token_ids,
            positions=positions_all,
            rope=self.rope,
            fingerprint=self.fingerprint,
            model_name=self.name,
            provenance="prefill" if exact else "computed",
            valid=None if past is None else _held_after(past, n_new),
        )
        logits = out.logits.float()
        logits = logits[0] if logits.shape[0] == 1 else logits
        attentions = tuple(a.detach() for a in out.attentions) if output_attentions else None
        return Forward(snapshot=snapshot, logits=logits, attentions=attentions)

    def _check_own(self, past: KVSnapshot) -> None:
        """Refuse a past snapshot made by another model (its fingerprint differs)."""
        if past.fingerprint != self.fingerprint:
            from kvlab.errors import IncompatibleCacheError

            raise IncompatibleCacheError(
                f"the cache was made by another model ({past.model_name or past.fingerprint[:12]}), not {self.name}"
            )

    def _windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention); empty for a model without sliding layers."""
        windows = tuple(sliding_windows(self.config))
        return windows if any(w is not None for w in windows) else ()

    def _hiding(
        self,
        past: KVSnapshot | None,
        fed: torch.Tensor,
        windows: tuple[int | None, ...],
        output_attentions: bool,
    ) -> Any:
        """For one forward: a masked past's hidden slots hidden and each sliding layer's window applied on the
        slots' positions (:mod:`kvlab.hf.slot_mask`); nothing for a model without sliding layers over an
        unmasked past."""
        valid = None if past is None else past.valid
        if valid is None and not windows:
            return contextlib.nullcontext()
        context = past.positions if past is not None else torch.zeros(0, dtype=torch.long, device="cpu")
        if output_attentions:
            if valid is not None:
                raise BadInputError(
                    "attention weights over a masked (evicted) cache are not available; unmask it"
                )
            slots = torch.cat((context.cpu(), fed))
            if not torch.equal(slots, torch.arange(slots.numel(), device="cpu")):
                raise BadInputError(
                    "attention weights of a model with sliding-window layers are available over slots at "
                    "positions 0, 1, 2, ... only (transformers' windows count slots)"
                )
            return contextlib.nullcontext()  # every slot kept: transformers' own windows are these
        from kvlab.hf.slot_mask import hidden_slots

        return hidden_slots(self.model, valid, context=context, fed=fed, windows=windows)

    @torch.no_grad()
    def run(
        self,
        input_ids: torch.Tensor,
        cache: Any = None,
        *,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
        logits_to_keep: int = 0,
        output_attentions: bool = False,
        stop_after_layer: int | None = None,
        attention_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """The one call into the model: ``input_ids [batch, n]`` on a live transformers ``cache``.

        Every kvlab module reaches the model through here (snapshots through :meth:`forward`, live
        caches such as :class:`~kvlab.hf.RollingCache` directly), so there is one place that knows how
        transformers wants its arguments. ``positions`` (``[n]`` or ``[batch, n]``): RoPE positions of
        the new tokens; None lets the cache choose them (``cache.get_seq_length()`` onward), which a
        rolling cache relies on. ``attention_mask``: a prepared 4-D float mask, passed through as is
        (or one per layer type, ``{layer type: mask}``, for hybrid models that accept it).
        ``stop_after_layer=k`` stops the pass after decoder layer ``k - 1`` (the cache then holds the
        new tokens' K/V for the first ``k`` layers) and returns None: a probe at ``k / L`` of the cost.
        ``attention_kwargs``: extra keyword arguments transformers hands every layer's attention function
        (for kvlab's own attention functions, :mod:`kvlab.hf.graphs`).
        Writes into ``cache`` (that is what a live cache is for; without one, nothing is cached);
        returns transformers' output.
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device)
        ids = ids[None] if ids.ndim == 1 else ids
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "use_cache": cache is not None,
            "logits_to_keep": logits_to_keep,
        }
        if cache is not None:
            kwargs[self._cache_kwarg] = cache
        if positions is not None:
            pos = torch.as_tensor(positions, dtype=torch.long, device=self.device)
            kwargs["position_ids"] = (pos[None] if pos.ndim == 1 else pos).expand(ids.shape[0], -1)
        if isinstance(attention_mask, dict):  # one prepared mask per layer type (hybrid models)
            kwargs["attention_mask"] = {k: m.to(self.device) for k, m in attention_mask.items()}
        elif attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(self.device)
        if attention_kwargs:  # beside the model's own arguments, never in place of one
            own = {*kwargs, "position_ids", "attention_mask", "output_attentions", "past_key_values"}
            if clash := sorted(set(attention_kwargs) & own):
                raise BadInputError(f"attention_kwargs may not set the model's own arguments {clash}")
            kwargs.update(attention_kwargs)
        # a cache that may re-base (RollingCache) does so only while the model takes positions from it
        choosing = getattr(cache, "choosing_positions", None) if positions is None else None
        with choosing() if choosing is not None else contextlib.nullcontext():
            if output_attentions:
                kwargs["output_attentions"] = True
                with self.eager_attention():
                    return self.model(**kwargs)
            if stop_after_layer is None:
                return self.model(**kwargs)
        layers = decoder_layers(self.model)
        if not 1 <= stop_after_layer <= len(layers):
            raise BadInputError(f"probe layers must lie in [1, {len(layers)}], got {stop_after_layer}")
        hook = layers[stop_after_layer - 1].register_forward_hook(_stop_forward)
        try:
            self.model(**kwargs)
        except _StopForward:
            pass
        finally:
            hook.remove()
        return None

    def prefill(self, tokens: TokensLike, *, start_position: int = 0, **kw) -> Forward:
        """Process ``tokens`` from an empty cache, the first at RoPE position ``start_position``."""
        n = self._as_ids(tokens).shape[1]
        if start_position < 0:
            raise BadInputError(f"start_position must be >= 0, got {start_position}")
        positions = torch.arange(start_position, start_position + n, device="cpu")
        return self.forward(tokens, None, positions=positions, **kw)

    def extend(self, past: KVSnapshot, tokens: TokensLike, **kw) -> Forward:
        """Feed ``tokens`` after the cached ones (the cache of A, then B, equals prefilling A+B)."""
        return self.forward(tokens, past, **kw)

    def decode_step(self, past: KVSnapshot, token_id: int) -> Forward:
        """One new token on top of ``past``; returns its ``[vocab]`` logits as ``logits[-1]``."""
        return self.forward([int(token_id)], past)

    @contextlib.contextmanager
    def live_rows(
        self, pasts: Sequence[KVSnapshot], room: int, *, start: int | None = None
    ) -> Iterator[LiveRows]:
        """Caches of equal length and positions (:func:`~kvlab.cache.snapshot.stack_rows`' rule) as the rows
        of one live batch with ``room`` slots reserved after them: each row is copied once into the
        batch's buffers, feeds write in place, and :meth:`LiveRows.rewind` drops what was fed after a
        point without copying (one question, then greedy answers, then back to teacher-force another
        answer). Masked rows keep their hidden slots hidden throughout; the pasts are not modified. The
        first token fed goes at ``start`` (default: the pasts' ``next_position``)."""
        from kvlab.cache.snapshot import require_stackable

        require_stackable(pasts)
        for p in pasts:
            self._check_own(p)
        live = LiveRows(self, list(pasts), room, start)
        windows = self._windows()
        if live.valid is None and not windows:
            yield live
            return
        from kvlab.hf.slot_mask import hidden_slots

        with hidden_slots(
            self.model, live.valid, context=pasts[0].positions, fed=live.start, windows=windows
        ):
            yield live

    @torch.no_grad()
    def generate(
        self,
        past: KVSnapshot,
        first_logits: torch.Tensor,
        max_new_tokens: int,
        *,
        stop_at_eos: bool = True,
        keep_logits: bool = False,
        sampling: Sampling = GREEDY,
    ) -> Generation:
        """Continue a cache whose last next-token logits are ``first_logits [vocab]`` (greedy by default).

        The returned snapshot holds ``past`` plus every generated token but the last (which was never fed).
        """
        if max_new_tokens < 1:
            raise BadInputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        eos = self.eos_ids() if stop_at_eos else set()
        with self.live_rows([past], max_new_tokens) as live:
            live.check_room(max_new_tokens)
            steps = list(
                decode_loop(
                    live.step,
                    first_logits,
                    max_new_tokens,
                    sampling=sampling,
                    stop_ids=eos,
                    keep_logits=keep_logits,
                )
            )
            snapshot = live.snapshot()
        out = [s.token(0) for s in steps]
        return Generation(
            token_ids=out,
            text=self.decode([t for t in out if t not in eos]),
            snapshot=snapshot,
            step_logits=torch.cat([s.logits for s in steps if s.logits is not None]) if keep_logits else None,
        )

    @torch.no_grad()
    def generate_rows(
        self,
        past: KVSnapshot,
        first_logits: torch.Tensor,
        max_new_tokens: int,
        *,
        stop_ids: set[int] | frozenset[int] = frozenset(),
    ) -> list[list[int]]:
        """Greedy continuations of every row of a batched cache at once.

        ``first_logits`` is ``[batch, vocab]``. One forward per step for the whole batch: on a CPU a
        decode step costs about one pass over the weights whatever the batch, so B rows cost about
        what one does. Row b's tokens equal :meth:`generate` on row b alone up to float rounding of
        the batched matmuls. A row ends with the first of ``stop_ids`` it picks (kept); the loop ends
        when every row has (default: no stop, ``max_new_tokens`` each).
        """
        if max_new_tokens < 1:
            raise BadInputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        logits = first_logits if first_logits.ndim == 2 else first_logits[None]
        if logits.shape[0] != past.batch_size:
            raise BadInputError(f"{logits.shape[0]} logit rows for a cache of batch {past.batch_size}")
        with self.live_rows([past], max_new_tokens) as live:
            return live.greedy(logits, max_new_tokens, stop_ids=stop_ids)

    def eos_ids(self) -> set[int]:
        """Token ids that end a reply: the config's ``eos_token_id`` (one or several) and the tokenizer's."""
        eos = getattr(self.config, "eos_token_id", None)
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    @contextlib.contextmanager
    def eager_attention(self) -> Iterator[None]:
        """Temporarily switch to eager attention, the only kind that returns attention weights."""
        before = self.model.config._attn_implementation
        if before == "eager":
            yield
            return
        self.model.set_attn_implementation("eager")
        try:
            yield
        finally:
            self.model.set_attn_implementation(before)

    def __repr__(self) -> str:
        return (
            f"ModelHandle({self.name}, {self.facts.attention_kind}, {str(self.dtype).replace('torch.', '')})"
        )


def _held_after(past: KVSnapshot, n_new: int) -> tuple[torch.Tensor, ...] | None:
    """A masked past's validity extended by ``n_new`` held slots (the tokens just fed); None unmasked."""
    if past.valid is None:
        return None
    return tuple(
        torch.cat((m, torch.ones(*m.shape[:2], n_new, dtype=torch.bool, device=m.device)), dim=2)
        for m in past.valid
    )


class LiveRows:
    """A live batch of cached rows (:meth:`ModelHandle.live_rows`): ``feed`` tokens, ``rewind`` to a point."""

    def __init__(
        self, handle: ModelHandle, pasts: list[KVSnapshot], room: int, start: int | None = None
    ) -> None:
        self.handle, self.pasts, self.room = handle, pasts, max(int(room), 0)
        self.start = pasts[0].next_position if start is None else int(start)
        #: the rows' hidden slots (per layer ``[rows, Hkv, T]``), None when no row hides any
        self.valid = (
            None
            if all(p.valid is None for p in pasts)
            else tuple(
                torch.cat(layer, dim=0) for layer in zip(*(p.valid_layers() for p in pasts), strict=True)
            )
        )
        self.fed = torch.zeros(sum(p.batch_size for p in pasts), 0, dtype=torch.long, device="cpu")
        self.cache = self._build()

    def _build(self) -> Any:
        from kvlab.hf.cache import growing_cache

        return growing_cache(self.pasts, self.handle.config, self.room)

    def feed(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Every row fed ``tokens`` (``[n]`` for all rows alike, or ``[rows, n]``): float32 logits
        ``[rows, n, vocab]``, at the positions after what was fed so far."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device="cpu")
        ids = ids[None].expand(self.fed.shape[0], -1) if ids.ndim == 1 else ids
        if ids.shape[0] != self.fed.shape[0] or ids.shape[1] == 0:
            raise BadInputError(
                f"feed {tuple(ids.shape)} tokens to {self.fed.shape[0]} rows (at least one each)"
            )
        at = self.start + self.fed.shape[1]
        last = at + ids.shape[1] - 1
        if self.handle.max_positions and last >= self.handle.max_positions:
            raise BadInputError(
                f"positions up to {last} exceed the model's maximum of {self.handle.max_positions}"
            )
        pos = torch.arange(at, last + 1, device="cpu")
        out = self.handle.run(ids, self.cache, positions=pos, logits_to_keep=0)
        self.fed = torch.cat((self.fed, ids), dim=1)
        return out.logits.float()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row (``[rows]``): the logits after it, ``[rows, vocab]`` (a ``decode_loop`` feed)."""
        return self.feed(tokens.detach().to("cpu", torch.long)[:, None])[:, -1]

    def check_room(self, new_tokens: int) -> None:
        """Refuse, before anything runs, ``new_tokens`` more tokens past the model's last position."""
        last = self.start + self.fed.shape[1] + new_tokens - 1
        if self.handle.max_positions and last >= self.handle.max_positions:
            raise BadInputError(
                f"positions up to {last} exceed the model's maximum of {self.handle.max_positions} "
                f"({new_tokens} new tokens starting at position {self.start + self.fed.shape[1]})"
            )

    def snapshot(self) -> KVSnapshot:
        """The rows' cache so far as one snapshot that owns compact copies (the live layers are views of
        larger buffers); masked rows keep their hidden slots, every fed token held."""
        from kvlab.cache.snapshot import stack_rows

        h, n = self.handle, self.fed.shape[1]
        past = self.pasts[0] if len(self.pasts) == 1 else stack_rows(self.pasts)
        return snapshot_from_hf(
            self.cache,
            copy=True,
            token_ids=torch.cat((past.token_ids, self.fed), dim=1),
            positions=torch.cat(
                (past.positions.cpu(), torch.arange(self.start, self.start + n, device="cpu"))
            ),
            rope=h.rope,
            fingerprint=h.fingerprint,
            model_name=h.name,
            provenance="computed" if n or past.provenance != "prefill" else "prefill",
            valid=_held_after(past, n),
        )

    def greedy(
        self,
        first_logits: torch.Tensor,
        max_new_tokens: int,
        *,
        stop_ids: set[int] | frozenset[int] = frozenset(),
    ) -> list[list[int]]:
        """Greedy continuations of every row from ``first_logits [rows, vocab]``, one batched forward per
        step; a row ends with the first of ``stop_ids`` it picks (kept), the loop when every row has."""
        self.check_room(max_new_tokens)
        out: list[list[int]] = [[] for _ in range(first_logits.shape[0])]
        for step in decode_loop(self.step, first_logits, max_new_tokens, stop_ids=stop_ids):
            for r, row in enumerate(out):
                if step.tokens[r] is not None:
                    row.append(step.token(r))
        return out

    def rewind(self, n: int) -> None:
        """Forget all but the first ``n`` tokens fed: the next feed goes at their positions again."""
        from kvlab.hf.cache import GrowingLayer

        if not 0 <= n <= self.fed.shape[1]:
            raise BadInputError(f"cannot rewind {self.fed.shape[1]} fed tokens to {n}")
        for layer in self.cache.layers:
            cast(GrowingLayer, layer).rewind(self.pasts[0].seq_len + n)
        self.fed = self.fed[:, :n]


class _StopForward(Exception):
    """Raised by a forward hook to end a pass early (see ``ModelHandle.run(stop_after_layer=...)``)."""


def _stop_forward(*_: Any) -> None:
    raise _StopForward


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM (``model.model.layers``), for hooks."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise UnsupportedModelError("this model does not keep its decoder layers in model.model.layers")
    return layers


_WRAPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def as_handle(model: ModelLike, tokenizer: Any = None) -> ModelHandle:
    """``model`` as a :class:`ModelHandle`: a handle is returned as is; a plain Hugging Face causal LM
    (``PreTrainedModel``) is wrapped once per model object (its fingerprint, which hashes the weights,
    is then computed once), with ``tokenizer`` where text must be encoded. Every public kvlab entry
    point that runs a model accepts either."""
    if isinstance(model, ModelHandle):
        return model
    if not (hasattr(model, "config") and callable(getattr(model, "forward", None))):
        raise BadInputError(
            f"expected a kvlab ModelHandle or a Hugging Face causal LM, got {type(model).__name__}"
        )
    handle = _WRAPPED.get(model)
    if handle is None or (tokenizer is not None and handle.tokenizer is not tokenizer):
        handle = ModelHandle(model, tokenizer)
        _WRAPPED[model] = handle
    return handle


if TYPE_CHECKING:

    def _a_handle_is_a_view(handle: ModelHandle) -> HandleView:
        return handle  # mypy checks that ModelHandle satisfies what the layers below it read
