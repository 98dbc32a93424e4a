"""A store folder that a hostile or unlucky world has put things into (issue 27, items 7 and 8).

Where a block file belongs there may be a FIFO (which would block an open forever), a symbolic link to
``/dev/zero`` (which never ends), a folder, a header of JSON nested 100,000 levels deep (which used to
escape as a RecursionError), or a block that passes its checksum but whose values are narrower than
the model's (which used to be served and fail every request with that prefix inside the model). Each
must be refused or reported, within a second, by a lookup (a miss, never a hit) and by ``kvlab store
verify`` (the real command line, in a subprocess: exit code 1, one line per finding, no traceback);
and the geometry (K and V head sizes, KV heads, layers, dtype) is checked on put and load too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvlab.cache import load_snapshot, save_snapshot
from kvlab.errors import IncompatibleCacheError, SnapshotFileError
from kvlab.store import KVStore, open_store
from kvlab.store.block import Block, encode_block
from kvlab.store.inventory import list_blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BT = 8  # tokens per block: IDS is two full blocks and a 4-token tail
IDS = list(range(5, 5 + 20))
KINDS = ("fifo", "dev_zero_link", "directory", "deep_json", "narrow_v")
# what `kvlab store verify` says about each
REASONS = {
    "fifo": "a FIFO, not a block file",
    "dev_zero_link": "a symbolic link, not a block file",
    "directory": "a folder, not a block file",
    "deep_json": "nested deeper than",
    "narrow_v": "do not have its namespace's geometry",
}
DEADLINE_S = 1.0  # every refusal, in process
CLI_TIMEOUT_S = 120  # a hang fails the test instead of stalling the suite (startup alone takes seconds here)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("smollm2", layers=2, head_dim=16)


@pytest.fixture(scope="module")
def full(tiny):
    return tiny.prefill(IDS).snapshot


def _block_path(st: KVStore, root: Path, hashes: tuple[str, ...], i: int, tiny) -> Path:
    parent = st.namespace(tiny).root if i == 0 else hashes[i - 1]
    return root / "blocks" / parent / f"{hashes[i]}.kvb"


def _plant(kind: str, path: Path, block: Block) -> None:
    """Replace the block file at ``path`` by the hostile thing ``kind``."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero_link":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_bytes(b"x")
    elif kind == "deep_json":  # far past Python's recursion limit: the C parser raises RecursionError
        header = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)
    elif kind == "narrow_v":  # the same name, tokens and checksum discipline; values half as wide
        narrow = Block(
            block.hash,
            block.parent,
            block.namespace,
            block.start,
            block.token_ids,
            block.keys.clone(),
            block.values[..., : block.values.shape[-1] // 2].clone(),
            block.namespace_info,
        )
        path.write_bytes(encode_block(narrow))
    else:
        raise AssertionError(kind)


def _hostile_store(root: Path, kind: str, which: int, tiny, full, ids=IDS) -> tuple[KVStore, tuple[str, ...]]:
    st = open_store(root, block_tokens=BT)
    snap = full if ids is IDS else tiny.prefill(ids).snapshot
    rep = st.put(snap, model=tiny)
    path = _block_path(st, root, rep.hashes, which, tiny)
    _plant(kind, path, st.tiers[1].find(rep.hashes[which]))
    return st, rep.hashes


@pytest.mark.parametrize("which", [1, 2], ids=["full-block", "tail-block"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_lookup_refuses_it_reports_it_and_a_put_repairs_it(tmp_path, tiny, full, kind, which, caplog):
    root = tmp_path / "st"
    _hostile_store(root, kind, which, tiny, full)
    reader = open_store(root, block_tokens=BT)  # a fresh process: nothing in its memory tier
    disk = reader.tiers[1]
    with caplog.at_level("WARNING", logger="kvlab.store"):
        started = time.perf_counter()
        m = reader.lookup(IDS, reader.namespace(tiny))
        took = time.perf_counter() - started
    assert took < DEADLINE_S, f"{kind}: the lookup took {took:.2f} s"
    assert m.cached_tokens == BT * which  # everything before the hostile block, nothing from it
    for a, b in zip(m.snapshot.values, full.values, strict=True):
        assert torch.equal(a, b[:, :, : BT * which])
    assert disk.counters.corrupt + reader.misfit_blocks >= 1 and "kvlab store" in caplog.text  # reported
    assert "Traceback" not in caplog.text
    # the hostile thing was moved to quarantine, so putting the prefix again stores the real block
    reader.put(full, model=tiny)
    again = open_store(root, block_tokens=BT).lookup(IDS, reader.namespace(tiny))
    assert again.cached_tokens == len(IDS)
    for a, b in zip(again.snapshot.values, full.values, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_verify_and_ls_report_it_without_reading_it(tmp_path, tiny, full, kind):
    root = tmp_path / "st"
    st, hashes = _hostile_store(root, kind, 1, tiny, full)
    started = time.perf_counter()
    report = open_store(root, create=False, block_tokens=BT).verify()["disk"]
    rows = list_blocks(open_store(root, create=False, block_tokens=BT))
    took = time.perf_counter() - started
    assert took < DEADLINE_S, f"{kind}: verify and ls took {took:.2f} s"
    assert report["ok"] == 2 and len(report["corrupt"]) == 1
    assert hashes[1] in report["corrupt"][0]["path"] and REASONS[kind] in report["corrupt"][0]["reason"]
    assert len(rows) == 3 and {r["start"] for r in rows if r["hash"] == hashes[1]} <= {-1, BT}
    repaired = open_store(root, create=False, block_tokens=BT).verify(repair=True)["disk"]
    assert len(repaired["corrupt"]) == 1
    assert open_store(root, create=False, block_tokens=BT).verify()["disk"] == {
        "ok": 2,
        "corrupt": [],
        "temp_files": [],
    }


def _run_kvlab(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m kvlab ARGV`` in its own process group, killed (with everything it started) at the deadline."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlab", *argv],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"kvlab {' '.join(argv)} hung (killed after {CLI_TIMEOUT_S} s)")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.process
def test_kvlab_store_verify_reports_each_one_in_one_line(tmp_path, tiny, full):
    """One store holding all five, checked by the real command: one line per finding, exit code 1."""
    root = tmp_path / "st"
    planted = {}
    for n, kind in enumerate(KINDS):
        ids = [t + 50 * (n + 1) for t in IDS]  # five different prefixes in one store
        _, hashes = _hostile_store(root, kind, 1, tiny, full, ids=ids)
        planted[kind] = hashes[1]
    done = _run_kvlab(["store", "verify", "--store", str(root)], tmp_path)
    text = done.stdout + done.stderr
    assert done.returncode == 1, text
    assert "Traceback" not in text
    assert done.stderr.strip().splitlines() == [
        "kvlab store verify: 5 bad block(s); `kvlab store verify --repair` removes them"
    ]
    lines = done.stdout.splitlines()
    assert lines[0] == "disk: 10 good block(s), 5 bad, 0 leftover temp file(s)", text
    for kind, h in planted.items():
        mine = [line for line in lines if h in line]
        assert len(mine) == 1 and mine[0].startswith("  bad ") and REASONS[kind] in mine[0], (kind, text)
    # and the machine-readable report says the same
    doc = json.loads(_run_kvlab(["store", "verify", "--store", str(root), "--json"], tmp_path).stdout)
    assert len(doc["disk"]["corrupt"]) == 5


def test_a_narrow_value_cache_is_refused_by_put_and_load(tmp_path, tiny, full):
    """Values of half the model's head size, under the model's own fingerprint: refused at every door."""
    narrow = full.replace(values=tuple(v[..., :8].clone() for v in full.values), provenance="prefill")
    assert narrow.fingerprint == tiny.fingerprint and narrow.value_head_dim == 8 != tiny.facts.head_dim
    st = open_store(tmp_path / "st", block_tokens=BT)
    with pytest.raises(IncompatibleCacheError, match="V head size 8"):
        st.put(narrow, model=tiny)
    with pytest.raises(IncompatibleCacheError, match="V head size 8"):
        st.put(narrow)  # without a model, against the namespace's geometry
    assert st.stats()["tiers"]["disk"]["blocks"] == 0
    path = save_snapshot(narrow, tmp_path / "narrow.kv.safetensors")
    with pytest.raises(SnapshotFileError, match="V head size"):
        load_snapshot(path, model=tiny)
    assert load_snapshot(path).value_head_dim == 8  # a file of another geometry still loads without a model
    # one geometry for all layers: a snapshot whose layers' values differ is not a snapshot
    with pytest.raises(IncompatibleCacheError, match="one geometry"):
        full.replace(values=(full.values[0], full.values[1][..., :8]))


@pytest.mark.parametrize("depth", [100, 100_000])
def test_a_snapshot_header_nested_deep_is_refused(tmp_path, depth):
    header = b'{"__metadata__":{"kvlab":"{}"},"x":' + b"[" * depth + b"]" * depth + b"}"
    path = tmp_path / "deep.kv.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    started = time.perf_counter()
    with pytest.raises(SnapshotFileError, match="nested deeper than 32"):
        load_snapshot(path)
    assert time.perf_counter() - started < DEADLINE_S


def test_special_files_as_snapshots_are_refused_quickly(tmp_path):
    fifo, link = tmp_path / "fifo.kv.safetensors", tmp_path / "zero.kv.safetensors"
    os.mkfifo(fifo)
    link.symlink_to("/dev/zero")
    for path in (fifo, link, tmp_path):
        started = time.perf_counter()
        with pytest.raises(SnapshotFileError, match="not a regular file"):
            load_snapshot(path)
        assert time.perf_counter() - started < DEADLINE_S
