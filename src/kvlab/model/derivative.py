"""A fine-tuned derivative of the bundled model: the second model of a same-geometry transplant.

The thread transplanted caches between a base and an instruct model. kvlab has one bundled model,
so it makes its own relative: a copy fine-tuned for a few hundred steps on a text (Shakespeare
where ``../shared/data`` is present, else the Python documentation or any file given). Same tokenizer, same cache geometry,
different weights: exactly the pair a transplant needs. The result is saved under
``cache_dir()/derivatives/<name>`` (never in the repository) with a ``derivative.json`` that
records the base fingerprint, the text, the steps and the loss curve.

Fine-tuning takes minutes; :func:`quantized_derivative` makes a relative in seconds, in memory: the
base with its decoder weights rounded to 4 bits. Same tokenizer and geometry again, weights that
differ by rounding instead of by training.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvlab.errors import BadInputError, ModelNotFoundError
from kvlab.model.handle import ModelHandle, decoder_layers
from kvlab.model.loading import cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kvlab.data import Text

DEFAULT_NAME = "smollm2-135m-shakespeare"
# 200 AdamW steps on 2 x 48-token windows: ~2 s a step on one CPU thread, ~7 minutes in all (the
# first version used 64-token windows at lr 5e-5 and took ~22 minutes here). The higher learning
# rate makes up for the fewer tokens: the derivative's loss on its text drops by about a nat.
DEFAULT_STEPS = 200
DEFAULT_SEQ_LEN = 48
DEFAULT_BATCH = 2
DEFAULT_LR = 1e-4
# The quantized derivative: symmetric 4-bit codes, one fp16 scale per 32 weights (like GGUF's Q4_0). Not
# asymmetric: the bundled weights are Q4_1 (a scale and a minimum per 32), which that grid reproduces.
QUANT_BITS = 4
QUANT_GROUP = 32


@dataclass(frozen=True)
class DerivativeInfo:
    name: str
    base_spec: str
    base_fingerprint: str
    text_source: str
    steps: int
    seq_len: int
    batch: int
    learning_rate: float
    seed: int
    seconds: float
    loss_first: float
    loss_last: float
    losses: list[float]


def derivative_dir(name: str = DEFAULT_NAME) -> Path:
    """Where the derivative named ``name`` lives (it may not exist yet); always inside the cache dir."""
    from kvlab.paths import contained, safe_name

    root = cache_dir() / "derivatives"
    return contained(root, root / safe_name(name, what="derivative name"))


def derivative_info(name: str = DEFAULT_NAME) -> DerivativeInfo | None:
    """The saved derivative's metadata, or None if it has not been built."""
    meta = derivative_dir(name) / "derivative.json"
    if not meta.is_file() or not (derivative_dir(name) / "config.json").is_file():
        return None
    return DerivativeInfo(**json.loads(meta.read_text()))


def build_command(name: str = DEFAULT_NAME) -> str:
    return "kvlab transfer finetune-derivative" + ("" if name == DEFAULT_NAME else f" --name {name}")


def load_derivative(name: str = DEFAULT_NAME, dtype: str = "float32") -> ModelHandle:
    """The derivative as a :class:`~kvlab.model.ModelHandle`; raises with the build command if absent."""
    from kvlab.model import load_model

    if derivative_info(name) is None:
        raise ModelNotFoundError(
            f"derivative '{name}' is not built yet; build it with: {build_command(name)}"
        )
    return load_model(str(derivative_dir(name)), dtype=dtype)


def default_training_text() -> Text:
    """Shakespeare from ``../shared/data`` when present, else the Python documentation (on every machine)."""
    from kvlab.data import python_docs, shared_book

    return shared_book("shakespeare") or python_docs()


def finetune_derivative(
    base: ModelHandle,
    text: str,
    *,
    text_source: str,
    name: str = DEFAULT_NAME,
    steps: int = DEFAULT_STEPS,
    seq_len: int = DEFAULT_SEQ_LEN,
    batch: int = DEFAULT_BATCH,
    learning_rate: float = DEFAULT_LR,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> DerivativeInfo:
    """Fine-tune a copy of ``base`` (a ModelHandle) on ``text`` and save it as a derivative.

    Trains every weight except the (tied) embeddings with AdamW on random ``seq_len``-token windows;
    ``base`` itself is never modified. Writes atomically: a temp folder renamed into place.
    """
    import copy
    import shutil

    if steps < 1 or seq_len < 8 or batch < 1:
        raise BadInputError(f"need steps >= 1, seq_len >= 8, batch >= 1 (got {steps}, {seq_len}, {batch})")
    derivative_dir(name)  # refuse a name that would leave the cache dir before any work or deletion
    if base.tokenizer is None:
        raise BadInputError("fine-tuning a derivative needs a model with a tokenizer")
    ids = torch.tensor(
        base.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long, device=base.device
    )
    if ids.numel() < seq_len * 4:
        raise BadInputError(f"the training text has {ids.numel()} tokens; give at least {seq_len * 4}")
    model = copy.deepcopy(base.model).float().train()
    started = time.perf_counter()
    losses = _train(model, ids, steps, seq_len, batch, learning_rate, seed, progress)
    model.eval()
    target = derivative_dir(name)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    base.tokenizer.save_pretrained(tmp)
    head = max(1, min(10, steps // 5))
    info = DerivativeInfo(
        name=name,
        base_spec=base.name,
        base_fingerprint=base.fingerprint,
        text_source=text_source,
        steps=steps,
        seq_len=seq_len,
        batch=batch,
        learning_rate=learning_rate,
        seed=seed,
        seconds=time.perf_counter() - started,
        loss_first=sum(losses[:head]) / head,
        loss_last=sum(losses[-head:]) / head,
        losses=losses,
    )
    (tmp / "derivative.json").write_text(json.dumps(asdict(info), indent=1))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return info


def _train(
    model: PreTrainedModel,
    ids: torch.Tensor,
    steps: int,
    seq_len: int,
    batch: int,
    learning_rate: float,
    seed: int,
    progress: Callable[[int, float], None] | None,
) -> list[float]:
    """AdamW on seeded random ``seq_len``-token windows of ``ids`` (warm-up then cosine learning rate, the
    embeddings frozen); the loss of every step."""
    gen = torch.Generator().manual_seed(seed)
    model.get_input_embeddings().weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    losses: list[float] = []
    for step in range(steps):
        starts = torch.randint(
            0, ids.numel() - seq_len, (batch,), generator=gen, device="cpu"
        )  # seeded host draw
        x = torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
        lr = learning_rate * min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step + 1, losses[-1])
    return losses


def quantized_derivative(base: ModelHandle) -> ModelHandle:
    """A copy of ``base`` whose decoder layers' linear weights are rounded to :data:`QUANT_BITS`-bit symmetric
    codes in groups of :data:`QUANT_GROUP` along each row (:func:`kvlab.policy.quant.scalar.quantize`, round to
    nearest, one fp16 scale per group), then de-quantized back to ``base``'s dtype.

    Deterministic and quick (no training, nothing saved); embeddings, norms and the tied output head
    keep the base's weights. ``base`` is never modified.
    """
    import copy

    from kvlab.policy.quant.scalar import quantize

    model = copy.deepcopy(base.model)
    with torch.no_grad():
        for layer in decoder_layers(model):
            for sub in layer.modules():
                if isinstance(sub, torch.nn.Linear):
                    q = quantize(sub.weight, QUANT_BITS, QUANT_GROUP, symmetric=True)
                    sub.weight.copy_(q.dequantize())
    return ModelHandle(model, base.tokenizer, name=f"{base.name} ({QUANT_BITS}-bit weights)")
