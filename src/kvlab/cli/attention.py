"""``kvlab attention`` (R7: attention rows and next-token logits under a roll) and ``kvlab compaction`` (R11 + B5)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli.common import (
    FullOpt,
    JsonOpt,
    ModelOpt,
    OutOpt,
    QuickOpt,
    SeedOpt,
    profile_from,
    run_and_report,
)


def register(app: typer.Typer) -> None:
    @app.command("attention")
    def attention_cmd(
        roll: Annotated[
            list[int] | None, typer.Option("--roll", "-n", help="Roll sizes n (repeatable; default 1 5 20).")
        ] = None,
        windows: Annotated[
            int | None, typer.Option("--windows", help="Number of windows (default by profile).")
        ] = None,
        window_tokens: Annotated[
            int | None, typer.Option("--window-tokens", help="Tokens per window.")
        ] = None,
        text: Annotated[
            Path | None, typer.Option("--text", help="A UTF-8 text file instead of the default text.")
        ] = None,
        model: ModelOpt = "smollm2-135m",
        out: OutOpt = Path("runs"),
        json_out: JsonOpt = False,
        quick: QuickOpt = False,
        full: FullOpt = False,
        seed: SeedOpt = 0,
    ) -> None:
        """Attention rows (sink-aware) and next-token logits, original vs rolled, over many windows."""
        from kvlab.experiments import get_experiment

        run_and_report(
            get_experiment("attention"),
            out=out,
            json_out=json_out,
            model=model,
            profile=profile_from(quick, full),
            seed=seed,
            rolls=roll or None,
            windows=windows,
            window_tokens=window_tokens,
            text=text,
        )

    @app.command("compaction")
    def compaction_cmd(
        conversations: Annotated[
            Path | None,
            typer.Option(
                "--conversations",
                help="JSON list of {full, compacted, summary} conversations (default: the shared set).",
            ),
        ] = None,
        limit: Annotated[
            int | None, typer.Option("--limit", help="Use only the N shortest conversations (>= 3).")
        ] = None,
        model: ModelOpt = "smollm2-135m",
        out: OutOpt = Path("runs"),
        json_out: JsonOpt = False,
        quick: QuickOpt = False,
        full: FullOpt = False,
        seed: SeedOpt = 0,
    ) -> None:
        """Full vs compacted conversation caches: centroids and the shared tail, with lexical controls."""
        from kvlab.experiments import get_experiment

        run_and_report(
            get_experiment("compaction"),
            out=out,
            json_out=json_out,
            model=model,
            profile=profile_from(quick, full),
            seed=seed,
            conversations=conversations,
            limit=limit,
        )
