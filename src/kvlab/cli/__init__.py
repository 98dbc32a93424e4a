"""The ``kvlab`` command line. Commands live in ``kvlab/cli/<name>.py``, each with ``register(app)``.

The CLI only parses arguments and calls library functions. One error path: usage errors (unknown
command or option, bad value, missing argument) and errors kvlab raises on purpose
(:class:`~kvlab.errors.KvlabError`) print one line on stderr and exit with code 2, never a traceback.
Command modules import torch and transformers inside their bodies, so ``--help`` stays fast.
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


def _version(value: bool) -> None:
    if value:
        from kvlab import __version__

        typer.echo(f"kvlab {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print kvlab's version and exit.", callback=_version, is_eager=True
    ),
) -> None:
    """See, measure and exploit what a language model's KV cache holds."""


_register_commands()


def _usage_error_line(exc: Exception) -> str:
    """One line for a typer/click usage error: which command, what was wrong, where help is."""
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None and getattr(ctx, "command_path", None) else "kvlab"
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    message = " ".join(message.split())  # click's messages may span lines
    return f"{where}: error: {message} (see '{where} --help')"


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app, turning kvlab errors into one line on stderr and exit code 2."""
    from kvlab.errors import KvlabError

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        # With standalone_mode=False click returns a command's typer.Exit code instead of exiting.
        code = app(args=argv, prog_name="kvlab", standalone_mode=False)
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
    except typer.TyperException as exc:  # typer's bundled click: usage errors, bad values, missing files
        if type(exc).__name__ == "NoArgsIsHelpError":  # typer has already printed the help
            return 2
        print(_usage_error_line(exc), file=sys.stderr)
        return 2
    return 0


def entry() -> None:
    sys.exit(main())
