"""Assemble BENCHMARKS.md from the per-benchmark result files in benchmarks/results/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = [
    "snapshot_io",
    "newcomer_times",
    "test_tiers",
    "cheap_paths",
    "study_timing",
    "study_timing_quick",
    "rolling",
    "compression",
    "compressed_decode",
    "coded_window",
    "coded_window_20k",
    "generate_20k_cli",
    "eval_ruler",
    "eval_ruler_full_1k",
    "eval_ruler_full_4k",
    "eval_curves_1k",
    "eval_curves_4k",
    "snapkv_vs_kvpress",
    "eval_gpu",
    "eval_batched",
    "hf_quantized_cache",
    "eval_ruler_haystack",
    "store",
    "store_cold_lookup",
    "serve",
    "serve_fidelity",
    "serve_soak",
    "serve_faults",
    "serve_sessions",
    "serve_sessions_smollm2",
    "serve_redis_full",
    "small_batch_linear",
    "prefill_interleave",
    "transfer",
    "hybrid_models",
    "gpu",
    "regression_issue28",
]

HEADER = """# Benchmarks

Measured on this project's machine (2 CPU cores, 24 GiB, no GPU), except the GPU sections (`eval_gpu`
and the one near the end: NVIDIA H100s and an H200, lent for a session at a time; each table names
its card). Every figure below was
produced by the command shown with it; speed goals are ratios measured side by side in one run, never timed unit
tests. Re-run everything with `make bench` (each script rewrites its section in
`benchmarks/results/`, then this file is re-assembled).
"""


#: a relative link target in a result file (a figure beside it), not a URL, an anchor or an absolute path
_RELATIVE = re.compile(r"\]\((?![a-z]+:|#|/)([^)\s]+)\)")


def rebased(text: str, folder: Path) -> str:
    """``text`` of a result file in ``folder`` with its relative links made relative to the repository root,
    where BENCHMARKS.md is (``![..](fig.png)`` -> ``![..](benchmarks/results/fig.png)``)."""
    prefix = folder.relative_to(ROOT).as_posix()
    return _RELATIVE.sub(lambda m: f"]({prefix}/{m.group(1)})", text)


def assembled() -> tuple[str, list[str]]:
    """BENCHMARKS.md's text from the result files, and the sections' names in order."""
    folder = ROOT / "benchmarks" / "results"
    files = {p.stem: p for p in folder.glob("*.md")}
    names = [n for n in ORDER if n in files] + sorted(n for n in files if n not in ORDER)
    parts = [HEADER] + [rebased(files[n].read_text().strip(), folder) + "\n" for n in names]
    return "\n".join(parts), names


def main() -> None:
    text, names = assembled()
    (ROOT / "BENCHMARKS.md").write_text(text)
    print(f"BENCHMARKS.md: {', '.join(names)}")


if __name__ == "__main__":
    main()
