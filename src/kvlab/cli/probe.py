"""``kvlab probe URL``: audit an OpenAI-compatible server's caching from outside (``kvlab.probe``).

Exit codes: 0 nothing found, 1 a finding, 2 bad input (one line on stderr, before any request). The
report goes to ``--out`` (``report.json``, ``report.html``); ``--json`` also prints it on stdout. Progress
lines go to stderr. A pure HTTP client: nothing here imports torch or transformers.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli.common import print_json


def _log(line: str) -> None:
    print(f"probe: {line}", file=sys.stderr, flush=True)


def register(app: typer.Typer) -> None:
    @app.command("probe")
    def probe_cmd(
        url: Annotated[str, typer.Argument(help="The server: http(s)://HOST:PORT (or .../v1).")],
        api_key: Annotated[
            list[str] | None, typer.Option(help="Bearer key; give two (two tenants) for the isolation check.")
        ] = None,
        model: Annotated[
            str | None, typer.Option(help="Model id (default: the first /models lists).")
        ] = None,
        api: Annotated[str, typer.Option(help="chat (/chat/completions) or completions.")] = "chat",
        json_out: Annotated[bool, typer.Option("--json", help="Print the report (JSON) on stdout.")] = False,
        out: Annotated[
            Path | None, typer.Option("--out", "-o", help="Report folder (default runs/probe-TIME).")
        ] = None,
        trials: Annotated[int, typer.Option(help="Timed trials per arm (>= 5).")] = 8,
        tolerance: Annotated[float, typer.Option(help="Largest log-probability difference allowed.")] = 2e-3,
        alpha: Annotated[float, typer.Option(help="Significance level of the timing tests.")] = 0.01,
        prefix_words: Annotated[int, typer.Option(help="Words of the long shared prefix.")] = 1024,
        context: Annotated[
            int | None, typer.Option(help="Context limit in tokens (default: /models, else 4096).")
        ] = None,
        max_tokens: Annotated[int, typer.Option(help="Tokens generated per compared answer.")] = 16,
        timeout: Annotated[float, typer.Option(help="Seconds to wait for one reply.")] = 120.0,
    ) -> None:
        """Audit an OpenAI-compatible server's caching: cold vs warm answers, prefix hits, the context limit,
        isolation between tenants and claimed cached tokens vs timing. See docs/serving.md."""
        from kvlab.probe import ProbeConfig, run_probe
        from kvlab.probe.report import write

        cfg = ProbeConfig(
            url,
            tuple(api_key or ()),
            model,
            api,  # type: ignore[arg-type]  # checked by ProbeConfig
            trials,
            tolerance,
            alpha,
            prefix_words,
            context,
            max_tokens,
            timeout,
        )
        folder = out or Path("runs") / time.strftime("probe-%Y%m%d-%H%M%S")
        report = run_probe(cfg, _log)
        js, page = write(report, folder)
        if json_out:
            print_json(report, default=str)
        else:
            for s in report["sections"]:  # type: ignore[attr-defined]
                print(f"{s['verdict']:>8}  {s['title']}: {s['summary']}")
            print(f"{report['verdict']}: report in {page} and {js}")
        _log(f"{report['verdict']}: {page}")
        if report["verdict"] == "finding":
            raise typer.Exit(1)
