"""Helpers shared by benchmark scripts: machine description and writing results."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from kvlab.kernels import compiler as c_compiler  # the one pick of a C compiler (no torch)

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    return (
        f"{os.cpu_count()} cores ({cpu}), torch {torch.__version__} with {torch.get_num_threads()} threads, "
        f"Python {platform.python_version()}"
    )


def write_page(path: Path, text: str) -> Path:
    """Write a results page, carrying the summary block of the page it replaces over as it was, after the
    new page's first line (its title): ``benchmarks/assemble.py`` then refuses it until its figures are the
    new run's (update the rows, their date and commit). Every benchmark writes its page through here, so a
    re-run never drops a row from BENCHMARKS.md unseen."""
    old = path.read_text() if path.exists() else ""
    block = re.search(r"<!-- summary -->\n.*?\n<!-- /summary -->\n", old, re.S)
    if block and "<!-- summary -->" not in text:
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n{block.group(0)}\n{rest.lstrip(chr(10))}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def write_results(name: str, title: str, body: str) -> Path:
    """Write ``benchmarks/results/<name>.md`` with the command, machine and date (through
    :func:`write_page`, which keeps its summary block), and print it."""
    command = "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    text = (
        f"## {title}\n\nCommand: `{command}` · machine: {machine()} · "
        f"date: {datetime.now().strftime('%Y-%m-%d %H:%M')}\n\n{body.strip()}\n"
    )
    path = write_page(RESULTS / f"{name}.md", text)
    print(text)
    return path


def c_function(source: Path, symbol: str, argtypes: list, restype=None):
    """``symbol`` of the C file ``source`` (a benchmark's own, beside this one), built with
    :func:`c_compiler` into a private temporary folder and loaded with ctypes; None without a compiler or
    when the build fails."""
    import ctypes

    cc = c_compiler()
    if cc is None:
        return None
    out = Path(tempfile.mkdtemp(prefix=f"kvlab-{source.stem}-")) / f"{source.stem}.so"
    flags = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared"]
    built = subprocess.run([cc, *flags, str(source), "-o", str(out)], capture_output=True)
    if built.returncode:
        shutil.rmtree(out.parent, ignore_errors=True)
        return None
    lib = ctypes.CDLL(str(out))
    shutil.rmtree(out.parent, ignore_errors=True)  # loaded: the file is no longer needed
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


class Refusal(SystemExit):
    """Bad input to a benchmark script, refused before anything is written: :func:`run_main` prints it as
    one line on stderr and exits 2 (a plain ``SystemExit("...")`` would exit 1)."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def run_main(main, *args) -> None:
    """Run a script's ``main``; a :class:`Refusal` becomes ``error: <message>`` and exit status 2."""
    try:
        main(*args)
    except Refusal as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        raise SystemExit(2) from None


def model_label(spec: str) -> str:
    """How a report names the model a run used (its ``--model``)."""
    return {
        "smollm2-135m": "SmolLM2-135M-Instruct (bundled)",
        "gemma3-270m": "Gemma-3-270M (base; Q4_K_M de-quantized to fp32, the optional package)",
    }.get(spec, spec)
