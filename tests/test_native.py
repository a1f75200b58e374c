"""graft_cli/models/native.py: a kernel is built once per machine into graft's home, atomically; where it cannot be
(turned off, no units, no compiler, a failed build) the caller gets None and torch's path serves."""

from __future__ import annotations

import pytest

from graft_cli.core.cpu_units import CpuUnits
from graft_cli.models import native


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A private graft home and no library remembered from earlier calls."""
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path))
    native.library.cache_clear()
    yield tmp_path / "kernels"
    native.library.cache_clear()


def test_off_without_the_units_or_when_turned_off(fresh, monkeypatch):
    monkeypatch.setattr(native, "cpu_units", lambda: CpuUnits("test", avx512=True))  # no AVX512-BF16
    assert native.library("attention") is None
    monkeypatch.setattr(native, "cpu_units", lambda: CpuUnits("test", avx512=True, avx512_bf16=True))
    monkeypatch.setenv("GRAFT_NATIVE", "0")
    assert native.library("attention") is None
    assert not fresh.exists()


def test_no_compiler_means_torchs_path(fresh, monkeypatch):
    monkeypatch.setattr(native, "cpu_units", lambda: CpuUnits("test", avx512=True, avx512_bf16=True))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "")
    assert native.library("attention") is None


def test_a_failed_build_says_so_in_one_line_and_leaves_nothing(fresh, monkeypatch, capsys):
    monkeypatch.setattr(native, "cpu_units", lambda: CpuUnits("test", avx512=True, avx512_bf16=True))
    monkeypatch.setenv("CXX", "false")  # exits 1, prints nothing
    assert native.library("attention") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "building" in err[0] and "could not build the attention kernel" in err[1]
    assert list(fresh.iterdir()) == []  # no library, no half-written scratch file


def test_built_once_then_loaded(fresh, capsys):
    if not native.enabled():
        pytest.skip("this CPU has no AVX512-BF16")
    first = native.library("attention")
    if first is None:
        pytest.skip("no C++ compiler here")
    built = list(fresh.glob("attention-*.so"))
    assert len(built) == 1 and "building its attention kernel" in capsys.readouterr().err
    native.library.cache_clear()
    assert native.library("attention") is not None
    assert list(fresh.glob("attention-*.so")) == built and capsys.readouterr().err == ""
