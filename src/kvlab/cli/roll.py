"""``kvlab roll ...``: the rolling-window study, one experiment per subcommand.

``kvlab roll sweep`` (roll amounts, controls, positions), ``kvlab roll long`` (roll vs truncate over
long contexts), ``kvlab roll derotation`` (correct vs buggy RoPE de-rotation), ``kvlab roll findings``
(the claims table; runs the others first when their results are absent).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli.common import count_option, experiment_command, text_option

SUBCOMMANDS = {
    "sweep": (
        "roll_sweep",
        "Roll sweep n = 1..20 and fractions, scrambled/unrelated/truncate controls, sink-aware.",
    ),
    "long": (
        "roll_long",
        "Roll vs truncate on a long context, step 1 to n = 64, curve analysis, terminal de-rotation.",
    ),
    "derotation": (
        "rope_derotation",
        "Correct vs the thread's buggy RoPE de-rotation, and the RoPE-only predictor.",
    ),
    "findings": ("findings", "The thread's claims with kvlab's numbers and computed verdicts."),
}


def _make(roll_app: typer.Typer, sub: str, experiment: str, help_text: str) -> None:
    def command(
        text: Annotated[
            Path | None,
            text_option(
                "A UTF-8 text file to study (default: Frankenstein when ../shared/data exists, else Python's docs)."
            ),
        ] = None,
        context: Annotated[
            int | None,
            count_option("--context", "-c", least=2, help="Window length in tokens (default: by profile)."),
        ] = None,
    ) -> dict:
        options: dict[str, object] = {"text": str(text) if text else None}
        if experiment != "findings":
            options["context"] = context
        return options

    command.__doc__ = help_text
    experiment_command(roll_app, sub, experiment, help=help_text)(command)


def register(app: typer.Typer) -> None:
    roll_app = typer.Typer(
        help="The rolling-window study: what rolling a context window does to the KV cache.",
        no_args_is_help=True,
    )
    for sub, (experiment, help_text) in SUBCOMMANDS.items():
        _make(roll_app, sub, experiment, help_text)
    app.add_typer(roll_app, name="roll")
