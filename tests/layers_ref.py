"""A reference for tests: run tokens after per-layer K/V given as plain tensors (no kvlab cache code).

The library runs every cache through :meth:`kvlab.model.ModelHandle.forward` on a snapshot (masked for an
eviction). Tests that compare a live cache's kept K/V, or a compacted eviction, with that path need an
independent computation: a transformers ``DynamicCache`` filled with the tensors, the tokens run at
explicit positions, nothing masked.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache


def cache_of_layers(keys, values, config: Any) -> DynamicCache:
    """A ``DynamicCache`` holding copies of per-layer ``[B, H, n, D]`` K/V."""
    cache = DynamicCache(config=config)
    assert len(cache.layers) == len(keys), (len(cache.layers), len(keys))
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k.clone(), v.clone(), i)
    return cache


@torch.no_grad()
def logits_after_layers(handle: Any, keys, values, tokens: list[int], start: int) -> torch.Tensor:
    """``[n, vocab]`` float32 logits of ``tokens`` at positions ``start..`` after the layers."""
    cache = cache_of_layers(keys, values, handle.config)
    positions = torch.arange(start, start + len(tokens), device=handle.device)
    ids = torch.as_tensor(tokens, device=handle.device)
    return handle.run(ids, cache, positions=positions).logits[0].float()


@torch.no_grad()
def greedy_after_layers(handle: Any, keys, values, prompt: list[int], start: int, n: int) -> list[int]:
    """``n`` greedy tokens after the layers plus ``prompt`` (run at ``start..``), no stop token."""
    cache = cache_of_layers(keys, values, handle.config)
    position = start + len(prompt)
    ids = torch.as_tensor(prompt, device=handle.device)
    pos = torch.arange(start, position, device=handle.device)
    logits = handle.run(ids, cache, positions=pos, logits_to_keep=1).logits[0, -1]
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        if len(out) == n:
            break
        at = torch.tensor([position], device=handle.device)
        logits = handle.run(torch.tensor([[out[-1]]], device=handle.device), cache, positions=at).logits[
            0, -1
        ]
        position += 1
    return out
