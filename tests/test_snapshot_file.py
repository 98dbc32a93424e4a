"""Snapshot files (format v2): the digest covers metadata and tensors, the schema is validated in full,
non-regular files are refused, interrupted writes are cleaned up, and provenance survives operations.

Each case of issue 12 "Why" point 1 is a test here: header edits of num_layers, inv_freq, pairing and
the fingerprint; forged files (digest recomputed) with int8/mixed dtypes, bad positions, NaN,
out-of-vocabulary ids, an empty cache; a FIFO; and a save killed with SIGKILL mid-write.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from kvlab.cache import _fuzz as F
from kvlab.cache import load_snapshot, read_metadata, save_snapshot
from kvlab.cache.io import clean_temp_files, tensors_digest
from kvlab.errors import IncompatibleCacheError, SnapshotFileError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small():
    return F.small_snapshot()


@pytest.fixture(scope="module")
def real(smollm):
    return smollm.prefill(list(range(100, 112)), all_logits=False).snapshot


def _edit_meta(path: Path, edit) -> None:
    """Change the kvlab metadata in place, leaving the digest as it was (a careless or hostile edit)."""
    header, meta, body = F.split_file(path.read_bytes())
    edit(meta)
    header["__metadata__"] = {"kvlab": json.dumps(meta)}
    path.write_bytes(F.join_file(header, body))


def test_round_trip_is_identical_and_checks_the_model(tmp_path, real, smollm):
    p = save_snapshot(real, tmp_path / "a.kv.safetensors")
    got = load_snapshot(p, model=smollm)
    assert F.same_snapshot(got, real) and got.provenance == "prefill"
    meta = read_metadata(p)
    assert (
        meta["version"] == 2 and meta["num_layers"] == smollm.facts.num_layers and len(meta["digest"]) == 64
    )
    other = F.small_snapshot()
    save_snapshot(other, tmp_path / "b.kv.safetensors")
    with pytest.raises(IncompatibleCacheError):
        load_snapshot(tmp_path / "b.kv.safetensors", model=smollm)


def test_editing_num_layers_is_caught(tmp_path, real):
    p = save_snapshot(real, tmp_path / "a.kv.safetensors")
    _edit_meta(p, lambda m: m.update(num_layers=3))  # 30 -> 3: one byte
    with pytest.raises(SnapshotFileError):
        load_snapshot(p, expect_fingerprint=real.fingerprint)
    # Even with the tensors of the dropped layers removed, the digest no longer matches.
    header, meta, _ = F.split_file(save_snapshot(real, tmp_path / "b.kv.safetensors").read_bytes())
    t = {k: v for k, v in F.tensors_of(real).items() if not k.startswith(("k.", "v.")) or int(k[2:]) < 3}
    meta["num_layers"] = 3
    (tmp_path / "c.kv.safetensors").write_bytes(st_save(t, metadata={"kvlab": json.dumps(meta)}))
    with pytest.raises(SnapshotFileError, match="digest"):
        load_snapshot(tmp_path / "c.kv.safetensors", expect_fingerprint=real.fingerprint)


def test_one_digit_of_inv_freq_is_caught(tmp_path, real):
    p = save_snapshot(real, tmp_path / "a.kv.safetensors")
    data = p.read_bytes()
    header, meta, body = F.split_file(data)
    text = header["__metadata__"]["kvlab"]
    old = repr(meta["rope"]["inv_freq"][3])
    # An early digit: changing the 17th may round to the same double (same content, rightly accepted).
    digit = [i for i, c in enumerate(old) if c.isdigit() and (c != "0" or i > old.find("."))][3]
    new = old[:digit] + str((int(old[digit]) + 1) % 10) + old[digit + 1 :]
    assert text.count(old) == 1
    header["__metadata__"]["kvlab"] = text.replace(old, new)
    p.write_bytes(F.join_file(header, body))
    assert F.split_file(p.read_bytes())[1]["rope"]["inv_freq"][3] != meta["rope"]["inv_freq"][3]
    with pytest.raises(SnapshotFileError, match="digest"):
        load_snapshot(p)


def test_pairing_and_fingerprint_edits_are_caught(tmp_path, real, smollm):
    p = save_snapshot(real, tmp_path / "a.kv.safetensors")
    _edit_meta(p, lambda m: m["rope"].update(pairing="interleaved"))
    with pytest.raises(SnapshotFileError):
        load_snapshot(p)
    # A random model's snapshot with the real fingerprint typed into its header.
    q = save_snapshot(F.small_snapshot(), tmp_path / "b.kv.safetensors")
    _edit_meta(q, lambda m: m.update(fingerprint=smollm.fingerprint))
    with pytest.raises(SnapshotFileError):
        load_snapshot(q, expect_fingerprint=smollm.fingerprint)
    # ... and if the forger also recomputes the digest, model= still sees the geometry is not the model's.
    _, meta, _ = F.split_file(save_snapshot(F.small_snapshot(), tmp_path / "c.kv.safetensors").read_bytes())
    meta["fingerprint"] = smollm.fingerprint
    (tmp_path / "c.kv.safetensors").write_bytes(F.forge(F.tensors_of(F.small_snapshot()), meta))
    assert (
        load_snapshot(tmp_path / "c.kv.safetensors").fingerprint == smollm.fingerprint
    )  # undetectable alone
    with pytest.raises(SnapshotFileError, match="geometry"):
        load_snapshot(tmp_path / "c.kv.safetensors", model=smollm)


@pytest.mark.parametrize("kind", F.FORGE_KINDS)
def test_forged_files_with_a_recomputed_digest_are_refused(tmp_path, small, kind):
    """int8/int64/mixed dtypes, NaN/inf, negative or float positions, out-of-vocab ids, an empty cache..."""
    kind, data = F.forge_invalid(small, random.Random(0), kind)
    p = tmp_path / "f.kv.safetensors"
    p.write_bytes(data)
    with pytest.raises(SnapshotFileError):
        load_snapshot(p, expect_vocab_size=F.VOCAB)


def test_out_of_vocab_ids_need_the_vocabulary(tmp_path, small, real, smollm):
    t = F.tensors_of(small)
    t["token_ids"] = t["token_ids"].clone()
    t["token_ids"][0, 2] = F.VOCAB + 5
    _, meta, _ = F.split_file(F.save_snapshot_bytes(small))
    p = tmp_path / "f.kv.safetensors"
    p.write_bytes(F.forge(t, meta))
    assert load_snapshot(p).token_ids[0, 2] == F.VOCAB + 5  # valid for some vocabulary
    with pytest.raises(SnapshotFileError, match="vocabulary"):
        load_snapshot(p, expect_vocab_size=F.VOCAB)
    # model= checks the vocabulary too.
    t = F.tensors_of(real)
    t["token_ids"] = t["token_ids"].clone()
    t["token_ids"][0, 0] = smollm.facts.vocab_size
    _, meta, _ = F.split_file(F.save_snapshot_bytes(real))
    p.write_bytes(F.forge(t, meta))
    with pytest.raises(SnapshotFileError, match="vocabulary"):
        load_snapshot(p, model=smollm)


def test_non_regular_files_are_refused_without_hanging(tmp_path):
    fifo = tmp_path / "x.kv.safetensors"
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def run():
        try:
            load_snapshot(fifo)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(10)
    assert not th.is_alive(), "loading a FIFO hung"
    assert len(errors) == 1 and isinstance(errors[0], SnapshotFileError)
    with pytest.raises(SnapshotFileError, match="not a regular file"):
        read_metadata(tmp_path)
    with pytest.raises(SnapshotFileError, match="no snapshot"):
        load_snapshot(tmp_path / "missing.kv.safetensors")


def test_version_1_files_are_refused_unless_allowed(tmp_path, small):
    t = F.tensors_of(small)
    meta = {
        "format": "kvlab.snapshot",
        "version": 1,
        "fingerprint": small.fingerprint,
        "model_name": small.model_name,
        "rope": small.rope.to_json(),
        "num_layers": small.num_layers,
        "provenance": "prefill",
        "sha256": tensors_digest(t),
    }
    p = tmp_path / "v1.kv.safetensors"
    p.write_bytes(st_save(t, metadata={"kvlab": json.dumps(meta)}))
    with pytest.raises(SnapshotFileError, match="version-1"):
        load_snapshot(p)
    got = load_snapshot(p, allow_v1=True)
    assert got.provenance == "unknown"  # its metadata is unauthenticated
    assert all(torch.equal(a, b) for a, b in zip(got.keys, small.keys, strict=True))
    save_snapshot(got, p)  # re-saving upgrades it
    assert read_metadata(p)["version"] == 2 and F.same_snapshot(load_snapshot(p), got)


def test_rope_spec_from_json_validates():
    from kvlab.errors import BadInputError
    from kvlab.rope.spec import RopeSpec

    good = F.small_snapshot().rope.to_json()
    assert RopeSpec.from_json(good) == F.small_snapshot().rope
    for bad in (
        None,
        [],
        {**good, "pairing": "diagonal"},
        {**good, "inv_freq": ["x"]},
        {**good, "inv_freq": []},
        {**good, "head_dim": "8"},
        {**good, "shift_exact": 1},
        {**good, "attention_scaling": float("nan")},
        {k: v for k, v in good.items() if k != "theta"},
    ):
        with pytest.raises(BadInputError):
            RopeSpec.from_json(bad)


# -- interrupted writes ------------------------------------------------------------------------------
_KILLED_WRITER = r"""
import sys, time
from pathlib import Path
from safetensors.torch import save_file
import kvlab.cache.io as io
from kvlab.cache import _fuzz as F

def slow_save(tensors, filename, metadata=None):
    save_file(tensors, filename, metadata=metadata)
    data = Path(filename).read_bytes()
    Path(filename).write_bytes(data[: len(data) // 2])  # half written, as a killed writer leaves it
    print("writing", flush=True)
    time.sleep(60)

io.save_file = slow_save
io.save_snapshot(F.small_snapshot(seed=1), Path(sys.argv[1]))
"""


def _killed_save(target: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(target)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _temps(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(".kvlab.tmp"))


@pytest.mark.process
def test_a_save_killed_mid_write_leaves_the_old_file_and_gc_removes_the_temp(tmp_path, small):
    target = tmp_path / "a.kv.safetensors"
    save_snapshot(small, target)
    _killed_save(target)
    temps = _temps(tmp_path)
    assert len(temps) == 1 and temps[0].stat().st_size > 0
    assert F.same_snapshot(load_snapshot(target), small)  # the old file, untouched
    with pytest.raises(SnapshotFileError):
        load_snapshot(temps[0])  # the half-written temp never loads
    (tmp_path / "notes.tmp").write_text("not ours")
    (tmp_path / ".a.kv.safetensors.kvlab.tmp").write_text("not our pattern")
    assert clean_temp_files(tmp_path, older_than=3600) == []  # young, and its age is all gc looks at
    from kvlab.cli import main

    assert main(["gc", str(tmp_path), "--older-than", "0", "--no-dead-writers"]) == 0
    assert _temps(tmp_path) == [tmp_path / ".a.kv.safetensors.kvlab.tmp"]
    assert (tmp_path / "notes.tmp").exists() and F.same_snapshot(load_snapshot(target), small)
    assert main(["gc", str(tmp_path / "nowhere")]) == 2
    assert main(["gc", str(tmp_path), "--older-than", "nan"]) == 2


@pytest.mark.process
def test_the_next_save_removes_a_dead_writers_temp(tmp_path, small):
    target = tmp_path / "b.kv.safetensors"
    _killed_save(target)
    assert not target.exists() and len(_temps(tmp_path)) == 1
    time.sleep(0.01)
    save_snapshot(small, target)
    assert _temps(tmp_path) == [] and F.same_snapshot(load_snapshot(target), small)


# -- provenance --------------------------------------------------------------------------------------
def test_operations_record_provenance(small):
    from kvlab.ops import perturb, suffix, transfer
    from kvlab.policy.quant.snapshot import quantize_snapshot

    assert suffix.roll(small, 2, sinks=1).provenance == "rolled"
    assert suffix.roll(small, 2, sinks=1, reposition=False).provenance == "rolled"
    assert transfer.drop_prefix(small, 3, sinks=1).provenance == "rolled"
    assert transfer.transfer_layers(small, F.small_snapshot(seed=2), [0]).provenance == "transplanted"
    assert transfer.hybrid_kv(small, F.small_snapshot(seed=2)).provenance == "transplanted"
    assert small.with_positions(torch.arange(6) + 5).provenance == "repositioned"
    assert small.slice(0, 4).provenance == "prefill"
    from kvlab.policy.quant import make_quantizer

    q = quantize_snapshot(small, make_quantizer("pertoken", 4, group_size=8))
    assert q.decompress().provenance == "quantized"
    with pytest.raises(IncompatibleCacheError, match="exact prefill"):
        perturb.truncate(suffix.roll(small, 2), 1)
    assert perturb.truncate(small, 2).provenance == "prefill"


def test_save_refuses_what_load_would_refuse_before_writing(tmp_path, small):
    from kvlab.errors import BadInputError

    bad = small.replace(token_ids=small.token_ids - 200)  # negative ids
    with pytest.raises(BadInputError, match="cannot save"):
        save_snapshot(bad, tmp_path / "sub" / "a.kv.safetensors")
    assert not (tmp_path / "sub").exists()  # validated before creating anything
    lying = small.replace(positions=small.positions + 3, provenance="prefill")
    with pytest.raises(BadInputError, match="prefill"):
        save_snapshot(lying, tmp_path / "b.kv.safetensors")
    nan = small.replace(values=(small.values[0] * float("nan"), small.values[1]))
    p = save_snapshot(nan, tmp_path / "c.kv.safetensors")  # NaN can be saved, and is refused unless allowed
    with pytest.raises(SnapshotFileError, match="NaN"):
        load_snapshot(p)
    assert load_snapshot(p, allow_nonfinite=True).values[0].isnan().all()
    with pytest.raises(BadInputError):
        clean_temp_files(tmp_path, older_than=float("nan"))
    with pytest.raises(SnapshotFileError):
        clean_temp_files(tmp_path / "nowhere")


def test_repeated_json_keys_are_refused(tmp_path, small):
    """A repeated key could be read one way by the checks and another by safetensors: refuse it."""
    header, meta, body = F.split_file(F.save_snapshot_bytes(small))
    text = json.dumps(meta)
    header["__metadata__"] = {"kvlab": text[:-1] + ', "num_layers": 1}'}
    p = tmp_path / "d.kv.safetensors"
    p.write_bytes(F.join_file(header, body))
    with pytest.raises(SnapshotFileError, match="repeats"):
        load_snapshot(p)
    raw = json.dumps(header)
    entry = json.dumps({"k.0": header["k.0"]})[1:-1]
    p.write_bytes(_raw_header(raw[:-1] + ", " + entry + "}", body))
    with pytest.raises(SnapshotFileError, match="repeats"):
        load_snapshot(p)


def _raw_header(text: str, body: bytes) -> bytes:
    data = text.encode()
    data += b" " * (-len(data) % 8)
    return len(data).to_bytes(8, "little") + data + body


_LOOPING_WRITER = r"""
import sys
from pathlib import Path
from kvlab.cache import save_snapshot
from kvlab.cache import _fuzz as F

snaps = [F.small_snapshot(seed=s, layers=4, tokens=3000) for s in (1, 2)]
print("ready", flush=True)
i = 0
while True:
    save_snapshot(snaps[i % 2], Path(sys.argv[1]))
    i += 1
"""


@pytest.mark.process
def test_saves_killed_at_random_moments_never_leave_a_wrong_file(tmp_path):
    """A real save loop (two alternating snapshots, 3 MB each) killed with SIGKILL at random times."""
    snaps = [F.small_snapshot(seed=s, layers=4, tokens=3000) for s in (1, 2)]
    target = tmp_path / "loop.kv.safetensors"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    rng = random.Random(0)
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", _LOOPING_WRITER, str(target)], stdout=subprocess.PIPE, text=True, env=env
        )
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.2, 0.8))
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for p in [target, *_temps(tmp_path)]:
            if not p.exists():
                continue
            try:
                got = load_snapshot(p)
            except SnapshotFileError:
                assert p != target, "the target itself must always be a complete file"
                continue
            assert F.same_snapshot(got, snaps[0]) or F.same_snapshot(got, snaps[1])
    assert target.exists()
    clean_temp_files(tmp_path, older_than=0)
    assert _temps(tmp_path) == []
