"""Shared fixtures: the bundled real model (loaded once per session) and tiny random models per family."""

from __future__ import annotations

import ast
import functools
import os
import re
from pathlib import Path

import pytest
import torch

pytest_plugins = ["pytester"]  # tests/test_markers.py runs small suites in-process

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
    "qwen3": "qwen3-0.6b.json",  # queries and keys normalised per head (q_norm, k_norm) before RoPE
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


# --- Markers: the tests `make test-fast` leaves out (pyproject.toml declares them) ----------------------
# real_model: loads the bundled model. Auto-marked from the ``smollm`` fixture; an unmarked test that
#   resolves the bundled model in this process fails on the spot (the guard below).
# process: starts a process (subprocess, a server, redis-server, a Ray cluster, Chromium, workers).
#   Auto-marked from its fixtures (a fixture whose source starts one); a test whose own code (or a helper
#   it calls, in tests/) starts one must carry the marker itself, or collection fails.
REAL_MODEL_FIXTURES = {"smollm"}
TESTS_DIR = Path(__file__).resolve().parent
#: Calls that start a process: ``module.function(...)``, ``anything.Process(...)``, ``Popen(...)``.
SPAWN_FUNCTIONS = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "os": {"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "spawnv", "spawnl"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
    "ray": {"init"},
}
SPAWN_METHODS = {"Process", "Pool", "ProcessPoolExecutor"}
SPAWN_NAMES = {"Popen", "Process", "ProcessPoolExecutor"}


def _spawns(call: ast.Call) -> bool:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id in SPAWN_NAMES
    if not isinstance(f, ast.Attribute):
        return False
    if isinstance(f.value, ast.Name) and f.attr in SPAWN_FUNCTIONS.get(f.value.id, ()):
        return True
    return f.attr in SPAWN_METHODS


def _uses(node: ast.AST) -> tuple[bool, set[str]]:
    """Whether ``node`` (a top-level def) calls something that starts a process, and the global names it
    reads (not its parameters, not annotations: a parameter annotated ``Server`` starts nothing)."""
    params = set()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        params = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x}
    annotations = set()
    for n in ast.walk(node):
        if isinstance(n, ast.arg) and n.annotation is not None:
            annotations.add(n.annotation)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns is not None:
            annotations.add(n.returns)
        elif isinstance(n, ast.AnnAssign):
            annotations.add(n.annotation)
    skip = {id(sub) for a in annotations for sub in ast.walk(a)}
    spawns, names = False, set()
    for n in ast.walk(node):
        if id(n) in skip:
            continue
        spawns = spawns or (isinstance(n, ast.Call) and _spawns(n))
        if isinstance(n, ast.Name) and n.id not in params:
            names.add(n.id)
    return spawns, names


@functools.cache
def _module_scan(path: str) -> tuple[dict[str, tuple[bool, set[str]]], dict[str, tuple[str, str]]]:
    """A test source's top-level functions and classes (name -> :func:`_uses`) and what it imports from
    other modules of the suite (name -> (module, name))."""
    tree = ast.parse(Path(path).read_text(), filename=path)
    defs = {
        node.name: _uses(node)
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    imports = {
        (a.asname or a.name): (node.module, a.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.module.split(".")[0] in ("tests", "conftest")
        for a in node.names
    }
    return defs, imports


@functools.cache
def starts_process(path: str, name: str) -> bool:
    """Whether top-level ``name`` of the test source ``path`` starts a process, itself or through the
    functions and classes of the suite it uses (the suite's sources only: a library call that starts
    workers is not seen, so such a test carries the marker by hand)."""
    return _starts(path, name, set())


def _starts(path: str, name: str, seen: set[tuple[str, str]]) -> bool:
    if (path, name) in seen or "site-packages" in path or not path.endswith(".py") or not _may_spawn(path):
        return False
    seen.add((path, name))
    defs, imports = _module_scan(path)
    if name in imports:
        source = _suite_source(imports[name][0])
        return source.is_file() and _starts(str(source), imports[name][1], seen)
    if name not in defs:
        return False
    spawns, names = defs[name]
    return spawns or any(_starts(path, n, seen) for n in names - {name})


def _suite_source(module: str) -> Path:
    """The file of a suite module named in an import (``tests.cli_runner``, ``tests.conftest``, ``conftest``)."""
    parts = module.split(".")
    return (
        TESTS_DIR.joinpath(*parts[1:]).with_suffix(".py")
        if parts[0] == "tests"
        else TESTS_DIR / "conftest.py"
    )


@functools.cache
def _may_spawn(path: str) -> bool:
    """Whether the source, or a suite module it imports (transitively), so much as names a call that starts
    a process: the sources that cannot are never parsed (most of the suite; collection stays quick)."""
    words = [f"{m}.{f}" for m, fs in SPAWN_FUNCTIONS.items() for f in fs] + [*SPAWN_METHODS, *SPAWN_NAMES]
    todo, seen = [Path(path)], set()
    while todo:
        source = todo.pop()
        if source in seen or not source.is_file():
            continue
        seen.add(source)
        text = source.read_text()
        if any(w in text for w in words):
            return True
        todo += [
            _suite_source(m) for m in re.findall(r"^\s*from (tests(?:\.\w+)*|conftest) import", text, re.M)
        ]
    return False


def _fixture_starts_process(item: pytest.Function, name: str) -> bool:
    defs = item._fixtureinfo.name2fixturedefs.get(name) or ()
    return any(starts_process(d.func.__code__.co_filename, d.func.__name__) for d in defs)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    unmarked = []
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        if REAL_MODEL_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.real_model)
        if any(_fixture_starts_process(item, name) for name in item.fixturenames):
            item.add_marker(pytest.mark.process)
        # the test's file and name, not its function's: a decorator (hypothesis' @given) may wrap it
        if item.get_closest_marker("process") is None and starts_process(str(item.path), item.originalname):
            unmarked.append(item.nodeid)
    if unmarked:
        raise pytest.UsageError(
            f"{len(unmarked)} test(s) start a process but are not marked process "
            "(add @pytest.mark.process, or pytestmark = pytest.mark.process for the file):\n  "
            + "\n  ".join(unmarked)
        )


_MAIN_PID = os.getpid()
_RUNNING: list[pytest.Item] = []


def _guard_the_bundled_model() -> None:
    """Make ``kvlab.model.loading.bundled_model_dir`` (every in-process road to the bundled model) fail a
    test that is not marked real_model, before it reads anything (once per session)."""
    from kvlab.model import loading

    if getattr(loading.bundled_model_dir, "kvlab_guard", False):
        return
    original = loading.bundled_model_dir

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        item = _RUNNING[-1] if _RUNNING and os.getpid() == _MAIN_PID else None
        if item is not None and item.get_closest_marker("real_model") is None:
            pytest.fail(f"{item.nodeid} loads the bundled model: mark it real_model", pytrace=False)
        return original(*args, **kwargs)

    guarded.kvlab_guard = True  # type: ignore[attr-defined]
    loading.bundled_model_dir = guarded


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _guard_the_bundled_model()
    _RUNNING.append(item)
    try:
        return (yield)
    finally:
        _RUNNING.pop()
