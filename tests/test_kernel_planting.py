"""A library planted where kvlab builds its C kernel is never loaded (issue 27).

The kernel's file name is predictable (source, flags, compiler and CPU hashed), so anyone who can write
to the cache folder could place a library there; loading it would run its code. Each test plants a
library whose constructor leaves a marker file, then asks for the kernel: the marker must never appear.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import kvlab.policy.quant.attention as qa
from kvlab import kernels

pytestmark = pytest.mark.process  # C compilers run for every test here

PLANT = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("MARKER", "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_LOADED", {})
    monkeypatch.setattr(kernels, "_ERRORS", {})
    return tmp_path


def _plant(tmp_path, at):
    marker = tmp_path / "marker"
    src = tmp_path / "plant.c"
    src.write_text(PLANT.replace("MARKER", str(marker)))
    subprocess.run([kernels.compiler(), "-shared", "-fPIC", str(src), "-o", str(at)], check=True)
    return marker


def _target(fresh):
    """Where kvlab will look for the kernel: build once, note the name, remove it and its record."""
    built = kernels._build(qa.KERNEL)
    built.unlink()
    built.with_suffix(".sha256").unlink()
    return built


def test_a_library_planted_at_the_kernels_name_is_rebuilt_not_loaded(fresh):
    target = _target(fresh)
    marker = _plant(fresh, target)
    planted = target.read_bytes()
    lib = kernels.load(qa.KERNEL)
    assert not marker.exists()  # the planted constructor never ran
    assert lib is not None and hasattr(lib, "kvq_scores")  # our kernel, rebuilt in its place
    assert target.read_bytes() != planted


def test_a_planted_library_with_a_forged_record_is_rebuilt(fresh):
    target = _target(fresh)
    marker = _plant(fresh, target)
    # a record that does not match (the attacker cannot know our build's hash without building it)
    target.with_suffix(".sha256").write_text("0" * 64)
    assert kernels.load(qa.KERNEL) is not None
    assert not marker.exists()


def test_a_symlink_at_the_kernels_name_is_never_followed(fresh):
    target = _target(fresh)
    elsewhere = fresh / "evil.so"
    marker = _plant(fresh, elsewhere)
    os.symlink(elsewhere, target)
    assert kernels.load(qa.KERNEL) is not None
    assert not marker.exists()
    assert not target.is_symlink()


def test_a_folder_others_can_write_is_refused(fresh):
    folder = fresh / "cache" / "kernels"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    assert kernels.load(qa.KERNEL) is None
    assert "writable by others" in (kernels.why_not(qa.KERNEL) or "")
    assert not list(folder.iterdir())  # nothing built there either


def test_a_folder_owned_by_another_user_is_refused(fresh, monkeypatch):
    folder = fresh / "cache" / "kernels"
    folder.mkdir(parents=True, mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(folder).st_uid + 1)  # we are someone else
    assert kernels.load(qa.KERNEL) is None
    assert "another user" in (kernels.why_not(qa.KERNEL) or "")


def test_the_kernel_folder_is_created_private(fresh):
    assert kernels.load(qa.KERNEL) is not None
    folder = fresh / "cache" / "kernels"
    assert folder.stat().st_mode & 0o077 == 0
    for f in folder.iterdir():
        assert f.stat().st_mode & 0o022 == 0


def test_a_folder_above_the_cache_others_can_write_is_refused(fresh, monkeypatch):
    """Someone who can write to a folder above the kernels could rename the kernels' folder away and put
    their own (with a planted library and a matching record) in its place: such a chain is refused."""
    above = fresh / "open"
    above.mkdir()
    above.chmod(0o777)  # writable by others, not sticky
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(above / "cache"))
    assert kernels.load(qa.KERNEL) is None
    assert "not sticky" in (kernels.why_not(qa.KERNEL) or "")


def test_a_sticky_folder_above_the_cache_is_accepted(fresh, monkeypatch):
    above = fresh / "shared-tmp"
    above.mkdir()
    above.chmod(0o1777)  # like /tmp: others cannot rename what they do not own
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(above / "cache"))
    assert kernels.load(qa.KERNEL) is not None


def test_a_library_swapped_between_the_check_and_the_load_is_not_loaded(fresh, monkeypatch):
    """The race of issue 48: the library passes the check, then another file takes its name before the
    loader opens it. The load hashes the descriptor it maps, so the swapped file is refused."""
    target = kernels._build(qa.KERNEL)
    marker = _plant(fresh, fresh / "evil.so")
    real_build = kernels._build

    def build_then_swap(name):
        built = real_build(name)
        os.replace(fresh / "evil.so", built)  # same owner and mode: only the bytes differ
        return built

    monkeypatch.setattr(kernels, "_build", build_then_swap)
    assert kernels.load(qa.KERNEL) is None
    assert "does not match its record" in (kernels.why_not(qa.KERNEL) or "")
    assert not marker.exists()
    assert target.exists()


def test_the_loader_maps_the_descriptor_it_hashed(fresh, monkeypatch):
    opened: list[str] = []
    real_cdll = kernels.ctypes.CDLL
    monkeypatch.setattr(kernels.ctypes, "CDLL", lambda path: opened.append(path) or real_cdll(path))
    assert kernels.load(qa.KERNEL) is not None
    assert len(opened) == 1 and opened[0].startswith("/proc/self/fd/")


def test_two_kernels_loaded_one_after_the_other_are_each_themselves(tmp_path):
    """The loader knows a library by the name it was opened under (``/proc/self/fd/N``): a second kernel
    opened at a number the first had used and closed came back as the first, without its functions.
    A fresh process, so that no earlier load in this one decides which numbers are free."""
    code = (
        "import kvlab.policy.quant.attention as qa\n"
        "from kvlab import kernels\n"
        "from kvlab.kernels import gemv\n"
        "assert gemv.op() is not None, kernels.why_not(gemv.KERNEL)\n"
        "lib = kernels.load(qa.KERNEL)\n"
        "assert lib is not None, kernels.why_not(qa.KERNEL)\n"
        "print(hasattr(lib, 'kvq_scores'))\n"
    )
    env = {**os.environ, "KVLAB_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"
