"""``kvlab store ...`` end to end on the bundled model, and the store_reuse experiment's smoke run."""

from __future__ import annotations

import json

import pytest

from kvlab.cli import main

TEXT = (
    "The harbour master counted the boats at dawn, wrote their names in the ledger, and rang the bell twice."
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.real_model
def test_store_cli_put_ls_get_generate_verify_gc(smollm, tmp_path, capsys):
    store = str(tmp_path / "store")
    assert main(["store", "put", TEXT, "--store", store, "--block-tokens", "8", "--json"]) == 0
    put = json.loads(capsys.readouterr().out)
    assert put["blocks_written"] == put["tokens"] // 8 + (1 if put["tokens"] % 8 else 0)
    # a re-put from a new process writes nothing: its counts come from the disk tier, not its memory
    assert main(["store", "put", TEXT, "--store", store, "--block-tokens", "8", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["blocks_written"] == 0 and again["blocks_present"] == put["blocks_written"]
    assert main(["store", "ls", "--store", store, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == put["blocks_written"] and {r["tier"] for r in rows} == {"disk"}
    # people get a table / aligned lines, not JSON they did not ask for
    assert main(["store", "stats", "--store", store]) == 0
    human = capsys.readouterr().out
    assert not human.lstrip().startswith("{") and "blocks" in human
    out_file = tmp_path / "prefix.kv.safetensors"
    short = put["last_block"][:16]  # what `store ls` shows
    assert main(["store", "get", short, "--store", store, "--out", str(out_file), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == put["tokens"] and out_file.is_file() and got["block"] == put["last_block"]
    from kvlab.cache import load_snapshot

    snap = load_snapshot(out_file, expect_fingerprint=smollm.fingerprint)
    assert snap.token_list() == smollm.encode(TEXT)
    assert (
        main(
            [
                "store",
                "generate",
                TEXT + " Then",
                "-n",
                "3",
                "--store",
                store,
                "--block-tokens",
                "8",
                "--json",
            ]
        )
        == 0
    )
    gen = json.loads(capsys.readouterr().out)
    assert (
        gen["cached_tokens"] == put["tokens"]
        and gen["computed_tokens"] == gen["prompt_tokens"] - put["tokens"]
    )
    assert main(["store", "stats", "--store", store, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tiers"]["disk"]["blocks"] >= put["blocks_written"]
    assert main(["store", "verify", "--store", store, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["disk"]["corrupt"] == []
    victim = next((tmp_path / "store" / "blocks").glob("*/*.kvb"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main(["store", "verify", "--store", store, "--json"]) == 1  # 1: findings (2 is bad input)
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["disk"]["corrupt"]) == 1 and "1 bad block" in captured.err
    assert main(["store", "verify", "--repair", "--store", store, "--json"]) == 0
    capsys.readouterr()
    assert main(["store", "verify", "--store", store, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["disk"]["corrupt"] == []
    assert main(["store", "gc", "--store", store, "--json"]) == 0
    capsys.readouterr()


def test_store_cli_bad_input_is_one_line(tmp_path, capsys):
    assert main(["store", "ls", "--store", str(tmp_path / "nothing-here")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlab: error: no kvlab store") and err.count("\n") == 1
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "kvlab-store.json").write_text('{"format": "kvlab.store", "version": 1}')
    assert main(["store", "get", "ab" * 32, "--store", str(tmp_path / "s")]) == 2
    assert "no block" in capsys.readouterr().err
    assert main(["store", "get", "zz", "--store", str(tmp_path / "s")]) == 2
    assert "not a block hash" in capsys.readouterr().err
    assert main(["store", "gc", "--max-bytes", "1e400", "--store", str(tmp_path / "s")]) == 2
    assert "positive number of bytes" in capsys.readouterr().err
    # an unknown URL scheme is refused and creates nothing (no local folder named "ftp:")
    here = sorted(p.name for p in tmp_path.iterdir())
    assert main(["store", "ls", "--store", "ftp://127.0.0.1/x"]) == 2
    assert "scheme" in capsys.readouterr().err and sorted(p.name for p in tmp_path.iterdir()) == here
    assert main(["store", "gc", "--store", str(tmp_path / "s"), "--max-bytes", "lots"]) == 2
    assert "cannot read a size" in capsys.readouterr().err


@pytest.mark.real_model
@pytest.mark.slow
def test_store_reuse_experiment_smoke(smollm, tmp_path):
    from kvlab.study.experiments import ExperimentContext, get_experiment
    from kvlab.study.runner import run_experiment

    ctx = ExperimentContext(
        out_dir=tmp_path / "run",
        profile="quick",
        options={"lengths": [64, 192], "reps": 2, "questions": 2, "answer_tokens": 3},
    )
    ctx.model_handle = smollm
    result = run_experiment(get_experiment("store_reuse"), ctx)
    assert result.status == "ok"
    doc = json.loads((tmp_path / "run" / "result.json").read_text())
    assert doc["summary"]["prefix_lengths"] == [64, 192]
    assert all(v < 1e-3 for v in doc["summary"]["max_abs_logit_error_vs_full"].values())
    # the claim, measured: CacheBlend-style recompute is closer to a full prefill than rotation only
    kl = doc["summary"]["kl_mean"]
    assert kl["cacheblend"] < kl["none"] and kl["epic"] < kl["none"], kl
    # ... and per question, paired: 2 questions give no interval, so no verdict either way
    diff = doc["summary"]["cacheblend_minus_rotation_only_kl"]
    assert (
        diff["n"] == 2
        and diff["low"] is None
        and diff["value"] == pytest.approx(kl["cacheblend"] - kl["none"])
    )
    assert doc["summary"]["cacheblend_closer_than_rotation_only"] is None
    assert (tmp_path / "run" / "ttft_by_tier.png").is_file() and (
        tmp_path / "run" / "nonprefix_quality.png"
    ).is_file()
    assert (tmp_path / "run" / "arrays.npz").is_file()
