"""Property tests of the snapshot loader: any mutation of a saved file gives a kvlab error or the
identical snapshot, never different content, never another exception, never a hang.

Bounded (a few hundred examples per property, a tiny 2-layer file) so this runs in seconds;
``benchmarks/fuzz_snapshot.py`` runs thousands of mutations and reports the counts.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab.cache import _fuzz as F

SNAP = F.small_snapshot()
DATA = F.save_snapshot_bytes(SNAP)
HEADER_LEN = int.from_bytes(DATA[:8], "little")
SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check(data: bytes, **kw) -> str:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.kv.safetensors"
        p.write_bytes(data)
        result = F.outcome(p, SNAP, **kw)
    assert result in ("rejected", "identical"), result
    return result


def test_the_unmutated_file_loads_identically():
    assert _check(DATA) == "identical"


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, len(DATA) - 1), st.integers(0, 255)), min_size=1, max_size=4))
def test_byte_overwrites_anywhere(edits):
    data = bytearray(DATA)
    for pos, byte in edits:
        data[pos] = byte
    _check(bytes(data))


@SETTINGS
@given(st.integers(8, 8 + HEADER_LEN - 1), st.integers(32, 126))
def test_header_byte_overwrites(pos, byte):
    data = bytearray(DATA)
    data[pos] = byte
    _check(bytes(data))


@SETTINGS
@given(st.integers(0, len(DATA) - 1), st.binary(max_size=32))
def test_truncations_and_appended_bytes(cut, tail):
    _check(DATA[:cut])
    if tail:
        _check(DATA + tail)


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
_, META, BODY = F.split_file(DATA)
FIELDS = sorted(META) + [f"rope.{k}" for k in sorted(META["rope"])]


@SETTINGS
@given(st.sampled_from(FIELDS), _JSON, st.booleans())
def test_header_field_edits_with_a_stale_digest(field, value, delete):
    meta = json.loads(json.dumps(META))
    target, key = (meta["rope"], field[5:]) if field.startswith("rope.") else (meta, field)
    if delete:
        target.pop(key)
    else:
        target[key] = value
    header = F.split_file(DATA)[0]
    header["__metadata__"] = {"kvlab": json.dumps(meta)}
    _check(F.join_file(header, BODY))


@SETTINGS
@given(st.sampled_from(F.FORGE_KINDS), st.integers(0, 2**32))
def test_forged_files_with_a_recomputed_digest_but_invalid_schema(kind, seed):
    _, data = F.forge_invalid(SNAP, random.Random(seed), kind)
    assert _check(data) == "rejected"


@SETTINGS
@given(st.integers(0, 2**32))
def test_mixed_random_mutations(seed):
    rng = random.Random(seed)
    _, data = F.mutate(DATA, rng, SNAP)
    _check(data)
