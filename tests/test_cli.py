"""The command line: known answers, reports on disk, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvlab.cli import main
from tests.conftest import CONFIG_DIR, config_path


def run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect_config_tinyllama_fp16(capsys, tmp_path):
    code, out, _ = run_cli(
        capsys,
        "inspect",
        "--config",
        str(config_path("llama")),
        "--dtype",
        "float16",
        "--json",
        "--out",
        str(tmp_path),
    )
    assert code == 0
    doc = json.loads(out)
    assert doc["summary"]["bytes_per_token"] == 22_528  # the Phase 1 log's figure


def test_inspect_config_llama70b_has_crossover(capsys, tmp_path):
    path = CONFIG_DIR / "llama-3.1-70b.json"
    code, out, _ = run_cli(capsys, "inspect", "--config", str(path), "--json", "--out", str(tmp_path))
    doc = json.loads(out)
    assert code == 0 and doc["summary"]["bytes_per_token"] == 327_680
    crossover = doc["summary"]["crossover_tokens"]["bfloat16/batch1"]
    # 70.6e9 bf16 parameters (141 GB) / 327,680 bytes per token ~ 430k tokens.
    assert 400_000 < crossover < 460_000


@pytest.mark.parametrize(
    "args, message",
    [
        (["inspect", "--model", "no-such-org/no-such-model"], "never downloads"),
        (["inspect", "--config", "/nonexistent/config.json"], "no config file"),
        (["inspect", "--prompt", "   "], "empty"),
        (["inspect", "--config", "PLACEHOLDER", "--dtype", "float7"], "unknown dtype"),
        (["study", "--only", "no-such-experiment"], "unknown experiment"),
        (["study", "--only", "kv_swap,no-such-experiment"], "unknown experiment(s) no-such-experiment;"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, args, message):
    args = [str(config_path("llama")) if a == "PLACEHOLDER" else a for a in args]
    code, _, err = run_cli(capsys, *args, "--out", str(tmp_path))
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_only_takes_names_repeated_or_comma_separated():
    from kvlab.cli.study import _only_names

    assert _only_names(["kv_swap,store_reuse", " inspect "]) == ["kv_swap", "store_reuse", "inspect"]
    assert _only_names(None) is None and _only_names([]) == []


@pytest.mark.process
def test_cli_process_exit_code_and_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvlab", "inspect", "--model", "not/a-model", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "kvlab inspect: error:" in proc.stderr


@pytest.mark.real_model
def test_inspect_bundled_model_writes_a_report(capsys, tmp_path, smollm):
    code, out, _ = run_cli(capsys, "inspect", "--quick", "--json", "--out", str(tmp_path))
    assert code == 0
    doc = json.loads(out)
    report = tmp_path / doc["report_dir"].split("/")[-1]
    assert (report / "index.html").is_file() and (report / "result.json").is_file()
    pngs = sorted(p.name for p in report.glob("*.png"))
    assert {"growth.png", "sinks_per_position.png", "sink_by_layer.png"} <= set(pngs)
    html = (report / "index.html").read_text()
    assert all(name in html for name in pngs)
    s = doc["summary"]
    assert s["bytes_per_token"] == s["measured_bytes_per_token"] == 46_080
    assert s["sinks"]["pos0_over_median"] > 5  # position 0 is the attention sink of this model


@pytest.mark.real_model
def test_study_quick_only_inspect(capsys, tmp_path, smollm):
    code, out, _ = run_cli(capsys, "study", "--quick", "--only", "inspect", "--out", str(tmp_path))
    assert code == 0
    (run,) = list(tmp_path.glob("study-*"))
    assert (run / "index.html").is_file() and (run / "inspect" / "result.json").is_file()
    assert "inspect/growth.png" in (run / "index.html").read_text()


def test_bad_input_leaves_no_run_folder(capsys, tmp_path):
    code, _, _ = run_cli(capsys, "inspect", "--config", "/nonexistent/config.json", "--out", str(tmp_path))
    assert code == 2 and list(tmp_path.iterdir()) == []
