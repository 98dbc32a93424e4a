"""The ``kvlab`` command line. Commands live in ``kvlab/cli/<name>.py``, each with ``register(app)``.

The CLI only parses arguments and calls library functions. Errors that kvlab raises on purpose
(:class:`~kvlab.errors.KvlabError`) print one line and exit with code 2, without a traceback.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

import typer

app = typer.Typer(
    name="kvlab",
    help="See, measure and exploit what a language model's KV cache holds.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_commands() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.name == "common":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(app)


_register_commands()


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app, turning kvlab errors into one line on stderr and exit code 2."""
    from kvlab.errors import KvlabError

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        # With standalone_mode=False click returns a command's typer.Exit code instead of exiting.
        code = app(args=argv, standalone_mode=False)
        if isinstance(code, int):
            return code
    except KvlabError as exc:
        print(f"kvlab: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        print("kvlab: aborted", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("kvlab: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            return exc.exit_code
        raise
    return 0


def entry() -> None:
    sys.exit(main())
