"""Every mistyped or invalid command line: exit 2, one line on stderr, no traceback, nothing written.

Each case runs the real ``kvlab`` entry point in its own process and its own empty folder, with a
deadline (``tests/cli_runner.py``: forked from one process that imported kvlab once, or with
``KVLAB_CLI_TABLES_SUBPROCESS=1`` as ``python -m kvlab``). All of them fail while parsing or validating,
before any model is loaded, so the whole file takes seconds. The hostile inputs of issue 27 (FIFOs,
huge and sparse files, /proc outputs, deep TOML, absurd configs, Ray addresses ...) are in
``tests/test_cli_hostile.py``.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.cli_runner import REPO, Runner, assert_one_line_exit_2, run_kvlab, selected_params

# (argv, a fragment the one error line must contain). FILE is an existing regular file, LATIN1 a
# file that is not UTF-8, EMPTY an empty file, OUT a fresh folder path that must not be created.
CASES = [
    (["inspct"], "No such command 'inspct'"),
    (["--versoin"], "No such option: --versoin"),
    (["inspect", "--windw", "3"], "No such option: --windw"),
    (["inspect", "smollm2-135m"], "unexpected extra argument"),
    (["inspect", "--dtype"], "requires an argument"),
    (["inspect", "--config", "/nonexistent/config.json"], "no config file"),
    (["inspect", "--out", "FILE"], "is a file"),
    (["study", "--only", "no-such-experiment"], "unknown experiment"),
    (["study", "--seed", "abc"], "valid integer"),
    (["study", "--quick", "--full"], "--quick or --full"),
    (["study", "--out", "FILE"], "is a file"),
    (["roll"], ""),  # a group without its subcommand prints its help and exits 2
    (["roll", "swep"], "No such command 'swep'"),
    (["roll", "sweep", "--context", "0"], "--context"),
    (["roll", "sweep", "--context", "abc"], "valid integer"),
    (["roll", "long", "--text", "/nonexistent.txt"], "is not a file"),
    (["roll", "long", "--text", "LATIN1"], "not UTF-8"),
    (["roll", "derotation", "-T", "EMPTY"], "is empty"),
    (["attention", "--roll", "0"], "--roll"),
    (["attention", "-r", "-3"], "--roll"),
    (["attention", "--samples", "0"], "--samples"),
    (["attention", "--window-tokens", "64"], "No such option"),
    (["compaction", "--limit", "2"], "--limit"),
    (["compress", "--bits", "0"], "--bits"),
    (["compress", "--keep", "nan"], "--keep"),
    (["compress", "--keep", "1.5"], "--keep"),
    (["train-evictor", "--steps", "-1"], "--steps"),
    (["stream-ppl", "--window", "0"], "--window"),
    (["stream-ppl", "--sinks", "-1"], "--sinks"),
    (["stream-ppl", "--tokens", "x"], "valid integer"),
    (["suffix", "--roll", "abc"], "neither a token count nor a share"),
    (["suffix", "--roll", "150%"], "between 0% and 100%"),
    (["suffix", "--roll", "0"], "at least one token"),
    (["suffix", "FILE"], "unexpected extra argument"),
    (["generate"], "Missing argument"),
    (["generate", "hi", "-n", "-5"], "--max-new-tokens"),
    (["generate", "hi", "-n", "abc"], "valid integer"),
    (["generate", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "hi", "--temperature", "-1"], "--temperature"),
    (["generate", "hi", "--window", "0"], "--window"),
    (["chat", "-n", "0"], "--max-new-tokens"),
    (["store", "gett"], "No such command 'gett'"),
    (["store", "get"], "Missing argument"),
    (["store", "put", "hello", "-s", "x"], "No such option: -s"),
    (["store", "put", "--text", "LATIN1"], "not UTF-8"),
    (["store", "generate", "hi", "-n", "0"], "--max-new-tokens"),
    (["store", "put", "hi", "--block-tokens", "0"], "--block-tokens"),
    (["transfer", "retention", "--facts", "99"], "--facts"),
    (["transfer", "kv-swap", "--roll", "0"], "--roll"),
    (["transfer", "finetune-derivative", "--lr", "inf"], "not a finite number"),
    (["transfer", "finetune-derivative", "--text", "/nonexistent"], "is not a file"),
    (["transfer", "layerz"], "No such command 'layerz'"),
    (["gc"], "Missing argument"),
    (["inspect", "--config", "CFG_BIG"], "cannot build"),
    (["inspect", "--config", "CFG_BERT"], "not a decoder-only"),
    (["inspect", "--config", "CFG_BINARY"], "not UTF-8"),
    (["inspect", "--config", "CFG_NEG_LAYERS"], "num_hidden_layers must be an integer >= 1"),
    (["inspect", "--out", "/proc/kvlab-cannot-be-here"], "cannot create folders"),
    (["study", "--out", "/proc/kvlab-cannot-be-here"], "cannot create folders"),
    (["inspect", "--model", "BROKEN_WEIGHTS"], "cannot be loaded"),
    (["store", "put", "hi", "--store", "new-store", "--model", "no-such-model"], "never downloads"),
    (["store", "generate", "hi", "--store", "new-store", "--model", "no-such-model"], "never downloads"),
    (["store", "ls", "--store", "ftp://127.0.0.1/x"], "scheme"),
    (["store", "gc", "--max-bytes", "1e400", "--store", "new-store"], "positive number of bytes"),
    (["suffix", "--text", "/nonexistent.txt"], "is not a file"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli-errors")
    (root / "file.txt").write_text("a regular file\n")
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    (root / "empty.txt").write_bytes(b"")
    llama = json.loads(
        (REPO / "tests" / "fixtures" / "model-configs" / "tinyllama-1.1b-chat-v1.0.json").read_text()
    )
    configs = {
        "CFG_BIG": {**llama, "hidden_size": "big"},
        "CFG_NEG_LAYERS": {**llama, "num_hidden_layers": -3},
        "CFG_BERT": {
            "model_type": "bert",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
        },
    }
    for key, cfg in configs.items():
        (root / f"{key}.json").write_text(json.dumps(cfg))
    (root / "CFG_BINARY.json").write_bytes(bytes(range(256)))
    broken = root / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(llama))
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    extra = {key: str(root / f"{key}.json") for key in [*configs, "CFG_BINARY"]}
    extra["BROKEN_WEIGHTS"] = str(broken)
    return {
        **extra,
        "FILE": str(root / "file.txt"),
        "LATIN1": str(root / "latin1.txt"),
        "EMPTY": str(root / "empty.txt"),
        "root": str(root),
    }


@pytest.fixture(scope="module")
def runner(request, files, tmp_path_factory):
    """Starts every selected case at once; each test waits for its own."""
    before = sorted(os.listdir(files["root"]))
    run = Runner(tmp_path_factory.mktemp("cli-errors-runs"))
    for argv in selected_params(request, "test_bad_command_line_is_one_line_exit_2", "argv"):
        run.submit(" ".join(argv), [files.get(a, a) for a in argv])
    yield run
    run.close()
    assert sorted(os.listdir(files["root"])) == before  # no input was changed or added to


def test_at_least_forty_kinds():
    assert len({tuple(a) for a, _ in CASES}) >= 40


@pytest.mark.parametrize("argv, fragment", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_command_line_is_one_line_exit_2(runner, argv, fragment):
    assert_one_line_exit_2(runner.result(" ".join(argv)), fragment, usage_ok=argv == ["roll"])


@pytest.mark.process
def test_version_and_help_exit_0(tmp_path):
    version = run_kvlab(["--version"], cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("kvlab ")
    for argv in (["--help"], ["inspect", "--help"], ["store", "put", "--help"], ["roll", "sweep", "--help"]):
        proc = run_kvlab(argv, cwd=tmp_path)
        assert proc.returncode == 0 and "Usage" in proc.stdout, (argv, proc.stderr)


SAMPLE = [  # forked and real `python -m kvlab` runs agree (the tables fork from one process)
    ["inspect", "--config", "CFG_NEG_LAYERS"],
    ["roll", "long", "--text", "LATIN1"],
    ["compress", "--keep", "nan"],
    ["suffix", "--text", "/nonexistent.txt"],
]


@pytest.mark.process
def test_forked_cases_match_python_m_kvlab(files, tmp_path):
    (tmp_path / "forked").mkdir()
    forked = Runner(tmp_path / "forked")
    for argv in SAMPLE:
        forked.submit(" ".join(argv), [files.get(a, a) for a in argv])
    for i, argv in enumerate(SAMPLE):
        (tmp_path / f"real-{i}").mkdir()
        real = run_kvlab([files.get(a, a) for a in argv], cwd=tmp_path / f"real-{i}")
        fork = forked.result(" ".join(argv))
        assert (fork.returncode, fork.stdout, fork.stderr) == (real.returncode, real.stdout, real.stderr)
