"""``kvlab inspect``: Phase 1's cache report for a model, or for a config file alone."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli.common import JsonOpt, ModelOpt, OutOpt, QuickOpt, run_and_report


def register(app: typer.Typer) -> None:
    @app.command("inspect")
    def inspect_cmd(
        config: Annotated[
            Path | None, typer.Option("--config", help="A config.json: project without weights.")
        ] = None,
        prompt: Annotated[
            list[str] | None, typer.Option("--prompt", "-p", help="Prompt(s) to cache (repeatable).")
        ] = None,
        dtype: Annotated[
            str, typer.Option("--dtype", help="Cache dtype for bytes/token (default: the model's).")
        ] = "",
        model: ModelOpt = "smollm2-135m",
        out: OutOpt = Path("runs"),
        json_out: JsonOpt = False,
        quick: QuickOpt = False,
    ) -> None:
        """Structure, bytes per token, growth projections and attention sinks of a model's KV cache."""
        from kvlab.study.experiments import get_experiment

        run_and_report(
            get_experiment("inspect"),
            out=out,
            json_out=json_out,
            model=model,
            profile="quick" if quick else "default",
            config=config,
            prompts=prompt or None,
            cache_dtype=dtype or None,
        )
