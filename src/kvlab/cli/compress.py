"""``kvlab compress`` (quantizers and eviction policies, measured) and ``kvlab train-evictor``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli.common import (
    JsonOpt,
    ModelOptions,
    SeedOpt,
    check_output_file,
    console,
    count_option,
    experiment_command,
    finite,
    group_command,
    print_json,
    refuse_unknown,
    text_option,
)


def _keeps(value: list[float] | None) -> list[float] | None:
    """Typer callback: kept fractions are finite and in (0, 1] (keeping nothing is no policy)."""
    for v in finite(value) or []:
        if not 0.0 < v <= 1.0:
            raise typer.BadParameter(f"{v:g} is not a kept fraction in (0, 1]")
    return value


def _bits(value: list[int] | None) -> list[int] | None:
    """Typer callback: bit widths the quantizers pack (checked before any model loads)."""
    if value:
        from kvlab.policy.catalogue import SUPPORTED_BITS

        for b in value:
            if b not in SUPPORTED_BITS:
                raise typer.BadParameter(
                    f"unsupported bit width {b}; choose one of {', '.join(map(str, SUPPORTED_BITS))}"
                )
    return value


def quant_labels() -> list[str]:
    """The compression experiment's quantizer labels (its ``QUANT_METHODS``; a test checks): every codec
    alone and as ``+sinks``, named by :mod:`kvlab.policy.catalogue` (no torch)."""
    from kvlab.policy.catalogue import CODECS, VARIANTS

    return [label for name in [*CODECS, *VARIANTS] for label in (name, f"{name}+sinks")]


def _methods(value: list[str] | None) -> list[str] | None:
    """Typer callback: quantizer names the compression experiment knows, checked before any model loads."""
    if value:
        refuse_unknown(value, quant_labels(), "quantizer(s)")
    return value


def _policies(value: list[str] | None) -> list[str] | None:
    """Typer callback: eviction policy names the compression experiment knows (its ``POLICY_NAMES``)."""
    if value:
        from kvlab.policy.catalogue import SCORES as POLICY_NAMES

        refuse_unknown(value, POLICY_NAMES, "policy(ies)")
    return value


def compress_cmd(
    text: Annotated[
        Path | None,
        text_option(
            "Text file to measure on (default: Frankenstein if ../shared is present, else the Python docs)."
        ),
    ] = None,
    bits: Annotated[
        list[int] | None,
        typer.Option(min=1, max=16, callback=_bits, help="Bit widths (repeatable): 8, 4, 3, 2."),
    ] = None,
    keep: Annotated[
        list[float] | None,
        typer.Option(
            callback=_keeps,
            help="Kept fractions (repeatable), in (0, 1].",
        ),
    ] = None,
    method: Annotated[
        list[str] | None,
        typer.Option(callback=_methods, help="Quantizers (repeatable), e.g. rotation+sinks."),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(callback=_policies, help="Eviction policies (repeatable), e.g. snapkv."),
    ] = None,
    windows: Annotated[
        int | None, count_option("--samples", help="Text samples (windows) to average over.")
    ] = None,
    context: Annotated[
        int | None, count_option("--context", "-c", least=2, help="Context tokens per sample.")
    ] = None,
) -> dict:
    """Quantize and evict the KV cache, and measure distortion, perplexity, needle retrieval, bytes and time."""
    return {
        "text": text,
        "bits": bits or None,
        "keeps": keep or None,
        "methods": method or None,
        "policies": policy or None,
        "windows": windows,
        "context_tokens": context,
    }


def train_evictor_cmd(
    windows: Annotated[
        int, count_option("--samples", least=4, help="Training samples (the last quarter is held out).")
    ] = 24,
    context: Annotated[
        int, count_option("--context", "-c", least=2, help="Context tokens per sample.")
    ] = 512,
    future: Annotated[
        int, count_option("--future", help="Future queries whose attention is the target.")
    ] = 64,
    steps: Annotated[int, count_option("--steps", help="Optimizer steps.")] = 1500,
    text: Annotated[
        Path | None, text_option("Training text (default: the first 150k characters of the Python docs).")
    ] = None,
    weights: Annotated[
        Path | None,
        typer.Option(help="Where to write the weights (default: the packaged kvlab/policy/weights)."),
    ] = None,
    model: ModelOptions = ModelOptions(),
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
) -> None:
    """Train the learned eviction policy (a tiny MLP) on the model's own attention; a few minutes on CPU."""
    from kvlab.data import python_docs, read_text_file, token_samples
    from kvlab.policy.evict.learned import DEFAULT_WEIGHTS, save_weights, train_evictor
    from kvlab.study.experiments.compression import TRAIN_CHARS

    # the destination is checked before the model loads, not after minutes of training
    check_output_file(weights if weights is not None else DEFAULT_WEIGHTS, "--weights")
    handle = model.load()
    src = read_text_file(text).text if text else python_docs().text[:TRAIN_CHARS]
    ids = handle.encode(src)
    wins = token_samples(ids, context + future, windows, seed=seed)
    trained, report = train_evictor(
        handle,
        wins,
        context=context,
        future=future,
        steps=steps,
        seed=seed,
        progress=None if json_out else lambda i, n: console.print(f"window {i}/{n}"),
    )
    trained.meta["model"] = handle.name
    trained.meta["model_fingerprint"] = handle.fingerprint
    trained.meta["text"] = str(text) if text else f"Python docs, first {TRAIN_CHARS} characters"
    path = save_weights(trained, weights)
    report["weights"] = str(path)
    if json_out:
        print_json(report)
    else:
        for k, v in report.items():
            console.print(f"{k}: {v}")


def register(app: typer.Typer) -> None:
    experiment_command(app, "compress", "compression")(compress_cmd)
    app.command("train-evictor")(group_command(train_evictor_cmd))
