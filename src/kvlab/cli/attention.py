"""``kvlab attention`` (attention rows and next-token logits under a roll) and ``kvlab compaction``
(full vs compacted conversations, with lexical controls)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli.common import count_option, experiment_command, json_list_file, text_option


def register(app: typer.Typer) -> None:
    @experiment_command(app, "attention", "attention")
    def attention_cmd(
        roll: Annotated[
            list[int] | None, count_option("--roll", "-r", help="Roll sizes n (repeatable; default 1 5 20).")
        ] = None,
        windows: Annotated[
            int | None,
            count_option(
                "--samples",
                least=2,
                help="Text samples (windows) to average over, >= 2 (default: by profile).",
            ),
        ] = None,
        window_tokens: Annotated[
            int | None, count_option("--context", "-c", least=8, help="Tokens per sample (>= 8).")
        ] = None,
        text: Annotated[Path | None, text_option("A UTF-8 text file instead of the default text.")] = None,
    ) -> dict:
        """Attention rows (sink-aware) and next-token logits, original vs rolled, over many windows."""
        return {"rolls": roll or None, "windows": windows, "window_tokens": window_tokens, "text": text}

    @experiment_command(app, "compaction", "compaction")
    def compaction_cmd(
        conversations: Annotated[
            Path | None,
            typer.Option(
                callback=json_list_file,
                help="JSON list of {full, compacted, summary} conversations (default: the UltraChat set under ../shared when present, else conversations the model makes from Python's documentation).",
            ),
        ] = None,
        limit: Annotated[
            int | None, count_option("--limit", least=3, help="Use only the N shortest conversations (>= 3).")
        ] = None,
    ) -> None:
        """Full vs compacted conversation caches: centroids and the shared tail, with lexical controls."""
