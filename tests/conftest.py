"""Shared fixtures: the bundled real model (loaded once per session) and tiny random models per family."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The suite never reads ../shared implicitly: with it beside the checkout (CI, the study machine) the
# experiments would pick the shared books instead of what a fresh clone uses. Tests about the shared-data
# code use the small copy in tests/fixtures/shared-data (the ``shared_data`` fixture).
os.environ["KVLAB_SHARED_DATA"] = "none"
# Two threads on this 2-core machine; an explicit OMP_NUM_THREADS (e.g. 1 on a loaded machine) wins.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

REPO = Path(__file__).resolve().parents[1]
# Copies of the public configs the tiny random-weight models are built from (kept in the repository so
# a clone without ../shared runs every test).
CONFIG_DIR = Path(__file__).resolve().parent / "fixtures" / "model-configs"

# Families the RoPE and cache tests run on.
FAMILY_CONFIGS = {
    "llama": "tinyllama-1.1b-chat-v1.0.json",
    "qwen2": "qwen2.5-7b.json",
    "mistral": "mistral-7b-v0.1.json",
    "phi": "phi-2.json",
    "llama3-scaling": "llama-3.1-8b.json",
    "smollm2": "smollm2-135m-instruct.json",
}
# More families for the matrix tests (tests/test_family_matrix.py, test_padded_batches.py): one RoPE per
# layer, layers without RoPE, no RoPE at all, and Phi-3's split.
EXTRA_CONFIGS = {
    "gemma3": "gemma-3-tiny-hybrid-rope.json",  # local (sliding 64, base 1e4) and global (base 1e6) layers
    "smollm3": "smollm3-3b-nope-layers.json",  # every fourth layer without RoPE (build with layers=4)
    # Phi-3-mini-4k's config with Phi-4-mini's partial rotary split (0.75; without its longrope scaling)
    "phi3": "phi-3-mini-partial-rotary.json",
    "gpt2": "gpt2.json",  # learned absolute positions, no RoPE
}


SHARED_DATA_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "shared-data"


def config_path(family: str) -> Path:
    return CONFIG_DIR / {**FAMILY_CONFIGS, **EXTRA_CONFIGS}[family]


@pytest.fixture(scope="session")
def smollm():
    """The bundled SmolLM2-135M model, fp32 (converted once into ~/.cache/kvlab on first use)."""
    from kvlab import load_model

    return load_model("smollm2-135m")


_TINY: dict = {}


@pytest.fixture
def shared_data(monkeypatch) -> Path:
    """Points kvlab at a small copy of ../shared/data (an excerpt of Frankenstein, two UltraChat
    conversations) for tests that are about the shared-data code itself."""
    monkeypatch.setenv("KVLAB_SHARED_DATA", str(SHARED_DATA_FIXTURE))
    return SHARED_DATA_FIXTURE


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: ``tiny_model("qwen2")`` -> a small random-weight ModelHandle of that family (cached)."""
    from kvlab.model.random import tiny_random_model

    def make(family: str, **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in _TINY:
            _TINY[key] = tiny_random_model(config_path(family), **kw)
        return _TINY[key]

    return make


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module (restored afterwards): the tiny models used by the cache, store
    and streaming tests spend more on thread hand-offs than on maths, and this CPU is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_llama_2x64():
    """A 2-layer Llama (hidden 64, 4 heads, 2 KV heads of 16) with random weights: the compression tests' model."""
    from transformers import LlamaConfig

    from kvlab.model.random import tiny_random_model

    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return tiny_random_model(cfg, head_dim=16, layers=2)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """With ``KVLAB_TEST_NO_SKIPS=1`` (CI, ``make test``) a skipped test fails the run: a skip is a test
    that did not run, and a green run must not hide one."""
    if os.environ.get("KVLAB_TEST_NO_SKIPS") != "1":
        return
    skipped = terminalreporter.stats.get("skipped", [])
    if skipped:
        terminalreporter.write_line(
            f"KVLAB_TEST_NO_SKIPS=1: {len(skipped)} test(s) skipped; install what their reasons name "
            "(scripts/install-test-deps.sh) or unset KVLAB_TEST_NO_SKIPS",
            red=True,
        )
        for report in skipped:
            terminalreporter.write_line(f"  skipped: {report.nodeid}: {report.longrepr[-1]}")


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("KVLAB_TEST_NO_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and reporter.stats.get("skipped") and session.exitstatus == 0:
        session.exitstatus = 1


def start_redis_server(workdir):
    """A private redis-server on a free 127.0.0.1 port with ``workdir`` as its folder (no RDB/AOF files):
    ``(url, process)``; skips where redis-server is not installed, fails where it cannot start."""
    import shutil
    import socket
    import subprocess
    import time

    import redis

    binary = shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/sbin/redis-server") if os.access(p, os.X_OK)), None
    )
    if binary is None:
        pytest.skip(
            "no Redis: KVLAB_TEST_REDIS_URL is unset and redis-server is not installed "
            "(apt-get install -y redis-server, or run scripts/install-test-deps.sh)"
        )
    failures = []
    for _attempt in range(3):  # another process may take the free port between bind and start
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = workdir / f"redis-{port}.log"
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir)]
            + ["--logfile", str(log), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url, socket_timeout=2)
        deadline = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            code = proc.poll()
            proc.kill()
            proc.wait(timeout=10)
            err = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
            why = f"exited with code {code}" if code is not None else "no answer within 15 s"
            failures.append(f"port {port}: {why}" + (f" ({err[-1]})" if err else ""))
            continue
        client.close()
        return url, proc
    # an installed redis-server that cannot start is a failure, not a skip
    pytest.fail(f"{binary} did not start: " + "; ".join(failures))


def stop_process(proc) -> None:
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real Redis: $KVLAB_TEST_REDIS_URL, or a private redis-server started here on a free 127.0.0.1 port
    with its own temp dir (no RDB/AOF files, nothing written beside the checkout), stopped at session end."""
    url = os.environ.get("KVLAB_TEST_REDIS_URL")
    if url:
        yield url
        return
    url, proc = start_redis_server(tmp_path_factory.mktemp("redis"))
    try:
        yield url
    finally:
        stop_process(proc)
