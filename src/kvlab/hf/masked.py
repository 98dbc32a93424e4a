"""Forward passes that need more control than ``ModelHandle.forward``: a custom attention mask, or
stopping after the first few layers. Used by non-prefix reuse (:mod:`kvlab.store.blend`).

Relies on transformers 5.x passing a 4-D ``attention_mask`` through unchanged (``masking_utils``
returns "an already prepared 4D mask ... as-is"). Both go through :meth:`ModelHandle.run`, the one
call into the model.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.cache import hf_cache_layers, new_hf_cache, to_hf_cache
from kvlab.hf.runner import Runner
from kvlab.rope.layers import sliding_windows

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.no_grad()
def forward_masked(
    handle: Runner, past: KVSnapshot | None, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor]:
    """Run ``ids [n]`` at RoPE ``positions [n]`` on top of ``past`` (None: nothing) with an explicit visibility mask.

    ``visible [n, past_len + n]`` (bool): which past slots and which of the new tokens each new token
    attends to. Returns the new tokens' per-layer keys and values ``[1, kv_heads, n, head_dim]`` and their
    logits ``[n, vocab]``. ``past`` is not modified.

    Sliding-window layers (Mistral, Gemma-3's local layers) keep every slot here, as kvlab's snapshots
    do, and see what ``visible`` allows within their window: a key at position ``p_k`` is visible to a
    query at ``p_q`` only if ``p_q - p_k < window`` (transformers' rule, on the slots' RoPE positions).
    A hybrid model gets one mask per layer type, which its decoder must accept
    (:func:`accepts_mask_per_layer_type`).
    """
    n = int(ids.numel())
    past_len = 0 if past is None else past.seq_len
    if tuple(visible.shape) != (n, past_len + n) or visible.dtype != torch.bool:
        raise BadInputError(f"visible must be a bool [{n}, {past_len + n}] mask, got {tuple(visible.shape)}")
    if past is not None and past.fingerprint != handle.fingerprint:
        raise BadInputError("the past cache comes from another model")
    dtype, device = handle.dtype, handle.device

    def as_float(v: torch.Tensor) -> torch.Tensor:
        hidden = ~v.to(device)
        return torch.zeros(v.shape, dtype=dtype, device=device).masked_fill(hidden, torch.finfo(dtype).min)[
            None, None
        ]

    windows = sliding_windows(handle.config)
    mask: torch.Tensor | dict[str, torch.Tensor]
    if all(w is None for w in windows):
        cache = new_hf_cache(handle.config) if past is None else to_hf_cache(past, handle.config, copy=False)
        mask = as_float(visible)
    else:
        # every layer keeps every slot (a cache without sliding layers); the windows go into the masks
        cache = DynamicCache() if past is None else to_hf_cache(past, None, copy=False)
        pos = positions.reshape(n).cpu()
        key_pos = pos if past is None else torch.cat((past.positions.cpu(), pos))
        distance = pos[:, None] - key_pos[None, :]
        per_window = {w: as_float(visible & (distance < w)) if w else as_float(visible) for w in set(windows)}
        if len(per_window) == 1:
            mask = next(iter(per_window.values()))
        else:
            if not accepts_mask_per_layer_type(handle.model):
                raise UnsupportedModelError(
                    f"{type(handle.model).__name__} mixes sliding and full attention layers but does not take "
                    "one prepared mask per layer type, so a masked forward cannot give each its own window"
                )
            text = handle.config.get_text_config(decoder=True)
            types = list(getattr(text, "layer_types", None) or [])
            if len(types) != len(windows):
                raise UnsupportedModelError("this hybrid model does not name a type for every layer")
            mask = {t: per_window[w] for t, w in zip(types, windows, strict=True)}
    out = handle.run(ids.reshape(1, n), cache, positions=positions.reshape(n), attention_mask=mask)
    layers = hf_cache_layers(cache)  # the cache this pass extended
    keys = tuple(k[:, :, past_len:].clone() for k, _ in layers)
    values = tuple(v[:, :, past_len:].clone() for _, v in layers)
    return keys, values, out.logits[0].float()


def accepts_mask_per_layer_type(model: PreTrainedModel) -> bool:
    """Whether the model's decoder takes ``attention_mask`` as ``{layer type: prepared mask}`` (transformers'
    hybrid decoders, e.g. Gemma-2/3, Qwen2, Cohere-2, GPT-OSS, do; read from the decoder's own code)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    # mypy checks a class object against Hashable with the instance's __hash__ signature; classes hash
    return _forward_takes_mask_dict(type(decoder))  # type: ignore[arg-type]  # see above


@functools.cache
def _forward_takes_mask_dict(cls: type[torch.nn.Module]) -> bool:
    """Read once per decoder class (the source lookup is file I/O)."""
    try:
        return "attention_mask, dict)" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


@torch.no_grad()
def first_layers_kv(
    handle: Runner, past: KVSnapshot | None, ids: torch.Tensor, positions: torch.Tensor, num_layers: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K/V ``[1, kv_heads, n, head_dim]`` of the new tokens in the first ``num_layers`` layers only.

    The pass stops after layer ``num_layers - 1`` (causal over ``past``'s slots), so it costs about
    ``num_layers / L`` of a full forward. kvlab's one first-layers probe (selective recompute of
    rolled caches and of blended store chunks both use it).
    """
    cache = to_hf_cache(past, handle.config, copy=False) if past is not None else new_hf_cache(handle.config)
    past_len = past.seq_len if past is not None else 0
    handle.run(ids.reshape(1, -1), cache, positions=positions.reshape(-1), stop_after_layer=num_layers)
    out = []
    for i, layer in enumerate(cache.layers[:num_layers]):
        # a DummyLayer (KV sharing, no attention) or a linear-attention layer holds no keys
        if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
            raise UnsupportedModelError(f"cache layer {i} holds no keys after the partial forward pass")
        out.append((layer.keys[:, :, past_len:], layer.values[:, :, past_len:]))
    return out
