"""The live caches' decode speed on two commits of kvlab, paired: is a refactor free?

Each round runs one fresh process per side (old, new; the order alternates between rounds), each loading the
bundled model once on 1 torch thread and then timing, in process, greedy decoding through the same caches:

* ``rolling``: ``rolling_cache_for(model, window=252, sinks=4, evict_chunk=64)`` under ``model.generate``;
* ``scored``: ``cache_for("h2o,budget=256,every=64")``, fed a 600-token prompt, then decoding;
* ``coded``: ``cache_for("sinks=4,window=256,codec=kivi4")`` the same way.

Both sides run the same script with ``PYTHONPATH`` set to their ``src/`` (a git worktree of the old commit). The
figure per workload is new/old of the decode time, per round (paired), with the median, the range and a
bootstrap interval over rounds (5 or more). Usage::

    python benchmarks/regression.py --old c3a2729 [--rounds 5] [--tokens 160] [--results-name regression_issue46]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Refusal, run_main, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("rolling", "scored", "coded")

SCRIPT = """
import json, sys, time, torch
torch.set_num_threads(1)
import kvlab
try:
    from kvlab.policy.spec import cache_for
except ImportError:  # before 12fca8a (issue 46) moved it beside the spec's parser
    from kvlab.hf.policy_cache import cache_for
from kvlab.hf.rolling_cache import rolling_cache_for
tokens = int(sys.argv[1])
model = kvlab.load_model()
text = kvlab.data.python_docs().text
prompt = torch.tensor([model.encode(text[:2600])[:600]])

def timed(cache):
    start = time.perf_counter()
    out = model.model.generate(prompt, cache=cache, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return time.perf_counter() - start, out[0, -tokens:].tolist()

timed(rolling_cache_for(model, window=252, sinks=4, evict_chunk=64))  # warm-up
got = {}
for name, make in (
    ("rolling", lambda: rolling_cache_for(model, window=252, sinks=4, evict_chunk=64)),
    ("scored", lambda: cache_for("h2o,budget=256,every=64", model)),
    ("coded", lambda: cache_for("sinks=4,window=256,codec=kivi4", model)),
):
    seconds, ids = timed(make())
    got[name] = {"seconds": seconds, "ids": ids}
print(json.dumps(got))
"""


def run_side(src: Path, tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tokens)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise Refusal(f"the side at {src} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def worktree(commit: str, where: Path) -> Path:
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), commit],
        check=True,
        capture_output=True,
    )
    return where / "src"


def summary(ratios: list[float]) -> str:
    from kvlab.metrics.stats import bootstrap_ci

    iv = bootstrap_ci(ratios, "median", seed=0)
    return f"{statistics.median(ratios):.3f} ({iv.bracket('.3f')}; range {min(ratios):.3f}-{max(ratios):.3f})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="the commit before the change (a short hash)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--results-name", default="regression")
    args = ap.parse_args(argv)
    if args.rounds < 5:
        raise Refusal("--rounds must be 5 or more: an interval needs 5 pairs")
    new = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        old_src = worktree(args.old, Path(tmp) / "old")
        try:
            rows = []
            for r in range(args.rounds):
                order = [("old", old_src), ("new", ROOT / "src")][:: 1 if r % 2 == 0 else -1]
                got = {side: run_side(src, args.tokens) for side, src in order}
                rows.append(got)
                print(
                    f"round {r + 1}/{args.rounds}: "
                    + ", ".join(
                        f"{w} {got['new'][w]['seconds'] / got['old'][w]['seconds']:.3f}" for w in WORKLOADS
                    ),
                    file=sys.stderr,
                )
            load.append(os.getloadavg()[0])
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(tmp) / "old")])
    write(args, rows, new, load)


def write(args: argparse.Namespace, rows: list[dict], new: str, load: list[float]) -> None:
    lines = [
        f"Old = `{args.old}`, new = `{new}`: {args.rounds} rounds, one fresh process per side, the order "
        f"alternating; each process on 1 torch thread, greedy, {args.tokens} new tokens after a 600-token prompt "
        f"of Python's docs, the bundled SmolLM2-135M in float32. Load average {load[0]:.1f} at the start, "
        f"{load[-1]:.1f} at the end (2 cores shared with other jobs).",
        "",
        "| workload | old s (median) | new s (median) | new/old per round: median [95% CI] (range) | same tokens |",
        "|---|---:|---:|---|---|",
    ]
    for w in WORKLOADS:
        old = [r["old"][w]["seconds"] for r in rows]
        new_s = [r["new"][w]["seconds"] for r in rows]
        same = sum(r["old"][w]["ids"] == r["new"][w]["ids"] for r in rows)
        ratios = [n / o for n, o in zip(new_s, old, strict=True)]
        lines.append(
            f"| {w} | {statistics.median(old):.2f} | {statistics.median(new_s):.2f} | {summary(ratios)} | "
            f"{same}/{len(rows)} |"
        )
    lines += [
        "",
        "Raw seconds per round (old, new): "
        + "; ".join(
            ", ".join(f"{w} {r['old'][w]['seconds']:.2f}/{r['new'][w]['seconds']:.2f}" for w in WORKLOADS)
            for r in rows
        ),
    ]
    write_results(
        args.results_name,
        "Regression: the live caches' decode speed, paired against the commit before",
        "\n".join(lines),
    )


if __name__ == "__main__":
    run_main(main)
