"""Helpers shared by benchmark scripts: machine description and writing results."""

from __future__ import annotations

import os
import platform
import sys
from datetime import datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    return (
        f"{os.cpu_count()} cores ({cpu}), torch {torch.__version__} with {torch.get_num_threads()} threads, "
        f"Python {platform.python_version()}"
    )


def write_results(name: str, title: str, body: str) -> Path:
    """Write ``benchmarks/results/<name>.md`` with the command, machine and date, and print it."""
    RESULTS.mkdir(exist_ok=True)
    command = "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    text = (
        f"## {title}\n\nCommand: `{command}` · machine: {machine()} · "
        f"date: {datetime.now().strftime('%Y-%m-%d %H:%M')}\n\n{body.strip()}\n"
    )
    path = RESULTS / f"{name}.md"
    path.write_text(text)
    print(text)
    return path
