"""Which matrix units this CPU has, read from the kernel's flags: what decides whether low precision pays here.

A bf16 matrix product is fast only where the CPU multiplies bf16 in hardware: AMX tiles (Intel Sapphire Rapids
and later) or AVX512-BF16 (Intel Cooper Lake and later, AMD Zen 4 and later); int8 products need AMX-INT8 or VNNI.
Elsewhere torch emulates bf16 through fp32 and a bf16 model runs slower than fp32. Hypervisors often hide
AVX-512 from a guest whose host has it, so the flags are read from the running kernel (``/proc/cpuinfo``), not
guessed from the CPU's name. No torch: the command line names the units before anything heavy loads.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import cache

# what each unit is called in /proc/cpuinfo
FLAGS = {"amx_bf16": "amx_bf16", "amx_int8": "amx_int8", "avx512_bf16": "avx512_bf16",
         "avx512_vnni": "avx512_vnni", "avx_vnni": "avx_vnni", "avx512": "avx512f", "avx2": "avx2"}


@dataclass(frozen=True)
class CpuUnits:
    """The CPU's name and its matrix-relevant instruction sets."""

    name: str
    amx_bf16: bool = False
    amx_int8: bool = False
    avx512_bf16: bool = False
    avx512_vnni: bool = False
    avx_vnni: bool = False
    avx512: bool = False
    avx2: bool = False

    @property
    def bf16(self) -> bool:
        """bf16 products in hardware (AMX or AVX512-BF16): a bf16 model can beat fp32 here."""
        return self.amx_bf16 or self.avx512_bf16

    @property
    def int8(self) -> bool:
        """int8 dot products in hardware (AMX-INT8, AVX512-VNNI or AVX-VNNI)."""
        return self.amx_int8 or self.avx512_vnni or self.avx_vnni

    @property
    def best(self) -> str:
        """The strongest matrix unit, as docs/models.md names them: amx, avx512-bf16, vnni or none."""
        if self.amx_bf16:
            return "amx"
        if self.avx512_bf16:
            return "avx512-bf16"
        return "vnni" if self.int8 else "none"

    def summary(self) -> str:
        """One line for figures and notes: the CPU and its units."""
        present = [name.replace("_", "-") for name in FLAGS if getattr(self, name)]
        return f"{self.name} ({', '.join(present) or 'no vector units named'}; matrix units: {self.best})"


def parse_cpuinfo(text: str) -> CpuUnits:
    """The units of the first processor listed in ``/proc/cpuinfo``'s text."""
    name, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name is None:
            name = value.strip()
        elif key == "flags":
            flags = set(value.split())
            break
    return CpuUnits(name or platform.processor() or "unknown CPU",
                    **{unit: flag in flags for unit, flag in FLAGS.items()})


@cache
def cpu_units() -> CpuUnits:
    """This machine's units (none named where ``/proc/cpuinfo`` cannot be read: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return CpuUnits(platform.processor() or "unknown CPU")
