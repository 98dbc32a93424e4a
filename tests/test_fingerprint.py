"""A model's fingerprint follows its weights: a checkpoint swapped in with its size and mtime kept
(``cp -p``, ``rsync -a``) gets a new fingerprint, and concurrent memo writers lose nothing."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil

import pytest

from kvlab.model import load_model
from kvlab.model.memo import file_identity, memo_get, memo_put
from kvlab.model.random import tiny_random_model
from tests.conftest import config_path


def _save(tmp_path, name, seed):
    handle = tiny_random_model(config_path("llama"), seed=seed)
    folder = tmp_path / name
    handle.model.save_pretrained(folder, safe_serialization=True)
    return folder


def test_cp_p_of_another_checkpoint_changes_the_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path / "cache"))
    a, b = _save(tmp_path, "a", 0), _save(tmp_path, "b", 1)
    weights_a, weights_b = a / "model.safetensors", b / "model.safetensors"
    assert weights_a.stat().st_size == weights_b.stat().st_size  # same shape, different values
    before = load_model(str(a), reuse=False).fingerprint
    assert load_model(str(a), reuse=False).fingerprint == before  # served from the memo
    assert (tmp_path / "cache" / "weights-digests.json").is_file()
    stat = weights_a.stat()
    shutil.copy2(weights_b, weights_a)  # cp -p: contents replaced in place, mtime copied
    os.utime(weights_a, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the old mtime restored exactly
    assert weights_a.stat().st_size == stat.st_size and weights_a.stat().st_mtime_ns == stat.st_mtime_ns
    after = load_model(str(a), reuse=False).fingerprint
    assert after != before
    assert after == load_model(str(b), reuse=False).fingerprint


def test_identity_changes_with_ctime_even_when_size_and_mtime_are_kept(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 100)
    first = file_identity(f)
    st = f.stat()
    f.write_bytes(b"y" * 100)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_identity(f) != first


def _writer(memo: str, worker: int, n: int) -> None:
    from pathlib import Path

    for i in range(n):
        memo_put(Path(memo), f"w{worker}-{i}", f"digest-{worker}-{i}")


@pytest.mark.process
@pytest.mark.parametrize("workers, per_worker", [(4, 40)])
def test_concurrent_memo_writers_lose_nothing(tmp_path, workers, per_worker):
    memo = tmp_path / "memo" / "digests.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(memo), w, per_worker)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    for w in range(workers):
        for i in range(per_worker):
            assert memo_get(memo, f"w{w}-{i}") == f"digest-{w}-{i}"
    assert not [p for p in memo.parent.iterdir() if p.suffix == ".tmp"]  # no temp left behind
