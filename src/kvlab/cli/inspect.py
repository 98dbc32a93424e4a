"""``kvlab inspect``: Phase 1's cache report for a model, or for a config file alone."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli.common import (
    DeviceOpt,
    FourBitOpt,
    JsonOpt,
    ModelOpt,
    OutOpt,
    QuickOpt,
    checked,
    dtype_value,
    nonempty_texts,
    run_and_report,
)
from kvlab.errors import BadInputError

CACHE_ONLY_DTYPES = ("int8", "float8")  # sizes a cache can be projected in, not dtypes a model loads in


def _dtype(value: str | None) -> str | None:
    """``--dtype``: a model dtype, or (for ``--config`` projections) a cache-only dtype like int8; an
    empty one is refused (leaving the option out is how to take the default)."""
    if value is None:
        return None
    if not value.strip():
        raise typer.BadParameter("an empty dtype; choose float32, bfloat16 or float16 (or leave --dtype out)")
    return value if value in CACHE_ONLY_DTYPES else str(dtype_value(value))


def register(app: typer.Typer) -> None:
    @app.command("inspect")
    def inspect_cmd(
        config: Annotated[
            Path | None,
            typer.Option(
                callback=checked("kvlab.model.facts", "load_config_file"),
                help="A config.json: project without weights.",
            ),
        ] = None,
        prompt: Annotated[
            list[str] | None,
            typer.Option("--prompt", "-p", callback=nonempty_texts, help="Prompt(s) to cache (repeatable)."),
        ] = None,
        dtype: Annotated[
            str | None,
            typer.Option(
                callback=_dtype,
                help="Model dtype, and the cache dtype for bytes/token: float32 (default), bfloat16, "
                "float16; with --config also int8 or float8 (default there: the config's).",
            ),
        ] = None,
        model: ModelOpt = "smollm2-135m",
        device: DeviceOpt = "auto",
        load_in_4bit: FourBitOpt = False,
        out: OutOpt = Path("runs"),
        json_out: JsonOpt = False,
        quick: QuickOpt = False,
    ) -> None:
        """Structure, bytes per token, growth projections and attention sinks of a model's KV cache."""
        from kvlab.study.experiments import get_experiment

        if config is None and dtype in CACHE_ONLY_DTYPES:
            raise BadInputError(
                f"--dtype {dtype} sizes a cache from --config only; a model loads in float32, bfloat16 or float16"
            )
        run_and_report(
            get_experiment("inspect"),
            out=out,
            json_out=json_out,
            model=model,
            profile="quick" if quick else "default",
            dtype=dtype or "float32",
            device=device,
            load_in_4bit=load_in_4bit,
            config=config,
            prompts=prompt or None,
            cache_dtype=dtype or None,
        )
