"""Loading models offline and running them on kvlab snapshots.

:class:`ModelHandle` and friends are imported on first use (PEP 562), so ``kvlab.model.loading`` and
``kvlab.model.facts`` (device and dtype names, config files) are read without importing torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlab._lazy import lazy_exports
from kvlab.errors import KvlabError, ModelNotFoundError
from kvlab.model.loading import (
    BUNDLED_NAME,
    cache_dir,
    check_4bit,
    describe_device,
    parse_dtype,
    quantization_config_4bit,
    resolve_device,
    resolve_model_dir,
)

if TYPE_CHECKING:
    import torch

    from kvlab.model.facts import ModelFacts, facts_from_config, load_config_file
    from kvlab.model.handle import Forward, Generation, LiveRows, ModelHandle, as_handle

_LAZY = {
    "ModelFacts": "kvlab.model.facts",
    "facts_from_config": "kvlab.model.facts",
    "load_config_file": "kvlab.model.facts",
    "Forward": "kvlab.model.handle",
    "Generation": "kvlab.model.handle",
    "LiveRows": "kvlab.model.handle",
    "ModelHandle": "kvlab.model.handle",
    "as_handle": "kvlab.model.handle",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


_HANDLES: dict[tuple, ModelHandle] = {}


def load_model(
    spec: str = BUNDLED_NAME,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    load_in_4bit: bool = False,
    progress: Any = None,
    reuse: bool = True,
) -> ModelHandle:
    """Load a causal LM offline and wrap it in a :class:`ModelHandle`.

    ``spec`` is ``smollm2-135m`` (the bundled model, the default), a local folder with a
    ``config.json``, or a Hugging Face id already in the local cache. Nothing is ever downloaded:
    an unknown spec raises :class:`~kvlab.errors.ModelNotFoundError` saying what to install or copy.
    ``device`` is ``cpu`` (the default), ``cuda``, ``cuda:N`` or ``auto`` (CUDA when torch has it), resolved
    and checked by :func:`~kvlab.model.loading.resolve_device` (a device this machine lacks is a
    :class:`~kvlab.errors.BadInputError`, before anything loads).
    ``load_in_4bit`` reproduces the Phase 1 log's NF4 set-up and needs CUDA + bitsandbytes.
    With ``reuse`` (default), loading the same spec twice in one process returns the same handle.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from kvlab.model.handle import ModelHandle

    hf_logging.disable_progress_bar()
    torch_dtype = parse_dtype(dtype)
    device = check_4bit(device) if load_in_4bit else resolve_device(device)
    key = (spec, torch_dtype, device, attn_implementation, load_in_4bit)
    if reuse and key in _HANDLES:
        return _HANDLES[key]
    path, name = resolve_model_dir(spec, progress)
    kwargs: dict[str, Any] = {
        "dtype": torch_dtype,
        "attn_implementation": attn_implementation,
        "local_files_only": True,
    }
    if load_in_4bit:
        kwargs["quantization_config"] = quantization_config_4bit()
        kwargs["device_map"] = device
    if (path / "config.json").is_file():
        from kvlab.model.facts import load_config_file

        load_config_file(path / "config.json")  # a clear error for a config kvlab cannot use
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as exc:
        raise ModelNotFoundError(f"could not load model weights from {path}: {exc}") from None
    except Exception as exc:  # broken weights: safetensors, torch and transformers each raise their own
        if isinstance(exc, KvlabError):
            raise
        reason = " ".join(str(exc).split())[:300]
        raise ModelNotFoundError(
            f"the weights in {path} cannot be loaded ({type(exc).__name__}: {reason}); re-copy the model folder"
        ) from None
    if not load_in_4bit:
        # PreTrainedModel.to is decorated with functools.wraps, whose typeshed type is not a descriptor:
        # mypy sees an unbound function and wants the model as the first argument.
        model = model.to(device)  # type: ignore[arg-type]  # typeshed's wraps() on a method, see above
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None
    digest = _remembered_weights_digest(path, torch_dtype)
    handle = ModelHandle(model, tokenizer, name=name, weights_digest=digest)
    if digest is None:
        _remember_weights_digest(path, torch_dtype, handle.weights_digest())
    if reuse:
        _HANDLES[key] = handle
    return handle


def _digest_key(path: Path, dtype: torch.dtype) -> str:
    from kvlab.model.memo import files_identity

    files = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt")]
    return f"{path.resolve()}|{dtype}|{files_identity(files)}"


def _remembered_weights_digest(path: Path, dtype: torch.dtype) -> str | None:
    from kvlab.model.memo import memo_get

    return memo_get(cache_dir() / "weights-digests.json", _digest_key(path, dtype))


def _remember_weights_digest(path: Path, dtype: torch.dtype, digest: str) -> None:
    from kvlab.model.memo import memo_put

    memo_put(cache_dir() / "weights-digests.json", _digest_key(path, dtype), digest)


__all__ = [
    "BUNDLED_NAME",
    "Forward",
    "Generation",
    "LiveRows",
    "ModelFacts",
    "ModelHandle",
    "as_handle",
    "describe_device",
    "facts_from_config",
    "load_config_file",
    "load_model",
    "resolve_device",
]
