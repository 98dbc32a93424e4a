"""Re-run the kvpress worker's RULER trials of a finished piece and compare with the rows it recorded.

Run in the anchors environment (kvpress installed), e.g.
``benchmarks/out/anchors-venv/bin/python benchmarks/anchors/check_batched_decode.py PIECE_DIR [N]``:
the worker as it is now (presses of one ratio decoded as the rows of one batch) against the piece's
``kvpress.jsonl`` (written one press at a time by pieces run before that change). Prints, per trial, the
rows whose answers differ, then the count of identical answers and the largest |ΔKL|; with ``--json OUT``
also every row's pair. Used once, 2026-11-27: see docs/eval.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anchor_worker  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("piece", type=Path, help="a piece's --out-dir (job.json, trials.jsonl, kvpress.jsonl)")
    ap.add_argument("trials", type=int, nargs="?", default=None, help="only the first N trials")
    ap.add_argument("--json", type=Path, default=None, help="write every row's pair here")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    job = json.loads((args.piece / "job.json").read_text())
    lines = (args.piece / "trials.jsonl").read_text().splitlines()
    trials = [t for t in map(json.loads, lines) if "context" in t]
    recorded = {}
    for line in (args.piece / "kvpress.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "setup" in r:
            recorded[(r["key"], r["setup"])] = r
    torch.set_num_threads(int(job.get("threads", 1)))
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()
    setups = anchor_worker.ruler_setups(job)
    pairs, worst = [], 0.0
    for trial in trials[: args.trials]:
        t0 = time.perf_counter()
        rows = anchor_worker.ruler_trial(model, job, trial, setups, verify=False)
        for r in rows:
            old = recorded[(r["key"], r["setup"])]
            same = r["answer_ids"] == old["answer_ids"]
            worst = max(worst, abs(r["kld"] - old["kld"]))
            if not same:
                print(f"differs: {r['key']} {r['setup']} KL {r['kld']:.4g} vs {old['kld']:.4g}", flush=True)
            pairs.append(
                {
                    "key": r["key"],
                    "setup": r["setup"],
                    "same_answer": same,
                    "batch_rows": r["batch_rows"],
                    "kld": r["kld"],
                    "kld_recorded": old["kld"],
                    "top1": r["top1"],
                    "top1_recorded": old["top1"],
                }
            )
        print(f"{trial['key']}: {time.perf_counter() - t0:.1f} s", flush=True)
    n_same = sum(p["same_answer"] for p in pairs)
    print(f"same answers {n_same}/{len(pairs)}; largest |ΔKL| {worst:.3g} nats")
    if args.json:
        args.json.write_text(json.dumps(pairs, indent=1) + "\n")


if __name__ == "__main__":
    main()
