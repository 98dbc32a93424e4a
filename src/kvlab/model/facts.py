"""Architecture facts of a model, from its config alone (no weights needed).

These feed ``kvlab inspect``'s tables and memory projections; they work for a 70B model's
``config.json`` on a laptop.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlab.errors import BadInputError

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "int8": 1}

#: The largest size each config field may give: well past every published model (Llama-3.1-405B has
#: 126 layers, 16,384 hidden units, 128 heads and a 128k vocabulary; Llama-4 Scout 10M positions), so a
#: value above one is a broken or hostile config, refused naming the field before anything is built
#: from it (a config with 10**12 layers would otherwise exhaust memory listing its layers).
CONFIG_LIMITS = {
    "num_hidden_layers": 4096,
    "hidden_size": 2**18,
    "num_attention_heads": 2**14,
    "num_key_value_heads": 2**14,
    "head_dim": 2**14,
    "intermediate_size": 2**22,
    "vocab_size": 2**24,
    "max_position_embeddings": 2**31,
    "sliding_window": 2**31,
}
#: A config.json larger than this is not a model config (real ones are a few KB).
MAX_CONFIG_BYTES = 16 * 2**20


@dataclass(frozen=True)
class ModelFacts:
    """What decides the size and shape of a model's KV cache."""

    name: str
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    num_parameters: int
    weights_dtype: str
    sliding_window: int | None = None
    num_sliding_layers: int = 0

    @property
    def gqa_ratio(self) -> float:
        return self.num_attention_heads / self.num_kv_heads

    @property
    def attention_kind(self) -> str:
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA (multi-head)"
        if self.num_kv_heads == 1:
            return "MQA (multi-query)"
        return f"GQA ({self.num_attention_heads}:{self.num_kv_heads})"

    def kv_bytes_per_token(self, dtype: str = "float32") -> int:
        """layers x 2 (K and V) x kv_heads x head_dim x bytes per element."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)

    def kv_bytes_formula(self, dtype: str = "float32") -> str:
        text = (
            f"{self.num_layers} layers x 2 (K,V) x {self.num_kv_heads} kv_heads x {self.head_dim} head_dim x "
            f"{dtype_bytes(dtype)} bytes ({dtype}) = {self.kv_bytes_per_token(dtype):,} bytes/token"
        )
        if self.sliding_window:
            text += (
                f" (up to {self.sliding_window - 1} tokens; then only the "
                f"{self.num_layers - self.num_sliding_layers} full-attention layers grow)"
            )
        return text

    def kv_bytes(self, tokens: int, dtype: str = "float32") -> int:
        """Cache bytes of one sequence of ``tokens`` tokens. A sliding-window layer holds at most ``window - 1``
        tokens (transformers' sliding layers keep that many: the next token completes the window)."""
        per_layer = 2 * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)
        held = min(tokens, self.sliding_window - 1) if self.sliding_window else tokens
        full_layers = self.num_layers - self.num_sliding_layers
        return per_layer * (full_layers * tokens + self.num_sliding_layers * held)

    def weights_bytes(self, dtype: str | None = None) -> int:
        return self.num_parameters * dtype_bytes(dtype or self.weights_dtype)

    def crossover_tokens(
        self, cache_dtype: str, weights_dtype: str | None = None, batch: int = 1
    ) -> int | None:
        """Context length at which the KV cache (for ``batch`` sequences) outgrows the weights; None when it
        never does (every layer slides, so the cache stops growing at the window)."""
        weights = self.weights_bytes(weights_dtype)
        per_layer = 2 * self.num_kv_heads * self.head_dim * dtype_bytes(cache_dtype) * batch
        n = -(-weights // (per_layer * self.num_layers))
        if not self.sliding_window or n <= self.sliding_window - 1:
            return n
        full_layers = self.num_layers - self.num_sliding_layers
        if full_layers == 0:
            return None
        rest = weights - per_layer * self.num_sliding_layers * (self.sliding_window - 1)
        return -(-rest // (per_layer * full_layers))

    def to_json(self) -> dict:
        return asdict(self) | {"gqa_ratio": self.gqa_ratio, "attention_kind": self.attention_kind}


def dtype_bytes(dtype: str | torch.dtype) -> int:
    name = str(dtype).replace("torch.", "")
    if name not in DTYPE_BYTES:
        raise BadInputError(f"unknown dtype '{name}'; choose one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def estimate_num_parameters(config: Any) -> int:
    """Parameter count of a decoder-only transformer from its config (exact for Llama-style models).

    Counts embeddings, attention projections (with biases where the config says so), the MLP (gated
    for SiLU-style activations, two matrices for GELU-style), norms and an untied LM head.
    """
    h = int(config.hidden_size)
    n_layers = int(config.num_hidden_layers)
    n_heads = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
    head_dim = int(getattr(config, "head_dim", None) or h // n_heads)
    inter = int(getattr(config, "intermediate_size", None) or 4 * h)
    vocab = int(config.vocab_size)
    model_type = getattr(config, "model_type", "")
    bias_qkv = bool(getattr(config, "attention_bias", False)) or model_type in ("qwen2", "phi")
    bias_o = model_type == "phi"
    attn = h * head_dim * (n_heads + 2 * n_kv) + n_heads * head_dim * h
    attn += (head_dim * (n_heads + 2 * n_kv) if bias_qkv else 0) + (h if bias_o else 0)
    gated = str(getattr(config, "hidden_act", "silu")) in ("silu", "swish")
    mlp = (3 if gated else 2) * h * inter + (0 if gated else inter + h)
    norms = (2 if model_type != "phi" else 2) * h
    embed = vocab * h
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head = 0 if tied else vocab * h + (vocab if model_type == "phi" else 0)
    return embed + n_layers * (attn + mlp + norms) + h + head


def _check_int(text: Any, attr: str, *, minimum: int = 1, optional: bool = False) -> None:
    value = getattr(text, attr, None)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadInputError(f"config: {attr} must be an integer >= {minimum}, got {value!r}")


def _check_limits(fields: dict, where: str = "config", prefix: str = "", depth: int = 0) -> None:
    """Refuse a size beyond :data:`CONFIG_LIMITS`, naming the field (sub-configs such as
    ``text_config`` are checked too, three levels down)."""
    for key, value in fields.items():
        if isinstance(value, dict):
            if depth < 3:
                _check_limits(value, where, f"{prefix}{key}.", depth + 1)
            continue
        limit = CONFIG_LIMITS.get(key)
        if limit is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        minimum = 0 if key in ("max_position_embeddings", "sliding_window") else 1
        if value < minimum:  # a zero head count would divide by zero inside transformers
            raise BadInputError(f"{where}: {prefix}{key} must be an integer >= {minimum}, got {value!r}")
        if value > limit:
            shown = f"{value:,}" if isinstance(value, int) else f"{value:g}"
            raise BadInputError(
                f"{where}: {prefix}{key} is {shown}, more than {limit:,}; no model has that many, "
                "is the config right?"
            )


def check_config(config: Any) -> None:
    """Refuse configs kvlab cannot describe truthfully: models without a decoder KV cache (BERT-style
    encoders, encoder-decoders such as T5) and sizes that are missing, non-integer or out of range."""
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise BadInputError(
            f"{model_type} is an encoder-decoder model; kvlab studies decoder-only (causal LM) KV caches"
        )
    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        )
    except ImportError:  # pragma: no cover - transformers layout changed
        pass
    else:
        text_type = getattr(config.get_text_config(decoder=True), "model_type", model_type)
        encoder = text_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
        if encoder or (
            text_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        ):
            raise BadInputError(
                f"{model_type} is not a decoder-only language model (it keeps no KV cache while generating)"
            )
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for attr in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        _check_int(text, attr)
    _check_int(text, "num_key_value_heads", optional=True)
    _check_int(text, "head_dim", optional=True)
    _check_int(text, "max_position_embeddings", minimum=0, optional=True)
    _check_limits(vars(text) if hasattr(text, "__dict__") else {})
    kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if text.num_attention_heads % kv:
        raise BadInputError(
            f"config: num_attention_heads ({text.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({kv})"
        )
    if getattr(text, "head_dim", None) is None and text.hidden_size % text.num_attention_heads:
        raise BadInputError(
            f"config: hidden_size ({text.hidden_size}) is not a multiple of num_attention_heads "
            f"({text.num_attention_heads}) and no head_dim is given"
        )


def facts_from_config(config: Any, name: str = "", num_parameters: int | None = None) -> ModelFacts:
    check_config(config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n_heads = int(text.num_attention_heads)
    from kvlab.rope.layers import sliding_windows

    windows = sliding_windows(text)
    sliding = [w for w in windows if w is not None]
    dtype = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or "float32"
    return ModelFacts(
        name=name or getattr(text, "_name_or_path", "") or text.model_type,
        architecture=(getattr(config, "architectures", None) or ["?"])[0],
        model_type=text.model_type,
        num_layers=int(text.num_hidden_layers),
        hidden_size=int(text.hidden_size),
        num_attention_heads=n_heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or n_heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // n_heads),
        vocab_size=int(text.vocab_size),
        max_positions=int(getattr(text, "max_position_embeddings", 0) or 0),
        num_parameters=int(num_parameters if num_parameters is not None else estimate_num_parameters(text)),
        weights_dtype=str(dtype).replace("torch.", ""),
        sliding_window=min(sliding) if sliding else None,
        num_sliding_layers=len(sliding),
    )


def load_config_file(path: str | Path) -> Any:
    """A transformers config object from a ``config.json`` file (no weights, no network)."""
    from kvlab.data import read_file_bytes

    path = Path(path)
    if not path.exists():
        raise BadInputError(f"no config file at {path}")
    raw = read_file_bytes(path, limit=MAX_CONFIG_BYTES, what="config file")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadInputError(f"{path} is not a JSON config file (it is not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise BadInputError(f"{path} is not a JSON config file ({exc})") from None
    except RecursionError:
        raise BadInputError(f"{path} is not a config file: its JSON is nested too deeply") from None
    if not isinstance(data, dict):
        raise BadInputError(f"{path} is not a config: its JSON is a {type(data).__name__}, not an object")
    if "model_type" not in data:
        raise BadInputError(f"{path} has no 'model_type'; is it a Hugging Face config.json?")
    _check_limits(data, str(path))  # before transformers builds anything sized by these
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    model_type = data.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError, TypeError, AttributeError, ArithmeticError, StrictDataclassError) as exc:
        reason = " ".join(str(exc).split())  # one line, whatever the library printed
        raise BadInputError(f"{path}: transformers cannot build a {model_type!r} config ({reason})") from None
    check_config(config)
    return config
