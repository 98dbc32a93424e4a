"""Build the anchors' virtual environment (once) and run kvpress + QuantizedCache on a kvlab job file.

``python3 benchmarks/anchors/run_anchors.py JOB.json OUT.json`` creates ``benchmarks/out/anchors-venv``
with kvpress 0.5.5, transformers 5.2.0, optimum-quanto 0.2.7 and torch 2.13 from pip (kvpress pins
``transformers<5.3``, so it cannot share kvlab's environment), then runs ``anchor_worker.py`` in it with one
torch thread. ``benchmarks/compression.py`` writes the job and merges the output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = HERE.parent / "out" / "anchors-venv"
PINS = ["kvpress==0.5.5", "transformers==5.2.0", "optimum-quanto==0.2.7", "torch==2.13.*"]


def venv_python() -> Path:
    return VENV / "bin" / "python"


def ensure_venv() -> Path:
    """Create the venv and install the pins unless they are already there; raises with pip's output on failure."""
    py = venv_python()
    check = [
        str(py),
        "-c",
        "import kvpress, optimum.quanto, transformers; assert transformers.__version__ == '5.2.0'",
    ]
    if py.is_file() and subprocess.run(check, capture_output=True).returncode == 0:
        return py
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", *PINS], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"pip install {' '.join(PINS)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return py


def _env() -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }


def start(job: Path, out: Path, log: Path) -> subprocess.Popen:
    """Start the worker in the background (stderr to ``log``); it rewrites ``out`` after every setup."""
    py = ensure_venv()
    with open(log, "w") as fh:
        return subprocess.Popen(
            [str(py), str(HERE / "anchor_worker.py"), str(job), str(out)],
            env=_env(),
            stdout=fh,
            stderr=subprocess.STDOUT,
        )


def run(job: Path, out: Path) -> None:
    py = ensure_venv()
    subprocess.run([str(py), str(HERE / "anchor_worker.py"), str(job), str(out)], check=True, env=_env())


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]))
