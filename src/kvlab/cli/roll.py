"""``kvlab roll ...``: the rolling-window study, one experiment per subcommand.

``kvlab roll sweep`` (R1/R2/B2), ``kvlab roll long`` (R3/R4/R6), ``kvlab roll derotation`` (R5/B3),
``kvlab roll findings`` (the claims table; runs the others first when their results are absent).
"""

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

TextOpt = Annotated[
    Path | None,
    typer.Option(
        "--text",
        help="A UTF-8 text file to study (default: Frankenstein "
        "when ../shared/data exists, else Python's docs).",
    ),
]
ContextOpt = Annotated[
    int | None, typer.Option("--context", help="Window length in tokens (default: by profile).")
]

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
    @roll_app.command(sub, help=help_text)
    def command(
        model: ModelOpt = "smollm2-135m",
        out: OutOpt = Path("runs"),
        json_out: JsonOpt = False,
        quick: QuickOpt = False,
        full: FullOpt = False,
        seed: SeedOpt = 0,
        text: TextOpt = None,
        context: ContextOpt = None,
    ) -> None:
        from kvlab.experiments import get_experiment

        options = {"text": str(text) if text else None}
        if experiment != "findings":
            options["context"] = context
        run_and_report(
            get_experiment(experiment),
            out=out,
            json_out=json_out,
            model=model,
            profile=profile_from(quick, full),
            seed=seed,
            **options,
        )


def register(app: typer.Typer) -> None:
    roll_app = typer.Typer(
        help="The rolling-window study: what rolling a context window does to the KV cache.",
        no_args_is_help=True,
    )
    for sub, (experiment, help_text) in SUBCOMMANDS.items():
        _make(roll_app, sub, experiment, help_text)
    app.add_typer(roll_app, name="roll")
