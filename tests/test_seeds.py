"""Seeds are replicates: a seed changes what is sampled (texts, windows, prompts, facts), so a 2-seed
sweep gives different point estimates for every experiment that samples; every experiment says what its
seed changes (docs/sweeps.md lists them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvlab.data import Text
from kvlab.study.experiments import registry
from kvlab.study.experiments._sampling import seeded_order, seeded_text

REPO = Path(__file__).resolve().parents[1]
TINY = f"tiny:{REPO / 'tests' / 'fixtures' / 'model-configs' / 'qwen2.5-7b.json'}"

# Experiments that run on a tiny random-weight model, with options that keep them small.
ON_TINY = {
    "inspect": {},
    "roll_sweep": {"windows": 3, "context": 32},
    "roll_long": {},
    "rope_derotation": {},
    "findings": {},
    "streaming_ppl": {},
    "suffix_caching": {},
    "attention": {},
    "store_reuse": {},
    "transfer_equivalence": {"pairs": 3, "kept_generated": 2},
    "context_retention": {"facts": 3},
    "layer_transfer": {},
    "kv_swap": {},
}
# Experiments that need the bundled model (a float64 copy, quantizer groups of 64, a derivative model).
ON_BUNDLED = {
    "compression": {
        "context_tokens": 64,
        "continuation_tokens": 16,
        "windows": 2,
        "bits": [4],
        "keeps": [0.5],
        "needle_lengths": [96],
        "needle_depths": [0.5],
        "timing_steps": 2,
    },
    "transplant": {},
    "caching_numerics": {"steps": 3, "dtypes": ["float64", "float32"]},
    "ruler": {},  # its quick profile: one needle task at 256 tokens, 2 trials
    "positions": {},  # its quick profile: snapkv at 0.5, one needle task at 160 tokens, 5 trials
}
# Its ten shared conversations are the whole set: only its lexical control is drawn by the seed, and
# without ../shared it does not run at all (not applicable).
NEEDS_SHARED = {"compaction"}
# Wall-clock quantities differ between any two runs, whatever the seed: they are not point estimates.
TIMING = re.compile(r"second|_ms\b|ms$|speedup|per_s|ttft|time", re.I)


def test_seeded_text_moves_with_the_seed_and_keeps_seed_0():
    text = Text("\n\n".join(f"Paragraph {i} says something about caches." for i in range(40)), "test text")
    assert seeded_text(text, 0) is text
    one, two = seeded_text(text, 1), seeded_text(text, 2)
    assert one.text != text.text and one.text != two.text
    assert sorted(one.text.split("\n\n")) == sorted(text.text.split("\n\n"))  # a rotation: nothing lost
    assert "seed 1" in one.source and seeded_text(text, 1) == one  # reproducible
    assert seeded_order(10, 0) == list(range(10)) and sorted(seeded_order(10, 3)) == list(range(10))
    assert seeded_order(10, 3) != seeded_order(10, 4)


def test_every_experiment_says_what_its_seed_changes():
    doc = (REPO / "docs" / "sweeps.md").read_text()
    table = doc[doc.index("## What a seed changes") :]
    for exp in registry().values():
        assert exp.seed_changes, f"{exp.name} does not say what its seed changes"
        assert f"`{exp.name}`" in table, f"docs/sweeps.md's seed table lacks {exp.name}"
    assert set(ON_TINY) | set(ON_BUNDLED) | NEEDS_SHARED == {
        e.name for e in registry().values() if e.in_study
    }


def _grid(path: Path, model: str, experiments: dict[str, dict]) -> Path:
    body = f'profile = "quick"\nseeds = [0, 1]\ndevice = "cpu"\nmodels = ["{model}"]\n'
    for name, options in experiments.items():
        body += f'\n[[experiments]]\nname = "{name}"\n'
        if options:
            inline = ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items())  # JSON values are TOML
            body += f"options = {{ {inline} }}\n"
    path.write_text(body)
    return path


def _point_estimates(summary, path: str = ""):
    """(path, value) of every number in a summary (an interval's value; wall-clock times left out)."""
    if isinstance(summary, dict):
        if "value" in summary and "n" in summary:
            yield path, summary["value"]
            return
        for k, v in summary.items():
            yield from _point_estimates(v, f"{path}.{k}")
    elif isinstance(summary, list):
        for i, v in enumerate(summary):
            yield from _point_estimates(v, f"{path}[{i}]")
    elif isinstance(summary, int | float) and not isinstance(summary, bool) and not TIMING.search(path):
        yield path, summary


@pytest.fixture(scope="module")
def two_seed_cells(tmp_path_factory):
    from kvlab.study.sweep import run_sweep

    tmp = tmp_path_factory.mktemp("seeds")
    cells = []
    for i, (model, exps) in enumerate(((TINY, ON_TINY), ("smollm2-135m", ON_BUNDLED))):
        grid = _grid(tmp / f"grid{i}.toml", model, {**exps, **{n: {} for n in NEEDS_SHARED if i == 0}})
        root = tmp / f"out{i}"
        cells += [{**c, "root": str(root)} for c in run_sweep(grid, root, workers=2)["cells"]]
    return cells


@pytest.mark.real_model  # a sweep on the bundled model, in worker processes
@pytest.mark.process
@pytest.mark.slow
def test_a_two_seed_sweep_gives_different_point_estimates(two_seed_cells):
    by: dict[str, dict[int, dict]] = {}
    for c in two_seed_cells:
        by.setdefault(c["experiment"], {})[c["seed"]] = c
    same = []
    for name, seeds in by.items():
        statuses = {c["status"] for c in seeds.values()}
        if name in NEEDS_SHARED and statuses == {"not_applicable"}:
            continue  # no shared conversations on this machine: nothing was sampled
        assert statuses == {"ok"}, (name, [c.get("error") for c in seeds.values()])
        a, b = dict(_point_estimates(seeds[0]["summary"])), dict(_point_estimates(seeds[1]["summary"]))
        changed = [k for k in a if k in b and a[k] != b[k]]
        if not changed or seeds[0]["headline"] == seeds[1]["headline"] and name != "findings":
            same.append(name)
    assert same == [], f"seeds 0 and 1 gave the same point estimates in {same}"
    assert set(by) == set(ON_TINY) | set(ON_BUNDLED) | NEEDS_SHARED


@pytest.mark.real_model  # a sweep on the bundled model, in worker processes
@pytest.mark.process
@pytest.mark.slow
def test_every_experiments_intervals_keep_the_statistics_rules(two_seed_cells):
    """Every study experiment, as the sweep wrote it (result.json and its page): no NaN interval, none
    from fewer than 5 samples, no collapsed proportion interval."""
    from tests.test_intervals import study_interval_problems

    problems, scanned = [], 0
    for c in two_seed_cells:
        if c["status"] == "ok":
            folder = Path(c["root"]) / c["folder"]
            scanned += (folder / "result.json").is_file() and (folder / "index.html").is_file()
            problems += study_interval_problems(folder)
    assert scanned >= 2 * (len(ON_TINY) + len(ON_BUNDLED))  # the scan read every cell's output
    assert problems == []
