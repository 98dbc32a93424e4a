"""Property tests of the store's block format: any damage is refused or harmless, never served.

``benchmarks/fuzz_store.py`` runs the same mutations by the thousand (results in BENCHMARKS.md).
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab.store._fuzz import CRASH, DIFFERENT, IDENTICAL, classify_decode, encoded, make_sample, mutate
from kvlab.store.block import decode_block, encode_block
from kvlab.store.keys import block_problem

SAMPLE = make_sample(3)
BLOBS = encoded(SAMPLE)
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(
    which=st.integers(0, 2),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
)
def test_overwritten_bytes_are_refused_or_identical(which, edits):
    data = bytearray(BLOBS[which])
    for at, value in edits:
        data[at % len(data)] = value
    assert classify_decode(bytes(data), SAMPLE.blocks[which]) not in (DIFFERENT, CRASH)


@FAST
@given(which=st.integers(0, 2), cut=st.integers(0, 10**6), extra=st.binary(max_size=64))
def test_truncated_or_extended_files_are_refused(which, cut, extra):
    data = BLOBS[which][: cut % len(BLOBS[which])] + extra
    assert classify_decode(data, SAMPLE.blocks[which]) not in (DIFFERENT, CRASH)


@FAST
@given(seed=st.integers(0, 2**32 - 1))
def test_random_mutations_of_every_kind(seed):
    rng = random.Random(seed)
    j = rng.randrange(3)
    _, data = mutate(BLOBS[j], rng, BLOBS[(j + 1) % 3])
    assert classify_decode(data, SAMPLE.blocks[j]) not in (DIFFERENT, CRASH)


def test_the_original_bytes_decode_identically():
    for blob, block in zip(BLOBS, SAMPLE.blocks, strict=True):
        assert classify_decode(blob, block) == IDENTICAL
        assert block_problem(decode_block(blob)) is None


def test_a_re_checksummed_forgery_is_caught_by_its_content():
    """Someone who rewrites a block with a valid checksum cannot make it pass as the real one."""
    b = SAMPLE.blocks[1]
    forged_tokens = b.__class__(**{**b.__dict__, "token_ids": tuple(t + 1 for t in b.token_ids)})
    assert "hash to its name" in block_problem(decode_block(encode_block(forged_tokens)))
    forged_shape = b.__class__(**{**b.__dict__, "keys": b.keys[:1], "values": b.values[:1]})
    assert "geometry" in block_problem(decode_block(encode_block(forged_shape)))
    forged_dtype = b.__class__(**{**b.__dict__, "keys": b.keys.double(), "values": b.values.double()})
    assert "dtype" in block_problem(decode_block(encode_block(forged_dtype)))
