"""Cheap paths stay cheap: listing, help and refusals never import torch or transformers.

``kvlab experiments``, every ``--help`` and a refused option value (a mistyped ``--cache`` spec, a policy
a command cannot run) are answered while the options are read, from tables that name what the heavy
modules hold (:data:`kvlab.study.experiments.CATALOGUE`, :mod:`kvlab.policy.catalogue`). Each command
line runs in its own process, as a shell runs it; the process reports which of torch and transformers
it imported. The tables are checked against the registries they name. How long these take is measured
by ``benchmarks/cheap_paths.py`` (benchmarks/results/cheap_paths.md), not asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

HEAVY = ("torch", "transformers")
CALIBRATION = str(Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "ruler_calibration.json")
#: runs ``kvlab.cli.main(argv)`` and writes which heavy modules it imported to the file named first
CHILD = f"""
import json, sys
from kvlab.cli import main
try:
    code = main(sys.argv[2:])
finally:
    heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)
    open(sys.argv[1], "w").write(json.dumps(heavy))
sys.exit(code)
"""


def run_cli(argv: list[str], tmp_path: Path) -> tuple[int, str, str, list[str]]:
    """``kvlab ARGV`` in a fresh process: exit code, stdout, stderr and the heavy modules it imported."""
    report = tmp_path / "heavy.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(report), *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    return proc.returncode, proc.stdout, proc.stderr, json.loads(report.read_text())


HELPS = [
    ["--help"],
    ["generate", "--help"],
    ["stream-ppl", "--help"],
    ["serve", "--help"],
    ["study", "--help"],
    ["roll", "sweep", "--help"],
    ["eval", "ruler", "--help"],
    ["store", "put", "--help"],
    ["transfer", "kv-swap", "--help"],
    ["model-path", "--help"],
]


@pytest.mark.parametrize("argv", HELPS, ids=" ".join)
def test_help_imports_neither_torch_nor_transformers(argv, tmp_path):
    code, out, err, heavy = run_cli(argv, tmp_path)
    assert code == 0, err
    assert "Usage" in out
    assert heavy == []


def test_experiments_lists_every_experiment_without_importing_them(tmp_path):
    from kvlab.study.experiments import CATALOGUE

    code, out, err, heavy = run_cli(["experiments"], tmp_path)
    assert code == 0, err
    assert all(name in out for name in CATALOGUE)
    assert heavy == []


REFUSALS = [
    (["generate", "hi", "--dtype", "float32", "--cache", "snapkvv:0.5"], "unknown item 'snapkvv'"),
    (["generate", "hi", "--cache", "sinks=4,window=40,codec=kivi4"], "holds none"),
    (["stream-ppl", "--cache", "kivi5"], "unsupported bit width 5"),
    (["generate", "hi", "--cache", "kvzip,keep=0.5"], "runs offline only"),
    (["generate", "hi", "--cache", "snapkv,keep=0.5,heads=global"], "heads=global runs offline only"),
    (["stream-ppl", "--cache", "h2o,keep=0.5,heads=global"], "heads=global runs offline only"),
    (["generate", "hi", "--cache", "h2o,budget=64,every=8,prefix=kvzip"], "drop prefix="),
    (["eval", "ruler", "--cache", "h2o,keep=0.5,prefix=kvzip"], "name that score instead"),
    (["stream-ppl", "--cache", "int4", "--cache", "codec=pertoken4"], "given twice"),
    (["eval", "ruler", "--cache", "bogus"], "unknown item 'bogus'"),
    (["eval", "ruler", "--cache", "h2o,keep=0.5,every=32"], "compresses the context once"),
    (["eval", "ruler", "--cache", "h2o,keep=0.5,codec=kivi4"], "reads slots along tokens"),
    (["eval", "ruler", "--cache", "snapkv"], "give one budget"),
    (["eval", "ruler", "--positions", "gapless"], "unknown positions convention(s) 'gapless'"),
    (["eval", "ruler", "--cache", "h2o,keep=0.5,heads=ada", "--positions", "cache"], "a shared budget"),
    (["serve", "--cache", "bogus"], "unknown item 'bogus'"),
    (["serve", "--cache", "snapkv:0.5"], "add every=N"),
    (["serve", "--cache", "h2o,budget=64,every=8,heads=ada"], "per-head budgets"),
    (["serve", "--cache", "int4"], "kvlab serve runs sinks + window caches"),
    (["serve", "--cache", "sinks=4,window=256", "--window", "64"], "drop --window"),
    (["study", "--only", "rol_sweep"], "unknown experiment(s) rol_sweep"),
    (["study", "--only", "kv_swap,rol_sweep"], "unknown experiment(s) rol_sweep"),
    (["eval", "ruler", "--calibration", "/no/such/calibration.json"], "cannot read it"),
    (
        ["eval", "ruler", "--calibration", CALIBRATION, "--lengths", "2048"],
        "no entry for niah_single at 2048 tokens",
    ),
    (["compress", "--method", "kivi+sink"], "unknown quantizer(s) 'kivi+sink'"),
    (["compress", "--policy", "snap"], "unknown policy(ies) 'snap'"),
    (["store", "gc", "--max-bytes", "lots"], "cannot read a size"),
    (["attention", "--dtype", "float8"], "unknown dtype 'float8'"),
    (["model-path", "--model", ""], "empty model name"),
    (["attention", "--model", "no-such-org/no-such-model"], "never downloads"),
    (["serve", "--cache", "sinks=4,window=256", "--model", "/no/such/folder"], "never downloads"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_refusals_are_one_line_before_torch(argv, message, tmp_path):
    code, out, err, heavy = run_cli(argv, tmp_path)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and message in lines[0], err
    assert out == ""
    assert heavy == []
    assert list(tmp_path.iterdir()) == [tmp_path / "heavy.json"]  # nothing created


def test_model_path_of_a_local_folder_is_that_folder(tmp_path):
    folder = tmp_path / "my model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    code, out, err, heavy = run_cli(["model-path", "--model", str(folder)], tmp_path)
    assert code == 0, err
    assert out == f"{folder.resolve()}\n" and heavy == []


@pytest.mark.real_model
def test_model_path_prints_the_converted_bundled_model_alone(tmp_path):
    """Only the folder on stdout (it composes in a shell); the folder is the one kvlab loads, and
    transformers reads it as a model folder."""
    from transformers import AutoConfig

    from kvlab.model.loading import bundled_model_dir

    code, out, err, _ = run_cli(["model-path"], tmp_path)
    assert code == 0, err
    assert out.count("\n") == 1
    path = Path(out.strip())
    assert path == bundled_model_dir().resolve()
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    assert AutoConfig.from_pretrained(path).model_type == "llama"


def test_the_experiment_catalogue_equals_what_the_modules_define():
    from kvlab.study.experiments import CATALOGUE, registry

    defined = {name: (e.title, e.in_study) for name, e in registry().items()}
    assert list(CATALOGUE.items()) == list(defined.items())  # the same, in study order


def test_the_spec_catalogue_equals_the_registries():
    """Every score and codec a spec names (read without torch) is a registered class with these facts."""
    from kvlab.policy.catalogue import CODECS, SCORES, SUPPORTED_BITS, VARIANTS
    from kvlab.policy.evict import POLICIES
    from kvlab.policy.quant.methods import QUANTIZERS, make_quantizer, quantizer_names
    from kvlab.policy.quant.scalar import SUPPORTED_BITS as SCALAR_BITS

    assert tuple(POLICIES) == SCORES
    assert list(CODECS) + list(VARIANTS) == quantizer_names()
    assert SUPPORTED_BITS is SCALAR_BITS
    for name in [*CODECS, *VARIANTS]:
        facts = CODECS[VARIANTS.get(name, name)]
        kind = VARIANTS.get(name, name)
        assert QUANTIZERS[kind].fixed_bits == facts.fixed_bits, name
        for bits in [facts.fixed_bits] if facts.fixed_bits else SUPPORTED_BITS:
            q = make_quantizer(name, bits)
            got = (q.window, q.token_multiple() > 1, q.uses_positions, q.rolling_block())
            assert got == (facts.tail, facts.along_tokens, facts.uses_positions, facts.block), (name, bits)


def test_the_compress_command_names_what_the_experiment_measures():
    from kvlab.cli.compress import quant_labels
    from kvlab.policy.catalogue import SCORES
    from kvlab.study.experiments.compression import POLICY_NAMES, QUANT_METHODS

    assert quant_labels() == list(QUANT_METHODS)
    assert SCORES == POLICY_NAMES
