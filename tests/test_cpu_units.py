"""The CPU's matrix units, read from /proc/cpuinfo's flags: they decide whether bf16 or int8 can pay."""

from __future__ import annotations

from graft_cli.core.cpu_units import CpuUnits, cpu_units, parse_cpuinfo
from tests.bench_fixtures import tiny_dir  # noqa: F401 - the fixture

XEON = """processor	: 0
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: fpu avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
processor	: 1
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: fpu
"""
ZEN4 = "model name\t: AMD EPYC 9R14\nflags\t\t: avx2 avx512f avx512_vnni avx512_bf16\n"
GUEST = "model name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma\n"  # a hypervisor that hides AVX-512


def test_the_units_each_kind_of_cpu_has():
    xeon, zen4, guest = parse_cpuinfo(XEON), parse_cpuinfo(ZEN4), parse_cpuinfo(GUEST)
    assert xeon.name == "Intel(R) Xeon(R) Platinum 8480+" and xeon.best == "amx" and xeon.bf16 and xeon.int8
    assert zen4.best == "avx512-bf16" and zen4.bf16 and zen4.int8 and not zen4.amx_bf16
    assert guest.best == "none" and not guest.bf16 and not guest.int8 and guest.avx2
    assert parse_cpuinfo("flags\t: avx2 avx_vnni\n").best == "vnni"
    assert guest.summary() == "AMD EPYC (avx2; matrix units: none)"


def test_this_machine_is_read():
    units = cpu_units()
    assert isinstance(units, CpuUnits) and units.name
    assert units.best in ("amx", "avx512-bf16", "vnni", "none")


def test_bf16_without_its_units_is_noted(tiny_dir, capsys, monkeypatch):
    from graft_cli.runtime import loading

    for text, noted in ((GUEST, True), (ZEN4, False)):
        monkeypatch.setattr(loading, "cpu_units", lambda text=text: parse_cpuinfo(text))
        loading.load_model(str(tiny_dir), "cpu", "bfloat16")
        err = capsys.readouterr().err
        assert ("no bf16 matrix unit" in err) == noted
        loading.load_model(str(tiny_dir), "cpu", "float32")
        assert "bf16" not in capsys.readouterr().err


def test_auto_picks_bf16_only_where_the_cpu_multiplies_it(monkeypatch):
    """``--dtype auto`` on a CPU: bf16 where AMX or AVX512-BF16 make it faster, fp32 elsewhere; GRAFT_DTYPE
    overrides the choice (the suite pins fp32 through it)."""
    import pytest
    import torch

    from graft_cli.core import GraftError
    from graft_cli.runtime import loading

    monkeypatch.delenv("GRAFT_DTYPE")
    for text, dtype in ((XEON, torch.bfloat16), (ZEN4, torch.bfloat16), (GUEST, torch.float32)):
        monkeypatch.setattr(loading, "cpu_units", lambda text=text: parse_cpuinfo(text))
        assert loading.pick_dtype("auto", "cpu") == dtype
        assert loading.pick_dtype("float32", "cpu") == loading.pick_dtype("mixed", "cpu") == torch.float32
    monkeypatch.setenv("GRAFT_DTYPE", "float32")
    assert loading.pick_dtype("auto", "cpu") == torch.float32
    assert loading.pick_dtype("bfloat16", "cpu") == torch.bfloat16  # a dtype asked for by name wins
    monkeypatch.setenv("GRAFT_DTYPE", "fp8")
    with pytest.raises(GraftError, match="GRAFT_DTYPE: unknown dtype 'fp8'"):
        loading.pick_dtype("auto", "cpu")
