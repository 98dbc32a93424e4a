"""Tiny random-weight models of real families, for fast exact tests.

``tiny_random_model(config)`` keeps what matters for cache mechanics, the family (code path), RoPE
settings (theta, scaling, partial rotary, pairing), the GQA ratio and biases, and shrinks the rest
(2 layers, hidden 64, small vocabulary) so a forward pass takes milliseconds.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from kvlab.model.facts import load_config_file
from kvlab.model.handle import ModelHandle


def shrink_config(
    config: Any, *, layers: int = 2, head_dim: int = 16, kv_heads: int | None = None, vocab: int = 512
) -> Any:
    """A small copy of ``config`` with the same family, RoPE and GQA ratio."""
    cfg = copy.deepcopy(config)
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    ratio = max(heads // kv, 1)
    new_kv = kv_heads or min(kv, 2)
    new_heads = new_kv * min(ratio, 4)
    cfg.num_hidden_layers = layers
    cfg.num_attention_heads = new_heads
    cfg.num_key_value_heads = new_kv
    cfg.hidden_size = new_heads * head_dim
    if hasattr(cfg, "head_dim"):
        cfg.head_dim = head_dim
    cfg.intermediate_size = 2 * cfg.hidden_size
    cfg.vocab_size = vocab
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        val = getattr(cfg, key, None)
        if isinstance(val, int) and val >= vocab:
            setattr(cfg, key, vocab - 1)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(cfg.layer_types)[:layers]
    if isinstance(getattr(cfg, "no_rope_layers", None), list):  # SmolLM3, Llama-4: which layers rotate
        cfg.no_rope_layers = list(cfg.no_rope_layers)[:layers]
    cfg.dtype = "float32"
    return cfg


def tiny_random_model(
    config: Any,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    **shrink,
) -> ModelHandle:
    """A :class:`ModelHandle` around a freshly initialised small model of ``config``'s family.

    ``config`` may be a transformers config or a path to a ``config.json``.
    """
    from transformers import AutoModelForCausalLM

    if isinstance(config, (str, Path)):
        name = Path(config).stem
        config = load_config_file(config)
    else:
        name = getattr(config, "model_type", "model")
    cfg = shrink_config(config, **shrink)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    # Random init leaves attention nearly uniform; larger weights give distinct, position-sensitive keys.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
    return ModelHandle(model, None, name=f"tiny-random-{name}")
