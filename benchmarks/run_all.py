"""Run every benchmark script in benchmarks/ (one process each), then assemble BENCHMARKS.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SKIP = {"run_all.py", "assemble.py"}


def main() -> int:
    failed = []
    for script in sorted(HERE.glob("*.py")):
        if script.name in SKIP or script.name.startswith("_"):
            continue
        print(f"== {script.name}", flush=True)
        if subprocess.run([sys.executable, str(script)], cwd=HERE).returncode != 0:
            failed.append(script.name)
    subprocess.run([sys.executable, str(HERE / "assemble.py")], check=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
