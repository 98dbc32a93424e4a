"""Sweep throughput: the same grid run by 1 local worker and by 2 (one torch thread each), side by side.

python benchmarks/sweep.py            # writes benchmarks/results/sweep.md
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from _common import write_page  # noqa: E402
from kvlab.study.sweep import run_sweep  # noqa: E402

CONFIGS = ROOT / "tests" / "fixtures" / "model-configs"
GRID = f"""
profile = "quick"
seeds = [0, 1]
models = ["smollm2-135m", "tiny:{CONFIGS / "tinyllama-1.1b-chat-v1.0.json"}", "tiny:{CONFIGS / "qwen2.5-7b.json"}"]

[[experiments]]
name = "inspect"

[[experiments]]
name = "transfer_equivalence"
options = {{ pairs = 2, kept_generated = 2 }}
"""


def main() -> int:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        grid = Path(tmp) / "grid.toml"
        grid.write_text(GRID)
        times = {}
        for workers in (1, 2):
            started = time.perf_counter()
            result = run_sweep(grid, Path(tmp) / f"out-{workers}", workers=workers)
            times[workers] = time.perf_counter() - started
            assert not result["failed"], result["failed"]
            cells = len(result["cells"])
    lines = [
        "## Sweep: local workers",
        "",
        f"Command: `python benchmarks/sweep.py` · machine: {os.cpu_count()} cores ({platform.machine()}), "
        f"torch {torch.__version__}, 1 thread per worker · date: {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"The same grid ({cells} cells: the bundled SmolLM2-135M and two tiny random models x `inspect` and "
        "`transfer_equivalence` x 2 seeds, quick profile), run one after the other in one run. Each time "
        "includes loading the models once per worker.",
        "",
        "| workers | seconds | vs 1 worker |",
        "|---|---|---|",
        f"| 1 | {times[1]:.1f} | 1.00x |",
        f"| 2 | {times[2]:.1f} | {times[2] / times[1]:.2f}x |",
        "",
    ]
    out = ROOT / "benchmarks" / "results" / "sweep.md"
    write_page(out, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
