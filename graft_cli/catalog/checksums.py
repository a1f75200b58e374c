"""Is a model dir whole, and which model is it: structural checks of a Hugging Face dir, the weights' SHA-256
recorded at pull time and checked once per change of a file, and the checksum that identifies a model."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from datastores.integrity import file_sha256, remember, sha256_matches, sha256_of
from graft_cli.catalog.home import eprint, read_manifest, write_manifest
from graft_cli.catalog.hub import blob_sha256, is_hub_snapshot
from graft_cli.catalog.q4 import FILE
from graft_cli.core import GraftError

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def weight_files(path: Path) -> list[Path]:
    """A model dir's weight files: its checkpoint's, and the 4-bit weights kept beside it (graft_cli/catalog/q4.py)."""
    return sorted(p for p in path.iterdir()
                  if p.is_file() and (p.suffix in (".safetensors", ".bin") or p.name == FILE))


def record_weights(path: Path) -> dict:
    """``{file: {bytes, sha256}}`` of a model dir's weight files, each remembered as intact as it is now."""
    weights = {}
    for p in weight_files(path):
        digest = file_sha256(p)
        remember(p, digest)
        weights[p.name] = {"bytes": p.stat().st_size, "sha256": digest}
    return weights


def check_weights(path: Path) -> None:
    """Every weight file has the size and SHA-256 recorded at pull time. The full hash is paid once per change of
    a file (its size/mtime/inode stamp, datastores/integrity.py): a sampled check could miss one flipped bit of
    hundreds of megabytes, and a wrong weight silently gives wrong text. A dir pulled before graft recorded
    checksums gets them recorded now, once."""
    manifest = read_manifest(path) or {}
    weights = manifest.get("weights")
    if not isinstance(weights, dict):
        eprint(f"graft: recording the checksums of {path.name}'s weights (once: it was pulled before graft kept them)")
        manifest["weights"] = record_weights(path)
        write_manifest(path, manifest)
        return
    for name, info in weights.items():
        p = path / name
        if not p.is_file():
            raise GraftError(f"model {path.name} is damaged: {name} is missing")
        if p.stat().st_size != info.get("bytes") or not sha256_matches(p, str(info.get("sha256"))):
            raise GraftError(f"model {path.name} is damaged: {name} does not match the SHA-256 recorded when it was pulled")


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


def model_checksum(path: Path) -> str:
    """The sha256 that identifies a resolved model dir: the source GGUF's, recorded in its manifest; for a plain
    Hugging Face dir, computed over its weight files (one file: that file's sha256), each hashed once per change
    of the file (datastores/integrity.py); for a hub snapshot, over the SHA-256 its blobs are named by."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest and isinstance(manifest.get("gguf_sha256"), str):
        return manifest["gguf_sha256"]
    files = weight_files(path)
    if not files:
        raise GraftError(f"model directory {path} has no weight files to checksum")
    if len(files) == 1:
        return _weight_sha256(files[0])
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{_weight_sha256(f)}\n".encode())
    return h.hexdigest()


def _weight_sha256(path: Path) -> str:
    """One weight file's SHA-256. In a hub snapshot it is the name of the blob the file links to (the hub's own
    content address: no gigabytes hashed), and nothing is recorded there: the hub cache is huggingface_hub's."""
    if is_hub_snapshot(path.parent):
        return blob_sha256(path) or file_sha256(path)
    return sha256_of(path)
