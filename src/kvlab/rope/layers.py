"""What a model's config says about each layer's attention over positions, read without transformers: the
decoder's own config, and each layer's sliding window (None: the layer attends to every earlier token)."""

from __future__ import annotations

from typing import Any


def text_config(config: Any) -> Any:
    """The decoder's config inside a model's config (a multimodal one nests it; a text one is it)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def sliding_windows(config: Any) -> list[int | None]:
    """Per layer: the sliding-window size of that layer's attention, or None for full attention."""
    text = text_config(config)
    n = int(text.num_hidden_layers)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * n if window is not None else [None] * n
