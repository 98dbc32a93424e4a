"""Build the anchors' virtual environment (once) and run kvpress + QuantizedCache on a kvlab job file.

``python3 benchmarks/anchors/run_anchors.py JOB.json OUT.json`` creates ``benchmarks/out/anchors-venv``
with kvpress 0.5.5, transformers 5.2.0, optimum-quanto 0.2.7 and torch 2.13 from pip (kvpress pins
``transformers<5.3``, so it cannot share kvlab's environment), then runs ``anchor_worker.py`` in it with one
torch thread. ``benchmarks/compression.py`` writes the job and merges the output; :func:`ruler_rows` runs
presses (KVzip by default) on given token ids from Python and returns the worker's rows.
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


def ruler_rows(
    model_dir: str | Path,
    trials: list[tuple[list[int], list[int], list[int]]],
    ratios: list[float],
    *,
    stop_ids: list[int],
    presses: tuple[str, ...] = ("kvzip",),
    max_new_tokens: int = 32,
    workdir: Path | None = None,
) -> list[dict]:
    """kvpress ``presses`` at ``ratios`` (fractions removed) on ``trials`` of ``(context ids, question ids,
    reference answer ids)``: the worker's ``ruler`` rows (job, rows and log kept in ``workdir`` if given).

    One row per trial and setup (``full``, then ``PRESS:RATIO``); ``trial`` is the trial's index. The
    reference answer is teacher-forced (minus its last id) after the question for KL / top-1 against the
    worker's own full cache; ``answer_ids`` is each setup's greedy answer (``stop_ids`` end it, kept).
    """
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(workdir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        job = {
            "kind": "ruler",
            "model_dir": str(model_dir),
            "presses": list(presses),
            "ratios": [float(r) for r in ratios],
            "stop_ids": [int(i) for i in stop_ids],
            "threads": 1,
            "trials": [
                {"key": f"trial/{i}", "task": "", "length": len(ctx), "trial": i, "seed": 0, "context": ctx}
                | {"question": q, "answer": a, "max_new_tokens": max_new_tokens}
                for i, (ctx, q, a) in enumerate(trials)
            ],
        }
        (folder / "job.json").write_text(json.dumps(job))
        run(folder / "job.json", folder / "rows.jsonl")
        lines = (folder / "rows.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if not (r.get("meta") or r.get("done"))]


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]))
