"""graft's own C++ kernels (``kernels/NAME.cpp``), built once per machine with its C++ compiler and loaded with
ctypes.

Why: a forward of graft's own is many small torch calls, and attention over a long cache was the largest share
of them (docs/cpu.md, "Where a forward's time goes"). A kernel that does one row's work start to end in one
thread is both what keeps a row's bits the same wherever it travels and several times faster than those calls.
The source needs no torch headers: it builds in seconds with plain ``c++`` and takes raw pointers.

Built where the CPU has the units the kernels use (AVX-512 and AVX512-BF16) and a compiler is found (``$CXX``,
else ``c++`` or ``g++`` on the path), into ``graft_home()/kernels/NAME-<digest>.so`` (the digest covers the
source, the flags and the compiler, so a changed source builds anew); the first build says so in one line.
Elsewhere, or with ``GRAFT_NATIVE=0``, :func:`library` gives None and the callers take torch's path, which keeps
graft's contract too, more slowly.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

from datastores.atomic import atomic_file
from graft_cli.catalog.home import graft_home
from graft_cli.core.cpu_units import cpu_units

SOURCES = Path(__file__).parent / "kernels"
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bf16")  # libgomp: torch's own, once loaded
BUILD_SECONDS = 300


def enabled() -> bool:
    """Whether native kernels may serve here: not turned off, and the CPU has AVX-512 with AVX512-BF16."""
    units = cpu_units()
    return os.environ.get("GRAFT_NATIVE") != "0" and units.avx512 and units.avx512_bf16


@cache
def library(name: str) -> ctypes.CDLL | None:
    """The kernel library ``kernels/NAME.cpp``, built on first use, or None where none can serve (module
    docstring). A failed build says why in one line, once per process."""
    if not enabled():
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None
    source = SOURCES / f"{name}.cpp"
    digest = hashlib.sha256(source.read_bytes() + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    path = graft_home() / "kernels" / f"{name}-{digest}.so"
    if not path.exists():
        try:
            build(compiler, source, path)
        except (OSError, subprocess.SubprocessError) as e:
            print(f"graft: could not build the {name} kernel ({e}); torch's path serves instead", file=sys.stderr)
            return None
    return ctypes.CDLL(str(path))


def build(compiler: str, source: Path, path: Path) -> None:
    """Compile ``source`` into ``path`` through a temporary file beside it, renamed when complete
    (``datastores/atomic.py``): a build cut short leaves nothing a later process could load half-written, and the
    next graft command removes what a killed one left."""
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"graft: building its {source.stem} kernel for this CPU (once, into {path.parent})", file=sys.stderr)
    with atomic_file(path) as scratch:
        done = subprocess.run([compiler, *FLAGS, str(source), "-o", str(scratch)], capture_output=True, text=True,
                              timeout=BUILD_SECONDS)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise subprocess.SubprocessError(lines[0] if lines else f"{compiler} exited {done.returncode}")
