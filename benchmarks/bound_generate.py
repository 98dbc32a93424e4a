"""ms/token of ``model.generate`` through a bound live cache (``cache_for(spec)``): the model's pre-hook path.

    python benchmarks/bound_generate.py SPEC [SPEC ...]     # e.g. 'sinks=4,window=128' 'h2o,keep=0.5,every=32'

Prints ``SPEC=ms`` per spec on one line (200 greedy tokens after a 13-token prompt, 1 torch thread, the
best of 2 generations). Run it under two checkouts alternately (``PYTHONPATH=OLD/src`` / ``NEW/src``) for
a paired old/new ratio: ``benchmarks/results/archive/regression_issue28.md``.
"""

from __future__ import annotations

import sys
import time

import torch

from kvlab import load_model
from kvlab.policy.spec import cache_for


def main(specs: list[str]) -> None:
    torch.set_num_threads(1)
    h = load_model("smollm2-135m")
    ids = torch.tensor([h.encode("Once upon a time, in a quiet village by the sea,")], device=h.device)
    out = []
    for spec in specs:
        times = []
        for _ in range(2):
            cache = cache_for(spec, h)
            t0 = time.perf_counter()
            h.model.generate(
                ids, past_key_values=cache, max_new_tokens=200, min_new_tokens=200, do_sample=False
            )
            times.append((time.perf_counter() - t0) / 200 * 1000)
        out.append(f"{spec}={min(times):.2f}")
    print(" ".join(out))


if __name__ == "__main__":
    main(sys.argv[1:] or ["sinks=4,window=128"])
