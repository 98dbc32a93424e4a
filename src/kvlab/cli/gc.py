"""``kvlab gc PATH``: remove the temp files that interrupted snapshot writes left behind.

``save_snapshot`` writes to ``.<name>.<pid>.<random>.kvlab.tmp`` beside the target and renames it;
a writer killed mid-write (SIGKILL, power loss) leaves that temp file. This command removes kvlab's
own temp files in one folder (never recursing, never touching any other file).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    @app.command("gc")
    def gc_cmd(
        path: Annotated[Path, typer.Argument(help="Folder holding snapshot files (or one snapshot file).")],
        older_than: Annotated[
            float,
            typer.Option(
                help="Only temp files older than this many seconds (default 3600; 0 = all, also live writers').",
            ),
        ] = 3600.0,
        dead_writers: Annotated[
            bool,
            typer.Option(
                "--dead-writers/--no-dead-writers", help="Also remove temps whose writer process is gone."
            ),
        ] = True,
    ) -> None:
        """Remove leftover temp files of interrupted snapshot writes (kvlab's own pattern only)."""
        from kvlab.cache.io import clean_temp_files
        from kvlab.errors import BadInputError

        if not math.isfinite(older_than) or older_than < 0:
            raise BadInputError(f"--older-than must be a finite number of seconds >= 0, got {older_than}")
        name = None
        if path.is_file():
            path, name = path.parent, path.name
        elif not path.is_dir():
            raise BadInputError(f"{path} is not a folder or a file")
        removed = clean_temp_files(path, older_than=older_than, name=name, dead_writers=dead_writers)
        print(f"removed {len(removed)} temp file(s) in {path}")
        for p in removed:
            print(f"  {p.name}")
