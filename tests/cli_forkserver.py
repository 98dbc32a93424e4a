"""A fork server for the command-line tables: import kvlab's CLI and its heavy libraries once, then run
each command line in a forked child, as ``python -m kvlab ARGV`` would run it.

Reads one JSON list of cases on stdin (``{"key", "argv", "cwd", "timeout"}``), runs up to ``--jobs`` at a
time and writes one JSON line per case on stdout as it ends (``{"key", "returncode", "seconds"}``;
returncode null: killed at its deadline). Each child is a session leader (a hang is killed with
whatever it started), has stdin on /dev/null, runs in its case's folder and writes its stdout and
stderr to ``<cwd>.stdout`` / ``<cwd>.stderr`` beside that folder. Importing torch, transformers and the
experiments takes seconds per process; a fork takes milliseconds, so hundreds of cases run in seconds.
The parent stays single-threaded (it only forks and waits), so the children start from a clean state.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback


def _preload() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import huggingface_hub  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401

    import kvlab.cli  # noqa: F401
    import kvlab.model  # noqa: F401
    import kvlab.study.sweep  # noqa: F401
    import kvlab.study.sweep.ray_backend  # noqa: F401
    from kvlab.study.experiments import registry

    registry()


def _child(case: dict) -> None:
    """In the forked child: become a session, redirect, run the CLI, exit with its code."""
    code = 1
    try:
        os.setsid()
        cwd = case["cwd"]
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(cwd + ".stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(cwd + ".stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.chdir(cwd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from kvlab.cli import main

        try:
            result = main(list(case["argv"]))
            code = result if isinstance(result, int) else 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(cases: list[dict], jobs: int) -> None:
    pending = list(cases)
    running: dict[int, tuple[dict, float]] = {}
    while pending or running:
        while pending and len(running) < jobs:
            case = pending.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(case)
            running[pid] = (case, time.monotonic())
        finished = False
        for pid, (case, started) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            elapsed = time.monotonic() - started
            if done == 0 and elapsed > case["timeout"]:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code = None
            elif done == 0:
                continue
            else:
                code = os.waitstatus_to_exitcode(status)
            del running[pid]
            finished = True
            print(
                json.dumps({"key": case["key"], "returncode": code, "seconds": round(elapsed, 3)}), flush=True
            )
        if not finished:
            time.sleep(0.01)


if __name__ == "__main__":
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    _preload()
    serve(json.load(sys.stdin), jobs)
