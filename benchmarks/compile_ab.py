"""Does an inductor setting of the frozen CPU step pay? Several compiles of each arm, in one process.

Two compiles of the same frozen step, on this machine, decode at speeds a few percent apart (not by the
autotuner's choices, which are the same each time; why, we have not found), so one compile per arm
cannot tell a change of a few percent from that. This script compiles the served step
(:func:`kvlab.serve.engine.captured_rows`, the bundled model, one conversation, window 1024 + 4 sinks,
float32, one thread) ``--compiles`` times per arm, the arms alternating, each arm's settings laid over
``kvlab.hf.graphs.FROZEN_INDUCTOR`` while it compiles and runs. Then ``--rounds`` rounds, each running
every compile for a block of ``--steps`` greedy decode steps (the order rotating round by round).

The comparison's unit is the compile: each compile's median ms/step over the rounds, arm B against
arm A as the ratio of their geometric means, with a t interval over the compiles (Welch's standard
error, df = 2·compiles - 2). Per round, the mean of B's blocks over the mean of A's blocks is shown too.
Every compile starts from the same prompt and token; the last warm-up step's logits of all compiles are
compared (the arms must compute the same step).
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Refusal, run_main, write_results  # noqa: E402


def settings(items: list[str]) -> dict[str, object]:
    """``key=value`` pairs (values as Python literals) for inductor's config."""
    out: dict[str, object] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise Refusal(f"a setting is key=value, not {item!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise Refusal(f"{item!r}: the value is not a Python literal (True, 8, 'x')") from None
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", nargs="*", default=["cpp_wrapper=False"], help="arm A's settings (key=value)")
    ap.add_argument("--b", nargs="*", default=[], help="arm B's settings (default: kvlab's own)")
    ap.add_argument("--compiles", type=int, default=5, help="compiles per arm (at least 5)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per block")
    ap.add_argument("--name", default="compile_ab", help="the results file's name")
    args = ap.parse_args(argv)
    if not 5 <= args.compiles <= 10:
        raise Refusal(
            f"--compiles must be 5 to 10 (an interval over fewer than 5 is not given), not {args.compiles}"
        )
    if args.rounds < 5 or args.steps < 1:
        raise Refusal("--rounds must be at least 5 and --steps at least 1")
    args.arm_a, args.arm_b = settings(args.a), settings(args.b)
    return args


def compile_one(handle, policy, layout: dict[str, object]) -> tuple[Callable[[int], float], object, str]:
    """One compiled served step with ``layout`` as its inductor settings; warmed up (compiled) here."""
    import torch

    from kvlab.hf import graphs
    from kvlab.policy.spec import cache_for
    from kvlab.serve.engine import captured_rows

    graphs.FROZEN_INDUCTOR = layout  # captured_rows compiles its widths as it is made: set before
    rows = captured_rows(handle, policy, 1, "compile")
    cache = cache_for(policy.live(), handle)
    out = handle.run(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8] * 5]), cache, logits_to_keep=1)
    joined, state = rows.join(cache), {"tok": int(out.logits[0, -1].argmax()), "logits": None}

    def block(n: int) -> float:
        graphs.FROZEN_INDUCTOR = layout
        t = time.perf_counter()
        for _ in range(n):
            logits = rows.step([joined], [state["tok"]])
            state["tok"] = int(logits[0].argmax())
        state["logits"] = logits
        return (time.perf_counter() - t) / n * 1000

    block(4)
    return block, state["logits"], wrapper(block)


def wrapper(block: Callable[[int], float]) -> str:
    """Which wrapper calls the compiled step's kernels, as a profile of one step sees it: the arms' own
    check that each compile took its arm's settings."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(block, 1)
    names = [name for (_, _, name) in pstats.Stats(profile).stats]  # type: ignore[attr-defined]
    return "C++" if any("inductor_entry_cpp" in name for name in names) else "Python"


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    import torch

    from kvlab.hf import graphs
    from kvlab.model import load_model
    from kvlab.serve.engine import EngineSettings

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    torch._inductor.config.fx_graph_cache = False  # every compile its own, not one graph loaded again
    handle = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    policy = EngineSettings(window=1024, sinks=4, evict_chunk=64, max_batch=1).policy
    arms = {"A": {**graphs.FROZEN_INDUCTOR, **args.arm_a}, "B": {**graphs.FROZEN_INDUCTOR, **args.arm_b}}
    blocks, first, took, wrappers = [], [], [], []
    for k in range(2 * args.compiles):
        arm = "AB"[k % 2]
        t0 = time.time()
        block, logits, called = compile_one(handle, policy, arms[arm])
        blocks.append((arm, block))
        wrappers.append(called)
        first.append(logits)
        took.append(time.time() - t0)
        print(
            f"compile {k + 1}/{2 * args.compiles} (arm {arm}, {called} wrapper): {took[-1]:.0f} s", flush=True
        )
    times: list[list[float]] = [[] for _ in blocks]
    for r in range(args.rounds):
        order = list(range(len(blocks)))
        for k in order[r % len(order) :] + order[: r % len(order)]:
            times[k].append(blocks[k][1](args.steps))
        print(f"round {r + 1}/{args.rounds}", flush=True)
    diff = max(float((x - first[0]).abs().max()) for x in first)
    write_results(
        args.name,
        "Frozen CPU step: inductor settings, several compiles per arm",
        report(args, arms, blocks, times, took, diff, wrappers),
    )


def report(args, arms, blocks, times, took, diff: float, wrappers: list[str]) -> str:
    from scipy import stats

    med = [statistics.median(t) for t in times]
    ia, ib = ([i for i, (arm, _) in enumerate(blocks) if arm == name] for name in "AB")
    la, lb = [math.log(med[i]) for i in ia], [math.log(med[i]) for i in ib]
    d = statistics.fmean(lb) - statistics.fmean(la)
    se = math.sqrt(statistics.variance(la) / len(la) + statistics.variance(lb) / len(lb))
    t = float(stats.t.ppf(0.975, len(la) + len(lb) - 2))
    per_round = [
        statistics.fmean(times[i][r] for i in ib) / statistics.fmean(times[i][r] for i in ia)
        for r in range(args.rounds)
    ]
    fmt = ", ".join
    rows = "\n".join(
        f"| {k + 1} | {arm} | {wrappers[k]} | {took[k]:.0f} | {med[k]:.2f} | {fmt(f'{x:.1f}' for x in times[k])} |"
        for k, (arm, _) in enumerate(blocks)
    )
    return f"""
Arm A: `{arms["A"]}`; arm B: `{arms["B"]}` (kvlab's own `FROZEN_INDUCTOR` with `--a` / `--b` laid over it).
The served step of the bundled model (SmolLM2-135M-Instruct, float32, one conversation, window 1024 +
4 sinks, `--capture compile`'s frozen step: max-autotune, inductor's C++ GEMM templates), one thread,
{args.compiles} compiles per arm in one process, alternating; {args.rounds} rounds of one block of
{args.steps} greedy steps per compile, the order rotating. Logits of every compile's last warm-up step
(the same prompt and token): max |difference| {diff:.3g}.

**B / A, ms per step: {math.exp(d):.3f}x** (geometric mean over the compiles of each compile's median;
95% interval [{math.exp(d - t * se):.3f}, {math.exp(d + t * se):.3f}], t with {len(la) + len(lb) - 2} df).
Per round (mean of B's blocks / mean of A's): median {statistics.median(per_round):.3f}, range
[{min(per_round):.3f}, {max(per_round):.3f}]. Compile to compile (sd of log ms per step): A {statistics.stdev(la):.3f}, B
{statistics.stdev(lb):.3f}. Median compile time: A {statistics.median(took[i] for i in ia):.0f} s, B
{statistics.median(took[i] for i in ib):.0f} s.

### Raw rows (ms per step, one block per round)

| compile | arm | kernels called from | compile + warm-up s | median ms | per round |
|---|---|---|---|---|---|
{rows}
"""


if __name__ == "__main__":
    run_main(main)
