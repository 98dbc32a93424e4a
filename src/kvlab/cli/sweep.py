"""``kvlab sweep GRID.toml``: the study across models, texts and seeds, locally or on a Ray cluster."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli.common import (
    DEVICE_HELP,
    DTYPE_HELP,
    JsonOpt,
    check_output_dir,
    console,
    device_name_value,
    dtype_value,
    print_json,
    workers_option,
)


def _ray_address(value: str | None) -> str | None:
    """Typer callback: ``--ray``'s form (host:port, ray://host:port, auto, local), checked at parse time;
    whether anything answers there is checked, within seconds, before the sweep starts."""
    if value is None:
        return None
    from kvlab.errors import KvlabError
    from kvlab.study.sweep.ray_backend import parse_ray_address

    try:
        parse_ray_address(value)
    except KvlabError as exc:
        raise typer.BadParameter(str(exc).removeprefix(f"--ray {value!r}: ")) from None
    return value


def register(app: typer.Typer) -> None:
    @app.command("sweep")
    def sweep_cmd(
        grid: Annotated[Path, typer.Argument(help="A grid file (TOML): models, texts, experiments, seeds.")],
        out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the sweep.")] = Path("runs/sweep"),
        ray: Annotated[
            str | None,
            typer.Option(
                callback=_ray_address,
                help="Run on a Ray cluster: its address (host:port, ray://host:port), or 'auto'.",
            ),
        ] = None,
        resume: Annotated[
            bool, typer.Option("--resume", help="Finish a sweep: skip cells already done.")
        ] = False,
        workers: Annotated[
            int | None, workers_option("Local worker processes (default: one per core; 1 on CUDA).")
        ] = None,
        device: Annotated[
            str | None,
            typer.Option(
                callback=device_name_value,
                help=f"{DEVICE_HELP} Default: the grid's device, else auto (with --ray: CUDA when the cluster has GPUs).",
            ),
        ] = None,
        dtype: Annotated[
            str | None,
            typer.Option(callback=dtype_value, help=f"{DTYPE_HELP} Default: the grid's dtype, else float32."),
        ] = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Run experiments over a grid of models, texts and seeds; one report with cross-model tables.

        Progress (cells done of all, elapsed, an estimate of the time left) goes to stderr: a bar on a
        terminal, one line per finished cell otherwise, nothing with --json."""
        from kvlab.progress import choose_mode
        from kvlab.study.sweep import run_sweep

        log = (lambda msg: None) if json_out else (lambda msg: print(msg, file=sys.stderr))
        import contextlib

        check_output_dir(out)  # before the grid's models load or any cell runs

        # Ray's driver prints worker deaths and logs to stdout: keep stdout for the --json document
        with contextlib.redirect_stdout(sys.stderr):
            result = run_sweep(
                grid,
                out,
                ray=ray,
                resume=resume,
                workers=workers,
                device=device,
                dtype=dtype,
                log=log,
                progress=choose_mode(json_out),
            )
        if json_out:
            print_json(result, indent=1, default=str)
        else:
            console.print(
                f"{len(result['cells'])} cells: {result['ran']} run, {result['skipped']} resumed, "
                f"{len(result['failed'])} failed\nreport: [bold]{out / 'index.html'}[/bold]"
            )
        if result["failed"]:
            raise typer.Exit(1)
