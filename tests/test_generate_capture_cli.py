"""``kvlab generate --capture compile|cuda-graph --cache SPEC``: a sinks + window spec runs on the ring.

The ring (:class:`~kvlab.hf.static_rolling.StaticRollingCache`) follows the dense rolling cache's rule, so a
greedy generation through its compiled steps writes what the spec's dense cache writes; a spec whose cache
has no captured step is refused in one line, before any model loads.
"""

from __future__ import annotations

import json

import pytest

from kvlab.cli import main

SPEC = "sinks=2,window=16,chunk=4"  # a 26-token prompt and 40 new tokens: rolls in the prefill and after


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny_serve import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def _generate(capsys, model_dir: str, *extra: str) -> dict:
    argv = [
        "generate",
        "once upon a time, far away",
        "-n",
        "40",
        "--json",
        "--model",
        model_dir,
        "--device",
        "cpu",
    ]
    assert main([*argv, *extra]) in (0, None)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_captured_spec_writes_what_its_dense_cache_writes(capsys, model_dir, one_torch_thread):
    dense = _generate(capsys, model_dir, "--cache", SPEC)  # auto on a CPU: the dense rolling cache
    ring = _generate(capsys, model_dir, "--cache", SPEC, "--capture", "compile")
    assert ring["tokens"] == dense["tokens"] == 40 and ring["text"] == dense["text"]
    assert ring["policy"] == dense["policy"] and ring["policy"]["spec"] == SPEC
    assert ring["cache"].startswith("StaticRollingCache(sinks=2, window=16, chunk=4, rebase=auto: ")
    flags = _generate(capsys, model_dir, "-s", "2", "-w", "16", "--evict-chunk", "4", "--capture", "compile")
    assert flags["text"] == ring["text"] and flags["cache"] == ring["cache"] and "policy" not in flags


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("full", "--capture compile runs sinks + window caches"),
        ("h2o,keep=0.5", "'h2o,keep=0.5' keeps"),
        ("sinks=4,window=64,codec=int4", "pertoken4 codes"),
        ("sinks=4,window=64,codec=fp8", "drop codec= or --capture"),
    ],
)
def test_specs_without_a_captured_step_are_refused_in_one_line(spec, fragment, capsys):
    code = main(["generate", "hi", "--cache", spec, "--capture", "compile"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and fragment in err[0], err
