"""``kvlab eval ruler``: RULER-style long-context tasks under cache policies, scored, with KL to the full cache."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli.common import (
    JsonOpt,
    ModelOptions,
    SeedOpt,
    capture_mode,
    capture_on,
    check_output_dir,
    checked,
    console,
    count_option,
    eval_cache_specs,
    group_command,
    print_json,
    refuse_unknown,
    text_file,
)
from kvlab.errors import BadInputError

#: the most tokens one trial may ask for (far past what kvlab's CPU runs reach; a larger one is a typo)
MAX_LENGTH = 1 << 20


def _lengths(value: str) -> str:
    """Typer callback: a comma-separated list of prompt lengths in tokens."""
    from kvlab.eval.tasks import MIN_LENGTH

    items = [v.strip() for v in value.split(",")]
    if not all(v.isdigit() for v in items):
        raise typer.BadParameter(f"{value!r} is not a comma-separated list of token counts (e.g. 1024,2048)")
    for n in map(int, items):
        if not MIN_LENGTH <= n <= MAX_LENGTH:
            raise typer.BadParameter(f"a length of {n} tokens is outside [{MIN_LENGTH}, {MAX_LENGTH}]")
    if len(set(items)) != len(items):
        raise typer.BadParameter(f"{value!r} repeats a length")
    return value


def _tasks(value: str | None) -> str | None:
    """Typer callback: a comma-separated list of registered task names."""
    if value is None:
        return None
    from kvlab.eval.tasks import TASKS

    items = [v.strip() for v in value.split(",")]
    refuse_unknown(items, list(TASKS), "task(s)", choose="choose from ")
    if len(set(items)) != len(items):
        raise typer.BadParameter(f"{value!r} repeats a task")
    return value


CachesOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--cache",
        callback=eval_cache_specs,
        help="Cache policy (repeatable): full, <policy>:<fraction removed> (snapkv:0.5, h2o:0.5, "
        "tova:0.5, keynorm:0.5, window:0.5), int4, int2, <quantizer>:int<bits> (kivi:int2); "
        "a policy without a ratio (snapkv, h2o) runs at each of --ratios.",
    ),
]
RatiosOpt = Annotated[
    str | None,
    typer.Option(
        "--ratios",
        callback=checked("kvlab.eval.specs", "parse_ratios"),  # fractions removed, each in [0, 1)
        help="Fractions removed, comma-separated (0.25,0.5,0.75): each --cache policy named "
        "without a ratio runs at each; codecs and complete specs run once.",
    ),
]
LengthsOpt = Annotated[
    str, typer.Option("--lengths", callback=_lengths, help="Prompt lengths in tokens, comma-separated.")
]
TasksOpt = Annotated[
    str | None,
    typer.Option(
        "--tasks",
        callback=_tasks,
        help="Tasks, comma-separated (default: all): niah_single, niah_multikey, niah_multivalue, vt, cwe, qa.",
    ),
]
TrialsOpt = Annotated[int, count_option("--trials", help="Trials per task and length.")]
HaystackOpt = Annotated[
    Path | None,
    typer.Option(
        "--haystack",
        callback=text_file,
        help="A UTF-8 text file to hide the facts in (default: Frankenstein if ../shared is present, "
        "else the Python docs).",
    ),
]
AnswerTokensOpt = Annotated[
    int | None,
    typer.Option("--max-new-tokens", "-n", min=1, max=4096, help="Answer tokens (default: each task's own)."),
]
RulerOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "-o",
        help="Folder for ruler.json (raw rows, summary with intervals); each trial is kept there "
        "as it finishes (ruler.partial.jsonl), so an interrupted run can be resumed.",
    ),
]
ResumeOpt = Annotated[
    Path | None,
    typer.Option(
        "--resume",
        help="Finish the interrupted run whose --out was this folder: skip the trials it kept, run "
        "the rest, write ruler.json (equal to an uninterrupted run's but for timings). Give the "
        "same options as the first run (others are refused).",
    ),
]
CalibrationOpt = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        help="A calibration (benchmarks/calibrate_ruler.py's JSON, kvlab.eval.calibrate): each task runs at "
        "its calibrated difficulty per length; refused when it lacks a task and length the run asks for.",
    ),
]


PositionsOpt = Annotated[
    str,
    typer.Option(
        "--positions",
        callback=checked("kvlab.eval.positions", "check_positions", one=True),
        help="The RoPE positions an eviction's kept keys carry: original (with gaps, the question at the "
        "context's length T; the default), contiguous (re-rotated to 0..k-1, the question still at T) or "
        "cache (re-rotated to 0..k-1, the question at k: StreamingLLM's positions within the cache).",
    ),
]

CaptureOpt = Annotated[
    str,
    typer.Option(
        "--capture",
        callback=capture_mode,
        help="Answer through the captured step kvlab serve --capture runs: compile (torch.compile, on a CPU "
        "too), cuda-graph (a GPU), auto (CUDA graphs on a GPU, compile on a CPU), or off (the default: a live "
        "batch). It runs the sinks + window caches in the model's dtype; the others as without it. Each row "
        "says its runtime. See docs/eval.md.",
    ),
]


def _fmt(interval: dict | None, digits: str = ".2f") -> str:
    if interval is None:
        return "-"
    if interval["low"] is None:
        return f"{interval['value']:{digits}}"
    return f"{interval['value']:{digits}} [{interval['low']:{digits}}, {interval['high']:{digits}}]"


def table_lines(summary: list[dict]) -> list[str]:
    """The summary as a Markdown table: accuracy, KL and top-1 with 95% bootstrap intervals."""
    lines = [
        "| task | length | cache | n | accuracy [95% CI] | KL nats [95% CI] | top-1 [95% CI] | s |",
        "|---|---:|---|---:|---|---|---|---:|",
    ]
    for s in sorted(summary, key=lambda s: (s["task"], s["length"])):
        lines.append(
            f"| {s['task']} | {s['length']} | {_cache_label(s)} | {s['trials']} | {_fmt(s['accuracy'])} | "
            f"{_fmt(s['kld'], '.3g')} | {_fmt(s['top1'])} | {s['seconds']:.1f} |"
        )
    return lines


def _cache_label(row: dict) -> str:
    """A summary row's cache, with its positions convention when it is not the default."""
    moved = row.get("positions") not in (None, "original")
    return f"{row['cache']} @{row['positions']}" if moved else row["cache"]


def ruler(
    cache: CachesOpt = None,
    ratios: RatiosOpt = None,
    lengths: LengthsOpt = "1024",
    tasks: TasksOpt = None,
    trials: TrialsOpt = 5,
    haystack: HaystackOpt = None,
    max_new_tokens: AnswerTokensOpt = None,
    out: RulerOutOpt = None,
    resume: ResumeOpt = None,
    positions: PositionsOpt = "original",
    calibration: CalibrationOpt = None,
    capture: CaptureOpt = "off",
    model: ModelOptions = ModelOptions(),
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
) -> None:
    """Run RULER-style trials under each cache policy: accuracy, KL and top-1 agreement to the full cache.

    Progress goes to stderr: trials done of all and an estimate of the time left (a bar on a terminal,
    one line per trial otherwise, nothing with --json)."""
    from kvlab.eval.positions import DEFAULT, check_positions
    from kvlab.eval.resume import run_ruler
    from kvlab.eval.specs import check_capture, expand_specs, parse_cache_specs, parse_ratios
    from kvlab.eval.tasks import TASKS
    from kvlab.progress import choose_mode

    ratio_list = parse_ratios(ratios) if ratios is not None else None
    specs = parse_cache_specs(expand_specs(cache or ["full"], ratio_list))
    check_positions([positions], specs)
    if capture != "off":
        check_capture(specs, capture)
        capture = capture_on(capture, model.device, on_cpu="compile")
    task_names = [t.strip() for t in tasks.split(",")] if tasks else list(TASKS)
    length_list = [int(v) for v in lengths.split(",")]
    if resume is not None:
        if out is not None and Path(out).resolve() != Path(resume).resolve():
            raise BadInputError(f"--resume {resume} finishes the run in that folder; drop --out {out}")
        out = resume
    if out is not None:
        check_output_dir(out)
    from kvlab.data import read_text_file

    haystack_text = read_text_file(haystack).text if haystack is not None else None
    settings = {
        "model": model.model,
        "device": model.device,  # as the model loads it (run_ruler)
        "dtype": model.dtype,
        "caches": [s.to_json() for s in specs],
        "ratios": ratio_list,
        "tasks": task_names,
        "lengths": length_list,
        "trials": trials,
        "seed": seed,
        "haystack": str(haystack) if haystack is not None else "default",
        "max_new_tokens": max_new_tokens,
        **({"positions": positions} if positions != DEFAULT else {}),  # a default run's settings as before
        **({"capture": capture} if capture != "off" else {}),
        **(
            _calibrated(calibration, model.model, task_names, length_list, trials, seed)
            if calibration is not None
            else {}
        ),
    }
    doc = run_ruler(
        settings,
        specs,
        out=out,
        resume=resume is not None,
        haystack_text=haystack_text,
        mode=choose_mode(json_out),
    )
    _print_ruler(doc, out, json_out)


def _calibrated(path: Path, model: str, tasks: list[str], lengths: list[int], trials: int, seed: int) -> dict:
    """``--calibration``'s part of the settings: each task's knobs per length (``task@length``) and the pairs
    the calibration left apart; refused when it lacks a pair or its trials' seeds are the run's."""
    from kvlab.eval.calibrate import Calibration
    from kvlab.eval.tasks import trial_seed

    cal = Calibration.read(path)
    cal.check_model(model)
    cal.check_seeds([trial_seed(seed, i) for i in range(trials)])
    knobs = {f"{t}@{n}": cal.knobs(t, n) for t in tasks for n in lengths}
    return {"calibration": str(path), "knobs": knobs, "apart": sorted(f"{t}@{n}" for t, n in cal.apart())}


def _print_ruler(doc: dict, out: Path | None, json_out: bool) -> None:
    """The run's document as JSON on stdout, or its summary table and where ruler.json went."""
    summary, rows, wall = doc["summary"], doc["rows"], doc["wall_seconds"]
    if json_out:
        print_json(doc)
        return
    for line in table_lines(summary):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    ran = {f"{r['task']}@{r['length']}" for r in rows}
    apart = [k for k in doc["settings"].get("apart", []) if k in ran]
    if apart:
        console.print(
            f"apart (no difficulty put the full cache in the calibration's band; do not pool): {', '.join(apart)}",
            markup=False,
            highlight=False,
        )
    console.print(
        f"{len(rows)} rows in {wall:.1f} s" + (f"; wrote {Path(out) / 'ruler.json'}" if out else "")
    )


def register(app: typer.Typer) -> None:
    sub = typer.Typer(
        help="Score cache policies on long-context tasks (RULER-style), with KL to the full cache."
    )
    app.add_typer(sub, name="eval")
    sub.command("ruler")(group_command(ruler))
